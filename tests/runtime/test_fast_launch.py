"""LaunchCache (tritonep/runtime/fast_launch.py): keys follow Triton's specialisation; hits bind every parameter."""

import inspect

import pytest
import torch

from tritonep.runtime.fast_launch import LaunchCache, spec_key


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty, is_constexpr=False):
        self.name, self.default, self.is_constexpr = name, default, is_constexpr


class _Compiled:
    function = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        assert len(grid) == 3, grid  # Triton's CompiledKernel runner reads grid[0], grid[1], grid[2]
        return lambda *vals: self.log.append(("direct", grid, vals))


class _Kernel:
    """Stands in for a JITFunction: ``kernel[grid](*a, **kw)`` "compiles" (records) and returns a compiled kernel."""

    def __init__(self):
        self.params = [_Param("x_ptr"), _Param("n"), _Param("BLOCK", is_constexpr=True),
                       _Param("FLAG", False, is_constexpr=True)]
        self.log = []

    def __getitem__(self, grid):
        def run(*a, **kw):
            self.log.append(("triton", grid, a, kw))
            return _Compiled(self.log)
        return run


def test_hit_binds_positional_keywords_and_defaults():
    k, c = _Kernel(), LaunchCache()
    x = torch.zeros(64)
    c.launch(k, (4,), (x, 7), {"BLOCK": 32, "num_warps": 4})
    c.launch(k, (4,), (x, 9), {"BLOCK": 32, "num_warps": 4})
    assert (c.misses, c.hits) == (1, 1)
    assert k.log[1] == ("direct", (4, 1, 1), (x, 9, 32, False))  # num_warps is an option, not a parameter


@pytest.mark.parametrize("change", ["alignment", "int_one", "int_div16", "int64", "constexpr", "option", "grid",
                                    "dtype", "none"])
def test_every_specialisation_change_misses(change):
    k, c = _Kernel(), LaunchCache()
    x = torch.zeros(64)
    base = dict(args=(x, 7), kw={"BLOCK": 32, "num_warps": 4}, grid=(4,))
    c.launch(k, base["grid"], base["args"], base["kw"])
    args, kw, grid = base["args"], dict(base["kw"]), base["grid"]
    if change == "alignment":
        args = (x[1:], 7)
    elif change == "int_one":
        args = (x, 1)
    elif change == "int_div16":
        args = (x, 32)
    elif change == "int64":
        args = (x, 7 + (1 << 40))
    elif change == "constexpr":
        kw["BLOCK"] = 64
    elif change == "option":
        kw["num_warps"] = 8
    elif change == "grid":
        grid = (8,)
    elif change == "dtype":
        args = (x.to(torch.float16), 7)
    elif change == "none":
        kw["FLAG"] = None
    c.launch(k, grid, args, kw)
    assert (c.misses, c.hits) == (2, 0), change
    c.launch(k, grid, args, kw)
    assert (c.misses, c.hits) == (2, 1), change


def test_same_key_for_equal_specialisation():
    from tritonep.runtime.fast_launch import _KernelInfo

    info = _KernelInfo(_Kernel())
    x = torch.zeros(64)
    assert spec_key(info, (x, 7), {"BLOCK": 2}) == spec_key(info, (torch.ones(64), 3), {"BLOCK": 2})
    assert spec_key(info, (x, 7), {}) != spec_key(info, (x, 16), {})
    assert spec_key(info, (x, 7, 32), {}) != spec_key(info, (x, 7, 64), {})  # a constexpr passed positionally


def test_unhashable_argument_takes_triton_path():
    k, c = _Kernel(), LaunchCache()
    c.launch(k, (1,), (torch.zeros(4), 3), {"BLOCK": [1]})
    c.launch(k, (1,), (torch.zeros(4), 3), {"BLOCK": [1]})
    assert (c.misses, c.hits) == (0, 0)
    assert [e[0] for e in k.log] == ["triton", "triton"]


@pytest.mark.gpu
def test_gpu_cached_launch_matches_triton_path():
    import triton
    import triton.language as tl

    @triton.jit
    def _axpy(x_ptr, y_ptr, a, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m) * a + 1.0, mask=m)

    c = LaunchCache()
    buf = torch.randn(4097, device="cuda")
    for start in (0, 0, 1, 1, 0):  # aligned, aligned (hit), misaligned (miss), misaligned (hit), aligned (hit)
        x = buf[start:start + 4000]
        y = torch.empty_like(x)
        c.launch(_axpy, (4,), (x, y, 2.0, 4000), {"BLOCK": 1024})
        torch.testing.assert_close(y, x * 2.0 + 1.0, rtol=0, atol=0)
    assert (c.misses, c.hits) == (2, 3)


def test_key_never_merges_what_triton_specialises_apart():
    """Any two runtime values with the same LaunchCache key get the same specialisation from Triton 3.6's own
    (native) ``specialize_impl``, so a hit never launches a binary compiled for another signature (e.g. ``i64`` vs
    ``u64`` above 2**63)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from tritonep.runtime.fast_launch import _arg_key

    buf = torch.zeros(64, dtype=torch.int64)
    vals = [0, 1, -1, 2, 15, 16, 17, 32, (1 << 31) - 16, (1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1,
            -(1 << 31) - 16, (1 << 40) + 16, (1 << 40) + 3, (1 << 63) - 1, (1 << 63) - 16, 1 << 63, (1 << 63) + 3,
            (1 << 64) - 16, (1 << 64) - 1, -(1 << 63), True, False, None, 0.5, 3.0,
            buf, buf[1:], buf[2:], buf.float(), buf.to(torch.bfloat16)[1:], buf.to(torch.bfloat16)[8:]]

    def spec(v):
        return repr(native_specialize_impl(BaseBackend, v, False, True, True))

    for a in vals:
        for b in vals:
            if _arg_key(a) == _arg_key(b):
                assert spec(a) == spec(b), (a, b, _arg_key(a), spec(a), spec(b))
