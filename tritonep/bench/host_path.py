"""The host path of one call, counted: torch calls, allocations, kernel launches, host reads, and Python time.

A call's Python work is part of the product. This module measures it on any machine, the CPU included,
by running the real front door and backend code of an :class:`tritonep.EPBuffer` with every kernel launch
replaced by a no-op that only counts (the kernels' own cost is the GPU's business; on a CPU the interpreter would
drown the host path). Per call kind (``dispatch``, ``dispatch_sync_free``, ``combine``, ``dispatch_bwd``,
``combine_bwd``) it reports:

* ``torch_calls``: torch functions and tensor methods called from Python (a ``TorchFunctionMode`` count): each is
  a few microseconds of host time on a GPU machine;
* ``aten_ops`` / ``allocs``: aten operators dispatched and, among them, allocations (``empty*``, ``zeros*``, ...);
* ``launches``: Triton launches (each ~5-80 us of host time on the GPU depending on the launch path);
* ``host_reads``: device -> host reads the backend counted (the eager budget: one per synced dispatch);
* ``host_us``: median Python time per call with launches stubbed (this machine; compare runs on one machine only).

Counts are exact and machine independent (the tests hold budgets on them); times are this machine's.

Idea: treat host overhead like a kernel (measure it, budget it); the launch-stub trick follows the way serving
stacks profile their CPU path separately from the device path.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostCounter", "stub_launches", "measure_host_path", "measure_calls", "host_calibration", "best_time_us",
           "CALL_KINDS", "HOST_READ_NAMES"]

CALL_KINDS = ("dispatch", "dispatch_sync_free", "combine", "dispatch_bwd", "combine_bwd")
# tensor methods that read device memory on the host (a device->host copy and a stream sync on a GPU)
HOST_READ_NAMES = frozenset(("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"))
# aten ops that launch no device kernel: allocations without a fill, views, metadata, host scalars
_NO_KERNEL = frozenset(("empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "view",
                        "_unsafe_view", "slice", "select", "as_strided", "unsqueeze", "squeeze", "expand", "detach",
                        "alias", "t", "transpose", "permute", "split", "split_with_sizes", "narrow", "unbind",
                        "_reshape_alias", "reshape", "lift_fresh", "scalar_tensor", "sym_size", "sym_stride",
                        "sym_numel", "sym_storage_offset", "size", "stride", "dim", "is_contiguous", "set_"))
_ALLOC_PREFIXES = ("empty", "zeros", "ones", "full", "new_empty", "new_zeros", "new_full", "new_ones",
                   "empty_like", "zeros_like", "ones_like", "full_like", "clone", "_to_copy")


class _Fn(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0
        self.names: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        name = getattr(func, "__name__", str(func))
        self.names[name] = self.names.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class _Aten(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0
        self.allocs = 0
        self.kernels = 0
        self.names: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        name = func.overloadpacket.__name__
        self.names[name] = self.names.get(name, 0) + 1
        if name.startswith(_ALLOC_PREFIXES):
            self.allocs += 1
        if name not in _NO_KERNEL:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


class HostCounter:
    """``with HostCounter() as c: <calls>`` counts torch calls (``c.torch_calls``), aten ops (``c.aten_ops``),
    allocations (``c.allocs``), aten ops that run a device kernel or copy (``c.torch_kernels``: all but allocations
    without a fill, views and metadata; on a GPU each is a launch of torch's own), their names (``c.torch_names``,
    ``c.aten_names``) and the torch calls that read device memory on the host (``c.tensor_reads``:
    :data:`HOST_READ_NAMES`, e.g. ``tolist``; a backend's pinned status read is no torch call:
    :attr:`tritonep.EPBuffer.host_reads` counts those)."""

    def __enter__(self):
        self._fn, self._aten = _Fn(), _Aten()
        self._fn.__enter__()
        self._aten.__enter__()
        return self

    def __exit__(self, *exc):
        self._aten.__exit__(*exc)
        self._fn.__exit__(*exc)
        self.torch_calls, self.aten_ops, self.allocs = self._fn.n, self._aten.n, self._aten.allocs
        self.torch_kernels = self._aten.kernels
        self.torch_names, self.aten_names = self._fn.names, self._aten.names
        self.tensor_reads = sum(n for name, n in self._fn.names.items() if name in HOST_READ_NAMES)
        return False


@contextmanager
def _uncounted():
    """Pause every torch function / dispatch mode (the counters) for the duration."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch._C.DisableTorchFunction(), _disable_current_modes():
        yield


@contextmanager
def stub_launches(buf, run: bool = False):
    """Replace every Triton launch by a counter (a ``list`` of kernel names, yielded); ``buf`` (unused: every bound
    launch of the process is stubbed, a front end's local kernels included) names the buffer measured.

    Every launch of both backends is a bound one (:class:`tritonep.runtime.bound.BoundKernel`, made by the one launch
    runtime, :mod:`tritonep.runtime.launch`): its call is swapped for the duration; the nccl backend's torch ops and
    collectives still run (they are its host path). With
    ``run`` the launch also runs for real, outside the counters (no torch call, aten op or allocation it makes is
    counted), and the seconds it took are added to ``names.spent``, so a caller can leave them out of the host time:
    what a path whose later steps read the kernels' outputs needs (the nccl backend's GPU path in the interpreter).
    """
    from ..runtime.bound import BoundKernel

    names = _Names()
    patched = {BoundKernel: BoundKernel.__call__}

    def timed(orig, *args, **kwargs):
        if run:
            t0 = time.perf_counter()
            with _uncounted():
                orig(*args, **kwargs)
            names.spent += time.perf_counter() - t0

    def fake_bound(self, *dyn):
        names.append(self.name)
        timed(patched[BoundKernel], self, *dyn)
        if not run and "ticket" in self._dyn:
            _publish_host_status(self, dyn)

    BoundKernel.__call__ = fake_bound
    try:
        yield names
    finally:
        for cls, orig in patched.items():
            cls.__call__ = orig


def _publish_host_status(bk, dyn):
    """What a stubbed launch that publishes its status to the host (a kernel bound with ``HOST_ST > 0`` and a
    per-call ``ticket``: the counts exchange, the decode dispatch) must still do for the host to go on: store the
    status words as they stand and then the call's ticket into the pinned tensor
    (:func:`tritonep.device.signal.publish_host_status`), uncounted. Without it the host's spin read would wait
    for a ticket no stub publishes."""
    words = bk.arg("HOST_ST")
    if not words:
        return
    with _uncounted():
        host = bk.arg("host_st_ptr")
        host[:words] = bk.arg("status_ptr")[:words]
        host[words] = bk.arg("ticket", dyn)


class _Names(list):
    """Kernel names launched, and ``spent``: seconds inside launches that ran for real."""

    spent = 0.0


def measure_host_path(buf, x, topk_idx, topk_weights, iters: int = 20, run_kernels: bool = False) -> dict:
    """Count and time the host path of each call kind (module docstring) on ``buf`` with launches stubbed.

    Args:
        buf: an open EPBuffer (a CPU buffer in a CPU world of one rank is enough; collectives of the nccl backend
            run for real). x / topk_idx / topk_weights: one call's inputs.
        iters: timed repetitions per call kind (the median is reported).
        run_kernels: launches run for real outside the counters and their time is left out of ``host_us``
            (:func:`stub_launches` with ``run``); needed when later host steps read what a kernel wrote (the nccl
            backend with ``use_triton`` on the CPU: its GPU path, kernels interpreted).

    Returns:
        ``{kind: {torch_calls, aten_ops, allocs, launches, host_reads, host_us, torch_names, aten_names, ...}}``
        (:func:`measure_calls`).
    """
    eo = buf.expert_out_buffer()
    with stub_launches(buf, run=run_kernels):
        d = buf.dispatch(x, topk_idx, topk_weights)  # warm every path once
        rows = d.x.shape[0]
        gx = torch.zeros(rows, buf.hidden, dtype=torch.bfloat16, device=x.device)
        gw = torch.zeros(rows, dtype=torch.float32, device=x.device)
        gy = torch.zeros(x.shape[0], buf.hidden, dtype=torch.bfloat16, device=x.device)
    calls = {
        "dispatch": lambda: buf.dispatch(x, topk_idx, topk_weights),
        "dispatch_sync_free": lambda: buf.dispatch(x, topk_idx, topk_weights, sync_free=True),
        "combine": lambda: buf.combine(eo[:rows], d.handle),
        "dispatch_bwd": lambda: buf.dispatch_backward(gx, gw, d.handle),
        "combine_bwd": lambda: buf.combine_backward(gy, eo[:rows], d.handle),
    }
    return measure_calls(calls, lambda: buf.host_reads, iters=iters, run_kernels=run_kernels)


def measure_calls(calls: dict, status_reads=lambda: 0, iters: int = 20, run_kernels: bool = False) -> dict:
    """Count and time the host path of each ``calls[name]()`` (no argument; run in order, each once to warm up, once
    counted, then ``iters`` times timed) with every bound launch stubbed (:func:`stub_launches`).

    Args:
        calls: name -> a callable making one call (e.g. a front end's dispatch); a later one may use what an
            earlier one's calls left (a handle).
        status_reads: the count of status reads so far that no torch call makes (:attr:`tritonep.EPBuffer.
            host_reads`, summed over the buffers the calls use).
        iters, run_kernels: as :func:`measure_host_path`.

    Returns:
        ``{name: {torch_calls, aten_ops, allocs, torch_kernels, launches, host_reads, tensor_reads, status_reads,
        host_us, torch_names, aten_names}}`` (:class:`HostCounter`'s counts; ``launches``: Triton launches);
        ``host_reads`` = ``tensor_reads`` (torch calls of :data:`HOST_READ_NAMES`) + ``status_reads`` (the pinned
        status reads the backends counted).
    """
    out = {}
    with stub_launches(None, run=run_kernels) as launched:
        for kind, fn in calls.items():
            fn()
            n0, r0 = len(launched), status_reads()
            with HostCounter() as c:
                fn()
            launches, reads = len(launched) - n0, status_reads() - r0
            ts = []
            for _ in range(iters):
                s0 = launched.spent
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0 - (launched.spent - s0)) * 1e6)
            out[kind] = dict(torch_calls=c.torch_calls, aten_ops=c.aten_ops, allocs=c.allocs,
                             torch_kernels=c.torch_kernels, launches=launches, host_reads=reads + c.tensor_reads,
                             tensor_reads=c.tensor_reads, status_reads=reads,
                             host_us=statistics.median(ts) if ts else 0.0, torch_names=c.torch_names,
                             aten_names=c.aten_names)
    return out


def host_calibration(device, iters: int = 2000, rounds: int = 7) -> dict:
    """This host's speed at the two kinds of work a call's host path is made of, microseconds (minimum over
    ``rounds`` of the mean of ``iters``): ``calib_python_loop_100_us`` (a list comprehension over 100 ints: the
    interpreter) and ``calib_slice_us`` (``t[:500]`` of a ``[1024, 7168]`` bf16 tensor on ``device``: torch's
    Python binding, dispatcher and view creation, what the views and checks of a call cost).

    The GPU machines' hosts differ by up to 2x in both and drift within a call, so every host-time
    figure of ``benchmarks/eager_profile.py`` / ``benchmarks/probes/host_primitives.py`` comes with these two; compare
    host times between runs only next to them."""
    data = list(range(100))
    t = torch.empty(1024, 7168, dtype=torch.bfloat16, device=device)
    return dict(calib_python_loop_100_us=best_time_us(lambda: [v * 2 for v in data], iters, rounds),
                calib_slice_us=best_time_us(lambda: t[:500], iters, rounds))


def best_time_us(fn, iters: int, rounds: int) -> float:
    """Host microseconds of one ``fn()`` call: the minimum over ``rounds`` of the mean over ``iters`` calls."""
    b = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        b = min(b, (time.perf_counter() - t0) / iters * 1e6)
    return b
