"""DeepEP's normal mode: how a rank whose input is refused still takes part in its peers' calls.

A refused dispatch or combine must run the same host collectives and signalling launches as its peers
(docs/protocols.md, host protocol rule): this mixin of :class:`tritonep.compat.deep_ep.normal.NormalMode` runs the
rows lane's (and where the peers go on, the meta lane's) call with an input EPBuffer refuses, so every peer sees the
refusal flag in the counts exchange and raises :class:`tritonep.errors.PeerInputError`, and this rank raises its own
typed error. It uses the lanes and caches :class:`NormalMode` owns (``lanes``, ``_spec_lane``, ``_meta_lane``,
``_last_*``, ``_rep_index``, ``_meta2_dispatch``).
"""

from __future__ import annotations

import torch

from ... import envs
from ...errors import TritonEPError
from .handles import slot_ids
from .packing import meta_rows_per_rank

__all__ = ["NormalRefusals"]


def _synced(sync_free: bool, sync_checks: int) -> bool:
    """Whether a refused EPBuffer call raises on every rank in the call itself (an eager call with host reads on:
    ``sync_checks``, the lanes' mode, not ``SYNC_NONE``): only then may the refusal path run a collective."""
    if sync_free or sync_checks == envs.SYNC_NONE:
        return False
    return not (_cuda() and torch._C._cuda_isCurrentStreamCapturing())


_HAS_CUDA: list = []


def _cuda() -> bool:
    """``torch.cuda.is_available()``, asked once (about 1 us a call)."""
    if not _HAS_CUDA:
        _HAS_CUDA.append(torch.cuda.is_available())
    return _HAS_CUDA[0]


class NormalRefusals:
    """The refusal half of :class:`tritonep.compat.deep_ep.normal.NormalMode` (see the module docstring)."""

    @staticmethod
    def _refused_dispatch(lane, sync_free: bool) -> None:
        """This rank's part in a lane's dispatch with an input EPBuffer refuses (float32 ids): its flag reaches every
        peer in the counts exchange, no row moves; this rank's own error (or a peer's) is swallowed here."""
        dev, slots = lane.device, lane.topk
        try:
            lane.dispatch(torch.empty(0, lane.hidden, dtype=torch.bfloat16, device=dev),
                          torch.empty(0, slots, dtype=torch.float32, device=dev),
                          torch.empty(0, slots, dtype=torch.float32, device=dev), sync_free=sync_free)
        except TritonEPError:
            pass

    def _meta_refused(self, K: int, worst: int) -> None:
        """Take part, refused, in the meta lane's dispatch of a call whose peers go on to it (they read nothing in
        the rows lane: sync-free, sync checks off or capture). ``K``: this rank's top-k width (0: no meta lane, as
        on the peers when they pass none)."""
        if not K:
            return
        try:
            lane = self._meta_lane(K, worst, 0)
        except TritonEPError:
            return  # its constructor's agreement raised on every rank
        self._refused_dispatch(lane, True)
        self.lanes.unread(lane)

    def _refuse(self, err: TritonEPError, spec, sync_free: bool, K: int):
        """This rank's input was refused before the exchange: run the rows lane's call with an input EPBuffer refuses
        (its flag reaches every peer in the counts exchange: they raise PeerInputError, no row moves), take part in
        the refusal's collective (synced) or in the meta lane's dispatch the peers go on to (they read nothing; none
        with meta rows), then raise ``err`` here. ``spec``: the call's ``(width, num_worst_tokens, K)`` as far as
        known (else the latest dispatch's: the lane the peers most likely use). With no lane to use yet (the first
        call), the lane is made with an invalid width: its constructor's agreement then raises on every rank
        (PeerConfigError there). ``K`` None (a top-k passed but none of its widths known, and no dispatch of this
        Buffer carried one): :meth:`_refuse_unknown_k`."""
        if K is None:
            if self._last_spec is not None:
                self._refuse_unknown_k(err, spec, sync_free)
            spec = None
        spec = spec or self._last_spec or (0, 0, 0)
        try:
            lane, P = self._spec_lane(spec, 0)
        except TritonEPError:
            raise err from None  # the constructor's agreement raised on every rank: nothing left to pair
        self._refused_dispatch(lane, sync_free)
        if _synced(sync_free, self.lanes.sync_checks):
            self.lanes.agree_regrow(0, True)
        else:
            self.lanes.unread(lane)
            if not P:
                self._meta_refused(K, spec[1])
        raise err

    def _refuse_unknown_k(self, err: TritonEPError, spec, sync_free: bool):
        """The refusal of a call that passes a top-k of unknown width (neither ``topk_idx`` nor ``topk_weights`` is
        2-D) on a Buffer none of whose dispatches carried one: the peers' lanes of their top-k were never made, so
        they make them now (a collective agreement each) unless their rows lane is the one of no top-k. Top-k width
        1 decides: when it already carries no meta rows, no width does (their rows grow with K), so the peers' rows
        lane is the ``("x", width, num_worst_tokens)`` one: this rank takes part there as refused (and then, if the
        peers go on to their new meta lane, in its construction with an invalid width); else it takes part in the
        construction of the peers' new meta-rows lane with an invalid width. Either way every rank raises: this one
        ``err``, the peers PeerInputError or PeerConfigError. (A width whose meta rows do not fit while width 1's
        do, a wide top-k at a narrow row: K >= 24 at row width 64, capacity 64 and 2 ranks, would still leave the
        peers on the rows lane of no top-k: not paired here.) Raises ``err``."""
        width, worst = (spec[0], spec[1]) if spec is not None else self._last_spec[:2]
        one = meta_rows_per_rank(self.lanes.tcap, 1, width, self.W, self.meta_rows_max_tokens)
        if not one:
            lane, _ = self._spec_lane((width, worst, 0), 0)
            self._refused_dispatch(lane, sync_free)
            if _synced(sync_free, self.lanes.sync_checks):
                self.lanes.agree_regrow(0, True)
                raise err
            self.lanes.unread(lane)
        try:  # the constructor's agreement raises on every rank (PeerConfigError on the peers)
            self._spec_lane((0, 0, 0), 0)
        except TritonEPError:
            pass
        raise err

    def _k_part(self, topk_idx, topk_weights) -> int | None:
        """The top-k width K a dispatch takes part with, also when it is refused (it picks the rows lane, and with it
        whether the top-k travels as meta rows: every rank must pick the peers' lane): ``topk_idx``'s second
        dimension; for a malformed ``topk_idx`` (not a 2-D tensor) ``topk_weights``'s, then the K of the latest
        dispatch that carried a top-k (the peers' most likely: they pass one too); 0 when neither is given; None with
        nothing to go by (no dispatch of this Buffer carried a top-k: :meth:`_refuse`)."""
        if topk_idx is None and topk_weights is None:
            return 0
        for t in (topk_idx, topk_weights):
            if isinstance(t, torch.Tensor) and t.dim() == 2:
                return t.shape[1]
        return self._last_topk

    def _cancel_combine(self, h, with_weights: bool, rows_done: bool = False) -> None:
        """This rank's combine input was refused: take part in the peers' combine as refused
        (:meth:`tritonep.EPBuffer.cancel_combine` on the rows lane, unless ``rows_done``) and, when the peers go on
        (their rows-lane combine reads nothing: a ``num_worst_tokens`` handle, sync checks off, capture) and pass
        ``topk_weights`` (``with_weights``: this rank's call passed them too), in their meta-lane backward
        (:meth:`tritonep.EPBuffer.cancel_dispatch_backward`), after a meta-rows dispatch also in the meta-lane
        dispatch before it (run as the peers run it: its routing is the dispatch's, not what was refused, so the
        peers' weights computed without this rank's rows stay exact where the backend keeps them). ``h``: the call's
        handle, or None for a handle this Buffer did not make (then the latest dispatch's lanes stand in: the peers'
        combine most likely is of it)."""
        if h is not None:
            lane, xh, meta, mh = h.x_lane, h.x_handle, h.meta_lane, h.meta_handle
            synced = xh.num_recv_rows is not None
            lazy = (h.topk, h.num_rows if h.worst else 0, h.slots, h.num_tokens, h.carried) \
                if h.meta_rows and h.topk else None
        else:
            lane, xh, meta, mh = self.lanes.peek(self._last_x_key), None, self._last_meta, None
            synced, lazy = self._last_synced, self._last_lazy
        if lane is None:
            return  # no dispatch yet: no peer can be in a combine of this Buffer either
        if not rows_done:
            try:
                lane.cancel_combine(xh)
            except TritonEPError:
                pass
        if synced and _synced(False, self.lanes.sync_checks):
            return  # the peers' eager combine raises PeerInputError: none of them goes on to the meta lane
        self.lanes.unread(lane)
        if with_weights and lazy is not None:  # the peers' meta-lane dispatch, then its backward (cancelled)
            K, worst, slots, T, carried = lazy  # the tokens' slots, each repeated K times, route the peers' dispatch
            index = self._rep_index(T, K, lane.device)
            ranks2 = self._ranks2_on(lane.device)
            routes = h.repeated_slots(index, ranks2) if h is not None else slot_ids(slots, carried, ranks2).take(index)
            meta, mh = self._meta2_dispatch(K, worst, routes, T, lane.device)
        if with_weights and meta is not None:
            try:
                meta.cancel_dispatch_backward(mh, with_weights=True)
            except TritonEPError:
                pass
            self.lanes.unread(meta)
