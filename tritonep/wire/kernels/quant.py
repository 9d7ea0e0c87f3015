"""Triton device functions for the fp8 and mxfp4 wires (docs/wire-formats.md), meant to be fused into other kernels.

All rounding is done with integer operations on fp32 bit patterns, so the Triton interpreter and sm_90 give
the same bits as the torch twins in :mod:`tritonep.wire.fp8` / :mod:`tritonep.wire.mxfp4` (the spec). The only
floating-point operations are IEEE ones both sides do the same way: ``tl.math.div_rn`` (the fp8 block's scale and
multiplier) and fp32 multiplies (fp8 scaling and dequant). Nothing here uses inline asm, libdevice or fp8/fp4 casts (the interpreter's
fp32->fp8 and fp32->bf16 casts are wrong: no RNE carry / truncation; see reference/triton_symm_primer.md §4, §6).

Tiles are 2-D: ``[G, 128]`` for fp8, ``[G, 32]`` for mxfp4 (G groups = scale blocks, G a power of two).
Ideas: DeepSeek-V3 ``act_quant`` and vLLM ``per_token_group_quant_fp8`` (fp8); triton_kernels
``_downcast_to_mxfp`` and OCP Microscaling v1.0 (mxfp4). The integer rounding is ours.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...device.common import mul_rn
from .fp8_hw import fp8_decode_hw, fp8_encode_hw
from .wirecodec import DeviceCodec

__all__ = [
    "fp8_quant_tile",
    "fp8_dequant_tile",
    "mxfp4_quant_tile",
    "mxfp4_dequant_tile",
    "e4m3_encode",
    "fp8_encode_bits",
    "e4m3_decode",
    "bf16_bits_to_fp32",
    "fp32_to_bf16_bits",
    "load_as_fp32",
    "store_fp32_as",
    "KIND_OF_DTYPE",
    "FP8_E4M3_CODEC",
    "MXFP4_CODEC",
    "scaled_quant_tile",
    "rne_shift",
]

KIND_OF_DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""KIND constexpr of :func:`load_as_fp32` / :func:`store_fp32_as` per torch dtype."""


@triton.jit
def rne_shift(m, s):
    """Round the non-negative int32 ``m`` right-shifted by ``s`` (1 <= s <= 25) to nearest, ties to even."""
    one = m * 0 + 1
    n = m >> s
    rem = m & ((one << s) - 1)
    half = one << (s - 1)
    up = (rem > half) | ((rem == half) & ((n & 1) == 1))
    return n + up.to(tl.int32)


@triton.jit
def fp8_encode_bits(y, MBITS: tl.constexpr, BIAS: tl.constexpr, MAXCODE: tl.constexpr):
    """fp32 tensor -> int32 bit pattern (0..255) of an 8-bit float with ``MBITS`` mantissa bits and exponent bias
    ``BIAS``: RNE, saturating to the code ``MAXCODE`` (the largest finite value), Inf -> +-max, NaN -> 0x7F.
    e4m3fn: (3, 7, 0x7E); e5m2: (2, 15, 0x7B). Integer ops only (the interpreter's fp8 casts do not round)."""
    SHIFT: tl.constexpr = 23 - MBITS
    yb = y.to(tl.int32, bitcast=True)
    sign = (yb >> 31) & 1
    ab = yb & 0x7FFFFFFF
    abc = tl.minimum(ab, 0x7F800000)
    e = abc >> 23
    # normal (|y| >= 2^(1-BIAS)): keep MBITS mantissa bits, RNE, carry into the exponent; rebias 127 -> BIAS
    r = (abc + ((1 << (SHIFT - 1)) - 1) + ((abc >> SHIFT) & 1)) >> SHIFT
    code_n = tl.minimum(r - ((127 - BIAS) << MBITS), MAXCODE)
    # subnormal: round |y| * 2^(BIAS-1+MBITS) to an integer (2^MBITS is the smallest normal's code)
    m = (abc & 0x7FFFFF) | 0x800000
    s = tl.minimum(tl.maximum((150 - (BIAS - 1 + MBITS)) - e, 1), 25)
    code_s = tl.where(e == 0, 0, rne_shift(m, s))
    code = tl.where(e >= 128 - BIAS, code_n, code_s) | (sign << 7)
    return tl.where(ab > 0x7F800000, 0x7F, code)


@triton.jit
def e4m3_encode(y, FAST: tl.constexpr = False):
    """fp32 tensor -> int32 float8_e4m3fn bit pattern (0..255): RNE, saturating to +-448, Inf -> +-448, NaN -> 0x7F.
    FAST (GPU only): the same bits by the hardware conversion (:func:`tritonep.wire.kernels.fp8_hw.fp8_encode_hw`)."""
    if FAST:
        return fp8_encode_hw(y, False)
    else:
        return fp8_encode_bits(y, 3, 7, 0x7E)


@triton.jit
def e4m3_decode(b, FAST: tl.constexpr = False):
    """int32 float8_e4m3fn bit pattern (0..255) -> exact fp32 value (0x7F/0xFF -> NaN 0x7FC00000).
    FAST (GPU only): the same bits by the hardware conversion (:func:`tritonep.wire.kernels.fp8_hw.fp8_decode_hw`)."""
    # the FAST-or-integer switch of e4m3_encode (and of the e5m2 codec), kept: a shared switch would only rename it
    if FAST:
        return fp8_decode_hw(b, False)
    else:
        return _e4m3_decode_bits(b)


@triton.jit
def _e4m3_decode_bits(b):
    """Integer-only body of :func:`e4m3_decode` (interpreter and GPU)."""
    sign = (b >> 7) & 1
    e = (b >> 3) & 0xF
    m = b & 7
    nbits = ((e + 120) << 23) | (m << 20)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9, exact
    bits = tl.where(e == 0, sub.to(tl.int32, bitcast=True), nbits) | (sign << 31)
    bits = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scale_from_amax_bits(amax_bits, POW2: tl.constexpr, FMAX: tl.constexpr):
    """Block scale from the int32 bits of the block amax: max(div_rn(amax, FMAX), 2^-126), optionally 2^ceil."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    sb = tl.math.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32)).to(tl.int32, bitcast=True)
    sb = tl.maximum(sb, 0x00800000)
    if POW2:
        sb = (sb + 0x7FFFFF) & 0x7F800000
    return sb.to(tl.float32, bitcast=True)


@triton.jit
def fp8_quant_tile(x, POW2: tl.constexpr, FAST: tl.constexpr = False):
    """Quantize fp32 ``x`` [G, 128] (one scale block per row of the tile) to e4m3.

    Returns ``(q_bits, scale)``: q_bits uint8 [G, 128] (float8_e4m3fn bit patterns), scale fp32 [G].
    Rule = :func:`tritonep.wire.fp8.quantize_fp8_torch`: amax over finite elements, scale =
    max(amax/448, 2^-126) (POW2: rounded up to a power of two), q = e4m3_rne_satfinite(x * inv) with the block's
    ``inv = 448 / max(amax, 448 * 2^-126)`` (POW2: ``1 / scale``, exact).
    FAST (GPU only): the same bits with the hardware conversion (see :func:`scaled_quant_tile`).
    """
    return scaled_quant_tile(x, POW2, 448.0, e4m3_encode, FAST)


@triton.jit
def scaled_quant_tile(x, POW2: tl.constexpr, FMAX: tl.constexpr, ENCODE: tl.constexpr, FAST: tl.constexpr = False):
    """Shared body of the fp32-scaled fp8 wires: ``x`` [G, BLK] -> (``ENCODE(x * inv)`` uint8 [G, BLK], scale fp32
    [G]) with amax over finite elements, scale = max(div_rn(amax, FMAX), 2^-126) (POW2: rounded up to 2^k) and the
    block's multiplier ``inv`` = div_rn(FMAX, max(amax, FMAX * 2^-126)) (POW2: 1 / scale, exact).
    ``ENCODE(y, FAST)``: fp32 -> int32 bit pattern of the 8-bit format (RNE, saturating to +-FMAX).

    One IEEE division per block and one IEEE multiply per element (DeepEP's ``x * (448 / amax)``), where a division
    per element (``div.rn.f32``: a Newton sequence and a slow-path branch) cost the GPU encoders most of their
    instructions. The multiply is ``mul.rn.f32`` with FAST (never flushes a subnormal ``x``); without FAST it is
    IEEE too (the interpreter's numpy, or an fp32 multiply the compiler cannot contract: integer ops follow it).
    FAST (GPU only, inline PTX): ``ENCODE`` by the hardware conversion.
    """
    xb = x.to(tl.int32, bitcast=True)
    ab = xb & 0x7FFFFFFF
    amax_bits = tl.max(tl.where(ab < 0x7F800000, ab, 0), axis=1)
    scale = _scale_from_amax_bits(amax_bits, POW2, FMAX)
    if POW2:
        # scale = 2^(e-127) with e in [1, 247] (amax <= FLT_MAX): 1/scale = 2^(127-e), biased 254-e, normal
        inv = ((254 << 23) - scale.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    else:
        amax = amax_bits.to(tl.float32, bitcast=True)
        # amax under FMAX * 2^-126 (the scale's floor) divides as that floor: inv = 2^126 exactly, never inf
        floor = tl.full(amax.shape, FMAX * 2.0**-126, tl.float32)
        inv = tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), tl.maximum(amax, floor))
    y = mul_rn(x, tl.broadcast_to(inv[:, None], x.shape), FAST)
    return ENCODE(y, FAST).to(tl.uint8), scale


@triton.jit
def fp8_dequant_tile(q_bits, scale, EXACT_MUL: tl.constexpr = False, FAST: tl.constexpr = False):
    """uint8 e4m3 bits [G, 128] and fp32 scale [G] -> fp32 [G, 128] = value(q) * scale (one fp32 multiply).

    EXACT_MUL (GPU only: inline PTX) emits ``mul.rn.f32``, which the compiler may not fuse with a following add.
    FAST (GPU only): value(q) by the hardware conversion (same bits, :func:`tritonep.wire.kernels.fp8_hw.fp8_decode_hw`).
    """
    v = e4m3_decode(q_bits.to(tl.int32), FAST)
    return mul_rn(v, tl.broadcast_to(scale[:, None], q_bits.shape), EXACT_MUL)


@triton.jit
def mxfp4_quant_tile(x, POW2: tl.constexpr = False, FAST: tl.constexpr = False):
    """Quantize fp32 ``x`` [G, 32] to MX fp4 (OCP Microscaling v1.0, e2m1 + e8m0). ``POW2`` is ignored (e8m0
    scales are powers of two already; the parameter makes the signature the codec contract's); ``FAST`` (GPU only)
    takes the scaling multiply as ``mul.rn.f32`` (inline PTX: never flushes an fp32 subnormal ``x``, same bits).

    Returns ``(packed, e8m0)``: packed uint8 [G, 16] (element 2i in the low nibble, 2i+1 in the high nibble;
    nibble = sign<<3 | e2m1 magnitude code), e8m0 uint8 [G]. Rule = :func:`tritonep.wire.mxfp4.quantize_mxfp4_torch`.

    One block reduction (the max of ``|x|``'s bits: a NaN / Inf in it marks the block, whose finite amax is then
    not needed) and, per element, ``y = |x| * 2^-X`` (X = the block's scale exponent; exact wherever the code depends
    on it: ``|y| < 8``, and a subnormal ``y`` is below 2^-126, far under the first rounding point 0.25, so its code
    is 0 however it rounds), then ``y``'s e2m1 code from its bits: ``y >= 1`` keeps one mantissa bit with RNE
    (the carry goes into the exponent; codes past 7 saturate to 7 = 6.0), ``y < 1`` is 0 / 0.5 / 1.0 by two
    compares with the midpoints 0.25 (a tie goes to 0) and 0.75 (a tie goes to 1.0). (A per-block
    midpoint-compare variant on the unscaled ``x`` measured ~26 us slower per dispatch at the DeepSeek-V3 shape on
    one H200: seven per-block values broadcast over the tile; here the thresholds are constants.)
    """
    G: tl.constexpr = x.shape[0]
    xb = x.to(tl.int32, bitcast=True)
    ab = xb & 0x7FFFFFFF
    amax_bits = tl.max(ab, axis=1)  # >= 0x7F800000: the block holds NaN/Inf
    bad = amax_bits >= 0x7F800000
    e8 = tl.maximum((amax_bits >> 23) - 2, 0)  # floor(log2 amax) - 2 + 127, clamped to [0, 252]
    rcp = ((254 - e8) << 23).to(tl.float32, bitcast=True)  # 2^-(e8 - 127), a normal fp32 (e8 <= 253)
    y = mul_rn(ab.to(tl.float32, bitcast=True), tl.broadcast_to(rcp[:, None], x.shape), FAST)
    yb = y.to(tl.int32, bitcast=True)
    # y >= 1: e2m1 = 1 exponent bit pair + 1 mantissa bit; code = RNE(bits >> 22) - (126 << 1), carry included
    code_n = tl.minimum(((yb + 0x1FFFFF + ((yb >> 22) & 1)) >> 22) - 252, 7)
    code_s = (yb > 0x3E800000).to(tl.int32) + (yb >= 0x3F400000).to(tl.int32)  # y < 1: 0, 0.5 or 1.0
    code = tl.where(yb >= 0x3F800000, code_n, code_s) | ((xb >> 28) & 8)
    code = tl.where(bad[:, None], 0, code)
    lo, hi = tl.split(tl.reshape(code, [G, 16, 2]))
    packed = (lo | (hi << 4)).to(tl.uint8)
    e8 = tl.where(bad, 255, e8).to(tl.uint8)
    return packed, e8


@triton.jit
def mxfp4_dequant_tile(packed, e8m0, EXACT_MUL: tl.constexpr = False, FAST: tl.constexpr = False):
    """uint8 packed e2m1 [G, 16] and uint8 e8m0 [G] -> exact fp32 [G, 32] (e8m0 == 255 -> NaN block; overflow ->
    +-Inf). Each element is its e2m1 magnitude as an fp32 value (from its bits: codes 2..7 are ``(code + 252) << 22``,
    code 1 is 0.5) times the block's 2^(e8m0 - 127) (fp32 bits ``e8m0 << 23``, 2^-127 a subnormal for e8m0 0): one
    multiply whose exact product is always an fp32 value or past the top (-> Inf), so rounding changes nothing;
    ``EXACT_MUL`` (GPU) takes it as ``mul.rn.f32``. ``FAST`` (codec contract) has nothing to do. (A variant with a
    tile-wide fast-path test measured ~22 us slower per dispatch on one H200: the test is a block-wide reduction.)"""
    p = packed.to(tl.int32)
    c = tl.interleave(p & 0xF, (p >> 4) & 0xF)  # [G, 32], element order
    mag = c & 7
    vb = tl.where(mag >= 2, (mag + 252) << 22, mag * 0x3F000000)  # |e2m1| as fp32 bits: 0, 0.5, 1, 1.5, ..., 6
    sc = e8m0.to(tl.int32)
    sb = tl.where(sc == 0, 0x00400000, tl.minimum(sc, 254) << 23)  # 2^(sc - 127) (sc == 255: replaced below)
    v = mul_rn(vb.to(tl.float32, bitcast=True), tl.broadcast_to(sb.to(tl.float32, bitcast=True)[:, None], c.shape),
               EXACT_MUL)
    bits = v.to(tl.int32, bitcast=True) | ((c >> 3) << 31)
    return tl.where((sc == 255)[:, None], 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits_to_fp32(b):
    """int16/uint16 bf16 bit patterns -> fp32 (exact; use instead of the interpreter's bf16 cast)."""
    return ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp32_to_bf16_bits(x):
    """fp32 -> int16 bf16 bit patterns, round to nearest even, NaN -> 0x7FC0 (as torch; interpreter-safe)."""
    xb = x.to(tl.int32, bitcast=True)
    ab = xb & 0x7FFFFFFF
    abc = tl.minimum(ab, 0x7F800000)
    r = (abc + 0x7FFF + ((abc >> 16) & 1)) >> 16
    r = tl.where(ab > 0x7F800000, 0x7FC0, r | ((xb >> 16) & 0x8000))
    return r.to(tl.int16)


@triton.jit
def load_as_fp32(ptr, offs, mask, KIND: tl.constexpr):
    """Masked load converted to fp32 exactly. KIND 0: fp32, 1: bf16 (``ptr`` must be an int16 view), 2: fp16."""
    if KIND == 1:
        return bf16_bits_to_fp32(tl.load(ptr + offs, mask=mask, other=0))
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_fp32_as(ptr, offs, v, mask, KIND: tl.constexpr):
    """Masked store of fp32 ``v`` with RNE. KIND 0: fp32, 1: bf16 (``ptr`` must be an int16 view), 2: fp16."""
    if KIND == 1:
        tl.store(ptr + offs, fp32_to_bf16_bits(v), mask=mask)
    else:
        tl.store(ptr + offs, v.to(ptr.dtype.element_ty), mask=mask)


FP8_E4M3_CODEC = DeviceCodec("fp8", block=128, payload_bits=8, scale_bytes=4, scale_dtype=tl.float32,
                             encode=fp8_quant_tile, decode=fp8_dequant_tile)
"""Device codec of the ``fp8`` wire (e4m3 + one fp32 scale per 128); twin :mod:`tritonep.wire.fp8`."""

MXFP4_CODEC = DeviceCodec("mxfp4", block=32, payload_bits=4, scale_bytes=1, scale_dtype=tl.uint8,
                          encode=mxfp4_quant_tile, decode=mxfp4_dequant_tile)
"""Device codec of the ``mxfp4`` wire (packed e2m1 + one e8m0 per 32); twin :mod:`tritonep.wire.mxfp4`. Its own-rank
rows are encoded by the expander, as fp8's (``stage_own`` off), at 8-token tiles (the tiles table): there the expander
holding both the encoder and the decoder compiles without spills, and the world-1 dispatch got faster than staging the
own rows (one H100, DeepSeek-V3, 4096 tokens: rows kept 154 -> 136 us, decoded 287 -> 244); at 16-token tiles it
spills and got slower (kept 131, decoded 515)."""
