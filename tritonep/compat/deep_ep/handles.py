"""The handles the compat Buffer returns: tuples shaped like DeepEP's, carrying tritonep's own state.

DeepEP's V1 handles are plain tuples its ``combine`` / cached ``dispatch`` / ``low_latency_combine`` take back, and
its own tests read a few of their fields. The handles here are tuples of the same length whose fields that exist in
tritonep hold what DeepEP puts there (computed when first read), and which carry the state tritonep needs in
attributes (a tuple subclass has an instance dictionary). A handle is valid only with the Buffer that made it.
"""

from __future__ import annotations

import torch

__all__ = ["NormalHandle", "LowLatencyHandle", "slot_ids"]


def slot_ids(slots: torch.Tensor, carried: bool, ranks2: torch.Tensor) -> torch.Tensor:
    """A meta-rows lane dispatch's slots as int32 ids: the slots themselves, or for a dispatch that carried its top-k
    with the rows (its slots: the bool rank mask ``is_token_in_rank [T, W]``) ``2r`` where set, else -1 (``ranks2``:
    int32 ``2 * arange(W)``; one ``torch.where``)."""
    return torch.where(slots, ranks2, -1) if carried else slots


class NormalHandle(tuple):
    """Handle of a normal-mode dispatch: a 6-tuple in DeepEP's intranode order.

    Fields (index: DeepEP's name):
        0 ``rank_prefix_matrix``: int32 ``[W, W]``, entry ``[i, j]`` = rows rank j receives from ranks ``0..i``
          (computed from the exchange's counts when first read; device op).
        1 ``channel_prefix_matrix``, 2 ``recv_channel_prefix_matrix``, 3 ``recv_src_idx``, 5 ``send_head``: None
          (tritonep has no channels; the source of each row is implied by the row order).
        4 ``is_token_in_rank``: bool ``[T, W]``, as passed to the dispatch.

    Attributes (tritonep's): ``owner`` (the compat Buffer's id), ``x_lane`` / ``x_handle`` (the EPBuffer and
    :class:`tritonep.DispatchHandle` of the rows), ``meta_lane`` / ``meta_handle`` (of the top-k ids and weights;
    None when the dispatch carried none or carried them as meta rows), ``slots`` (int32 ``[T, W]`` routing of the
    per-rank composition; ``[T + W*P, W]`` with meta rows, the tokens' first), ``num_tokens`` (T), ``num_rows`` (rows
    the dispatch returned: received rows, or ``num_worst_tokens``), ``topk`` (K of the carried top-k, or 0),
    ``worst`` (whether the dispatch used ``num_worst_tokens``), ``meta_rows`` (P: the top-k travelled as P meta rows
    per pair of ranks in the rows lane, whose pseudo-experts are then ``2r`` (token rows) and ``2r + 1`` (meta rows);
    0: the rows lane has one pseudo-expert per rank), ``carried`` (the lane of ``meta_rows`` carried the top-k with its
    rows instead: its layout holds the token rows alone, ``slots`` is ``[T, W]``).
    With meta rows, :meth:`repeated_slots` are the routes of the meta-lane dispatch a combine of ``topk_weights`` runs.
    """

    def __new__(cls, *, owner, x_lane, x_handle, meta_lane, meta_handle, slots, num_tokens, num_rows, topk,
                is_token_in_rank, worst, meta_rows=0, carried=False):
        h = tuple.__new__(cls, (None,) * 6)
        h.__dict__.update(owner=owner, x_lane=x_lane, x_handle=x_handle, meta_lane=meta_lane,
                          meta_handle=meta_handle, slots=slots, num_tokens=num_tokens, num_rows=num_rows, topk=topk,
                          is_token_in_rank=is_token_in_rank, worst=worst, meta_rows=meta_rows, carried=carried,
                          _rpm=None, _rc=None, _rep=None, _pc=None)
        return h

    def rank_counts(self) -> torch.Tensor:
        """int32 ``[W, W]``: token rows of source rank i to rank j in this dispatch (the exchange's counts of the
        token-row pseudo-experts; a strided view with meta rows; made once)."""
        c = self._rc
        if c is None:
            c = self.x_handle.counts
            c = self._rc = c[:, 0::2] if self.meta_rows else c
        return c

    def poison_counts(self) -> tuple:
        """``(counts, (W, stride0, stride1))``: :meth:`rank_counts` as the capacity poison launch reads it
        (:meth:`tritonep.compat.deep_ep.meta.MetaOps.poison`'s ``counts`` and ``shape``), made once. On the triton
        backend ``counts`` is the exchange's counts field of the rows lane's storage block as a
        :class:`tritonep.runtime.field_view.FieldView` (an address and a dtype: no tensor view made; the strides of
        the ``[W, E]`` field's token-row columns, ``(E, 2)`` with meta rows, ``(E, 1)`` without), the same address
        and strides :meth:`rank_counts` has; elsewhere :meth:`rank_counts` itself."""
        p = self._pc
        if p is None:
            xh = self.x_handle
            layout = getattr(xh, "layout", None)
            if self._rc is None and layout is not None and hasattr(layout, "field_view"):
                p = (layout.field_view(xh.store, "counts"), (layout.W, layout.E, 2 if self.meta_rows else 1))
            else:
                c = self.rank_counts()
                p = (c, (c.shape[0], c.stride(0), c.stride(1)))
            self._pc = p
        return p

    def repeated_slots(self, index: torch.Tensor, ranks2: torch.Tensor) -> torch.Tensor:
        """int32 ``[T, W*K]``: the token rows' slots, each repeated K times (K routes per (token, receiving rank),
        in the rows lane's order), given ``index`` = int64 ``[T, W*K]`` with ``index[t, j] = t*W + j // K`` on the
        slots' device: the routing of the meta-lane dispatch a combine of ``topk_weights`` runs after a meta-rows
        dispatch (made once per handle, on first use: one ``take`` of the slots, the meta rows' never read; the
        same values as ``slots[:T].index_select(1, arange(W).repeat_interleave(K))``). A ``carried`` handle's slots
        are the caller's ``is_token_in_rank`` (the lane's bool rank mask), which the caller may have overwritten
        since: its routing is the rows lane handle's own int32 copy of it (``2r`` where set, else -1, as
        :func:`slot_ids` makes them with ``ranks2``: int32 ``2 * arange(W)``), taken from there (the handle block's
        field as it lies, ``[T, W]`` row-major in its first ``T*W`` words: one slice)."""
        r = self._rep
        if r is None:
            xh = self.x_handle
            r = self._rep = (xh.layout.tensor(xh.store, "idx") if self.carried else self.slots).take(index)
        return r

    def _field(self, i: int):
        if i == 0:
            if self._rpm is None:
                self._rpm = torch.cumsum(self.rank_counts(), 0, dtype=torch.int32)
            return self._rpm
        if i == 4:
            return self.is_token_in_rank
        return None

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._field(j) for j in range(6)[i])
        if not -6 <= i < 6:
            raise IndexError("handle index out of range (a DeepEP normal handle has 6 fields)")
        return self._field(i % 6)

    def __iter__(self):
        return (self._field(j) for j in range(6))

    def __repr__(self):
        return f"NormalHandle(num_tokens={self.num_tokens}, num_rows={self.num_rows}, topk={self.topk})"


class LowLatencyHandle(tuple):
    """Handle of a low-latency dispatch: DeepEP's 5-tuple ``(src_info, layout_range,
    num_max_dispatch_tokens_per_rank, hidden, num_experts)``.

    ``src_info``: int32 ``[L, W*M]``, the source token index of each received row (valid in each expert's prefix
    ``[0, recv_count[e])``); ``layout_range``: int64 ``[L, W]``, ``(begin << 32) | count`` of each source rank's rows in
    each expert's prefix. Both are filled by the dispatch (or by its receive hook).

    Attributes (tritonep's): ``owner``, ``lane`` / ``ep_handle`` (the EPBuffer and its handle), ``num_tokens`` (T),
    ``topk`` (K), ``gather_index`` (int64 ``[R]``: the flat ``[L*W*M]`` slot of every row of the EPBuffer's
    expert-grouped layout; what the combine gathers), ``dropped`` (bool ``[R, 1]``: the rows that got no slot, or
    none to get: their combine rows are zeros), ``routes`` (the dispatch's ``topk_idx`` tensor, its version counter
    then, and its ids as they were: int ``[T, K]``, negatives as -1), ``combine_buffer`` (the tensor of
    :meth:`Buffer.get_next_low_latency_combine_buffer`, made on request).
    """

    def __new__(cls, src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts, *, owner, lane,
                ep_handle, num_tokens, topk, gather_index, dropped, routes):
        h = tuple.__new__(cls, (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts))
        h.__dict__.update(owner=owner, lane=lane, ep_handle=ep_handle, num_tokens=num_tokens, topk=topk,
                          gather_index=gather_index, dropped=dropped, routes=routes, combine_buffer=None)
        return h
