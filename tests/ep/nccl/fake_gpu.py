"""Launch-path probes for the nccl backend's bound kernels (:class:`tritonep.ep.bound.BoundKernel`).

:func:`fake_gpu` (CPU, interpreter): every BoundKernel made inside it believes it is on a GPU. Its kernel is wrapped
so that Triton's own path (``kernel[grid]``: the first launch of a variant) runs the interpreted kernel, logs
``("jit", name)`` and hands back a compiled-kernel stand-in; a later launch of the same variant then takes the
direct path, whose C-launcher call lands in the stand-in: it logs ``("direct", name)``, checks that the call is
exactly what Triton's runner would hand the C launcher for this launch (grid padded to three dimensions, every
tensor as its ``data_ptr()``, in parameter order: the contract of ``tests/ep/test_bound_launch.py``) and runs the
interpreted kernel with the real tensors, so the backend's outputs stay checkable bit for bit.

:func:`count_paths` (a real GPU): counts BoundKernel calls and the ones that went through ``kernel[grid]``; the
rest were direct C-launcher calls.

Both patch classes process-wide for the duration (a forked CPU rank, or one call inside a GPU world's rank) and
restore them after.
"""

from __future__ import annotations

import contextlib

import torch

from tritonep.ep import bound as bound_mod
from tritonep.ep.bound import BoundKernel


def _ptrs(args):
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


class _Run:
    """Stands in for Triton's CudaLauncher: ``launch`` is the C entry point the direct path calls."""

    launch_cooperative_grid = launch_pdl = False
    global_scratch_size = profile_scratch_size = 0

    def __init__(self, kernel):
        self.kernel = kernel

    def launch(self, gx, gy, gz, stream, function, coop, pdl, gscratch, pscratch, meta, lmeta, enter, exit_,
               *args):
        k = self.kernel
        bk = k.bound
        grid, dyn = bk._fake_last
        full = bk._args(dyn)
        want = tuple(grid) + (1,) * (3 - len(grid))
        assert (gx, gy, gz) == want, (k.name, (gx, gy, gz), want)
        assert (stream, function, meta, coop, pdl) == (0, ("function", k.name), ("meta", k.name), False, False)
        assert (gscratch, pscratch, lmeta, enter, exit_) == (None,) * 5
        assert args == _ptrs(full), (k.name, args, _ptrs(full))
        k.log.append(("direct", k.name))
        k.real[want](*full, **bk.options)


class _Compiled:
    def __init__(self, kernel):
        self.run = _Run(kernel)
        self.function, self.packed_metadata = ("function", kernel.name), ("meta", kernel.name)


class _FakeJIT:
    """An interpreted kernel dressed as a JITFunction on an sm_90 device (params, device cache, ``kernel[grid]``)."""

    def __init__(self, real, bound, log):
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import JITFunction

        kw = getattr(real, "kwargs", {})
        self.real, self.bound, self.log, self.fn = real, bound, log, real.fn
        self.name = real.fn.__name__
        self.params = JITFunction(real.fn, do_not_specialize=kw.get("do_not_specialize"),
                                  do_not_specialize_on_alignment=kw.get("do_not_specialize_on_alignment")).params
        self.device_caches = {0: (None, None, None, CUDABackend(GPUTarget("cuda", 90, 32)), None)}

    def __getitem__(self, grid):
        def run(*args, **options):
            self.log.append(("jit", self.name))
            self.real[grid](*args, **options)
            return _Compiled(self)
        return run


@contextlib.contextmanager
def fake_gpu():
    """Yields the launch log (a list of ``("jit" | "direct", kernel name)``); see the module docstring."""
    log = []
    init, call = BoundKernel.__init__, BoundKernel.__call__
    enabled = bound_mod.bound_launch_enabled
    had_stream = hasattr(torch._C, "_cuda_getCurrentRawStream")
    stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def fake_init(self, *a, **kw):
        init(self, *a, **kw)
        self.kernel = _FakeJIT(self.kernel, self, log)

    def noting_call(self, *dyn):
        self._fake_last = (dyn[0], dyn[1:]) if self.grid is None else (self.grid, dyn)
        call(self, *dyn)

    BoundKernel.__init__, BoundKernel.__call__ = fake_init, noting_call
    bound_mod.bound_launch_enabled = lambda device: True
    torch._C._cuda_getCurrentRawStream = lambda dev: 0
    try:
        yield log
    finally:
        BoundKernel.__init__, BoundKernel.__call__ = init, call
        bound_mod.bound_launch_enabled = enabled
        if had_stream:
            torch._C._cuda_getCurrentRawStream = stream
        else:
            del torch._C._cuda_getCurrentRawStream


class _Counting:
    """A real JIT kernel whose ``kernel[grid]`` (Triton's own launch path) is counted; everything else delegates."""

    def __init__(self, real, counts):
        self._real, self._counts = real, counts

    def __getitem__(self, grid):
        self._counts["jit"] += 1
        return self._real[grid]

    def __getattr__(self, name):
        return getattr(self._real, name)


@contextlib.contextmanager
def count_paths():
    """Yields ``{"calls": BoundKernel calls, "jit": of them through kernel[grid]}`` for BoundKernels made inside."""
    counts = {"calls": 0, "jit": 0}
    init, call = BoundKernel.__init__, BoundKernel.__call__

    def counting_init(self, *a, **kw):
        init(self, *a, **kw)
        self.kernel = _Counting(self.kernel, counts)

    def counting_call(self, *dyn):
        counts["calls"] += 1
        call(self, *dyn)

    BoundKernel.__init__, BoundKernel.__call__ = counting_init, counting_call
    try:
        yield counts
    finally:
        BoundKernel.__init__, BoundKernel.__call__ = init, call
