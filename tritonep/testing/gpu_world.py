"""GPU worlds: ``world_size`` spawned rank processes placed on the visible GPUs, any world size on any GPU count.

:class:`GpuWorld` starts the ranks once (placement, process group, optional MPS daemon: :mod:`.placement`,
:mod:`.mps`) and runs any number of functions on them (:meth:`GpuWorld.run`), so a test session pays the start-up
(Python, CUDA context, process group, kernel compiles) once per world instead of once per test;
:func:`run_gpu_world` is the one-shot form. Every rank runs ``fn(group, *args)``; the results come back moved to the
CPU, a failing rank raises :class:`tritonep.errors.RankError` with its traceback, a world past its time is killed
(:class:`tritonep.testing.WorldTimeout`), SIGINT / SIGTERM end every rank (:mod:`.interrupts`). A world that
failed, timed out or was interrupted is closed (ranks killed, MPS daemon stopped, temporary folder removed).
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from typing import Callable

from ..errors import ConfigError, RankError
from . import interrupts
from .gpu_rank import STOP, gpu_world_info, rank_main
from .placement import GpuWorldInfo, plan_world, rank_environment, without_mps
from .world import WorldTimeout, _secondary

__all__ = ["GpuWorld", "run_gpu_world", "gpu_world_info", "WorldResults"]


class WorldResults(list):
    """Every rank's return value (a list indexed by rank) plus ``info``: the world's
    :class:`tritonep.testing.placement.GpuWorldInfo`."""

    info: GpuWorldInfo | None = None


def _visible_devices() -> list:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(n)]


class GpuWorld:
    """``world_size`` rank processes placed round-robin on ``devices``, kept alive to run functions.

    Args:
        world_size: ranks (any number; at most ``MAX_RANKS_PER_DEVICE`` = 8 per device).
        mps: ``False`` (default): ranks that share a GPU time-slice (unless an MPS daemon already serves the
            machine, :func:`tritonep.testing.mps.external_mps_pipe`: the ranks then run under it, capped as below).
            ``True``: a private MPS daemon for this world (:class:`tritonep.testing.mps.MpsDaemon`), stopped when the
            world closes; raises :class:`tritonep.testing.mps.MpsUnavailable` if it cannot start. ``"auto"``: try
            MPS, else print one line saying why and time-slice. Ignored when every rank has a GPU of its own.
        devices: where to place ranks (default: every visible GPU, ``["cuda:0", ...]``). CPU devices
            (``["cpu"]``) run the world's process machinery alone, with a gloo group and no heap: for tests of the
            world itself.

    ``start()`` spawns the ranks; ``run(fn, *args)`` runs ``fn(group, *args)`` on every rank; ``close()`` stops them
    (also a context manager). ``info`` (:class:`tritonep.testing.placement.GpuWorldInfo`) says how it runs. Each
    task sees the parent's ``TRITONEP_*`` variables as they are when ``run`` is called (a test's
    ``monkeypatch.setenv`` reaches the ranks), and every rank's environment is put back after each task.

    Raises:
        ConfigError: no GPU (and no ``devices``), ``world_size < 1``, too many ranks per device, or a bad ``mps``.
    """

    def __init__(self, world_size: int, *, mps: bool | str = False, devices: list | None = None):
        if mps not in (False, True, "auto"):
            raise ConfigError(f"mps={mps!r}: use False, True or 'auto'")
        from .mps import external_mps_pipe

        self.devices = list(devices) if devices is not None else _visible_devices()
        self.info = plan_world(int(world_size), self.devices, mps=bool(mps))
        self._external = None if self.info.mode != "time-sliced" else external_mps_pipe()
        if self._external:  # the ranks would join it anyway: they run at once, so cap them as under our daemon
            self.info = replace(plan_world(int(world_size), self.devices, mps=True),
                                note=f"an MPS daemon already serves this machine ({self._external}): the ranks run "
                                     f"under it")
        self.world_size = self.info.world_size
        self.mps = mps
        self._procs: dict = {}
        self._conns: dict = {}
        self._tmp: str | None = None
        self._daemon = None
        self._token = None
        self._busy = False
        self.broken: str | None = None

    # ------------------------------------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        """True between a successful :meth:`start` and :meth:`close` (and not broken)."""
        return bool(self._procs) and self.broken is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _start_mps(self):
        if self.info.mode != "mps" or self._external:
            return {}
        from .mps import MpsDaemon, MpsUnavailable

        daemon = MpsDaemon(self._tmp)
        try:
            daemon.start()
        except MpsUnavailable as e:
            if self.mps is True:
                raise
            print(f"tritonep: {e}; the ranks time-slice instead", file=sys.stderr, flush=True)
            self.info = without_mps(self.info, str(e))
            return {}
        self._daemon = daemon
        return daemon.env()

    def start(self, timeout_s: float = 300.0) -> "GpuWorld":
        """Spawn the ranks and wait until every rank has its process group (within ``timeout_s``).

        Raises:
            RankError: a rank failed to start (its traceback). WorldTimeout: not every rank was ready in time.
            MpsUnavailable: ``mps=True`` and the daemon did not start.
        """
        if self._procs:
            return self
        import multiprocessing as mp

        self._tmp = tempfile.mkdtemp(prefix="tritonep_world_")
        self._token = interrupts.register(self._kill_now)
        interrupts.hold_sigterm()
        try:
            mps_env = self._start_mps()  # may fall back to time-slicing (mps="auto"): self.info changes first
            env = rank_environment(self.info, mps_env)
            ctx = mp.get_context("spawn")
            store = os.path.join(self._tmp, "store")
            with interrupts.ignoring_sigint():
                for r in range(self.world_size):
                    parent_end, child_end = ctx.Pipe(duplex=True)
                    p = ctx.Process(target=rank_main, args=(r, self.info, env, store, os.getpid(), child_end),
                                    name=f"tritonep-rank{r}", daemon=False)
                    p.start()
                    child_end.close()
                    self._procs[r] = p
                    self._conns[r] = parent_end
            reports = self._collect(set(range(self.world_size)), timeout_s, "starting")
            caps = {rep["max_programs"] for rep in reports.values()}
            if len(caps) > 1:
                raise RankError(f"{self._what()}: ranks computed different program caps {sorted(caps)} (GPUs of "
                                f"different kinds?)")
            if self.info.mode == "mps":
                self.info = replace(self.info, max_programs=caps.pop())
        except BaseException:
            self._kill_now()
            raise
        return self

    def run(self, fn: Callable, *args, timeout_s: float = 300.0,
            on_wait: Callable[[], None] | None = None) -> WorldResults:
        """Run ``fn(group, *args)`` on every rank; returns :class:`WorldResults` (by rank, with ``.info``).

        ``fn`` must be importable by the ranks (a module-level function) and its arguments and results must pickle
        (results are moved to the CPU first). ``on_wait``: called in this process about every 0.5 s while it waits
        (as :func:`tritonep.testing.run_cpu_world`'s).

        Raises:
            ConfigError: ``fn`` or ``args`` do not pickle; the world is closed or broken.
            RankError: a rank raised (the world is then closed). WorldTimeout: not done within ``timeout_s``
                (ranks killed).
        """
        from .. import envs

        if self.broken:
            raise ConfigError(f"{self._what()} is unusable: {self.broken}")
        if not self._procs:
            self.start(timeout_s)
        try:
            payload = pickle.dumps(("run", fn, args, envs.snapshot(), list(sys.path)))
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"{self._what()}: fn and its arguments must pickle (a module-level function): "
                              f"{type(e).__name__}: {e}") from None
        self._busy = True
        try:
            for r in range(self.world_size):
                self._conns[r].send_bytes(payload)
            out = self._collect(set(range(self.world_size)), timeout_s, getattr(fn, "__name__", "fn"), on_wait)
        except BaseException as e:
            self.broken = f"{type(e).__name__} in a previous run"
            self._kill_now()
            raise
        finally:
            self._busy = False
        res = WorldResults(out[r] for r in range(self.world_size))
        res.info = self.info
        return res

    def close(self) -> None:
        """Stop the ranks (politely when idle, else SIGKILL), stop the MPS daemon, remove the temporary folder."""
        if not self._procs and self._tmp is None:
            return
        if self.broken is None and not self._busy:
            with interrupts.deferred_signals():
                for c in self._conns.values():
                    try:
                        c.send_bytes(STOP)
                    except (OSError, EOFError):
                        pass
                for p in self._procs.values():
                    p.join(timeout=10)
        self._kill_now()

    def _kill_now(self) -> None:
        """SIGKILL and reap every rank, stop the MPS daemon, remove the temporary folder (idempotent)."""
        with interrupts.deferred_signals():
            for p in self._procs.values():
                if p.is_alive():
                    p.kill()
            for p in self._procs.values():
                p.join(timeout=10)
            for c in self._conns.values():
                c.close()
            self._procs.clear()
            self._conns.clear()
            if self._daemon is not None:
                if not self._daemon.stop():
                    print(f"tritonep: the MPS daemon of {self._tmp} did not quit in time", file=sys.stderr)
                self._daemon = None
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None
            if self._token is not None:
                interrupts.unregister(self._token)
                self._token = None
                interrupts.release_sigterm()

    # ------------------------------------------------------------------------------------------------ results
    def _what(self) -> str:
        return f"GPU world of {self.world_size} ({self.info.mode})"

    def _collect(self, ranks: set, timeout_s: float, task: str, on_wait: Callable[[], None] | None = None) -> dict:
        """Wait for one message of every rank in ``ranks``; raise the first failure (the primary one)."""
        from multiprocessing.connection import wait

        results: dict = {}
        deadline = time.monotonic() + timeout_s
        first_err = None
        while len(results) < len(ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                running = sorted(ranks - set(results))
                raise WorldTimeout(f"{self._what()}: ranks {running} did not finish {task} within {timeout_s:.0f} s "
                                   f"(killed all ranks)", running)
            waiting = {self._conns[r]: r for r in ranks if r not in results}
            ready = wait(list(waiting), timeout=min(left, 0.5))
            if on_wait is not None:
                on_wait()
            for c in ready:
                r = waiting[c]
                try:
                    msg = pickle.loads(c.recv_bytes())
                except (EOFError, OSError):
                    msg = ("crashed", r, None)
                results[r] = msg
                if msg[0] in ("err", "crashed") and first_err is None:
                    first_err = msg
            if first_err is not None:
                self._grace(ranks, results)
                self._raise(first_err, results, task)
        return {r: m[2] for r, m in results.items()}

    def _grace(self, ranks: set, results: dict, seconds: float = 2.0):
        """After a failure: give the other ranks a moment to report (their errors may be consequences)."""
        from multiprocessing.connection import wait

        end = time.monotonic() + seconds
        while time.monotonic() < end and len(results) < len(ranks):
            waiting = {self._conns[r]: r for r in ranks if r not in results}
            for c in wait(list(waiting), timeout=0.2):
                try:
                    results[waiting[c]] = pickle.loads(c.recv_bytes())
                except (EOFError, OSError):
                    results[waiting[c]] = ("crashed", waiting[c], None)

    def _raise(self, first_err, results: dict, task: str):
        errs = [m for m in results.values() if m[0] == "err"]
        primary = [m for m in errs if not _secondary(m[2][1])]
        kind, rank, info = primary[0] if primary else first_err
        if kind == "crashed":
            raise RankError(f"{self._what()}: rank {rank} died without a result ({task})")
        name, text, tb, exc = info
        err = RankError(f"{self._what()}: rank {rank} raised {name}: {text}\n--- rank {rank} traceback ---\n{tb}")
        err.rank = rank
        err.original = exc
        raise err


def run_gpu_world(world_size: int, fn: Callable, *args, timeout_s: float = 300.0, mps: bool | str = False,
                  devices: list | None = None, on_wait: Callable[[], None] | None = None) -> WorldResults:
    """Run ``fn(group, *args)`` in ``world_size`` spawned rank processes placed on the visible GPUs.

    Ranks go round-robin over the GPUs (rank ``r`` on ``cuda:{r % num_gpus}``): one rank per GPU keeps an NCCL group;
    ranks that share a GPU get a gloo group, torch symmetric memory allowed on one device, and either time-slice
    (default) or, with ``mps=True`` / ``"auto"``, run at once under a private MPS daemon with their waiting kernels'
    grids capped (``TRITONEP_MAX_PROGRAMS``) so they always fit on the chip together (docs/platform.md, "Several
    ranks on one GPU"). Multicast stays off. ``fn`` must be importable (a module-level function); results come back
    moved to the CPU. One :class:`GpuWorld` started and closed around the call; ``timeout_s`` bounds both.
    ``on_wait``: called in this process about every 0.5 s while the ranks run ``fn`` (see :meth:`GpuWorld.run`).

    Returns:
        :class:`WorldResults`: ``[result of rank 0, ...]`` with ``.info`` (:class:`GpuWorldInfo`: ranks per GPU,
        time-sliced or MPS, ...); inside ``fn``, :func:`gpu_world_info` gives the same.

    Raises:
        RankError / WorldTimeout: as :func:`tritonep.testing.run_cpu_world`.
        ConfigError: no CUDA GPU, more than 8 ranks per GPU, a bad ``mps``; ``MpsUnavailable`` (a ConfigError)
            with ``mps=True`` when the daemon cannot start.
        WorldInterrupted / KeyboardInterrupt: SIGINT (or SIGTERM under the CLI) ended the world (ranks killed,
            temporary files removed).
    """
    deadline = time.monotonic() + timeout_s
    with GpuWorld(world_size, mps=mps, devices=devices) as world:
        try:
            world.start(timeout_s)
            return world.run(fn, *args, timeout_s=max(1.0, deadline - time.monotonic()), on_wait=on_wait)
        except WorldTimeout as e:
            raise WorldTimeout(f"{world._what()}: ranks {e.ranks} did not finish within {timeout_s:.0f} s, start-up "
                               f"included (killed all ranks)", e.ranks) from None
