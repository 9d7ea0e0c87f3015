"""Multi-rank worlds for tests and the CLI.

* :func:`run_cpu_world` forks ``world_size`` CPU ranks that share one fork-shared mmap heap (docs/platform.md), with a
  gloo process group and ``TRITON_INTERPRET=1``, so the real Triton kernels run multi-rank on a CPU.
* :func:`tritonep.testing.run_gpu_world` (:mod:`.gpu_world`) spawns ranks placed on the visible GPUs, any world size
  on any number of GPUs (the same ``fn(group, *args)`` contract).

Both return every rank's return value (a list indexed by rank), re-raise the first failing rank's exception as
:class:`tritonep.errors.RankError` carrying that rank and its traceback, and kill every rank and raise if the world
runs past ``timeout_s`` (a hung kernel fails the test, not CI). SIGINT / SIGTERM to the parent kill and reap every
rank and remove the world's temporary folder (:mod:`.interrupts`).
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

from ..errors import ConfigError, RankError
from . import interrupts
from .protocol import ProtocolMismatch, compare_sequences

__all__ = ["run_cpu_world", "WorldTimeout", "ProtocolMismatch"]


class WorldTimeout(RankError):
    """The world did not finish in time; ``ranks`` lists the ranks still running when it was killed."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = list(ranks)


def _send(fd: int, obj: Any):
    data = pickle.dumps(obj)
    with os.fdopen(fd, "wb") as f:
        f.write(len(data).to_bytes(8, "little"))
        f.write(data)


def _cpu_rank_main(rank, world_size, store_path, heap, fn, args, wfd, record):
    import torch
    import torch.distributed as dist

    from ..memory import install_cpu_heap
    from .protocol import install_recorder

    status = 0
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        dist.barrier()  # the full mesh is connected on every rank before any rank may fail and exit
        group = dist.group.WORLD
        heap.attach(rank, group)
        install_cpu_heap(heap)
        log: list = []
        if record:
            install_recorder(log)
        out = fn(group, *args)
        _send(wfd, ("ok", rank, (out, log)))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        status = 1
        try:
            _send(wfd, ("err", rank, (type(e).__name__, str(e), traceback.format_exc(), _picklable(e))))
        except BaseException:
            pass
    finally:
        os._exit(status)


def _secondary(text: str) -> bool:
    """Errors that are consequences of another rank's failure (its exit closed the connection)."""
    return any(p in text for p in ("Connection closed by peer", "Connection reset by peer", "connectFullMesh"))


def _picklable(e):
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return None


def _collect(procs: dict, fds: dict, timeout_s: float, kill: Callable[[int], None], what: str,
             on_wait: Callable[[], None] | None = None):
    results: dict = {}
    bufs = {r: b"" for r in fds}
    open_fds = fds  # rank -> fd still open; closed ones leave the caller's dict (it closes the rest)
    deadline = time.monotonic() + timeout_s
    first_err = None
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            running = sorted(open_fds)
            for r in list(procs):
                kill(r)
            raise WorldTimeout(f"{what}: ranks {running} did not finish within {timeout_s:.0f} s (killed all ranks)",
                               running)
        rlist, _, _ = select.select(list(open_fds.values()), [], [], min(left, 0.5))
        if on_wait is not None:
            on_wait()
        for fd in rlist:
            r = next(k for k, v in open_fds.items() if v == fd)
            chunk = os.read(fd, 1 << 20)
            if chunk:
                bufs[r] += chunk
                continue
            os.close(fd)
            del open_fds[r]
            data = bufs[r]
            if len(data) < 8:
                msg = ("crashed", r, None)
            else:
                msg = pickle.loads(data[8:])
            results[r] = msg
            if msg[0] != "ok" and first_err is None:
                first_err = msg
        if first_err is not None:
            # one rank failed: the others may be waiting for it; give them a moment, then kill the world
            grace = time.monotonic() + 2.0
            while open_fds and time.monotonic() < grace:
                rlist, _, _ = select.select(list(open_fds.values()), [], [], 0.2)
                for fd in rlist:
                    r = next(k for k, v in open_fds.items() if v == fd)
                    chunk = os.read(fd, 1 << 20)
                    if chunk:
                        bufs[r] += chunk
                    else:
                        os.close(fd)
                        del open_fds[r]
            for r in list(procs):
                kill(r)
            for fd in open_fds.values():
                os.close(fd)
            open_fds.clear()
            for r, data in bufs.items():
                if r not in results and len(data) > 8:
                    try:
                        results[r] = pickle.loads(data[8:])
                    except Exception:
                        pass
            errs = [m for m in results.values() if m[0] == "err"]
            primary = [m for m in errs if not _secondary(m[2][1])]
            first_err = primary[0] if primary else first_err
            kind, rank, info = first_err
            if kind == "crashed":
                raise RankError(f"{what}: rank {rank} died without a result")
            name, text, tb, exc = info
            err = RankError(f"{what}: rank {rank} raised {name}: {text}\n--- rank {rank} traceback ---\n{tb}")
            err.rank = rank
            err.original = exc
            raise err
    return [results[r][2] for r in sorted(results)]


def run_cpu_world(world_size: int, fn: Callable, *args, timeout_s: float = 120.0, heap_bytes: int | None = None,
                  check_protocol: bool = True, on_wait: Callable[[], None] | None = None):
    """Run ``fn(group, *args)`` on ``world_size`` forked CPU ranks and return their results (list by rank).

    Each rank gets a gloo process group (``group``, the world), the shared CPU symmetric heap installed (see
    :class:`tritonep.memory.CpuHeap`; ``heap_bytes`` per rank, default ``TRITONEP_CPU_HEAP_BYTES``), one torch
    thread, and ``TRITON_INTERPRET=1`` (set in the parent before forking; kernel modules must not have been imported
    in compiled mode before).

    Host protocol check (docs/protocols.md (host protocol rule)): every rank records its sequence of launches through
    recorded bound launches (:mod:`tritonep.runtime.launch`) and of ``torch.distributed`` collectives
    (:mod:`tritonep.testing.protocol`); when every rank returns, the sequences must be equal, else
    :class:`tritonep.testing.protocol.ProtocolMismatch` is raised. ``check_protocol=False`` turns this off (only for
    worlds whose ranks run deliberately different programs, e.g. a rank that skips a call to provoke a timeout).

    Args:
        world_size: number of ranks (1..64).
        fn: called as ``fn(group, *args)`` in every rank; its return value must pickle (tensors do).
        timeout_s: wall-clock bound for the whole world; past it every rank is killed.
        heap_bytes: bytes of each rank's heap slice.
        on_wait: called in this process about every 0.5 s while it waits for the ranks (e.g. to print the progress
            the ranks write to a file: ``tritonep run`` does); it must return quickly and not raise.

    Returns:
        ``[result of rank 0, ..., result of rank world_size-1]``.

    Raises:
        RankError: a rank raised (message: its rank, exception and traceback; ``.rank``, ``.original``).
        WorldTimeout: the world ran past ``timeout_s`` (``.ranks`` = the ranks still running).
        ProtocolMismatch: the ranks' launch / collective sequences differ (``check_protocol``).
        HeapError: the heap cannot be made for this world.
        ConfigError: this process already imported the kernels, or Triton's ``triton.language`` (which
            ``import torch._dynamo`` does), compiled for the GPU (the ranks need the interpreter).
        KeyboardInterrupt: SIGINT reached this process (every rank killed and reaped and the temporary folder
            removed first); SIGTERM does the same cleanup and then ends the process as its default action would
            (:mod:`tritonep.testing.interrupts`).
    """
    from .. import envs
    from ..memory import CpuHeap
    from ..runtime.interpreter_speed import install as install_interpreter_speed

    if "tritonep.device.common" in sys.modules and not sys.modules["tritonep.device.common"].kernels_interpreted():
        raise ConfigError("run_cpu_world: tritonep's kernels were already imported for the GPU in this process "
                          "(TRITON_INTERPRET was not 1 then: any use of tep.EPBuffer, EPBuffer.required_bytes "
                          "included, tep.MoELayer / MoERecipe / MoEGeometry, or an import from tritonep.ep, "
                          "tritonep.moe (RouterConfig too), tritonep.balance or tritonep.wire before this call "
                          "imports them); the forked ranks need the interpreter: start Python with TRITON_INTERPRET=1 (or set "
                          "os.environ['TRITON_INTERPRET'] = '1' before those imports, as examples/train_moe.py does), "
                          "or make those objects inside the rank function")
    lang = sys.modules.get("triton.language")
    if lang is not None and type(getattr(lang, "sum", None)).__name__ == "JITFunction":
        raise ConfigError("run_cpu_world: Triton itself was already imported for the GPU in this process "
                          "(TRITON_INTERPRET was not 1 when triton.language was first imported, e.g. by "
                          "'import torch._dynamo' or torch.compile), so its library functions (tl.sum, ...) cannot "
                          "run in the forked ranks' interpreter; start Python with TRITON_INTERPRET=1 (or set "
                          "os.environ['TRITON_INTERPRET'] = '1' before importing torch._dynamo or triton)")
    envs.put("TRITON_INTERPRET", "1")
    install_interpreter_speed()  # before the fork: every rank's interpreter without its per-call member scan
    heap = CpuHeap.create(world_size, heap_bytes or envs.cpu_heap_bytes())
    tmp = tempfile.mkdtemp(prefix="tritonep_world_")
    store_path = os.path.join(tmp, "store")
    procs: dict = {}
    fds: dict = {}  # rank -> read end of its result pipe, while open
    parent = os.getpid()
    done = []

    def cleanup():
        """Kill and reap every rank, close the pipes, remove the temporary folder (idempotent; also run by
        SIGTERM / interpreter exit through :mod:`.interrupts`)."""
        if done:
            return
        done.append(True)
        with interrupts.deferred_signals():
            for pid in procs.values():  # a rank blocked writing its result would never exit on its own
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for fd in fds.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            fds.clear()
            for pid in procs.values():
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
            shutil.rmtree(tmp, ignore_errors=True)

    token = interrupts.register(cleanup)
    interrupts.hold_sigterm()
    try:
        for r in range(world_size):
            rfd, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:  # child
                interrupts.rank_process_setup(parent)
                os.close(rfd)
                for other in fds.values():
                    try:
                        os.close(other)
                    except OSError:
                        pass
                _cpu_rank_main(r, world_size, store_path, heap, fn, args, wfd, check_protocol)
            os.close(wfd)
            procs[r] = pid
            fds[r] = rfd

        def kill(r):
            try:
                os.kill(procs[r], signal.SIGKILL)
            except ProcessLookupError:
                pass

        what = f"CPU world of {world_size}"
        pairs = _collect(procs, fds, timeout_s, kill, what, on_wait)
        if check_protocol:
            compare_sequences([log for _, log in pairs], what)
        return [out for out, _ in pairs]
    finally:
        cleanup()
        interrupts.unregister(token)
        interrupts.release_sigterm()
