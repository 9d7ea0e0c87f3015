"""Wire formats of token rows between ranks: bf16, fp8 (e4m3 + fp32 scale per 128) and mxfp4 (DESIGN.md §7).

Each format has torch twins (``*_torch``, the exact-bit spec) and Triton implementations built on the fusable
device functions of :mod:`tritonep.kernels.quant`.
"""

from tritonep.wire.formats import (
    FP8_BLOCK,
    FP8_MAX,
    MXFP4_BLOCK,
    MXFP4_MAX,
    WIRES,
    block_size,
    check_wire,
    num_scales,
    payload_bytes,
    scale_bytes,
    scale_dtype,
)
from tritonep.wire.fp8 import (
    FP8_ABS_ERR_SCALE,
    FP8_REL_ERR,
    dequantize_fp8,
    dequantize_fp8_torch,
    e4m3_encode_torch,
    quantize_fp8,
    quantize_fp8_torch,
)
from tritonep.wire.mxfp4 import (
    MXFP4_REL_ERR,
    dequantize_mxfp4,
    dequantize_mxfp4_torch,
    quantize_mxfp4,
    quantize_mxfp4_torch,
)

__all__ = [
    "WIRES",
    "FP8_BLOCK",
    "MXFP4_BLOCK",
    "FP8_MAX",
    "MXFP4_MAX",
    "check_wire",
    "block_size",
    "payload_bytes",
    "num_scales",
    "scale_dtype",
    "scale_bytes",
    "quantize_fp8_torch",
    "dequantize_fp8_torch",
    "quantize_fp8",
    "dequantize_fp8",
    "e4m3_encode_torch",
    "FP8_REL_ERR",
    "FP8_ABS_ERR_SCALE",
    "quantize_mxfp4_torch",
    "dequantize_mxfp4_torch",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "MXFP4_REL_ERR",
]
