"""What dispatch returns: :class:`Dispatched` (rows + layout) and :class:`DispatchHandle` (how to undo it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["Dispatched", "DispatchHandle"]


@dataclass
class DispatchHandle:
    """Routing state of one dispatch, consumed by combine and by the backward passes.

    Sender side (this rank's tokens): ``topk_idx [T, K]``, ``topk_weights [T, K]`` float32, ``rows [T, K]`` int32
    (destination row of every route on its expert rank, -1 masked). Receiver side (rows this rank received):
    ``meta [W, Tmax, K]`` int32 (row of route (src, t, k) here, -1 if elsewhere), ``wts [W, Tmax, K]`` float32,
    ``ntok [W]`` int32 (tokens of every source). ``num_recv_rows``: rows of the expert-grouped output, or None when
    unknown on the host (graph capture / TRITONEP_SYNC_CHECKS=0). ``extras``: backend-specific tensors.
    """

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    rows: torch.Tensor
    meta: Optional[torch.Tensor]
    wts: Optional[torch.Tensor]
    ntok: Optional[torch.Tensor]
    num_tokens: int
    num_recv_rows: Optional[int]
    backend: str
    extras: dict = field(default_factory=dict)
    recv_weights: Optional[torch.Tensor] = None  # autograd-tracked per-row weights (set by the front door)


@dataclass
class Dispatched:
    """Output of :meth:`tritonep.EPBuffer.dispatch`.

    Attributes:
        x: ``[R, H]`` received rows, expert-grouped (segment j = rows of local expert j, ordered by (source rank,
            token, k); alignment padding rows are zero). ``R = expert_offsets[-1]`` when the host knows it, else
            ``max_recv_tokens`` rows whose tail past ``expert_offsets[-1]`` is unspecified.
        x_scales: wire scales when ``keep_quantized=True`` (fp8: float32 ``[R, H/128]``; mxfp4: uint8
            ``[R, H/32]``), else None.
        num_tokens_per_expert: int32 ``[L]`` real rows per local expert (device).
        expert_offsets: int32 ``[L]`` cumulative aligned segment ends (``offs`` of ``torch._grouped_mm``).
        weights: float32 ``[R]`` router weight of each row's route (0 on padding rows).
        handle: :class:`DispatchHandle` for combine.
    """

    x: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    handle: DispatchHandle
    weights: Optional[torch.Tensor] = None
    x_scales: Optional[torch.Tensor] = None
