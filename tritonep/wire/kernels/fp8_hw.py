"""GPU-only (sm_89+) fp8 conversions by the hardware ``cvt`` instructions, bit-identical to the integer helpers.

:func:`tritonep.wire.kernels.quant.fp8_encode_bits` / ``e4m3_decode`` / ``e5m2_decode`` round with ~20 integer ops per
element so the Triton interpreter and sm_90 agree. On the GPU the same bits come from one conversion instruction
per two elements (PTX ISA, ``cvt``, "Convert between different types and sizes"):

* encode: ``cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 d, a, b`` (a -> upper byte, b -> lower byte). Round to nearest
  even; ``.satfinite``: "if the absolute value of input is greater than MAX_NORM ... the result is sign-preserved
  MAX_NORM; if the input value is NaN, the result is NaN in the destination format". The integer rule
  (:func:`tritonep.wire.fp8.fp8_encode_bits_torch`) is the same on every finite input and on +-Inf (RNE, then
  saturation to +-max: a value that RNE would carry to the first code past max -- e4m3's NaN code, e5m2's Inf --
  is above MAX_NORM, so both give +-max), keeps signed zeros, and does not flush fp32 subnormals (``cvt`` without
  ``.ftz``). The one difference is NaN: the hardware leaves the sign and payload of the NaN code unspecified, the spec
  says 0x7F, so :func:`fp8_encode_hw` rewrites NaN inputs to 0x7F (one compare and select per element; the
  spec did not need to change).
* decode: ``cvt.rn.f16x2.{e4m3x2,e5m2x2}`` then ``cvt.f32.f16`` (exact: every e4m3 / e5m2 value is an f16 value,
  and every f16 value an fp32 value). NaN codes get the integer decoder's NaN bits.

Only call these with a constexpr that is True on the GPU (the kernels pass ``HAS_TIMER``): the interpreter cannot
run inline asm. The GPU test ``tests/wire/test_fp8_hw_gpu.py`` compares both paths on every bf16 pattern, random fp32
and the specials. Idea: Triton's own fp8 lowering and CUTLASS ``NumericConverter`` use the same instructions.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fp8_encode_hw", "fp8_decode_hw"]


@triton.jit
def fp8_encode_hw(y, E5M2: tl.constexpr):
    """fp32 tensor -> int32 bit pattern (0..255) of e4m3fn (``E5M2`` False) or e5m2 (True), four elements per asm
    call: RNE, saturating to +-max, Inf -> +-max, NaN -> 0x7F. Same bits as ``fp8_encode_bits(y, 3, 7, 0x7E)`` /
    ``fp8_encode_bits(y, 2, 15, 0x7B)``. GPU only."""
    if E5M2:
        q = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [y], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        q = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [y], dtype=tl.uint8, is_pure=True, pack=4)
    return tl.where(y != y, 0x7F, q.to(tl.int32))


@triton.jit
def fp8_decode_hw(b, E5M2: tl.constexpr):
    """int32 bit patterns (0..255) of e4m3fn / e5m2 -> exact fp32, four elements per asm call. Same bits as
    ``e4m3_decode`` (NaN codes -> 0x7FC00000) / ``e5m2_decode`` (NaN codes -> 0x7FC00000 with the code's sign,
    Inf codes -> +-Inf). GPU only."""
    bu = b.to(tl.uint8)
    if E5M2:
        v = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi, f0, f1, f2, f3; .reg .b32 p, q; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e5m2x2 p, lo; cvt.rn.f16x2.e5m2x2 q, hi; mov.b32 {f0, f1}, p; mov.b32 {f2, f3}, q; "
            "cvt.f32.f16 $0, f0; cvt.f32.f16 $1, f1; cvt.f32.f16 $2, f2; cvt.f32.f16 $3, f3; }",
            "=r,=r,=r,=r,r", [bu], dtype=tl.float32, is_pure=True, pack=4)
        nan = (b & 0x7F) > 0x7C
        nan_bits = 0x7FC00000 | ((b >> 7) << 31)
    else:
        v = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi, f0, f1, f2, f3; .reg .b32 p, q; mov.b32 {lo, hi}, $4; "
            "cvt.rn.f16x2.e4m3x2 p, lo; cvt.rn.f16x2.e4m3x2 q, hi; mov.b32 {f0, f1}, p; mov.b32 {f2, f3}, q; "
            "cvt.f32.f16 $0, f0; cvt.f32.f16 $1, f1; cvt.f32.f16 $2, f2; cvt.f32.f16 $3, f3; }",
            "=r,=r,=r,=r,r", [bu], dtype=tl.float32, is_pure=True, pack=4)
        nan = (b & 0x7F) == 0x7F
        nan_bits = b * 0 + 0x7FC00000
    return tl.where(nan, nan_bits.to(tl.float32, bitcast=True), v)
