"""What dispatch returns: :class:`Dispatched` (rows + layout) and the frozen, typed handles that undo it.

A handle is built by the backend that dispatched, and every field is final (the buffer id, the returned row weights,
the row count) before the dispatch returns it; it never changes afterwards (``dataclasses.FrozenInstanceError`` on
assignment; the triton backend makes its handle while the launch runs and fills every field after its host read,
:meth:`TritonHandle._fill`, before anyone else sees the handle):
:class:`DispatchHandle` holds what every backend records, :class:`TritonHandle` and :class:`NcclHandle` add their
backend's routing state. A handle owns the routing its combine and backward passes read (a copy made at dispatch):
a caller that refills its ``topk_idx`` / ``topk_weights`` in place after dispatch changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar, Optional

import torch

__all__ = ["Dispatched", "DispatchHandle", "TritonHandle", "NcclHandle"]


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
        backend: the registry name of the backend (class constant).
    """

    backend: ClassVar[str] = ""
    num_tokens: int
    num_recv_rows: Optional[int]
    x_scales: Optional[torch.Tensor] = None
    recv_weights: Optional[torch.Tensor] = None
    buffer_id: int = 0


@dataclass(frozen=True, kw_only=True)
class TritonHandle(DispatchHandle):
    """Handle of the triton backend: the receiver side of the symmetric-memory protocol, in ONE allocation.

    ``store`` is the call's int32 storage block (the kernels take the block itself and add each field's static
    offset: :data:`tritonep.runtime.bound.STORE`); ``views`` its fields as :class:`tritonep.runtime.field_view.FieldView` s
    (an address and a dtype each; made on first read, like each field's tensor view; the layout is the backend's
    static :class:`tritonep.backends.triton.outputs.HandleLayout`). Fields, as
    properties: ``meta [W, Tmax, K]`` int32 (row of route (src, t, k) here, -1 if elsewhere), ``wts [W, Tmax, K]``
    float32 (its weight), ``ntok [W]`` int32 (tokens of every source), ``rows``, ``counts``, ``topk_idx`` (int32,
    the handle's sanitized copy), ``topk_weights`` (float32 copy), and ``ntpe`` / ``offs`` (the dispatch's
    ``num_tokens_per_expert`` / ``expert_offsets``).
    """

    backend: ClassVar[str] = "triton"
    store: torch.Tensor
    layout: object

    def _fill(self, store: torch.Tensor, layout, num_tokens: int, buffer_id: int, num_recv_rows, recv_weights,
              x_scales):
        """Set every field of a handle made without ``__init__`` (``object.__new__``: the backend makes it while its
        launch runs and fills it after the host read, before any caller sees it). One update of the instance
        dictionary, as the generated frozen ``__init__`` would fill it field by field through
        ``object.__setattr__`` (~2 us of host time per dispatch less)."""
        self.__dict__.update(store=store, layout=layout, num_tokens=num_tokens, num_recv_rows=num_recv_rows,
                             x_scales=x_scales, recv_weights=recv_weights, buffer_id=buffer_id)

    @cached_property
    def views(self) -> tuple:
        """The fields of :attr:`store` as :class:`tritonep.runtime.field_view.FieldView` s (made once, on first read)."""
        return self.layout.views(self.store)

    def _get(self, name):
        return self.layout.shaped(self.views, name, self.num_tokens)

    meta = property(lambda self: self._get("meta"))
    wts = property(lambda self: self._get("wts"))
    ntok = property(lambda self: self._get("ntok"))
    rows = property(lambda self: self._get("rows"))
    counts = property(lambda self: self._get("counts"))
    topk_idx = property(lambda self: self._get("idx"))
    topk_weights = property(lambda self: self._get("w"))
    ntpe = property(lambda self: self._get("ntpe"))
    offs = property(lambda self: self._get("offs"))


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

    A sync-free dispatch's handle (:mod:`tritonep.backends.nccl.sync_free`) has fixed slots: splits of
    ``max_tokens_per_rank`` packets per peer, ``Ns = Nr = W * max_tokens_per_rank``; a slot its source left empty has
    routes -1 and weights 0 (combine and the backward passes need nothing else), ``num_recv_rows`` is None. In the
    one-hop mode (``TRITONEP_NCCL_SYNC_FREE=onehop``) every peer block has one more slot (the header: routes -1),
    splits of ``1 + max_tokens_per_rank``, and ``rows`` is an empty ``[0, K]`` tensor (the destination rows are known
    only on the expert ranks; nothing on this backend reads it).
    """

    backend: ClassVar[str] = "nccl"

    @classmethod
    def _new(cls, **fields) -> "NcclHandle":
        """``NcclHandle(**fields)`` without the generated frozen ``__init__``, which sets its 16 fields one
        ``object.__setattr__`` at a time (4.7 vs 0.8 us on a 2-core CPU, on every dispatch's host path): the instance
        dictionary is filled directly. Every field must be given (``tests/backends/nccl/test_call_contract.py`` checks
        the result equals the constructor's)."""
        h = cls.__new__(cls)
        h.__dict__.update(fields)
        return h

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    rows: torch.Tensor
    counts: torch.Tensor
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
