"""Kernels of the GPU test of the inline-PTX fp8 fast paths (``tests/wire/test_fp8_hw_gpu.py``).

Module-level so the offline sm_90 compile check (``tests/wire/test_fp8_hw_compile.py``) can compile them without a GPU.
Each compares :mod:`tritonep.wire.kernels.fp8_hw` (GPU only) with the integer path of :mod:`tritonep.wire.kernels.quant`.
"""

import triton
import triton.language as tl

from tritonep.wire.kernels.fp8_hw import fp8_decode_hw, fp8_encode_hw
from tritonep.wire.kernels.quant import _e4m3_decode_bits, fp8_encode_bits
from tritonep.wire.kernels.quant_e5m2 import _e5m2_decode_bits

__all__ = ["sweep_encode_kernel", "decode_codes_kernel", "tile_quant_kernel"]


@triton.jit
def sweep_encode_kernel(bad_ptr, first_ptr, base, E5M2: tl.constexpr, MBITS: tl.constexpr, BIAS: tl.constexpr,
                        MAXCODE: tl.constexpr, BLOCK: tl.constexpr):
    """Patterns ``base + pid*BLOCK + [0, BLOCK)`` (int64, low 32 bits = the fp32 pattern): count mismatches of the
    hardware and the integer encoders, keep the smallest mismatching pattern."""
    i = base + tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    y = (i & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True).to(tl.float32, bitcast=True)
    diff = fp8_encode_hw(y, E5M2) != fp8_encode_bits(y, MBITS, BIAS, MAXCODE)
    n = tl.sum(diff.to(tl.int32), 0)
    if n > 0:
        tl.atomic_add(bad_ptr, n)
        tl.atomic_min(first_ptr, tl.min(tl.where(diff, i, 1 << 40), 0))


@triton.jit
def decode_codes_kernel(b_ptr, hw_ptr, ref_ptr, E5M2: tl.constexpr):
    """The 256 codes at ``b_ptr`` (int32) decoded by the hardware (``hw_ptr``) and the integer path (``ref_ptr``),
    as int32 fp32 bit patterns."""
    b = tl.load(b_ptr + tl.arange(0, 256))
    tl.store(hw_ptr + tl.arange(0, 256), fp8_decode_hw(b, E5M2).to(tl.int32, bitcast=True))
    if E5M2:
        ref = _e5m2_decode_bits(b)
    else:
        ref = _e4m3_decode_bits(b)
    tl.store(ref_ptr + tl.arange(0, 256), ref.to(tl.int32, bitcast=True))


@triton.jit
def tile_quant_kernel(x_ptr, q_ptr, s_ptr, POW2: tl.constexpr, FAST: tl.constexpr, CODEC: tl.constexpr,
                      G: tl.constexpr):
    """One [G, 128] tile per program through the codec's encode (``scaled_quant_tile``)."""
    g = tl.program_id(0) * G + tl.arange(0, G)
    offs = g[:, None] * 128 + tl.arange(0, 128)[None, :]
    q, s = CODEC.encode(tl.load(x_ptr + offs), POW2, FAST)
    tl.store(q_ptr + offs, q)
    tl.store(s_ptr + g, s)
