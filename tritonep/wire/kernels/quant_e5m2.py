"""Device codec of the ``fp8_e5m2`` wire: float8_e5m2 values, one fp32 scale per 128 elements (docs/wire-formats.md).

Same block scaling as the e4m3 wire (:func:`tritonep.wire.kernels.quant.scaled_quant_tile`) with the e5m2 range:
scale = max(amax / 57344, 2^-126), q = e5m2(x * inv) with the block's multiplier inv = 57344 / max(amax, 57344 *
2^-126) (pow2 scales: 1 / scale), rounded to nearest even with saturation to +-57344.
Integer-only rounding (interpreter and sm_90 give the same bits). Twin: :mod:`tritonep.wire.fp8_e5m2`.
e5m2: 1 sign, 5 exponent (bias 15), 2 mantissa bits; normals 2^-14 .. 57344, subnormals m * 2^-16 (m = 1..3),
0x7C = Inf, 0x7D..0x7F = NaN (OCP 8-bit floating point, 2023).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...device.common import mul_rn
from .fp8_hw import fp8_decode_hw, fp8_encode_hw
from .quant import fp8_encode_bits, scaled_quant_tile
from .wirecodec import DeviceCodec

__all__ = ["e5m2_encode", "e5m2_decode", "e5m2_quant_tile", "e5m2_dequant_tile", "FP8_E5M2_CODEC"]


@triton.jit
def e5m2_encode(y, FAST: tl.constexpr = False):
    """fp32 tensor -> int32 float8_e5m2 bit pattern (0..255): RNE, saturating to +-57344, Inf -> +-57344,
    NaN -> 0x7F. FAST (GPU only): the same bits by the hardware conversion (:mod:`tritonep.wire.kernels.fp8_hw`)."""
    if FAST:
        return fp8_encode_hw(y, True)
    else:
        return fp8_encode_bits(y, 2, 15, 0x7B)


@triton.jit
def e5m2_decode(b, FAST: tl.constexpr = False):
    """int32 float8_e5m2 bit pattern (0..255) -> exact fp32 value (0x7C/0xFC -> +-Inf, 0x7D..0x7F -> NaN
    0x7FC00000 with the code's sign). FAST (GPU only): the same bits by the hardware conversion."""
    if FAST:
        return fp8_decode_hw(b, True)
    else:
        return _e5m2_decode_bits(b)


@triton.jit
def _e5m2_decode_bits(b):
    """Integer-only body of :func:`e5m2_decode`."""
    # the shape of quant._e4m3_decode_bits with e5m2's fields, kept per format: e5m2 has Inf, e4m3fn has none
    sign = (b >> 7) & 1
    e = (b >> 2) & 0x1F
    m = b & 3
    nbits = ((e + 112) << 23) | (m << 21)
    sub = m.to(tl.float32) * 0.0000152587890625  # m * 2^-16, exact
    bits = tl.where(e == 0, sub.to(tl.int32, bitcast=True), nbits)
    bits = tl.where(e == 31, tl.where(m == 0, 0x7F800000, 0x7FC00000), bits) | (sign << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e5m2_quant_tile(x, POW2: tl.constexpr, FAST: tl.constexpr = False):
    """Quantize fp32 ``x`` [G, 128] to e5m2: ``(q_bits uint8 [G, 128], scale fp32 [G])``.

    Rule = :func:`tritonep.wire.fp8_e5m2.quantize_fp8_e5m2_torch`: amax over finite elements, scale =
    max(amax/57344, 2^-126) (POW2: rounded up to a power of two), q = e5m2_rne_satfinite(x * inv) with the block's
    ``inv = 57344 / max(amax, 57344 * 2^-126)`` (POW2: ``1 / scale``, exact).
    FAST (GPU only): the same bits with the hardware conversion (:func:`tritonep.wire.kernels.quant.scaled_quant_tile`).
    """
    return scaled_quant_tile(x, POW2, 57344.0, e5m2_encode, FAST)


@triton.jit
def e5m2_dequant_tile(q_bits, scale, EXACT_MUL: tl.constexpr = False, FAST: tl.constexpr = False):
    """uint8 e5m2 bits [G, 128] and fp32 scale [G] -> fp32 [G, 128] = value(q) * scale (one fp32 multiply;
    EXACT_MUL: a standalone ``mul.rn.f32`` on the GPU; FAST: value(q) by the hardware conversion, same bits)."""
    v = e5m2_decode(q_bits.to(tl.int32), FAST)
    return mul_rn(v, tl.broadcast_to(scale[:, None], q_bits.shape), EXACT_MUL)


FP8_E5M2_CODEC = DeviceCodec("fp8_e5m2", block=128, payload_bits=8, scale_bytes=4, scale_dtype=tl.float32,
                             encode=e5m2_quant_tile, decode=e5m2_dequant_tile)
"""Device codec of the ``fp8_e5m2`` wire."""
