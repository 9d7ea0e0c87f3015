"""What dispatch returns: :class:`Dispatched` (rows + layout) and the frozen, typed handles that undo it.

A handle is built once, by the backend that dispatched, and never changed afterwards
(``dataclasses.FrozenInstanceError`` on assignment): :class:`DispatchHandle` holds what every backend records, :class:`TritonHandle` and
:class:`NcclHandle` add their backend's routing state as typed fields. The front door
(:meth:`tritonep.EPBuffer.dispatch`) stamps the buffer id and the autograd-tracked row weights by making a new handle
with :func:`dataclasses.replace`, never by mutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

__all__ = ["Dispatched", "DispatchHandle", "TritonHandle", "NcclHandle"]


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """Routing state of one dispatch, consumed by combine and by the backward passes (frozen; every backend).

    Attributes:
        topk_idx: ``[T, K]`` int32/int64 expert ids of this rank's tokens (-1 = masked).
        topk_weights: ``[T, K]`` float32 router weights.
        rows: ``[T, K]`` int32 destination row of every route on its expert rank (-1 masked).
        counts: int32 ``[W, E]`` routes of every rank per expert, this call's snapshot (expert-load statistics).
        num_tokens: T.
        num_recv_rows: rows of the expert-grouped output, or None when unknown on the host (graph capture /
            ``TRITONEP_SYNC_CHECKS=0``).
        x_scales: wire scales of a ``keep_quantized=True`` dispatch (fp8: float32 ``[R, H/128]``; mxfp4: uint8
            ``[R, H/32]``), else None.
        recv_weights: float32 ``[R]`` autograd-tracked per-row weights (set by the front door), else None.
        buffer_id: id of the :class:`tritonep.EPBuffer` that made it (0 until the front door stamps it); a handle is
            only valid with that buffer.
        backend: the registry name of the backend (class constant).
    """

    backend: ClassVar[str] = ""
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    rows: torch.Tensor
    counts: torch.Tensor
    num_tokens: int
    num_recv_rows: Optional[int]
    x_scales: Optional[torch.Tensor] = None
    recv_weights: Optional[torch.Tensor] = None
    buffer_id: int = 0


@dataclass(frozen=True, kw_only=True)
class TritonHandle(DispatchHandle):
    """Handle of the triton backend: the receiver side of the symmetric-memory protocol.

    Attributes (besides :class:`DispatchHandle`'s): ``meta [W, Tmax, K]`` int32 (row of route (src, t, k) here, -1
    if elsewhere), ``wts [W, Tmax, K]`` float32 (its weight), ``ntok [W]`` int32 (tokens of every source).
    """

    backend: ClassVar[str] = "triton"
    meta: torch.Tensor
    wts: torch.Tensor
    ntok: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class NcclHandle(DispatchHandle):
    """Handle of the nccl backend: the packets of one ``all_to_all_single`` and how routes map onto them.

    Attributes (besides :class:`DispatchHandle`'s; ``Ns`` / ``Nr`` packets sent / received, packets ordered by
    (destination rank, token)):
        send_splits / recv_splits: packets per peer (host tuples of W ints); num_send / num_recv: Ns / Nr.
        pkt: int32 ``[T, K]`` send packet of every route (-1 for a masked slot; the routes of a token to one rank
            share their packet).
        recv_rows: int32 ``[Nr, K]`` destination row of each received route (-1 where the route is elsewhere).
        recv_w: float32 ``[Nr, K]`` its weight (0 elsewhere).
    """

    backend: ClassVar[str] = "nccl"
    send_splits: tuple
    recv_splits: tuple
    num_send: int
    num_recv: int
    pkt: torch.Tensor
    recv_rows: torch.Tensor
    recv_w: torch.Tensor


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
        handle: the frozen :class:`DispatchHandle` for combine.
    """

    x: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    handle: DispatchHandle
    weights: Optional[torch.Tensor] = None
    x_scales: Optional[torch.Tensor] = None
