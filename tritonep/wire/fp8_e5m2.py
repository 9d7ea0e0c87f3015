"""The fp8_e5m2 wire: float8_e5m2 values with one fp32 scale per 128 contiguous elements of a row.

Spec (:func:`quantize_fp8_e5m2_torch`, exact bits; the device codec :mod:`tritonep.wire.kernels.quant_e5m2` gives the
same bits in the interpreter and on GPU). The fp8 (e4m3) wire's rule with the e5m2 range (OCP 8-bit floating point:
1 sign, 5 exponent bits with bias 15, 2 mantissa bits; largest finite 57344, smallest normal 2^-14, subnormal step
2^-16). e5m2 trades e4m3's precision for range: 4 values per binade instead of 8, 32 binades instead of 17.

* Blocks of 128, ``hidden % 128 == 0`` (no padding); ``amax`` = max |x| over the block's finite elements (fp32).
* ``scale = max(amax / 57344, 2^-126)`` (IEEE division); ``pow2_scale=True`` rounds it up to a power of two.
* ``q = e5m2(x * inv)``, ``inv = 57344 / max(amax, 57344 * 2^-126)`` (IEEE division once per block; ``pow2_scale``:
  ``1 / scale``, exact), one IEEE multiply per element, round to nearest even onto the e5m2 grid, saturating to
  +-57344.
  Signed zeros kept; NaN -> 0x7F; +-Inf -> +-57344 (0x7B / 0xFB); fp32 subnormals used as they are.

Dequant (:func:`dequantize_fp8_e5m2_torch`): ``(value(q) * scale).to(out_dtype)``, one fp32 multiply, RNE cast.

Error bound (fp32 output, tested): ``|dequant(quant(x)) - x| <= 2^-3 * |x| + 2^-17 * scale`` for finite x (half
an e5m2 ulp relative, or half the subnormal step 2^-16 times the scale), plus fp32 rounding (2^-21 |x|).
Idea: the OCP OFP8 e5m2 format (used for gradients in fp8 training recipes); the integer rounding is ours.
"""

from __future__ import annotations

import torch

from tritonep.wire.kernels.quant_e5m2 import FP8_E5M2_CODEC
from tritonep.wire.checks import check_quant_input
from tritonep.wire.fp8 import (FP8_BLOCK, _check_q, fp8_encode_bits_torch, scaled_dequantize, scaled_dequantize_torch,
                               scaled_quantize, scaled_quantize_torch)

__all__ = [
    "quantize_fp8_e5m2_torch",
    "dequantize_fp8_e5m2_torch",
    "quantize_fp8_e5m2",
    "dequantize_fp8_e5m2",
    "e5m2_encode_torch",
    "E5M2_MAX",
    "E5M2_REL_ERR",
    "E5M2_ABS_ERR_SCALE",
]

E5M2_MAX = 57344.0
"""Largest finite float8_e5m2 value."""

E5M2_REL_ERR = 2.0**-3
"""Round-trip bound, relative part: ``|dequant(quant(x)) - x| <= E5M2_REL_ERR*|x| + E5M2_ABS_ERR_SCALE*scale``."""

E5M2_ABS_ERR_SCALE = 2.0**-17
"""Round-trip bound, absolute part in units of the block scale (half the e5m2 subnormal step 2^-16)."""

_NAME = FP8_E5M2_CODEC.name


def e5m2_encode_torch(y: torch.Tensor) -> torch.Tensor:
    """fp32 tensor (any shape) -> uint8 float8_e5m2 bits: RNE, saturate to +-57344, Inf -> +-57344, NaN -> 0x7F.

    Twin of :func:`tritonep.wire.kernels.quant_e5m2.e5m2_encode`. Raises InputError if ``y`` is not float32.
    """
    return fp8_encode_bits_torch(y, 2, 15, 0x7B, "e5m2_encode_torch")


def quantize_fp8_e5m2_torch(x: torch.Tensor, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec of the fp8_e5m2 wire (module docstring).

    Args:
        x: [N, H] bfloat16/float16/float32, H % 128 == 0. pow2_scale: round each scale up to a power of two.

    Returns:
        (q [N, H] torch.float8_e5m2, scales [N, H // 128] float32), on x's device.

    Raises:
        InputError: x not 2-D or wrong dtype. WireError: H % 128 != 0.
    """
    check_quant_input(x, _NAME, FP8_BLOCK, "quantize_fp8_e5m2_torch")
    q, scale = scaled_quantize_torch(x, E5M2_MAX, e5m2_encode_torch, pow2_scale)
    return q.view(torch.float8_e5m2), scale


def dequantize_fp8_e5m2_torch(q: torch.Tensor, scales: torch.Tensor,
                              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Spec of fp8_e5m2 dequantization: ``(value(q) * scale).to(out_dtype)`` (fp32 multiply, RNE cast).

    Args:
        q: [N, H] float8_e5m2 (or its uint8 bits). scales: [N, H // 128] float32. out_dtype: bf16/fp16/fp32.

    Returns:
        [N, H] out_dtype. Raises InputError / WireError on bad shapes or dtypes.
    """
    qb = _check_q(q, scales, out_dtype, "dequantize_fp8_e5m2_torch", torch.float8_e5m2, _NAME)
    return scaled_dequantize_torch(qb.view(torch.float8_e5m2), scales, out_dtype)


def quantize_fp8_e5m2(x: torch.Tensor, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fp8_e5m2 quantization (the device codec); same bits as :func:`quantize_fp8_e5m2_torch`.

    Args:
        x: [N, H] bfloat16/float16/float32, contiguous, H % 128 == 0 (CUDA, or CPU under TRITON_INTERPRET=1).

    Returns:
        (q [N, H] torch.float8_e5m2, scales [N, H // 128] float32).

    Raises:
        InputError: x not 2-D, not contiguous, or wrong dtype. WireError: H % 128 != 0. ConfigError: the kernels
            were built for another device (:func:`tritonep.device.common.check_kernel_mode`).
    """
    check_quant_input(x, _NAME, FP8_BLOCK, "quantize_fp8_e5m2")
    q, s = scaled_quantize(x, pow2_scale, FP8_E5M2_CODEC, "quantize_fp8_e5m2")
    return q.view(torch.float8_e5m2), s


def dequantize_fp8_e5m2(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton fp8_e5m2 dequantization (the device codec); same bits as :func:`dequantize_fp8_e5m2_torch`.

    Args:
        q: [N, H] float8_e5m2 or uint8 bits, contiguous. scales: [N, H // 128] float32, contiguous.

    Returns:
        [N, H] out_dtype. Raises InputError / WireError on bad shapes, dtypes, devices or strides;
        ConfigError when the kernels were built for another device.
    """
    qb = _check_q(q, scales, out_dtype, "dequantize_fp8_e5m2", torch.float8_e5m2, _NAME)
    return scaled_dequantize(qb, scales, out_dtype, FP8_E5M2_CODEC, "dequantize_fp8_e5m2")
