"""Wire formats of token rows between ranks: bf16, fp8 (e4m3 + fp32 scale per 128), mxfp4 and fp8_e5m2 (docs/wire-formats.md).

:mod:`tritonep.wire.formats` is the registry (one :class:`WireFormat` record per format: sizes, codec, twins,
tolerance). Each format has torch twins (``*_torch``, the exact-bit spec) and Triton implementations built on the
fusable device codecs of :mod:`tritonep.wire.kernels.quant` / :mod:`tritonep.wire.kernels.quant_e5m2`.
"""

from tritonep.wire.formats import (
    FP8_BLOCK,
    FP8_MAX,
    MXFP4_BLOCK,
    MXFP4_MAX,
    WIRE_FORMATS,
    WIRES,
    WireFormat,
    block_size,
    check_wire,
    get_wire,
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
from tritonep.wire.fp8_e5m2 import (
    E5M2_ABS_ERR_SCALE,
    E5M2_MAX,
    E5M2_REL_ERR,
    dequantize_fp8_e5m2,
    dequantize_fp8_e5m2_torch,
    e5m2_encode_torch,
    quantize_fp8_e5m2,
    quantize_fp8_e5m2_torch,
)
from tritonep.wire.mxfp4 import (
    MXFP4_REL_ERR,
    dequantize_mxfp4,
    dequantize_mxfp4_torch,
    quantize_mxfp4,
    quantize_mxfp4_torch,
)

__all__ = [
    "WireFormat",
    "WIRE_FORMATS",
    "WIRES",
    "get_wire",
    "FP8_BLOCK",
    "MXFP4_BLOCK",
    "FP8_MAX",
    "MXFP4_MAX",
    "E5M2_MAX",
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
    "quantize_fp8_e5m2_torch",
    "dequantize_fp8_e5m2_torch",
    "quantize_fp8_e5m2",
    "dequantize_fp8_e5m2",
    "e5m2_encode_torch",
    "E5M2_REL_ERR",
    "E5M2_ABS_ERR_SCALE",
]
