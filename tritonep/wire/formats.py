"""Wire format names, validation and sizes (DESIGN.md §7).

A *wire format* is how one token row of ``hidden`` elements travels between ranks:

| wire    | payload per row | scales per row        | scale dtype                         |
|---------|-----------------|-----------------------|-------------------------------------|
| "bf16"  | 2 * hidden B    | 0                     | None                                |
| "fp8"   | hidden B (e4m3) | hidden // 128 (fp32)  | torch.float32                       |
| "mxfp4" | hidden // 2 B   | hidden // 32 (e8m0)   | torch.uint8 (biased exponent, OCP)  |

Rule: no padding. ``hidden`` must be a multiple of the format's block (128 for fp8, 32 for mxfp4);
otherwise :class:`tritonep.errors.WireError` is raised naming hidden, the block and the field.
"""

from __future__ import annotations

import torch

from tritonep.errors import InputError, WireError

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
]

WIRES = ("bf16", "fp8", "mxfp4")
"""Supported wire format names."""

FP8_BLOCK = 128
"""Contiguous elements of a row sharing one fp32 scale in the fp8 wire (DeepSeek-V3 1x128 activations)."""

MXFP4_BLOCK = 32
"""Contiguous elements of a row sharing one e8m0 scale in the mxfp4 wire (OCP Microscaling v1.0)."""

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""

MXFP4_MAX = 6.0
"""Largest e2m1 value."""

_BLOCKS = {"bf16": 1, "fp8": FP8_BLOCK, "mxfp4": MXFP4_BLOCK}


def _check_name(wire: str, field: str) -> None:
    if wire not in WIRES:
        raise WireError(f"{field}={wire!r} is not a supported wire format; supported: {', '.join(WIRES)}")


def block_size(wire: str) -> int:
    """Elements per scale block of ``wire`` (1 for bf16). Raises WireError for an unknown name."""
    _check_name(wire, "wire")
    return _BLOCKS[wire]


def check_wire(wire: str, hidden: int, field: str = "dispatch_wire") -> None:
    """Validate a wire format name against a hidden size.

    Args:
        wire: one of :data:`WIRES`.
        hidden: elements per token row (int > 0).
        field: name of the argument/config field being checked, used in the message.

    Raises:
        WireError: unknown ``wire`` (message lists the supported values), ``hidden`` not a positive int, or
            ``hidden % block != 0`` (no padding: hidden must be a multiple of the block; message names
            hidden, the block and the field).
    """
    _check_name(wire, field)
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0:
        raise WireError(f"{field}={wire!r}: hidden must be a positive int, got {hidden!r}")
    blk = _BLOCKS[wire]
    if hidden % blk != 0:
        raise WireError(
            f"{field}={wire!r} needs hidden to be a multiple of its block of {blk} elements (no padding); "
            f"got hidden={hidden} (hidden % {blk} = {hidden % blk})"
        )


def payload_bytes(wire: str, hidden: int) -> int:
    """Bytes of one quantized row's payload (no scales): bf16 ``2*hidden``, fp8 ``hidden``, mxfp4 ``hidden//2``.

    Raises:
        WireError: as :func:`check_wire`.
    """
    check_wire(wire, hidden, "wire")
    return {"bf16": 2 * hidden, "fp8": hidden, "mxfp4": hidden // 2}[wire]


def num_scales(wire: str, hidden: int) -> int:
    """Scales per row: bf16 0, fp8 ``hidden//128``, mxfp4 ``hidden//32``. Raises WireError as :func:`check_wire`."""
    check_wire(wire, hidden, "wire")
    return 0 if wire == "bf16" else hidden // _BLOCKS[wire]


def scale_dtype(wire: str) -> torch.dtype | None:
    """Dtype of the scales: fp8 ``torch.float32``, mxfp4 ``torch.uint8`` (e8m0 biased exponent), bf16 None.

    Raises:
        WireError: unknown ``wire``.
    """
    _check_name(wire, "wire")
    return {"bf16": None, "fp8": torch.float32, "mxfp4": torch.uint8}[wire]


def scale_bytes(wire: str, hidden: int) -> int:
    """Bytes of one row's scales: fp8 ``4*hidden//128``, mxfp4 ``hidden//32``, bf16 0. Raises WireError."""
    n = num_scales(wire, hidden)
    return n * (4 if wire == "fp8" else 1)


QUANT_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes the quantizers take."""


def check_quant_input(x: torch.Tensor, wire: str, name: str) -> None:
    """Validate the input of a quantizer of ``wire`` ("fp8" | "mxfp4").

    Raises:
        InputError: not a tensor, not 2-D ``[N, hidden]``, or a dtype outside :data:`QUANT_IN_DTYPES`.
        WireError: hidden not a multiple of the wire's block (no padding rule).
    """
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise InputError(f"{name}: x must be 2-D [N, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in QUANT_IN_DTYPES:
        raise InputError(f"{name}: x dtype must be one of bfloat16/float16/float32, got {x.dtype}")
    blk = block_size(wire)
    if x.shape[1] % blk != 0:
        raise WireError(f"{name}: wire {wire!r} needs hidden to be a multiple of its block of {blk} (no padding); "
                        f"got hidden={x.shape[1]}")
