"""BoundKernel (tritonep/runtime/bound.py): the direct C-launcher call hands exactly what Triton's own runner hands.

No GPU here: a fake JIT function and a fake compiled kernel record what reaches the C launcher. Triton 3.6's path is
``CompiledKernel[grid](*args)`` -> ``CudaLauncher(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *args)`` -> ``launch(gx, gy, gz, stream, function, coop, pdl, global_scratch,
profile_scratch, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`` with each tensor argument turned
into its ``data_ptr()`` by the C code. The bound path must produce that tuple with the tensors already as ints, pick
the variant by Triton's own specialisation of the per-call values, and fall back to Triton's path for a new variant,
a launch hook, scratch memory or the warm-up.
"""

import inspect

import pytest
import torch
import triton
import triton.language as tl

from tritonep.runtime import recorder
from tritonep.runtime import bound as bound_mod
from tritonep.runtime.bound import BoundKernel

_STREAM = 0x5EED


class _Param:
    def __init__(self, p):
        self.name = p.name
        self.is_const = self.is_constexpr = False
        self.do_not_specialize = p.name in ("T",)
        self.do_not_specialize_on_alignment = False


class _Run:
    """Stands in for CudaLauncher: ``launch`` is the C entry point."""

    def __init__(self, log, scratch=0):
        self.log = log
        self.launch_cooperative_grid, self.launch_pdl = False, False
        self.global_scratch_size, self.profile_scratch_size = scratch, 0

    def launch(self, *a):
        self.log.append(("c", a))

    def __call__(self, gx, gy, gz, stream, function, *args):  # what Triton's runner calls (CudaLauncher.__call__)
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None, *args)


class _Compiled:
    def __init__(self, log, tag, scratch=0):
        self.run = _Run(log, scratch)
        self.function, self.packed_metadata = ("function", tag), ("meta", tag)

    def runner(self, grid, *args):
        """Triton's CompiledKernel.__getitem__(grid)(*args) with no hooks installed."""
        self.run(grid[0], grid[1], grid[2], _STREAM, self.function, self.packed_metadata, None, None, None, *args)


def _fn(x_ptr, idx_ptr, out_ptr, T, table_ptr, n_static, BLOCK, FLAG=False):  # the kernel's parameters
    pass


class _Kernel:
    """Stands in for a JITFunction: ``kernel[grid](*args, **options)`` compiles one variant per specialisation."""

    def __init__(self, scratch=0):
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend

        self.fn = _fn
        self.params = [_Param(p) for p in inspect.signature(_fn).parameters.values()]
        self.device_caches = {0: (None, None, None, CUDABackend(GPUTarget("cuda", 90, 32)), None)}
        self.log, self.compiled, self.scratch = [], {}, scratch
        self.warm = []

    def _variant(self, args):
        from triton.runtime.jit import native_specialize_impl

        b = self.device_caches[0][3]
        return tuple(native_specialize_impl(b, a, False, p.name != "T", True) for a, p in zip(args, self.params))

    def __getitem__(self, grid):
        def run(*args, **options):
            key = self._variant(args)
            c = self.compiled.setdefault(key, _Compiled(self.log, len(self.compiled), self.scratch))
            self.log.append(("triton", grid, args, options))
            c.runner(tuple(grid) + (1,) * (3 - len(grid)), *args)
            return c
        return run

    def warmup(self, *args, grid, **options):
        """Triton's warm-up: compile this variant (no launch) and return it."""
        self.warm.append((grid, args, options))
        return self.compiled.setdefault(self._variant(args), _Compiled(self.log, len(self.compiled), self.scratch))


class _Launcher:
    def __init__(self, device):
        self.device = torch.device(device)
        self._warmup = False
        self.max_programs = 0


@pytest.fixture
def gpu_like(monkeypatch):
    monkeypatch.setattr(bound_mod, "bound_launch_enabled", lambda launcher: True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: _STREAM, raising=False)


def _bound(kernel, launcher):
    table = torch.arange(4, dtype=torch.int64)
    return BoundKernel(launcher, kernel, (6,), dict(table_ptr=table, n_static=7, BLOCK=32, num_warps=4),
                       dyn=("x_ptr", "idx_ptr", "out_ptr", "T")), table


def _as_c(args):
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def test_direct_launch_equals_tritons_runner(gpu_like):
    k = _Kernel()
    bk, table = _bound(k, _Launcher("cuda:0"))
    x, idx, out = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.int64), torch.zeros(64)
    bk(x, idx, out, 5)  # first: Triton's path (compiles), then remembered
    assert k.log[0][0] == "triton" and k.log[0][3] == {"num_warps": 4}
    via_triton = k.log[1]
    x2, out2 = torch.ones(64, dtype=torch.bfloat16), torch.ones(64)
    bk(x2, idx, out2, 9)  # same variant: direct
    assert len(k.log) == 3 and k.log[2][0] == "c"
    direct = k.log[2][1]
    expect = (6, 1, 1, _STREAM, ("function", 0), False, False, None, None, ("meta", 0), None, None, None,
              *_as_c((x2, idx, out2, 9, table, 7, 32, False)))
    assert direct == expect
    # the Triton path's C call has the same shape (tensors there, converted by the C code)
    assert _as_c(via_triton[1]) == expect[:13] + _as_c((x, idx, out, 5, table, 7, 32, False))


@pytest.mark.parametrize("change", ["dtype", "alignment", "int_is_one_not_specialized"])
def test_a_new_specialisation_goes_through_triton(gpu_like, change):
    k = _Kernel()
    bk, _ = _bound(k, _Launcher("cuda:0"))
    x, idx, out = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.int64), torch.zeros(64)
    bk(x, idx, out, 5)
    n = len(k.log)
    if change == "dtype":
        bk(x, idx.to(torch.int32), out, 5)  # another compiled variant
        assert k.log[n][0] == "triton" and len(k.compiled) == 2
    elif change == "alignment":
        bk(x, idx, torch.zeros(65)[1:], 5)  # 4-byte aligned out: Triton specialises on 16
        assert k.log[n][0] == "triton" and len(k.compiled) == 2
    else:
        bk(x, idx, out, 1)  # T is do_not_specialize: T == 1 is the same variant
        assert k.log[n][0] == "c" and len(k.compiled) == 1


def test_hooks_scratch_recorder_and_warmup(gpu_like, monkeypatch):
    from triton import knobs

    x, idx, out = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.int64), torch.zeros(64)
    k = _Kernel()
    bk, _ = _bound(k, _Launcher("cuda:0"))
    bk(x, idx, out, 5)
    hook = lambda *a: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        n = len(k.log)
        bk(x, idx, out, 5)
        assert k.log[n][0] == "triton"  # a profiler's hook sees every launch
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    ks = _Kernel(scratch=128)
    bks, _ = _bound(ks, _Launcher("cuda:0"))
    bks(x, idx, out, 5)
    bks(x, idx, out, 5)
    assert [e[0] for e in ks.log].count("triton") == 2  # scratch memory: Triton's launcher allocates it
    seen = []
    recorder.set_recorder(seen.append)
    try:
        bk(x, idx, out, 5)
    finally:
        recorder.set_recorder(None)
    assert seen == [("launch", "_fn", (6,))]
    lau = _Launcher("cuda:0")
    kw = _Kernel()
    bkw, _ = _bound(kw, lau)
    lau._warmup = True
    bkw(x, idx, out, 5)
    assert kw.warm and not kw.log  # compiled, not run


def test_cpu_path_is_tritons_own_and_binding_errors():
    k = _Kernel()
    bk, table = _bound(k, _Launcher("cpu"))
    x, idx, out = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.int64), torch.zeros(64)
    bk(x, idx, out, 5)
    bk(x, idx, out, 6)
    assert [e[0] for e in k.log] == ["triton", "c", "triton", "c"]  # interpreter: every launch via kernel[grid]
    assert k.log[2][2] == (x, idx, out, 6, table, 7, 32, False)
    with pytest.raises(TypeError, match="neither bound nor per-call"):
        BoundKernel(_Launcher("cpu"), k, (1,), dict(BLOCK=1), dyn=("x_ptr",))
    with pytest.raises(TypeError, match="unknown parameters"):
        BoundKernel(_Launcher("cpu"), k, (1,), dict(nope=1), dyn=())
    with pytest.raises(TypeError, match="3 per-call values, bound for 4"):
        bk(x, idx, out)  # T missing: it would reach the kernel as None
    capped = _Launcher("cpu")
    capped.max_programs = 4
    from tritonep.errors import ConfigError

    with pytest.raises(ConfigError, match="TRITONEP_MAX_PROGRAMS"):
        _bound(k, capped)


def test_per_call_grid_unrecorded(gpu_like):
    """``grid=None`` (the nccl backend): the grid is the first value of a call, it is not part of the variant, the
    direct call gets it padded to three dimensions, and ``record=False`` keeps the launch out of the recorder."""
    k = _Kernel()
    table = torch.arange(4, dtype=torch.int64)
    bk = BoundKernel(_Launcher("cuda:0"), k, None, dict(table_ptr=table, n_static=7, BLOCK=32, num_warps=4),
                     dyn=("x_ptr", "idx_ptr", "out_ptr", "T"), record=False)
    x, idx, out = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.int64), torch.zeros(64)
    seen = []
    recorder.set_recorder(seen.append)
    try:
        bk((3, 2), x, idx, out, 5)
        bk((9,), x, idx, out, 7)  # another grid, same variant: direct
    finally:
        recorder.set_recorder(None)
    assert seen == []
    assert [e[0] for e in k.log] == ["triton", "c", "c"] and k.log[0][1] == (3, 2)
    assert k.log[2][1] == (9, 1, 1, _STREAM, ("function", 0), False, False, None, None, ("meta", 0), None, None, None,
                           *_as_c((x, idx, out, 7, table, 7, 32, False)))
    capped = _Launcher("cuda:0")
    capped.max_programs = 4
    bkc = BoundKernel(capped, k, None, dict(table_ptr=table, n_static=7, BLOCK=32), dyn=("x_ptr", "idx_ptr",
                                                                                         "out_ptr", "T"))
    from tritonep.errors import ConfigError

    with pytest.raises(ConfigError, match="TRITONEP_MAX_PROGRAMS"):
        bkc((5,), x, idx, out, 5)


# ---------------------------------------------------------------------------------------------------- attacks
# A kernel whose variants are keyed by Triton's own binder (what ``JITFunction.run`` compiles by): a direct launch
# whose compiled function names another key than the binder gives for this launch's arguments is a stale variant.

@triton.jit(do_not_specialize=["T"])
def _spec_kernel(x_ptr, idx_ptr, out_ptr, T, n, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


class _TritonKeyed:
    """JIT stand-in: ``kernel[grid](*args)`` "compiles" one variant per Triton binder key and runs it; ``launch``
    logs ``("c", key of the function it was handed, the key Triton's binder gives for these arguments)``."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        jf = JITFunction(_spec_kernel.fn, do_not_specialize=["T"])
        self.fn, self.params = jf.fn, jf.params
        backend = CUDABackend(GPUTarget("cuda", 90, 32))
        self.device_caches = {0: (None, None, None, backend, None)}
        self._binder = create_function_from_signature(jf.signature, jf.params, backend)
        self.log, self.compiled, self.last = [], {}, None

    def key(self, args, options=None):
        return str(self._binder(*args, **(options or {}))[1])

    def __getitem__(self, grid):
        def run(*args, **options):
            key = self.key(args, options)
            self.compiled.setdefault(key, len(self.compiled))
            self.log.append(("triton", key, key))
            return _KeyedCompiled(self, key)
        return run

    def warmup(self, *args, grid, **options):
        """Like Triton's: compiled, binary not loaded (``function`` None until ``_init_handles``)."""
        key = self.key(args, options)
        self.compiled.setdefault(key, len(self.compiled))
        self.log.append(("warm", key, key))
        return _UnloadedCompiled(self, key)


class _UnloadedCompiled:
    """A warm-up's CompiledKernel: ``function`` is None until ``_init_handles`` loads the binary."""

    def __init__(self, kernel, key):
        self._loaded = _KeyedCompiled(kernel, key)
        self.run, self.packed_metadata, self.function = self._loaded.run, self._loaded.packed_metadata, None

    def _init_handles(self):
        self.function = self._loaded.function


class _KeyedCompiled:
    def __init__(self, kernel, key):
        self.run = _KeyedRun(kernel)
        self.function, self.packed_metadata = ("function", key), ("meta", key)


class _KeyedRun:
    launch_cooperative_grid = launch_pdl = False
    global_scratch_size = profile_scratch_size = 0

    def __init__(self, kernel):
        self.kernel = kernel

    def launch(self, gx, gy, gz, stream, function, coop, pdl, gs, ps, meta, lmeta, enter, exit_, *args):
        k = self.kernel
        grid, full = k.last
        assert (gx, gy, gz) == tuple(grid) + (1,) * (3 - len(grid)) and args == _as_c(full)
        k.log.append(("c", function[1], k.key(full)))


def test_per_call_values_never_launch_a_stale_variant(gpu_like):
    """Alternating per-call values of every kind Triton specialises on (tensor dtype, 16-byte alignment of a bf16
    view 2 elements in, ints 0 / 1 / 16 / across the int32 range, a do_not_specialize int, a per-call constexpr),
    a grid of 0 programs, a launch hook installed and removed: every launch runs the variant Triton's binder picks
    for its arguments (the first launch of a variant through ``kernel[grid]``, later ones direct)."""
    from triton import knobs

    k = _TritonKeyed()
    bk = BoundKernel(_Launcher("cuda:0"), k, None, dict(num_warps=4),
                     dyn=("x_ptr", "idx_ptr", "out_ptr", "T", "n", "BLOCK"), record=False)
    base = torch.zeros(80, dtype=torch.bfloat16)
    x, x_off = base[:64], base[2:66]  # x_off: 4-byte aligned (Triton's "D" specialisation off)
    i64, i32, out = torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int32), torch.zeros(64)
    calls = [((3,), x, i64, out, 5, 3, 16), ((3,), x_off, i64, out, 5, 3, 16), ((2,), x, i32, out, 7, 3, 16),
             ((0,), x, i64, out, 0, 3, 16), ((1,), x, i64, out, 2**31, 3, 16), ((1,), x, i64, out, 5, 1, 16),
             ((1,), x, i64, out, 5, 16, 16), ((1,), x, i64, out, 5, 2**31 + 16, 16), ((1,), x, i64, out, 5, -2**31 - 1,
                                                                                  16), ((4,), x, i64, out, 5, 3, 32)]

    def launch(c):
        k.last = (c[0], bk._args(c[1:]))
        bk(*c)
        kind, ran, want = k.log[-1]
        assert ran == want, (kind, c[0], [getattr(v, "dtype", v) for v in c[1:]])
        return kind

    for c in calls + calls[::-1] + calls:
        launch(c)
    variants = {k.key(bk._args(c[1:])) for c in calls}
    assert len(variants) == len(calls) - 1  # T is do_not_specialize: T = 0 (grid 0) is T = 5's variant
    assert len(k.compiled) == len(variants)
    assert [e[0] for e in k.log].count("triton") == len(variants)  # compiled once each, every later launch direct
    hook = lambda *a: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launch(calls[1]) == "triton"  # a profiler sees the launch
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert launch(calls[1]) == "c" and launch(calls[2]) == "c"  # hook gone: direct again, right variants


def test_warmup_binds_the_direct_path(gpu_like):
    """The owner's dry run (``launcher._warmup``) compiles AND binds: the first real call with the warm-up's
    specialisation launches directly (no ``kernel[grid]``), one with another specialisation (a 4-byte aligned view,
    another T kind) still goes through Triton's path once and is bound then."""
    k = _TritonKeyed()
    lau = _Launcher("cuda:0")
    bk = BoundKernel(lau, k, None, dict(num_warps=4), dyn=("x_ptr", "idx_ptr", "out_ptr", "T", "n", "BLOCK"),
                     record=False)
    base = torch.zeros(80, dtype=torch.bfloat16)
    x, i64, out = base[:64], torch.zeros(16, dtype=torch.int64), torch.zeros(64)
    lau._warmup = True
    bk((3,), x, i64, out, 128, 32, 16)  # the dry run's dummy values: T = max tokens, n a multiple of 16
    lau._warmup = False
    assert [e[0] for e in k.log] == ["warm"]

    def launch(c):
        k.last = (c[0], bk._args(c[1:]))
        bk(*c)
        kind, ran, want = k.log[-1]
        assert ran == want
        return kind

    # real calls: other T (do_not_specialize), other tensors of the same dtype and alignment, other n % 16 == 0
    assert launch(((3,), torch.ones(64, dtype=torch.bfloat16), i64, torch.ones(64), 7, 48, 16)) == "c"
    assert launch(((3,), base[2:66], i64, out, 7, 32, 16)) == "triton"  # 4-byte aligned x: a new variant
    assert launch(((3,), base[2:66], i64, out, 9, 32, 16)) == "c"
    assert launch(((3,), x, i64, out, 7, 1, 16)) == "triton"  # n == 1: Triton makes it a constexpr
    assert launch(((3,), x, i64, out, 7, 17, 16)) == "triton"  # n % 16 != 0
    assert launch(((3,), x, i64, out, 7, 33, 16)) == "c"
    assert [e[0] for e in k.log].count("triton") == 3


class _OneParam:
    """``_one(v)`` with the given flags: what ``key_of`` makes of one per-call value."""

    def __init__(self, constexpr=False, spec=True, align=True, const=False):
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend

        p = type("P", (), dict(name="v", is_constexpr=constexpr, is_const=const, do_not_specialize=not spec,
                               do_not_specialize_on_alignment=not align))()
        self.fn, self.params = (lambda v: None), [p]
        self.fn.__name__ = "_one"
        self.device_caches = {0: (None, None, None, CUDABackend(GPUTarget("cuda", 90, 32)), None)}


@pytest.mark.parametrize("spec,align,const", [(True, True, False), (True, False, False), (False, True, False),
                                              (True, True, True)])
def test_key_is_exactly_tritons_specialisation(gpu_like, spec, align, const):
    """Two values share a ``key_of`` exactly when ``native_specialize_impl`` (Triton's binder) gives them the same
    specialisation, for ints across every range and residue Triton tells apart, bools and floats (first bound
    value an int), and for tensors of several dtypes and alignments (first bound value a tensor)."""
    from triton.runtime.jit import native_specialize_impl

    ints = [0, 1, 2, 15, 16, 17, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**32, 2**63 - 16, 2**63, 2**64 - 1,
            -2**31, -2**31 - 1, -2**31 - 16, -2**63, True, False, 1.0, 16.0]
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], base[2:].view(torch.float16), base.view(torch.bfloat16)[1:],
               base.view(torch.int32), base.view(torch.int32)[3:]]
    for first, values in ((5, ints), (base, tensors)):
        k = _OneParam(spec=spec, align=align, const=const)
        bk = BoundKernel(_Launcher("cuda:0"), k, (1,), {}, dyn=("v",))
        bk._bind((first,))
        b = k.device_caches[0][3]
        for u in values:
            for v in values:
                same_triton = native_specialize_impl(b, u, const, spec, align) == \
                    native_specialize_impl(b, v, const, spec, align)
                assert (bk.key_of((u,)) == bk.key_of((v,))) == same_triton, (u, v)
    kc = _OneParam(constexpr=True)
    bkc = BoundKernel(_Launcher("cuda:0"), kc, (1,), {}, dyn=("v",))
    bkc._bind((4,))
    assert bkc.key_of((4,)) != bkc.key_of((True,)) and bkc.key_of((1,)) != bkc.key_of((True,))
    assert bkc.key_of((4,)) == bkc.key_of((4,)) and bkc.key_of((4,)) != bkc.key_of((5,))
    kn = _OneParam()
    bkn = BoundKernel(_Launcher("cuda:0"), kn, (1,), {}, dyn=("v",))
    bkn._bind((None,))
    assert bkn.key_of((None,)) is not None and bkn.key_of((base,)) is None  # another kind: Triton's path


def test_storage_block_fields(gpu_like):
    """Fields of one per-call int32 block (``fields`` + ``STORE``): Triton's path gets the typed views, the direct
    path the block's address plus each field's byte offset, the same C tuple; the variant key follows the block's
    alignment residue (a field's alignment is the block's plus its fixed offset)."""
    k = _Kernel()
    table = torch.arange(4, dtype=torch.int64)
    fields = {"idx_ptr": (4, 8, torch.int32), "out_ptr": (64, 16, torch.float32)}
    bk = BoundKernel(_Launcher("cuda:0"), k, (6,), dict(table_ptr=table, n_static=7, BLOCK=32, num_warps=4),
                     dyn=("x_ptr", bound_mod.STORE, "T"), fields=fields)
    x = torch.zeros(64, dtype=torch.bfloat16)
    store = torch.zeros(128, dtype=torch.int32)
    bk(x, store, 5)  # Triton's path: the fields as views of the block
    args = k.log[0][2]
    assert args[1].dtype == torch.int32 and args[1].data_ptr() == store.data_ptr() + 16 and args[1].numel() == 8
    assert args[2].dtype == torch.float32 and args[2].data_ptr() == store.data_ptr() + 256 and args[2].numel() == 16
    store2 = torch.ones(128, dtype=torch.int32)
    bk(x, store2, 9)  # direct: base + 4 * start
    direct = k.log[-1]
    assert direct[0] == "c" and len(k.log) == 3
    b = store2.data_ptr()
    assert direct[1][13:] == _as_c((x, b + 16, b + 256, 9, table, 7, 32, False))
    assert bk.arg("out_ptr", (x, store2, 9)).data_ptr() == b + 256  # what a reader of the call gets
    # the key: the block's residue mod 16 (a block 4 bytes off moves the idx field off its 16-byte alignment)
    assert bk.key_of((x, store2, 9)) == bk.key_of((x, store, 5))
    off = torch.zeros(129, dtype=torch.int32)[1:]
    assert bk.key_of((x, off, 9)) != bk.key_of((x, store2, 9))
    bk(x, off, 9)  # a new specialisation: Triton's path again
    assert k.log[-2][0] == "triton" and len(k.compiled) == 2
    with pytest.raises(TypeError, match="need the per-call value"):
        BoundKernel(_Launcher("cuda:0"), k, (6,), dict(table_ptr=table, n_static=7, BLOCK=32), dyn=("x_ptr", "T"),
                    fields=fields)


def test_field_arg_needs_the_call_values(gpu_like):
    k = _Kernel()
    table = torch.arange(4, dtype=torch.int64)
    bk = BoundKernel(_Launcher("cuda:0"), k, (6,), dict(table_ptr=table, n_static=7, BLOCK=32),
                     dyn=("x_ptr", bound_mod.STORE, "T"),
                     fields={"idx_ptr": (0, 8, torch.int32), "out_ptr": (64, 8, torch.float32)})
    with pytest.raises(ValueError, match="field of the per-call storage block"):
        bk.arg("out_ptr")
    assert bk.arg("n_static") == 7
