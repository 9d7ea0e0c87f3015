"""Launch-path probes for the nccl backend's bound kernels (:class:`tritonep.runtime.bound.BoundKernel`).

:func:`fake_gpu` (CPU, interpreter): every BoundKernel made inside it believes it is on a GPU. Its kernel is wrapped
so that Triton's own path (``kernel[grid]``: the first launch of a variant) runs the interpreted kernel, logs
``("jit", name)`` and hands back a compiled-kernel stand-in named by the specialisation Triton's own binder gives
the launch's arguments (one per variant Triton would compile); a later launch of the same variant then takes the
direct path, whose C-launcher call lands in the stand-in: it logs ``("direct", name)``, checks that the call is
exactly what Triton's runner would hand the C launcher for this launch (grid padded to three dimensions, every
tensor as its ``data_ptr()``, in parameter order: the contract of ``tests/runtime/test_bound_launch.py``; a compiled
function of another variant than Triton's binder picks for these arguments is logged ``("stale", name)``) and runs the
interpreted kernel with the real tensors, so the backend's outputs stay checkable bit for bit. With packed launches on
(``TRITONEP_PACKED_LAUNCH``, the default) a direct launch goes through the packed launcher instead: the real C
module packs the parameters and its bytes are checked against the twin of the same call (``log.packed`` counts them).

:func:`count_paths` (a real GPU): counts BoundKernel calls and the ones that went through ``kernel[grid]``; the
rest were direct C-launcher calls.

Both patch classes process-wide for the duration (a forked CPU rank, or one call inside a GPU world's rank) and
restore them after.
"""

from __future__ import annotations

import contextlib

import torch

from tritonep.runtime import bound as bound_mod
from tritonep.runtime.bound import BoundKernel


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
        assert (stream, meta[:2], coop, pdl) == (0, ("meta", k.name), False, False)
        assert (gscratch, pscratch, lmeta, enter, exit_) == (None,) * 5
        assert args == _ptrs(full), (k.name, args, _ptrs(full))
        # the variant handed over must be the one Triton's binder picks for this launch's arguments; a stale one is
        # logged, not raised, so the ranks stay in step through their collectives and the test fails at once
        key = k.key(full, bk.options)
        ok = function == _function_id(k.name, key) and meta == ("meta", k.name, key)
        k.log.append(("direct", k.name) if ok else ("stale", k.name))
        k.real[want](*full, **bk.options)


_FUNCTIONS: dict = {}


def _function_id(name, key) -> int:
    """The stand-in CUfunction handle of one variant (a distinct nonzero int per (kernel, specialisation))."""
    return _FUNCTIONS.setdefault((name, key), len(_FUNCTIONS) + 1)


class _Meta:
    num_warps, num_ctas, shared, launch_cooperative_grid, launch_pdl = 4, 1, 0, False, False


class _Src:
    def __init__(self, signature):
        self.signature = signature


class _Compiled:
    def __init__(self, kernel, key, types):
        self.run = _Run(kernel)
        self.function, self.packed_metadata = _function_id(kernel.name, key), ("meta", kernel.name, key)
        # what the packed path reads (tritonep.runtime.packed_launch.bind): Triton's signature of this variant, its
        # metadata and its loaded function (an int handle, one per variant)
        self.src = _Src(dict(zip([p.name for p in kernel.params], types)))
        self.metadata = _Meta()
        self.key, self.types = key, types


class _Packed:
    """Stands in for the packed launcher's C module (tritonep/runtime/packed_launch.py): ``make`` and ``fill`` are the
    real C functions; ``run`` / ``run_grid`` check the bytes a launch would hand the driver against the twin
    (:func:`tritonep.runtime.packed_launch.pack_twin` of what Triton's runner would pass for this launch), log
    ``("direct", name)`` (``("stale", name)`` for a variant other than Triton's binder picks) and run the
    interpreted kernel."""

    def __init__(self, real, log):
        self._real, self.log, self.caps = real, log, {}
        self.make, self.fill = real.make, real.fill

    def run(self, cap, stream, *dyn):
        self._launch(cap, None, stream, dyn)

    def run_grid(self, cap, gx, gy, gz, stream, *dyn):
        self._launch(cap, (gx, gy, gz), stream, dyn)

    def _launch(self, cap, g3, stream, dyn):
        from tritonep.runtime import packed_launch

        k, key, types = self.caps[id(cap)]
        bk = k.bound
        grid, fdyn = bk._fake_last
        full = bk._args(fdyn)
        want = tuple(grid) + (1,) * (3 - len(grid))
        assert stream == 0 and (g3 is None) == (bk.grid is not None) and (g3 is None or g3 == want), (k.name, g3)
        got = self._real.fill(cap, *dyn)
        assert got == packed_launch.pack_twin(types, _ptrs(full)), (k.name, types)
        ok = key == k.key(full, bk.options)
        k.log.append(("direct", k.name) if ok else ("stale", k.name))
        self.log.packed += 1
        k.real[want](*full, **bk.options)


class _Log(list):
    """The launch log; ``packed``: how many direct launches went through the packed launcher."""

    packed = 0


class _FakeJIT:
    """An interpreted kernel dressed as a JITFunction on an sm_90 device (params, device cache, ``kernel[grid]``)."""

    def __init__(self, real, bound, log):
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        kw = getattr(real, "kwargs", {})
        self.real, self.bound, self.log, self.fn = real, bound, log, real.fn
        self.name = real.fn.__name__
        jf = JITFunction(real.fn, do_not_specialize=kw.get("do_not_specialize"),
                         do_not_specialize_on_alignment=kw.get("do_not_specialize_on_alignment"))
        self.params = jf.params
        backend = CUDABackend(GPUTarget("cuda", 90, 32))
        self.device_caches = {0: (None, None, None, backend, None)}
        self._binder = create_function_from_signature(jf.signature, jf.params, backend)

    def key(self, args, options) -> str:
        """The specialisation Triton's own binder computes for ``args`` (what ``JITFunction.run`` compiles by)."""
        return str(self._binder(*args, **options)[1])

    def types(self, args, options) -> list:
        """The signature types of that specialisation (a compiled kernel's ``src.signature`` values)."""
        return [s[0] for s in self._binder(*args, **options)[1]]

    def __getitem__(self, grid):
        def run(*args, **options):
            self.log.append(("jit", self.name))
            self.real[grid](*args, **options)
            return _Compiled(self, self.key(args, options), self.types(args, options))
        return run


@contextlib.contextmanager
def fake_gpu():
    """Yields the launch log (a list of ``("jit" | "direct" | "stale", kernel name)``; "stale": a direct launch
    handed a variant Triton would not pick for its arguments); see the module docstring."""
    from tritonep.runtime import packed_launch

    log = _Log()
    init, call = BoundKernel.__init__, BoundKernel.__call__
    enabled = bound_mod.bound_launch_enabled
    module, bind = packed_launch.module, packed_launch.bind
    real = module()
    shim = _Packed(real, log) if real is not None else None

    def recording_bind(compiled, static, call_pos, grid3):
        cap = bind(compiled, static, call_pos, grid3)
        if cap is not None:
            shim.caps[id(cap)] = (compiled.run.kernel, compiled.key, compiled.types)
        return cap
    had_stream = hasattr(torch._C, "_cuda_getCurrentRawStream")
    stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def fake_init(self, *a, **kw):
        init(self, *a, **kw)
        self.kernel = _FakeJIT(self.kernel, self, log)

    def noting_call(self, *dyn):
        self._fake_last = (dyn[0], dyn[1:]) if self.grid is None else (self.grid, dyn)
        try:
            call(self, *dyn)
        finally:  # read by the fake launcher during the call only: hold no tensor past it (the output pool would
            self._fake_last = None  # see the call's pooled outputs as held by a caller)

    BoundKernel.__init__, BoundKernel.__call__ = fake_init, noting_call
    bound_mod.bound_launch_enabled = lambda launcher: True
    torch._C._cuda_getCurrentRawStream = lambda dev: 0
    if shim is not None:
        packed_launch.module, packed_launch.bind = (lambda: shim), recording_bind
    try:
        yield log
    finally:
        BoundKernel.__init__, BoundKernel.__call__ = init, call
        bound_mod.bound_launch_enabled = enabled
        packed_launch.module, packed_launch.bind = module, bind
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
