"""The mxfp4 wire: OCP Microscaling v1.0 MXFP4 (e2m1 elements, one e8m0 scale per 32 elements) (docs/wire-formats.md).

Spec (:func:`quantize_mxfp4_torch`, exact bits; the Triton path gives the same bits in the interpreter and on GPU):

* Blocks: 32 contiguous elements of a row; ``hidden % 32 == 0`` (no padding).
* Shared exponent (OCP v1.0 §6.3, "floor" rule): ``X = floor(log2(amax)) - 2`` (2 = emax of e2m1), amax over the
  block in fp32, clamped to the e8m0 range: ``e8m0 = clamp(X + 127, 0, 254)``. amax == 0 (or fp32-subnormal
  amax) gives e8m0 = 0 (scale 2^-127); zeros stay zeros.
* Elements: ``x / 2^X`` rounded to nearest, ties to even code, onto e2m1 {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating
  to +-6 (values in (6, 8) * 2^X become 6 * 2^X). Nibble = sign << 3 | magnitude index (0..7); signed zero kept.
* Packing: two nibbles per byte, element 2i in the LOW nibble, 2i+1 in the high nibble.
* Non-finite inputs (OCP: an e2m1 block cannot carry them): a block holding any NaN or +-Inf gets e8m0 = 255
  (NaN) and all its nibbles 0; it dequantizes to NaN in all 32 elements.
* All rounding is integer arithmetic on the fp32 bits (no float division at all).

Dequant (:func:`dequantize_mxfp4_torch`): ``value(nibble) * 2^(e8m0 - 127)``, exact in fp32 (built from bits,
subnormals included; e8m0 253/254 with large elements, which quantization never emits, overflow to +-Inf), then cast to ``out_dtype`` (exact for bf16/fp32; fp16 rounds/overflows as torch does).

Error bound (tested): for a finite block with scale ``2^X``, ``|dequant(quant(x)) - x| <= 2^-2 * max(|x|, 2^X)``:
steps of 0.5/1/2 below 2/4/6 give at most a quarter of |x| or 2^X / 4, and saturation of (6, 8) * 2^X to 6 * 2^X
costs at most |x| / 4. Since 2^X <= amax / 4, small elements err by at most amax / 16.
"""

from __future__ import annotations

import torch

from tritonep.errors import InputError, WireError
from tritonep.device.common import check_kernel_mode
from tritonep.wire.kernels.quant import KIND_OF_DTYPE, MXFP4_CODEC
from tritonep.wire.kernels.wire_quant import mxfp4_dequant_kernel, mxfp4_quant_kernel
from tritonep.wire.checks import check_quant_input
from tritonep.wire.fp8 import _rne_shift_torch, _tiling

__all__ = [
    "quantize_mxfp4_torch",
    "dequantize_mxfp4_torch",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "MXFP4_REL_ERR",
]

MXFP4_REL_ERR = 2.0**-2
"""Round-trip bound: ``|dequant(quant(x)) - x| <= MXFP4_REL_ERR * max(|x|, 2^X)`` with 2^X the block scale."""

_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TWICE_E2M1 = (0, 1, 2, 3, 4, 6, 8, 12)  # 2 * e2m1 magnitude, by code


MXFP4_BLOCK = MXFP4_CODEC.block  # 32


def _check_x(x: torch.Tensor, name: str) -> None:
    check_quant_input(x, "mxfp4", MXFP4_BLOCK, name)


def _check_packed(packed: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype, name: str) -> int:
    if not isinstance(packed, torch.Tensor) or not isinstance(scales, torch.Tensor):
        raise InputError(f"{name}: packed and scales must be torch.Tensors")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise InputError(f"{name}: packed must be 2-D uint8 [N, hidden // 2], got {packed.dtype} {tuple(packed.shape)}")
    n, hh = packed.shape
    h = 2 * hh
    if h % MXFP4_BLOCK != 0:
        raise WireError(f"{name}: wire 'mxfp4' needs hidden % {MXFP4_BLOCK} == 0 (no padding); got hidden={h}")
    if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu) or tuple(scales.shape) != (n, h // MXFP4_BLOCK):
        raise InputError(
            f"{name}: scales must be uint8 (e8m0) of shape {(n, h // MXFP4_BLOCK)}, got {scales.dtype} "
            f"{tuple(scales.shape)}"
        )
    if scales.device != packed.device:
        raise InputError(f"{name}: scales on {scales.device} but packed on {packed.device}")
    if out_dtype not in _IN_DTYPES:
        raise InputError(f"{name}: out_dtype must be bfloat16/float16/float32, got {out_dtype}")
    return h


def quantize_mxfp4_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec of the mxfp4 wire (see the module docstring for the exact rule).

    Args:
        x: [N, H] bfloat16/float16/float32, H % 32 == 0.

    Returns:
        (packed [N, H // 2] uint8, scales [N, H // 32] uint8 e8m0 biased exponents), on x's device.

    Raises:
        InputError: x not 2-D or wrong dtype. WireError: H % 32 != 0.
    """
    _check_x(x, "quantize_mxfp4_torch")
    n, h = x.shape
    xb = x.float().contiguous().reshape(n, h // MXFP4_BLOCK, MXFP4_BLOCK).view(torch.int32)
    ab = xb & 0x7FFFFFFF
    finite = ab < 0x7F800000
    bad = (~finite).any(dim=-1)
    amax_bits = torch.where(finite, ab, torch.zeros_like(ab)).amax(dim=-1)
    e8 = torch.clamp((amax_bits >> 23) - 2, min=0)  # floor(log2 amax) - 2 + 127
    ex = (e8 - 127)[..., None]
    e = ab >> 23
    frac = ab & 0x7FFFFF
    m = torch.where(e == 0, frac, frac | 0x800000)
    e_lsb = torch.where(e == 0, torch.full_like(e, -149), e - 150)  # |x| = m * 2^e_lsb
    ey = torch.clamp(e - 127 - ex, min=0)  # binade of |x| / 2^X above 1 (0, 1 or 2): e2m1 step 2^(ey-1)
    s = torch.clamp(ey - 1 + ex - e_lsb, 1, 25)
    code = torch.clamp(_rne_shift_torch(m, s) + 2 * ey, max=7) | (((xb >> 31) & 1) << 3)
    code = torch.where(bad[..., None], torch.zeros_like(code), code).reshape(n, h)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    e8 = torch.where(bad, torch.full_like(e8, 255), e8).to(torch.uint8)
    return packed, e8


def dequantize_mxfp4_torch(packed: torch.Tensor, scales: torch.Tensor,
                           out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Spec of mxfp4 dequantization: ``sign * e2m1(nibble) * 2^(e8m0 - 127)`` exact in fp32, then ``.to(out_dtype)``.

    Args:
        packed: [N, H // 2] uint8 (even element in the low nibble). scales: [N, H // 32] uint8 (or float8_e8m0fnu).
        out_dtype: bfloat16, float16 or float32.

    Returns:
        [N, H] out_dtype; blocks with e8m0 == 255 are NaN. Raises InputError / WireError on bad input.
    """
    h = _check_packed(packed, scales, out_dtype, "dequantize_mxfp4_torch")
    n = packed.shape[0]
    p = packed.to(torch.int32)
    c = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(n, h // MXFP4_BLOCK, MXFP4_BLOCK)
    v = torch.tensor(_TWICE_E2M1, dtype=torch.int32, device=p.device)[c & 7]  # value = v * 2^(e8m0 - 128)
    lv = torch.where(v >= 8, 3, torch.where(v >= 4, 2, torch.where(v >= 2, 1, 0))).to(torch.int32)
    mbit = torch.where((v == 3) | (v == 6) | (v == 12), 1 << 22, 0).to(torch.int32)
    sc = scales.view(torch.uint8).to(torch.int32)[..., None]
    biased = lv + sc - 1
    nbits = torch.where(biased >= 255, 0x7F800000, (torch.clamp(biased, min=0) << 23) | mbit)  # overflow -> Inf
    sbits = v << torch.clamp(sc + 21, 0, 22)
    bits = torch.where(biased >= 1, nbits, sbits)
    bits = torch.where(v == 0, torch.zeros_like(bits), bits) | ((c >> 3) << 31)
    bits = torch.where(sc == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32).reshape(n, h).to(out_dtype)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton mxfp4 quantization; same bits as :func:`quantize_mxfp4_torch`.

    Args:
        x: [N, H] bfloat16/float16/float32, contiguous, H % 32 == 0 (CUDA, or CPU under TRITON_INTERPRET=1).

    Returns:
        (packed [N, H // 2] uint8, scales [N, H // 32] uint8 e8m0).

    Raises:
        InputError: x not 2-D, not contiguous, or wrong dtype. WireError: H % 32 != 0. ConfigError: the kernels
            were built for another device (:func:`tritonep.device.common.check_kernel_mode`).
    """
    _check_x(x, "quantize_mxfp4")
    if not x.is_contiguous():
        raise InputError(f"quantize_mxfp4: x must be contiguous, got strides {x.stride()}")
    check_kernel_mode(x.device.type)
    n, h = x.shape
    packed = torch.empty((n, h // 2), dtype=torch.uint8, device=x.device)
    s = torch.empty((n, h // MXFP4_BLOCK), dtype=torch.uint8, device=x.device)
    if n > 0:
        r, g, progs = _tiling(n, h // MXFP4_BLOCK, x.device, 32)
        xin = x.view(torch.int16) if x.dtype == torch.bfloat16 else x
        mxfp4_quant_kernel[(progs,)](xin, packed, s, n, h, KIND=KIND_OF_DTYPE[x.dtype], R=r, G=g)
    return packed, s


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton mxfp4 dequantization; same bits as :func:`dequantize_mxfp4_torch`.

    Args:
        packed: [N, H // 2] uint8, contiguous. scales: [N, H // 32] uint8 (or float8_e8m0fnu), contiguous.
        out_dtype: bfloat16, float16 or float32.

    Returns:
        [N, H] out_dtype. Raises InputError / WireError on bad shapes, dtypes, devices or strides, ConfigError
        when the kernels were built for another device.
    """
    h = _check_packed(packed, scales, out_dtype, "dequantize_mxfp4")
    if not packed.is_contiguous() or not scales.is_contiguous():
        raise InputError("dequantize_mxfp4: packed and scales must be contiguous")
    check_kernel_mode(packed.device.type)
    n = packed.shape[0]
    out = torch.empty((n, h), dtype=out_dtype, device=packed.device)
    if n > 0:
        r, g, progs = _tiling(n, h // MXFP4_BLOCK, packed.device, 32)
        o = out.view(torch.int16) if out_dtype == torch.bfloat16 else out
        mxfp4_dequant_kernel[(progs,)](packed, scales.view(torch.uint8), o, n, h, KIND=KIND_OF_DTYPE[out_dtype],
                                        R=r, G=g)
    return out
