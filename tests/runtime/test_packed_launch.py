"""Packed launches (tritonep/runtime/packed_launch.py + packed_launch.c): the bytes a launch hands the driver.

No GPU here. The C module builds anyway (it opens the CUDA driver only at a launch); its ``fill`` returns the
parameter storage a launch would hand ``cuLaunchKernelEx``, which must equal the twin :func:`pack_twin` of the
arguments Triton's own launcher gets. Through :class:`tritonep.runtime.bound.BoundKernel` with a fake compiled kernel
(signature from Triton's real binder): the bytes of a packed launch equal the twin of the tuple Triton's launcher
path passes for the same call, for static and per-call grids, storage-block fields and a variant whose per-call int
is 1 (a constexpr in that variant). The GPU run of real kernels is tests/ep/test_packed_launch_gpu.py.
"""

import math
import random
import shutil
import struct

import pytest
import torch

from tritonep.runtime import bound as bound_mod
from tritonep.runtime import packed_launch as pl
from tritonep.runtime.bound import BoundKernel

from tests.backends.nccl.fake_gpu import _Meta, _Src

from .test_bound_launch import _STREAM, _as_c, _Kernel, _Launcher, gpu_like  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("clang") is None,
                                reason="no C compiler: Triton cannot build launchers either")


@pytest.fixture(scope="module")
def mod():
    m = pl.module()
    assert m is not None, pl.build_error()
    return m


def _make(mod, types, static_vals, call_pos, grid=(3, 1, 1)):
    offsets, n = pl.layout(types)
    buf = bytearray(pl.pack_twin(types, [static_vals.get(i, 0) if offsets[i] is not None else None
                                         for i in range(len(types))]))
    for p in call_pos:  # what bind() leaves in a per-call slot before the first fill: zeros
        if offsets[p] is not None:
            struct.pack_into("<Q", buf, offsets[p], 0)
    kinds = "".join(pl.kind_of(types[p]) for p in call_pos).encode()
    dyn_off = tuple(-1 if offsets[p] is None else offsets[p] for p in call_pos)
    return mod.make(0x1234, *grid, 4, 1, 0, 0, 0, bytes(buf), tuple(o for o in offsets if o is not None), kinds,
                    dyn_off)


_VALUES = {"p": lambda r: r.choice([None, 0, r.randrange(1 << 48) * 16, (1 << 64) - 16]),
           "b": lambda r: r.randrange(-128, 128), "B": lambda r: r.randrange(256),
           "h": lambda r: r.randrange(-(1 << 15), 1 << 15), "H": lambda r: r.randrange(1 << 16),
           "i": lambda r: r.randrange(-(1 << 31), 1 << 31), "I": lambda r: r.randrange(1 << 32),
           "l": lambda r: r.randrange(-(1 << 63), 1 << 63), "L": lambda r: r.randrange(1 << 64),
           "f": lambda r: r.choice([0.0, -1.5, 3.25e7, 1e-3]), "d": lambda r: r.uniform(-1e300, 1e300),
           "x": lambda r: r.choice([None, 1, 64, "dtype"])}
_TYPES = ["*bf16", "*fp32", "*i32", "i1", "i8", "u8", "i16", "u16", "i32", "u32", "i64", "u64", "fp32", "fp64",
          "constexpr"]


def test_fill_equals_the_twin(mod):
    r = random.Random(7)
    for trial in range(200):
        types = [r.choice(_TYPES) for _ in range(r.randrange(1, 40))]
        call_pos = tuple(sorted(r.sample(range(len(types)), r.randrange(0, len(types) + 1))))
        vals = [_VALUES[pl.kind_of(t)](r) for t in types]
        cap = _make(mod, types, {i: v for i, v in enumerate(vals) if i not in call_pos}, call_pos)
        got = mod.fill(cap, *[vals[p] for p in call_pos])
        assert got == pl.pack_twin(types, vals), (trial, types, call_pos)
        vals2 = [_VALUES[pl.kind_of(t)](r) if i in call_pos else v for i, (t, v) in enumerate(zip(types, vals))]
        assert mod.fill(cap, *[vals2[p] for p in call_pos]) == pl.pack_twin(types, vals2)  # a second call


def test_layout_and_twin_spec():
    offsets, n = pl.layout(["*bf16", "constexpr", "i32", "fp32"])
    assert offsets == [0, None, 8, 16, 24, 32] and n == 40  # the two scratch pointers last, zero
    b = pl.pack_twin(["*bf16", "constexpr", "i32", "fp32"], [0xABC0, "ignored", -2, 1.5])
    assert b == struct.pack("<QQ", 0xABC0, 0xFFFFFFFE) + struct.pack("<fI", 1.5, 0) + bytes(16)
    assert pl.layout(["*bf16", ("i32", "i32")]) is None and pl.layout(["bf16"]) is None
    assert pl.kind_of("nvTmaDesc") is None and pl.kind_of("*fp8e4nv") == "p"
    # a static fp32 beyond float32 packs as an infinity (the C cast and Triton's pack_fp32 give one), not an error
    assert pl.pack_twin(["fp32"], [1e39])[:4] == struct.pack("<f", math.inf)


def test_errors_name_the_value(mod):
    types = ["*bf16", "i32", "u8", "fp32"]
    cap = _make(mod, types, {}, (0, 1, 2, 3))
    with pytest.raises(TypeError, match="3 per-call values, bound for 4"):
        mod.fill(cap, 0, 1, 2)
    with pytest.raises(OverflowError, match="per-call value 1: 2147483648 does not fit kind i"):
        mod.fill(cap, 0, 1 << 31, 0, 0.0)
    with pytest.raises(OverflowError, match="per-call value 2"):
        mod.fill(cap, 0, 0, 256, 0.0)
    with pytest.raises(OverflowError):
        mod.fill(cap, -16, 0, 0, 0.0)  # a negative address
    with pytest.raises(TypeError, match="per-call value 0: a device address"):
        mod.fill(cap, torch.zeros(1), 0, 0, 0.0)  # the caller passes addresses, never tensors
    with pytest.raises(TypeError, match="per-call value 1: an integer"):
        mod.fill(cap, 0, 1.0, 0, 0.0)
    with pytest.raises(TypeError, match="use run_grid"):
        mod.run(_make(mod, types, {}, (0,), grid=(-1, -1, -1)), 0, 0)
    assert mod.run(_make(mod, types, {}, (0,), grid=(0, 1, 1)), 0, 0) is None  # a bound empty grid: no launch
    assert mod.run(_make(mod, types, {}, (0,), grid=(3, 0, 1)), 0, 0) is None  # an empty grid: no launch
    assert mod.run_grid(cap, 0, 1, 1, 0, 0, 0, 0, 0.0) is None  # an empty grid launches nothing, opens no driver
    with pytest.raises(ValueError, match="num_ctas must be 1"):
        mod.make(1, 1, 1, 1, 4, 2, 0, 0, 0, bytes(8), (0,), b"", ())
    with pytest.raises(ValueError, match="outside"):
        mod.make(1, 1, 1, 1, 4, 1, 0, 0, 0, bytes(8), (8,), b"", ())
    with pytest.raises(ValueError, match="unknown kind"):
        mod.make(1, 1, 1, 1, 4, 1, 0, 0, 0, bytes(8), (0,), b"z", (0,))


class _PackedKernel(_Kernel):
    """The fake JIT kernel, whose compiled variants carry Triton's signature of that variant (as a real
    ``CompiledKernel.src`` does), its metadata and a loaded function."""

    def __getitem__(self, grid):
        inner = super().__getitem__(grid)

        def run(*args, **options):
            c = inner(*args, **options)
            self._dress(c, args)
            return c
        return run

    def warmup(self, *args, grid, **options):
        c = super().warmup(*args, grid=grid, **options)
        self._dress(c, args)
        return c

    def _dress(self, c, args):
        names = [p.name for p in self.params]
        c.src = _Src({n: s[0] for n, s in zip(names, self._variant(args))})
        c.metadata = _Meta()
        c.function = 0xF00 + len(self.compiled)


@pytest.fixture
def packed_log(monkeypatch, mod):
    """Packed launches recorded as (stream, grid, bytes) instead of launched."""
    log = []

    class Shim:
        make = staticmethod(mod.make)

        @staticmethod
        def run(cap, stream, *dyn):
            log.append((stream, None, mod.fill(cap, *dyn)))

        @staticmethod
        def run_grid(cap, gx, gy, gz, stream, *dyn):
            log.append((stream, (gx, gy, gz), mod.fill(cap, *dyn)))

    monkeypatch.setattr(pl, "module", lambda: Shim)
    return log


def _sig(k, args):
    return [s[0] for s in k._variant(args)]


def test_bound_kernel_packed_bytes_equal_the_twin(gpu_like, packed_log):
    k = _PackedKernel()
    table = torch.arange(4, dtype=torch.int64)
    bk = BoundKernel(_Launcher("cuda:0"), k, (6,), dict(table_ptr=table, n_static=7, BLOCK=32, num_warps=4),
                     dyn=("x_ptr", "idx_ptr", "out_ptr", "T"))
    x, idx, out = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.int64), torch.zeros(64)
    bk(x, idx, out, 5)  # Triton's path, then the variant is packed
    assert k.log[-1][0] == "c" and not packed_log
    x2, out2 = torch.ones(64, dtype=torch.bfloat16), torch.ones(64)
    bk(x2, idx, out2, 9)
    assert len(k.log) == 2 and len(packed_log) == 1  # packed, not Triton's launcher
    full = (x2, idx, out2, 9, table, 7, 32, False)
    stream, grid, got = packed_log[-1]
    assert stream == _STREAM and grid is None
    assert got == pl.pack_twin(_sig(k, full), _as_c(full))
    # T == 1 is another variant (Triton makes it a constexpr, here do_not_specialize is set for T: same variant)
    bk(x2, idx, out2, 1)
    assert packed_log[-1][2] == pl.pack_twin(_sig(k, full), _as_c((x2, idx, out2, 1, table, 7, 32, False)))


def test_bound_kernel_packed_off_keeps_tritons_launcher(gpu_like, packed_log):
    k = _PackedKernel()
    table = torch.arange(4, dtype=torch.int64)
    lau = _Launcher("cuda:0")
    lau.packed = False  # the launch mode "direct" (tritonep.runtime.launch.Launch)
    bk = BoundKernel(lau, k, (6,), dict(table_ptr=table, n_static=7, BLOCK=32, num_warps=4),
                     dyn=("x_ptr", "idx_ptr", "out_ptr", "T"))
    x, idx, out = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.int64), torch.zeros(64)
    bk(x, idx, out, 5)
    bk(x, idx, out, 6)
    assert not packed_log and [e[0] for e in k.log] == ["triton", "c", "c"]


def test_packed_fields_per_call_grid_and_constexpr_variant(gpu_like, packed_log):
    """Storage-block fields (block address + offset), a per-call grid, and a per-call int that is a constexpr in
    one variant (``n_static`` per call, 1: Triton's ``("constexpr", 1)``: no slot in that variant)."""
    k = _PackedKernel()
    table = torch.arange(4, dtype=torch.int64)
    fields = {"idx_ptr": (4, 8, torch.int32), "out_ptr": (64, 16, torch.float32)}
    bk = BoundKernel(_Launcher("cuda:0"), k, None, dict(table_ptr=table, BLOCK=32, num_warps=4),
                     dyn=("x_ptr", bound_mod.STORE, "T", "n_static"), fields=fields, record=False)
    x = torch.zeros(64, dtype=torch.bfloat16)
    store = torch.zeros(128, dtype=torch.int32)
    for n_static in (7, 1):
        bk((5, 2), x, store, 3, n_static)  # Triton's path for each new variant
        bk((4, 1), x, store, 9, n_static)
        stream, grid, got = packed_log[-1]
        b = store.data_ptr()
        full = (x, b + 16, b + 256, 9, table, n_static, 32, False)
        assert grid == (4, 1, 1)
        assert got == pl.pack_twin(_sig(k, full), _as_c(full)), n_static
    assert _sig(k, (x, 0, 0, 9, table, 1, 32, False))[5] == "constexpr"
    assert len(packed_log) == 2 and len(k.compiled) == 2


# ---------------------------------------------------------------------------------------------------- GPU
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _mixed_kernel(out_ptr, x_ptr, w_ptr, n, big, scale, flag, table_ptr, T, BLOCK: tl.constexpr):
    """Every scalar kind the EP kernels take, written back so a launch's arguments can be read: out[pid, 0..7]."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < n, other=0.0)
    base = out_ptr + pid * 8
    tl.store(base + 0, tl.sum(x * w, axis=0).to(tl.int64))
    tl.store(base + 1, n)  # n and T: ints that are constexprs in the variant where they are 1
    tl.store(base + 2, big)
    tl.store(base + 3, scale * 1000.0)
    tl.store(base + 4, flag)
    tl.store(base + 5, tl.load(table_ptr + pid))
    tl.store(base + 6, T)
    tl.store(base + 7, BLOCK)


@pytest.mark.gpu
def test_gpu_packed_launch_equals_tritons(monkeypatch):
    """On the GPU: a bound kernel's packed launches (static grid and per-call grid, a variant where a per-call int
    is 1, a CUDA graph capture) write exactly what Triton's own ``kernel[grid]`` writes for the same arguments."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from tritonep.runtime.launch import Launch

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.arange(64, device=dev).to(torch.bfloat16)
    w = torch.full((64,), 0.5, device=dev)
    table = torch.arange(100, 104, dtype=torch.int64, device=dev)
    big = (1 << 40) + 3
    lau = Launch(dev, record=False, max_programs=0)
    static = dict(w_ptr=w, big=big, scale=0.25, flag=3, table_ptr=table, BLOCK=64)
    bk_grid = lau.bind(_mixed_kernel, static, ("out_ptr", "x_ptr", "n", "T"), grid=(4,))
    bk_call = lau.bind(_mixed_kernel, static, ("out_ptr", "x_ptr", "n", "T"))

    def want(n, T, g):
        ref = torch.zeros(g, 8, dtype=torch.int64, device=dev)
        _mixed_kernel[(g,)](ref, x, w, n, big, 0.25, 3, table, T, BLOCK=64)
        return ref

    for n, T in ((64, 7), (64, 9), (33, 1), (33, 1), (1, 5)):
        out = torch.zeros(4, 8, dtype=torch.int64, device=dev)
        bk_grid(out, x, n, T)
        assert torch.equal(out, want(n, T, 4)), (n, T)
        out2 = torch.zeros(3, 8, dtype=torch.int64, device=dev)
        bk_call((3,), out2, x, n, T)
        assert torch.equal(out2, want(n, T, 3)), (n, T)
    packed = [e for e in list(bk_grid._variants.values()) + list(bk_call._variants.values())
              if e.__class__ is not tuple]
    assert packed and len(packed) == len(bk_grid._variants) + len(bk_call._variants)  # every variant packed
    # a CUDA graph capture of a packed launch replays its values
    out = torch.zeros(4, 8, dtype=torch.int64, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        bk_grid(out, x, 64, 7)  # warm on the side stream
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            bk_grid(out, x, 48, 11)
    torch.cuda.current_stream().wait_stream(s)
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want(48, 11, 4))
