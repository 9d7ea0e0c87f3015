"""What every backend's dispatch handle holds: :class:`DispatchHandle`, the frozen base each backend's handle type
extends (:class:`tritonep.backends.triton.handle.TritonHandle`, :class:`tritonep.backends.nccl.handle.NcclHandle`).

A handle is built by the backend that dispatched, and every field is final (the buffer id, the returned row weights,
the row count) before the dispatch returns it; it never changes afterwards (``dataclasses.FrozenInstanceError`` on
assignment). A handle owns the routing its combine and backward passes read (a copy made at dispatch): a caller that
refills its ``topk_idx`` / ``topk_weights`` in place after dispatch changes nothing. Public as
:class:`tritonep.DispatchHandle`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

__all__ = ["DispatchHandle"]


@dataclass(frozen=True, kw_only=True)
class DispatchHandle:
    """Routing state of one dispatch, consumed by combine and by the backward passes (frozen; every backend).

    A handle OWNS what combine and the backward passes read again: the routing (``topk_idx``, ``topk_weights``) is
    the handle's own copy, made at dispatch (the caller may refill its routing tensors in place as soon as dispatch
    returns), and ids outside ``[-1, E)`` are stored as -1 (no kernel ever indexes with them).

    Attributes (every backend; the routing ones are properties or fields of the backend's subclass):
        topk_idx: ``[T, K]`` int32 (triton) / int64 (nccl) expert ids of this rank's tokens (-1 = masked).
        topk_weights: ``[T, K]`` float32 router weights.
        rows: ``[T, K]`` int32 destination row of every route on its expert rank (-1 masked).
        counts: int32 ``[W, E]`` routes of every rank per expert, this call's snapshot (expert-load statistics).
        num_tokens: T.
        num_recv_rows: rows of the expert-grouped output, or None when unknown on the host (graph capture,
            ``sync_free=True``, ``TRITONEP_SYNC_CHECKS=0``).
        x_scales: wire scales of a ``keep_quantized=True`` dispatch (fp8: float32 ``[R, H/128]``; mxfp4: uint8
            ``[R, H/32]``), else None.
        recv_weights: float32 ``[R]`` per-row weights (the tensor the dispatch returned, autograd-tracked when the
            dispatch was), else None.
        buffer_id: id of the :class:`tritonep.EPBuffer` that made it; a handle is only valid with that buffer.
        count_sums: a list of ints, the sums over the sources of the dispatch's ``count_ids`` routes per local
            expert of this rank (:meth:`tritonep.EPBuffer.dispatch`), where the call computed them (the triton
            backend's decode dispatch, read on the host); else None.
        carried: ``(idx [R, CK], weights [R, CK])``: the count routing carried with the rows
            (:meth:`tritonep.EPBuffer.dispatch`'s ``count_weights``), else None.
        backend: the registry name of the backend (class constant).
    """

    backend: ClassVar[str] = ""
    num_tokens: int
    num_recv_rows: Optional[int]
    x_scales: Optional[torch.Tensor] = None
    recv_weights: Optional[torch.Tensor] = None
    buffer_id: int = 0
    count_sums: Optional[list] = None
    carried: Optional[tuple] = None
