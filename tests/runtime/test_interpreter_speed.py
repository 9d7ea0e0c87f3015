"""tritonep.runtime.interpreter_speed: the interpreter's language patches, found faster, are the same patches."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from tritonep.device import common
from tritonep.runtime.interpreter_speed import _packages, builtin_names, install

pytestmark = pytest.mark.skipif(not common.kernels_interpreted(), reason="the interpreter's functions (a CPU run)")


def _patched(patch_builtin, pkg):
    scope = interpreter._LangPatchScope()
    patch_builtin(pkg, interpreter.interpreter_builder, scope)
    names = [(name, original) for _, name, original in scope._changes]
    scope.restore()
    return names


def test_installed_on_the_pinned_triton():
    assert install() is True and getattr(interpreter, "_tritonep_fast", False)
    assert triton.__version__.startswith("3.6.")


@pytest.mark.parametrize("pkg", _packages(), ids=lambda p: getattr(p, "__name__", str(p)))
def test_fast_patch_builtin_patches_what_the_original_patches(pkg):
    fast = interpreter._patch_builtin
    original = fast.__closure__[[c for c in fast.__code__.co_freevars].index("original_builtin")].cell_contents
    want = _patched(original, pkg)
    assert want and _patched(fast, pkg) == want  # same attributes, same order, same members replaced
    assert [n for n, _ in want] == builtin_names(pkg)
    assert all(tl.core.is_builtin(getattr(pkg, n)) for n, _ in want)  # restored afterwards


def test_np_dtype_table_equals_the_original():
    fast = interpreter._get_np_dtype
    original = fast.__closure__[fast.__code__.co_freevars.index("original")].cell_contents
    types = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32,
             tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8,
             tl.float8e4b15]
    types += [tl.pointer_type(tl.int64), tl.block_type(tl.float32, [4]), tl.block_type(tl.bfloat16, [2, 8]),
              tl.block_type(tl.pointer_type(tl.uint8), [4])]
    for t in types:
        assert fast(t) == original(t), t
    assert fast(tl.int32) is np.dtype(np.int32)


@triton.jit
def _helper_sum(x):
    return tl.sum(x, 0)  # tl.sum is a jit function that sees tl and tl.core: patched inside the launch


@triton.jit
def _sum_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    v = tl.load(x_ptr + offs)
    tl.store(out_ptr + tl.program_id(0), _helper_sum(v) + tl.max(v, 0).to(tl.float32) * 0)


def test_kernels_with_nested_helpers_run_and_the_language_is_restored_after():
    x = torch.arange(8, dtype=torch.float32)
    out = torch.zeros(3)
    for _ in range(2):  # a second launch re-patches what the first one's end restored
        _sum_kernel[(3,)](x, out, N=8)
        assert out.tolist() == [28.0] * 3
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.core.tensor.__add__)
