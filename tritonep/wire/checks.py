"""Input checks shared by the quantizers of every wire format (kept apart from the registry: no import cycle)."""

from __future__ import annotations

import torch

from tritonep.errors import InputError, WireError

__all__ = ["QUANT_IN_DTYPES", "check_quant_input"]

QUANT_IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Input dtypes the quantizers take."""


def check_quant_input(x: torch.Tensor, wire: str, block: int, name: str) -> None:
    """Validate the input of a quantizer of ``wire`` (scale blocks of ``block`` elements).

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
    if x.shape[1] % block != 0:
        raise WireError(f"{name}: wire {wire!r} needs hidden to be a multiple of its block of {block} (no padding); "
                        f"got hidden={x.shape[1]}")
