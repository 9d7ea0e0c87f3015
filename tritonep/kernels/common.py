"""Small device helpers shared by the kernels."""

import triton
import triton.language as tl


@triton.jit
def cast_rne(x, DT: tl.constexpr):
    """fp32 -> DT with round-to-nearest-even, bit-identical on GPU and in the interpreter.

    The Triton 3.6 interpreter truncates fp32 -> bf16; rounding the fp32 bits first (integer ops) makes the final
    cast exact everywhere. NaN stays NaN. Other target dtypes use the plain cast.
    """
    if DT == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        y = tl.where(x != x, x, r.to(tl.float32, bitcast=True))
        return y.to(tl.bfloat16)
    else:
        return x.to(DT)


@triton.jit
def mul_rn(a, b, USE_ASM: tl.constexpr):
    """fp32 ``a * b`` rounded on its own (never contracted into an FMA with a following add).

    GPU compilers fuse ``acc += a * b`` into one FMA (one rounding); the reference and the interpreter round the
    product first. ``mul.rn.f32`` forbids the contraction, so the GPU sums are bit-identical to the reference.
    """
    if USE_ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b
