"""The fp8 wire: float8_e4m3fn values with one fp32 scale per 128 contiguous elements of a row (docs/wire-formats.md).

Spec (:func:`quantize_fp8_torch`, exact bits; the Triton path gives the same bits in the interpreter and on GPU):

* Blocks: 128 contiguous elements of a row; ``hidden % 128 == 0`` (no padding).
* ``amax`` = max |x| over the block's *finite* elements, in fp32 (NaN and +-Inf are left out; 0 if none).
* ``scale = max(amax / 448, 2^-126)`` with IEEE round-to-nearest division (``tl.math.div_rn`` in Triton).
  The floor 2^-126 (smallest normal fp32) keeps the scale normal and nonzero: an all-zero (or all
  non-finite) block gets scale 2^-126 and zeros stay zeros.
  ``pow2_scale=True`` then rounds the scale UP to a power of two (UE8M0-style, for GEMMs that need it).
* ``q = e4m3(x * inv)`` with the block's multiplier ``inv = 448 / max(amax, 448 * 2^-126)`` (IEEE division once
  per block, ``2^126`` where the scale's floor holds; ``pow2_scale``: ``inv = 1 / scale``, exact) and one IEEE
  multiply per element (DeepEP's ``x * (448 / amax)``; a division per element costs a GPU encoder most of its
  instructions), then round to nearest even onto the e4m3fn grid with saturation to +-448 (like
  ``cvt.rn.satfinite``). Signed zeros are kept (``-0.0 -> 0x80``).
* Non-finite inputs: NaN -> 0x7F (positive NaN code); +-Inf -> +-448 (0x7E / 0xFE), i.e. it dequantizes to
  +-448 * scale of the block's finite elements.
* fp32-subnormal inputs are used as they are (no flush to zero).

Dequant (:func:`dequantize_fp8_torch`): ``out = (value(q) * scale).to(out_dtype)``, one fp32 multiply, RNE cast.

Error bound (fp32 output, tested): ``|dequant(quant(x)) - x| <= 2^-4 * |x| + 2^-10 * scale`` for finite x
(half an e4m3 ulp relative, or half the subnormal step 2^-9 times the scale), plus fp32 rounding (2^-21 |x|: the
multiplier's division, the scaling multiply, the scale's division and the dequant multiply round once each).
"""

from __future__ import annotations

import torch
import triton

from tritonep.errors import InputError, WireError
from tritonep.device.common import check_kernel_mode
from tritonep.wire.kernels.quant import FP8_E4M3_CODEC, KIND_OF_DTYPE
from tritonep.wire.kernels.wire_quant import fp8_dequant_kernel, fp8_quant_kernel
from tritonep.wire.checks import check_quant_input

FP8_BLOCK = FP8_E4M3_CODEC.block  # 128

__all__ = [
    "quantize_fp8_torch",
    "dequantize_fp8_torch",
    "quantize_fp8",
    "dequantize_fp8",
    "e4m3_encode_torch",
    "FP8_REL_ERR",
    "FP8_ABS_ERR_SCALE",
]

FP8_REL_ERR = 2.0**-4
"""Round-trip error bound, relative part: ``|dequant(quant(x)) - x| <= FP8_REL_ERR*|x| + FP8_ABS_ERR_SCALE*scale``."""

FP8_ABS_ERR_SCALE = 2.0**-10
"""Round-trip error bound, absolute part in units of the block scale (half the e4m3 subnormal step 2^-9)."""

_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MIN_SCALE_BITS = 0x00800000  # 2^-126


def _rne_shift_torch(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """int32 ``m >= 0`` shifted right by ``s`` (1..25), round to nearest even."""
    one = torch.ones_like(m)
    n = m >> s
    rem = m & ((one << s) - 1)
    half = one << (s - 1)
    up = (rem > half) | ((rem == half) & ((n & 1) == 1))
    return n + up.to(torch.int32)


def fp8_encode_bits_torch(y: torch.Tensor, mbits: int, bias: int, maxcode: int, name: str) -> torch.Tensor:
    """fp32 tensor (any shape) -> uint8 bits of an 8-bit float with ``mbits`` mantissa bits and exponent ``bias``:
    RNE, saturate to the code ``maxcode``, Inf -> +-max, NaN -> 0x7F (e4m3fn: 3, 7, 0x7E; e5m2: 2, 15, 0x7B).

    Twin of :func:`tritonep.wire.kernels.quant.fp8_encode_bits`. Raises InputError (naming ``name``) if ``y`` is not
    float32.
    """
    if y.dtype != torch.float32:
        raise InputError(f"{name} needs float32, got {y.dtype}")
    shift = 23 - mbits
    yb = y.contiguous().view(torch.int32)
    sign = (yb >> 31) & 1
    ab = yb & 0x7FFFFFFF
    abc = torch.clamp(ab, max=0x7F800000)
    e = abc >> 23
    r = (abc + ((1 << (shift - 1)) - 1) + ((abc >> shift) & 1)) >> shift
    code_n = torch.clamp(r - ((127 - bias) << mbits), max=maxcode)
    m = (abc & 0x7FFFFF) | 0x800000
    s = torch.clamp((150 - (bias - 1 + mbits)) - e, 1, 25)
    code_s = torch.where(e == 0, torch.zeros_like(m), _rne_shift_torch(m, s))
    code = torch.where(e >= 128 - bias, code_n, code_s) | (sign << 7)
    code = torch.where(ab > 0x7F800000, torch.full_like(code, 0x7F), code)
    return code.to(torch.uint8)


def e4m3_encode_torch(y: torch.Tensor) -> torch.Tensor:
    """fp32 tensor (any shape) -> uint8 float8_e4m3fn bits: RNE, saturate to +-448, Inf -> +-448, NaN -> 0x7F.

    Twin of :func:`tritonep.wire.kernels.quant.e4m3_encode`. Raises InputError if ``y`` is not float32.
    """
    return fp8_encode_bits_torch(y, 3, 7, 0x7E, "e4m3_encode_torch")


def _check_q(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype, name: str,
             qdtype: torch.dtype = torch.float8_e4m3fn, wire: str = "fp8") -> torch.Tensor:
    """Checks of an fp32-scaled 8-bit wire's ``(q, scales)``; returns q's uint8 view."""
    if not isinstance(q, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise InputError(f"{name}: q and scales must be torch.Tensors")
    if q.dtype not in (qdtype, torch.uint8) or q.dim() != 2:
        raise InputError(f"{name}: q must be 2-D {str(qdtype)[6:]} or uint8, got {q.dtype} {tuple(q.shape)}")
    n, h = q.shape
    if h % FP8_BLOCK != 0:
        raise WireError(f"{name}: wire {wire!r} needs hidden % {FP8_BLOCK} == 0 (no padding); got hidden={h}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (n, h // FP8_BLOCK):
        raise InputError(
            f"{name}: scales must be float32 of shape {(n, h // FP8_BLOCK)}, got {scales.dtype} {tuple(scales.shape)}"
        )
    if scales.device != q.device:
        raise InputError(f"{name}: scales on {scales.device} but q on {q.device}")
    if out_dtype not in _IN_DTYPES:
        raise InputError(f"{name}: out_dtype must be bfloat16/float16/float32, got {out_dtype}")
    return q.view(torch.uint8)


def quantize_fp8_torch(x: torch.Tensor, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec of the fp8 wire (see the module docstring for the exact rule).

    Args:
        x: [N, H] bfloat16/float16/float32, H % 128 == 0.
        pow2_scale: round each scale up to a power of two.

    Returns:
        (q [N, H] torch.float8_e4m3fn, scales [N, H // 128] float32), on x's device.

    Raises:
        InputError: x not 2-D or wrong dtype. WireError: H % 128 != 0.
    """
    check_quant_input(x, "fp8", FP8_BLOCK, "quantize_fp8_torch")
    q, scale = scaled_quantize_torch(x, 448.0, e4m3_encode_torch, pow2_scale)
    return q.view(torch.float8_e4m3fn), scale


def scaled_quantize_torch(x: torch.Tensor, fmax: float, encode, pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared spec of the fp32-scaled 8-bit wires (blocks of 128): ``(encode(x * inv) uint8 [N, H], scale fp32
    [N, H/128])``, amax over finite elements, scale = max(amax / fmax, 2^-126) (IEEE division; pow2_scale: rounded
    up to a power of two), the block's multiplier inv = fmax / max(amax, fmax * 2^-126) (IEEE division; pow2_scale:
    1 / scale, exact), one IEEE multiply per element. ``encode``: fp32 tensor -> uint8 bits (RNE, saturating).
    ``x`` is checked by the caller."""
    n, h = x.shape
    xf = x.float().contiguous().reshape(n, h // FP8_BLOCK, FP8_BLOCK)
    ab = xf.view(torch.int32) & 0x7FFFFFFF
    amax_bits = torch.where(ab < 0x7F800000, ab, torch.zeros_like(ab)).amax(dim=-1)
    # divide by a tensor, not a Python scalar: on CUDA, torch turns a scalar divisor into a multiply by its
    # reciprocal (not IEEE division, differs in the last bit); a tensor divisor is a true div.rn
    amax = amax_bits.view(torch.float32)
    fmax_t = torch.full_like(amax, fmax)
    scale = amax / fmax_t
    sb = torch.clamp(scale.view(torch.int32), min=_MIN_SCALE_BITS)
    if pow2_scale:
        sb = (sb + 0x7FFFFF) & 0x7F800000
    scale = sb.view(torch.float32)
    if pow2_scale:
        inv = (0x7F000000 - sb).view(torch.float32)  # 1 / 2^k: exact and normal (k in [-126, 120])
    else:
        inv = fmax_t / torch.clamp(amax, min=fmax * 2.0**-126)  # 2^126 where the scale's floor holds; never inf
    q = encode(xf * inv[..., None])
    return q.reshape(n, h), scale


def dequantize_fp8_torch(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Spec of fp8 dequantization: ``(value(q) * scale).to(out_dtype)`` (fp32 multiply, RNE cast).

    Args:
        q: [N, H] float8_e4m3fn (or its uint8 bits). scales: [N, H // 128] float32.
        out_dtype: bfloat16, float16 or float32.

    Returns:
        [N, H] out_dtype. Raises InputError / WireError on bad shapes or dtypes.
    """
    qb = _check_q(q, scales, out_dtype, "dequantize_fp8_torch")
    return scaled_dequantize_torch(qb.view(torch.float8_e4m3fn), scales, out_dtype)


def scaled_dequantize_torch(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Shared dequant spec of the fp32-scaled 8-bit wires: ``(q.float() * scale).to(out_dtype)`` per block of 128
    (torch's exact 8-bit -> fp32 conversion, one fp32 multiply, RNE cast). ``q`` [N, H] of its float8 dtype."""
    n, h = q.shape
    v = q.float().reshape(n, h // FP8_BLOCK, FP8_BLOCK)
    return (v * scales[..., None]).reshape(n, h).to(out_dtype)


def _tiling(n: int, nb: int, device: torch.device, groups: int) -> tuple[int, int, int]:
    """(R rows, G groups, grid) for an [N rows, nb blocks] problem: tiles of about ``groups`` scale blocks.

    GPU: one row per tile, G = min(nb, groups). CPU interpreter: 4x larger tiles over several rows (fewer steps).
    """
    g = min(triton.next_power_of_2(nb), groups)
    r = 1 if device.type == "cuda" else max(1, min(triton.next_power_of_2(n), 4 * groups // g))
    progs = triton.cdiv(n, r)
    if device.type == "cuda":
        progs = min(progs, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return r, g, max(1, progs)


def quantize_fp8(x: torch.Tensor, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fp8 quantization; same bits as :func:`quantize_fp8_torch`.

    Args:
        x: [N, H] bfloat16/float16/float32, contiguous, H % 128 == 0 (CUDA, or CPU under TRITON_INTERPRET=1).
        pow2_scale: round each scale up to a power of two.

    Returns:
        (q [N, H] torch.float8_e4m3fn, scales [N, H // 128] float32).

    Raises:
        InputError: x not 2-D, not contiguous, or wrong dtype. WireError: H % 128 != 0. ConfigError: the kernels
            were built for another device (:func:`tritonep.device.common.check_kernel_mode`).
    """
    check_quant_input(x, "fp8", FP8_BLOCK, "quantize_fp8")
    q, s = scaled_quantize(x, pow2_scale, FP8_E4M3_CODEC, "quantize_fp8")
    return q.view(torch.float8_e4m3fn), s


def scaled_quantize(x: torch.Tensor, pow2_scale: bool, codec, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton quantization of an fp32-scaled 8-bit wire (``codec``: e4m3, e5m2): uint8 ``[N, H]`` and fp32
    ``[N, H/128]``. ``x`` is checked by the caller except for contiguity (InputError). ConfigError: the kernels
    were built for another device (:func:`tritonep.device.common.check_kernel_mode`)."""
    if not x.is_contiguous():
        raise InputError(f"{name}: x must be contiguous, got strides {x.stride()}")
    check_kernel_mode(x.device.type)
    n, h = x.shape
    q = torch.empty((n, h), dtype=torch.uint8, device=x.device)
    s = torch.empty((n, h // FP8_BLOCK), dtype=torch.float32, device=x.device)
    if n > 0:
        r, g, progs = _tiling(n, h // FP8_BLOCK, x.device, 8)
        xin = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        fp8_quant_kernel[(progs,)](xin, q, s, n, h, KIND=KIND_OF_DTYPE[x.dtype], POW2=bool(pow2_scale),
                                    R=r, G=g, BLK=FP8_BLOCK, CODEC=codec, FAST=x.device.type == "cuda")
    return q, s


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton fp8 dequantization; same bits as :func:`dequantize_fp8_torch`.

    Args:
        q: [N, H] float8_e4m3fn or uint8 bits, contiguous. scales: [N, H // 128] float32, contiguous.
        out_dtype: bfloat16, float16 or float32.

    Returns:
        [N, H] out_dtype. Raises InputError / WireError on bad shapes, dtypes, devices or strides;
        ConfigError when the kernels were built for another device.
    """
    qb = _check_q(q, scales, out_dtype, "dequantize_fp8")
    return scaled_dequantize(qb, scales, out_dtype, FP8_E4M3_CODEC, "dequantize_fp8")


def scaled_dequantize(qb: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype, codec, name: str) -> torch.Tensor:
    """Triton dequantization of an fp32-scaled 8-bit wire (uint8 ``qb`` checked by the caller except for
    contiguity, InputError) -> ``[N, H]`` out_dtype. ConfigError: kernels built for another device."""
    if not qb.is_contiguous() or not scales.is_contiguous():
        raise InputError(f"{name}: q and scales must be contiguous")
    check_kernel_mode(qb.device.type)
    n, h = qb.shape
    out = torch.empty((n, h), dtype=out_dtype, device=qb.device)
    if n > 0:
        r, g, progs = _tiling(n, h // FP8_BLOCK, qb.device, 8)
        o = out.view(torch.int16) if out_dtype == torch.bfloat16 else out
        fp8_dequant_kernel[(progs,)](qb, scales, o, n, h, KIND=KIND_OF_DTYPE[out_dtype], R=r, G=g, BLK=FP8_BLOCK,
                                      CODEC=codec, FAST=qb.device.type == "cuda")
    return out
