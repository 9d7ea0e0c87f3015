"""The nccl backend's dispatch handle: :class:`NcclHandle` (the packets of one ``all_to_all_single`` and how routes
map onto them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..handle import DispatchHandle

__all__ = ["NcclHandle"]


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
        the result equals the constructor's); ``count_sums`` and ``carried`` are None (this backend neither sums nor
        carries a count routing)."""
        h = cls.__new__(cls)
        h.__dict__.update(fields, count_sums=None, carried=None)
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
