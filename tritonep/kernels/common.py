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
