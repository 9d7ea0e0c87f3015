"""The wire-format registry: one :class:`WireFormat` record per format, read by kernels, backends, CLI and tests.

A *wire format* is how one token row of ``hidden`` elements travels between ranks:

| wire       | id | payload per row   | scales per row       | scale dtype                        | CLI tol |
|------------|----|-------------------|----------------------|------------------------------------|---------|
| "bf16"     | 0  | 2 * hidden B      | 0                    | None                               | 3e-2    |
| "fp8"      | 1  | hidden B (e4m3)   | hidden // 128 (fp32) | torch.float32                      | 0.15    |
| "mxfp4"    | 2  | hidden // 2 B     | hidden // 32 (e8m0)  | torch.uint8 (biased exponent, OCP) | 0.5     |
| "fp8_e5m2" | 3  | hidden B (e5m2)   | hidden // 128 (fp32) | torch.float32                      | 0.3     |

A row on the wire is its payload bytes followed by its scale bytes (no padding). Rule: ``hidden`` must be a
multiple of the format's block, else :class:`tritonep.errors.WireError` names hidden, the block and the field.

Adding a format = a device codec next to its tile functions (:class:`tritonep.wire.kernels.wirecodec.DeviceCodec`),
its torch twins (``quantize_*_torch`` / ``dequantize_*_torch``, the exact-bit spec) and one record below. Every
size, allocation, tolerance and kernel branch is derived from the record.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

from tritonep.errors import WireError
from tritonep.wire.kernels.quant import FP8_E4M3_CODEC, MXFP4_CODEC
from tritonep.wire.kernels.quant_e5m2 import FP8_E5M2_CODEC
from tritonep.wire.kernels.wirecodec import RAW_BF16, DeviceCodec
from tritonep.wire.fp8 import dequantize_fp8_torch, quantize_fp8_torch
from tritonep.wire.fp8_e5m2 import E5M2_MAX, dequantize_fp8_e5m2_torch, quantize_fp8_e5m2_torch
from tritonep.wire.mxfp4 import dequantize_mxfp4_torch, quantize_mxfp4_torch

__all__ = [
    "WireFormat",
    "WIRE_FORMATS",
    "WIRES",
    "get_wire",
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
]


@dataclass(frozen=True)
class WireFormat:
    """One wire format (see the module table).

    Fields:
        name: the wire name users pass (``dispatch_wire=`` / ``combine_wire=`` / ``--dispatch-wire``).
        id: a small stable integer (reports, logs); never reused.
        codec: the device side handed to the EP kernels as their ``WIRE`` constexpr (block, payload bits,
            scale bytes and ``tl`` dtype, the Triton (jit) tile encode / decode).
        tolerance: relative max error ``max|got - ref| / max|ref|`` of an MoE layer's output and gradients
            with this wire against the dense reference (``tritonep run``, benchmarks, tests).
        max_value: largest finite magnitude of an encoded element (before the scale).
        payload_dtype: dtype of the twin's payload tensor (the raw wire: bfloat16).
        scale_dtype: dtype of the twin's scales (None: no scales).
        quantize_torch: ``x [N, H] -> (payload [N, payload_bytes], scales [N, num_scales])``, the exact-bit spec.
        dequantize_torch: ``(payload, scales, out_dtype) -> [N, H]``, the exact-bit spec.

    Raises (construction):
        ValueError: the record and its codec disagree (name, scale size, raw vs quantized).
    """

    name: str
    id: int
    codec: DeviceCodec
    tolerance: float
    max_value: float
    payload_dtype: torch.dtype
    scale_dtype: torch.dtype | None = None
    quantize_torch: Callable | None = None
    dequantize_torch: Callable | None = None

    def __post_init__(self):
        sb = 0 if self.scale_dtype is None else torch.empty(0, dtype=self.scale_dtype).element_size()
        twins = self.quantize_torch is not None and self.dequantize_torch is not None
        if self.codec.name != self.name or sb != self.codec.scale_bytes or twins != self.codec.quantized:
            raise ValueError(f"wire {self.name!r}: record and codec {self.codec!r} disagree (name, scale bytes "
                             f"{sb} vs {self.codec.scale_bytes}, or twins vs quantized)")

    @property
    def block(self) -> int:
        """Elements per scale block (1 for bf16)."""
        return self.codec.block

    @property
    def quantized(self) -> bool:
        """False for the raw bf16 wire."""
        return self.codec.quantized

    def check(self, hidden: int, field: str = "dispatch_wire") -> None:
        """Raise WireError unless ``hidden`` is a positive int and a multiple of :attr:`block` (message names
        ``field``, the wire, hidden and the block)."""
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0:
            raise WireError(f"{field}={self.name!r}: hidden must be a positive int, got {hidden!r}")
        if hidden % self.block != 0:
            raise WireError(
                f"{field}={self.name!r} needs hidden to be a multiple of its block of {self.block} elements (no "
                f"padding); got hidden={hidden} (hidden % {self.block} = {hidden % self.block})")

    def payload_bytes(self, hidden: int) -> int:
        """Bytes of one row's payload (no scales). Raises WireError as :meth:`check`."""
        self.check(hidden, "wire")
        return hidden * self.codec.pay_mul // self.codec.pay_div

    def num_scales(self, hidden: int) -> int:
        """Scales per row (0 for bf16). Raises WireError as :meth:`check`."""
        self.check(hidden, "wire")
        return hidden // self.block if self.quantized else 0

    def scale_bytes(self, hidden: int) -> int:
        """Bytes of one row's scales. Raises WireError as :meth:`check`."""
        return self.num_scales(hidden) * self.codec.scale_bytes

    def row_bytes(self, hidden: int) -> int:
        """Bytes of one wire row: payload then scales. Raises WireError as :meth:`check`."""
        return self.payload_bytes(hidden) + self.scale_bytes(hidden)

    @cached_property
    def zero_scale(self) -> float:
        """The scale the twin gives an all-zero block (fp8: 2^-126, mxfp4: 0): what padding rows hold."""
        if not self.quantized:
            return 0.0
        _, s = self.quantize_torch(torch.zeros(1, self.block))
        return s.view(-1)[0].item()

    def empty_quantized(self, nrows: int, hidden: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(payload uint8 [nrows, payload_bytes] zeros, scales [nrows, num_scales] = zero_scale)``: every row
        the encoding of a zero row, as the twin gives it (the padding rows of ``keep_quantized`` outputs)."""
        q = torch.zeros(nrows, self.payload_bytes(hidden), dtype=torch.uint8, device=device)
        s = torch.full((nrows, self.num_scales(hidden)), self.zero_scale, dtype=self.scale_dtype, device=device)
        return q, s

    def quantize_bytes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, H]`` rows -> ``(payload uint8 [N, payload_bytes], scale bytes uint8 [N, scale_bytes])`` by the twin."""
        q, s = self.quantize_torch(x)
        return q.view(torch.uint8), s.view(torch.uint8)

    def wire_views(self, rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 rows ``[N, >= row_bytes]`` (any row stride) -> views ``(payload uint8 [N, P], scales [N, S])``."""
        p, nb = self.payload_bytes(hidden), self.scale_bytes(hidden)
        return rows[:, :p], rows[:, p:p + nb].view(self.scale_dtype)

    def dequantize_rows(self, rows: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """uint8 wire rows ``[N, >= row_bytes]`` -> ``[N, H]`` of ``dtype`` by the twin (fp32 value, one RNE cast)."""
        q, s = self.wire_views(rows, hidden)
        return self.dequantize_torch(q, s, dtype)


BF16 = WireFormat("bf16", 0, RAW_BF16, tolerance=3e-2, max_value=torch.finfo(torch.bfloat16).max,
                  payload_dtype=torch.bfloat16)
FP8 = WireFormat("fp8", 1, FP8_E4M3_CODEC, tolerance=0.15, max_value=448.0, payload_dtype=torch.float8_e4m3fn,
                 scale_dtype=torch.float32, quantize_torch=quantize_fp8_torch, dequantize_torch=dequantize_fp8_torch)
MXFP4 = WireFormat("mxfp4", 2, MXFP4_CODEC, tolerance=0.5, max_value=6.0, payload_dtype=torch.uint8,
                   scale_dtype=torch.uint8, quantize_torch=quantize_mxfp4_torch, dequantize_torch=dequantize_mxfp4_torch)
FP8_E5M2 = WireFormat("fp8_e5m2", 3, FP8_E5M2_CODEC, tolerance=0.3, max_value=E5M2_MAX,
                      payload_dtype=torch.float8_e5m2, scale_dtype=torch.float32,
                      quantize_torch=quantize_fp8_e5m2_torch, dequantize_torch=dequantize_fp8_e5m2_torch)

WIRE_FORMATS: dict[str, WireFormat] = {f.name: f for f in (BF16, FP8, MXFP4, FP8_E5M2)}
"""Every wire format by name (insertion order = the order users see)."""
assert len({f.id for f in WIRE_FORMATS.values()}) == len(WIRE_FORMATS), "wire ids must be unique"

WIRES = tuple(WIRE_FORMATS)
"""Supported wire format names."""

FP8_BLOCK = FP8.block
"""Contiguous elements of a row sharing one fp32 scale in the fp8 wire (DeepSeek-V3 1x128 activations)."""

MXFP4_BLOCK = MXFP4.block
"""Contiguous elements of a row sharing one e8m0 scale in the mxfp4 wire (OCP Microscaling v1.0)."""

FP8_MAX = FP8.max_value
"""Largest finite float8_e4m3fn value."""

MXFP4_MAX = MXFP4.max_value
"""Largest e2m1 value."""


def get_wire(wire: str, field: str = "wire") -> WireFormat:
    """The record of ``wire``. Raises WireError naming ``field``, the value and the supported names."""
    f = WIRE_FORMATS.get(wire) if isinstance(wire, str) else None
    if f is None:
        raise WireError(f"{field}={wire!r} is not a supported wire format; supported: {', '.join(WIRES)}")
    return f


def block_size(wire: str) -> int:
    """Elements per scale block of ``wire`` (1 for bf16). Raises WireError for an unknown name."""
    return get_wire(wire).block


def check_wire(wire: str, hidden: int, field: str = "dispatch_wire") -> None:
    """Validate a wire format name against a hidden size.

    Args:
        wire: one of :data:`WIRES`. hidden: elements per token row (int > 0).
        field: name of the argument/config field being checked, used in the message.

    Raises:
        WireError: unknown ``wire`` (message lists the supported values), ``hidden`` not a positive int, or
            ``hidden % block != 0`` (no padding; message names hidden, the block and the field).
    """
    get_wire(wire, field).check(hidden, field)


def payload_bytes(wire: str, hidden: int) -> int:
    """Bytes of one row's payload (no scales): bf16 ``2*hidden``, fp8 ``hidden``, mxfp4 ``hidden//2``. WireError."""
    return get_wire(wire).payload_bytes(hidden)


def num_scales(wire: str, hidden: int) -> int:
    """Scales per row: bf16 0, fp8 ``hidden//128``, mxfp4 ``hidden//32``. Raises WireError as :func:`check_wire`."""
    return get_wire(wire).num_scales(hidden)


def scale_dtype(wire: str) -> torch.dtype | None:
    """Dtype of the scales: fp8 ``torch.float32``, mxfp4 ``torch.uint8`` (e8m0), bf16 None. WireError if unknown."""
    return get_wire(wire).scale_dtype


def scale_bytes(wire: str, hidden: int) -> int:
    """Bytes of one row's scales: fp8 ``4*hidden//128``, mxfp4 ``hidden//32``, bf16 0. Raises WireError."""
    return get_wire(wire).scale_bytes(hidden)
