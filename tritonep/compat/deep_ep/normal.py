"""DeepEP's normal (high-throughput) mode on EPBuffers: layout, dispatch (fresh and cached), combine.

The composition (docs/deep_ep.md, "How it is built"): the rows travel in an EPBuffer whose experts are the ranks
(``num_experts = W``, ``topk = W``, slot r of token t = r where the token goes to rank r, weight 1,
:func:`tritonep.compat.deep_ep.packing.rank_slots`). Its expert-grouped output is then exactly DeepEP's: one row per
(token, receiving rank), ordered by (source rank, source token), the caller's own tensor when ``x`` is bf16 (no
copy); its combine is DeepEP's combine: the unweighted sum over the receiving ranks (fp32, ranks in order, one bf16
rounding). The top-k ids and weights travel one of two ways (docs/deep_ep.md, "How it is built"):

* meta rows (small token capacities: :func:`tritonep.compat.deep_ep.packing.meta_rows_per_rank`): in the rows lane
  itself, as P extra rows per pair of ranks (pseudo-tokens routed to a second pseudo-expert per rank, ``2r + 1``;
  the token rows go to ``2r``), so a dispatch is ONE EPBuffer dispatch; ``x`` is copied into the lane's input (with
  the meta rows, one launch), and a combine copies its rows into the lane's expert-output buffer (the lane's layout
  has the meta rows after them). DeepEP's combine of ``topk_weights`` then dispatches a meta lane (below) first.
  Where that lane carries a count routing with its rows (``EPBuffer.carries_topk``: the triton backend's one-launch
  decode tiles), no meta row travels: the ids and weights ride with each token's row in the lane's own launch
  (``dispatch(count_weights=..., count_out=...)``, :mod:`tritonep.backends.triton.kernels.carry`), the lane reads
  the caller's ``x`` as it is and its slots are the token rows' alone (``2r``), and a combine reads the caller's rows
  (no copy): a dispatch is ONE launch and a combine one, as an EPBuffer's;
* a meta lane: a second, narrow EPBuffer with the same routing, so the rows lane never copies ``x``. Its routing has
  K slots per rank, so each received token arrives there as K rows; the route weights are the top-k weights, which
  EPBuffer moves as float32 both ways (dispatch, and back unsummed through ``dispatch_backward`` for DeepEP's combine
  of ``topk_weights``).

Every call runs on the caller's current stream; an ``async_finish`` call returns an event recorded after its work.
"""

from __future__ import annotations

import torch

from ... import envs
from ...errors import CapacityError, ConfigError, InputError, PeerInputError, TritonEPError
from ...runtime.pool import remember
from .handles import NormalHandle
from .normal_checks import _ID_DTYPES, NormalChecks, _plain_dispatch, _plain_rows, _plain_weights, _tensor, _width
from .normal_refusal import NormalRefusals, _synced
from .packing import meta_rows_per_rank, meta_width, rank_slots, unpack_quantized

__all__ = ["NormalMode"]

# local experts per rank whose receive counts a meta-rows lane's dispatch sums in its exchange (EPConfig.
# count_columns: a few KiB of symmetric memory; a constant, so that every rank, a refused one included, makes the lane
# alike whatever its num_experts); more experts per rank take the unpacking's read instead
COUNT_COLUMNS = 1024


def _new_input(lane) -> torch.Tensor:
    """A meta-rows lane's input rows: bf16 ``[max_tokens_per_rank, H]``, kept per lane (each dispatch writes its
    rows, then the lane reads them, in stream order)."""
    return torch.empty(lane.max_tokens_per_rank, lane.hidden, dtype=torch.bfloat16, device=lane.device)


def _expert_out(lane) -> torch.Tensor:
    """A meta-rows lane's combine input: its expert-output buffer ``[max_recv_tokens, H]`` (the combine copies the
    caller's rows into its first rows; the lane's meta rows after them are read and their sums dropped)."""
    return lane.expert_out_buffer()


class NormalMode(NormalRefusals, NormalChecks):
    """The normal-mode calls of one compat Buffer (its lanes, rank and cached constant tensors)."""

    def __init__(self, owner, lanes, rank: int, world_size: int, meta_rows_max_tokens: int = 256,
                 carry_topk: bool = True):
        self.owner, self.lanes, self.rank, self.W = owner, lanes, rank, world_size
        self.meta_rows_max_tokens, self.carry_topk = meta_rows_max_tokens, carry_topk
        self._ranks = {}   # device -> int32 arange(W)
        self._ranks2 = {}  # device -> int32 2 * arange(W): the token-row pseudo-experts of a meta-rows lane
        self._ones = {}    # device -> float32 ones [n, W] (grown on demand)
        self._ones_v = {}  # (n, device) -> its first n rows (a view made once)
        self._ones_k = {}  # (n, K, device) -> float32 ones [n, W*K]: the meta lane's route weights of a combine
        self._rep_idx = {}  # (T, K, device) -> int64 [T, W*K] take index of NormalHandle.repeated_slots
        self._zeros = {}   # (rows, width, device) -> bf16 zeros: the meta lane's rows in a weights-only backward
        self._inputs = {}  # meta-rows lane key -> (lane, x_in [Tmax, H] bf16, {rows: view})
        self._eo = {}      # meta-rows lane -> its expert-output buffer
        self._wb = {}  # id(meta lane) -> [lane, float32 row weights [max_recv_tokens], rows written, {(rows, K): view}]
        self._plans = {}   # ((width, num_worst_tokens, K), capacity) -> (rows-lane key, P): _plan
        self._sends = {}   # (spec, T, E, device) -> a dispatch's derived values (_sent), this capacity's
        self._sends_tcap = None  # ... the shared capacity they were derived under
        self._last_x_key = None  # the latest dispatch's rows-lane key
        self._last_spec = None  # ... and what chose it: (width, num_worst_tokens, K)
        self._last_topk = None  # K of the latest dispatch that carried top-k (None: none did yet)
        self._meta_ops = {}  # device -> MetaOps (the layout and meta-unpacking launches, bound on first use)
        self._last_meta = None  # the latest dispatch's meta lane (None: it carried no top-k, or as meta rows)
        # (K, num_worst_tokens, slots, T, carried) of the latest dispatch when its top-k came as meta rows or carried
        self._last_lazy = None
        self._last_synced = True  # whether the latest dispatch's rows-lane handle is a synced one

    # -------------------------------------------------------------------------------------------------- shared
    def _ops(self, device):
        """The :class:`tritonep.compat.deep_ep.meta.MetaOps` of ``device`` (made on first use: importing the compat
        package imports no kernel module)."""
        ops = self._meta_ops.get(device)
        if ops is None:
            from .meta import MetaOps

            ops = self._meta_ops[device] = MetaOps(device, self.lanes.launch, self.rank, self.lanes.timeout_s)
        return ops

    def _ranks_on(self, device):
        t = self._ranks.get(device)
        if t is None:
            t = self._ranks[device] = torch.arange(self.W, dtype=torch.int32, device=device)
        return t

    def _ranks2_on(self, device):
        t = self._ranks2.get(device)
        if t is None:
            t = self._ranks2[device] = 2 * torch.arange(self.W, dtype=torch.int32, device=device)
        return t

    def _ones_rows(self, n: int, device):
        """float32 ones ``[n, W]`` (the lanes' route weights: DeepEP's unweighted sum), a view made once per n."""
        v = self._ones_v.get((n, device))
        if v is None:
            t = self._ones.get(device)
            if t is None or t.shape[0] < n:  # views made before keep the smaller tensor alive
                t = self._ones[device] = torch.ones(max(n, 64 if t is None else 2 * t.shape[0]), self.W,
                                                    dtype=torch.float32, device=device)
            v = self._ones_v[(n, device)] = t[:n]
        return v

    def _cached_view(self, cache: dict, key, lane, make, n: int):
        """Rows ``[0, n)`` of a tensor kept per meta-rows lane (``make(lane)``, remade when the key's lane changed:
        capacity growth), each view made once."""
        ent = cache.get(key)
        if ent is None or ent[0] is not lane:
            ent = cache[key] = (lane, make(lane), {})
        v = ent[2].get(n)
        if v is None:
            v = ent[2][n] = ent[1][:n]
        return ent[1], v

    def _zero_rows(self, n: int, width: int, device):
        key = (n, width, device)
        t = self._zeros.get(key)
        if t is None:
            t = self._zeros[key] = torch.zeros(n, width, dtype=torch.bfloat16, device=device)
        return t

    def _x_lane(self, key, T: int):
        width, worst = key[1], key[2]
        mrt = worst if worst else (lambda tcap: self.W * tcap)
        return self.lanes.get(key, T, num_experts=self.W, hidden=width, topk=self.W, max_recv_tokens=mrt,
                              count_columns=COUNT_COLUMNS)

    def _spec_lane(self, spec, T: int):
        """``(rows lane, P)`` of a dispatch of ``spec = (row width, num_worst_tokens, K)`` (made now if new:
        collective, the shared capacity agreed first if unset): with meta rows (``P > 0``,
        :func:`tritonep.compat.deep_ep.packing.meta_rows_per_rank` of the shared capacity) an EPBuffer of two
        pseudo-experts per rank (``2r`` token rows, ``2r + 1`` meta rows) and ``capacity + W*P`` tokens, else one
        pseudo-expert per rank (the meta lane carries the top-k). Every rank decides alike (the same capacity and
        spec)."""
        self.lanes.capacity(T)
        key, P = self._plan(spec)
        lane = self.lanes.peek(key)
        if lane is not None:
            return lane, P
        width, worst, K = spec
        if not P:
            return self._x_lane(key, T), 0
        return self._meta_rows_lane(key, T, width, worst, K, P, worst and self.carry_topk), P

    def _meta_rows_lane(self, key, T: int, width: int, worst: int, K: int, P: int, carried: bool):
        """A new meta-rows lane (collective): ``capacity + W*P`` tokens, and room for ``num_worst_tokens`` (``worst``)
        rows plus the ``W*P`` meta rows, or for every token of every rank plus them (``worst`` 0). ``carried``: a
        ``num_worst_tokens`` lane that may carry the top-k with its rows, which receives its token rows alone: its
        room is ``worst`` rows exactly (with the meta rows' room a call over ``worst`` by up to ``W*P`` rows would not
        be refused, its ids not -1, and no later read would raise it); a lane made so that cannot carry (not the
        decode tiles, the nccl backend: every rank's lane alike) is dropped and made with the meta rows' room."""
        extra, W = self.W * P, self.W
        if carried:
            lane = self.lanes.get(key, T, num_experts=2 * W, hidden=width, topk=W, count_columns=COUNT_COLUMNS,
                                  count_topk=K, max_tokens_per_rank=lambda tc: tc + extra, max_recv_tokens=worst)
            if lane.carries_topk:
                return lane
            self.lanes.drop(key)
        mrt = (lambda tc: worst + extra) if worst else (lambda tc: W * tc + extra)
        return self.lanes.get(key, T, num_experts=2 * W, hidden=width, topk=W, count_columns=COUNT_COLUMNS,
                              count_topk=K, max_tokens_per_rank=lambda tc: tc + extra, max_recv_tokens=mrt)

    def _plan(self, spec):
        """``(rows-lane key, P)`` of ``spec`` under the current shared capacity (agreed before: :meth:`_spec_lane`),
        worked out once per (spec, capacity)."""
        got = self._plans.get((spec, self.lanes.tcap))
        if got is None:
            width, worst, K = spec
            P = meta_rows_per_rank(self.lanes.tcap, K, width, self.W, self.meta_rows_max_tokens)
            got = self._plans[(spec, self.lanes.tcap)] = (("xm", width, worst, K) if P else ("x", width, worst)), P
        return got

    def _lane_key(self, spec):
        """The key of ``spec``'s rows lane under the current shared capacity (None before it is agreed)."""
        if spec is None or self.lanes.tcap is None:
            return None
        return self._plan(spec)[0]

    def _meta_lane(self, K: int, worst: int, T: int, rows2: bool = False):
        """The meta lane of top-k K (``rows2``: the one a combine of ``topk_weights`` dispatches after a meta-rows
        dispatch, routed like its rows lane: pseudo-experts ``2r``, ``2r + 1``; its rows carry nothing)."""
        key = ("meta2" if rows2 else "meta", K, worst)
        lane = self.lanes.peek(key)
        if lane is not None:  # made before: no arguments to build
            return lane
        mrt = worst * K if worst else (lambda tcap: self.W * tcap * K)
        return self.lanes.get(key, T, num_experts=(2 if rows2 else 1) * self.W,
                              hidden=8 if rows2 else meta_width(K), topk=self.W * K, max_recv_tokens=mrt)

    def _counted(self, lane, K: int, sync_free: bool, E: int) -> bool:
        """Whether a dispatch on ``lane`` carries the caller's ``topk_idx`` as the lane's count routing (DeepEP's
        per-expert counts with the lane's status): a synced call with top-k on a lane that sums them, at most
        :data:`COUNT_COLUMNS` experts per rank. The same on every rank (the spec, E and the lane's config)."""
        return bool(K) and not sync_free and lane.sums_counts and E // self.W <= COUNT_COLUMNS

    def _carried(self, lane, P: int, K: int, E: int) -> bool:
        """Whether a dispatch on the meta-rows lane ``lane`` (``P`` > 0) carries its top-k with the rows instead of as
        meta rows (``EPBuffer.carries_topk``, the count routing of at most :data:`COUNT_COLUMNS` experts per rank).
        The same on every rank (the lane's config, the spec and E)."""
        return bool(P and K) and self.carry_topk and lane.carries_topk and E // self.W <= COUNT_COLUMNS

    def _sent(self, spec, T: int, E: int, device):
        """What an earlier dispatch of ``(spec, T, E, device)`` worked out under the current shared capacity:
        ``(tcap, lane, key, P, x_in, lane_x, w, ops, counted, carried)`` (the lane, its key and P, with meta rows
        its kept input and the view of its first ``T + W*P`` rows (else None, None: the call's own rows travel), the
        route weights, the device's :class:`MetaOps` (None without top-k and meta rows), whether the call carries
        the count routing, whether its top-k rides with the rows: :meth:`_carried`), or None: not seen yet, the
        capacity grew (every entry is dropped then) or
        the key's lane is another one. The same values :meth:`_send` would derive again."""
        tcap = self.lanes.tcap
        if tcap != self._sends_tcap:
            self._sends, self._sends_tcap = {}, tcap
            return None
        got = self._sends.get((spec, T, E, device))
        if got is None or self.lanes.peek(got[2]) is not got[1]:
            return None
        return got

    def _derive(self, spec, lane, key, P: int, T: int, E: int, device) -> tuple:
        """What a dispatch of ``(spec, T, E, device)`` on ``lane`` (its ``key``, ``P`` meta rows per pair of ranks)
        works out before it packs, kept for :meth:`_sent` under the current shared capacity: ``(tcap, lane, key, P,
        x_in, lane_x, w, ops, counted, carried)`` (see there). With meta rows a token count over the capacity is
        refused here, taking part as refused (the lane's input holds the capacity).

        Raises:
            CapacityError: ``P > 0`` and ``T`` over the shared capacity (after taking part in the peers' call)."""
        tcap, K = self.lanes.tcap, spec[2]
        carried = self._carried(lane, P, K, E)
        if P and not carried and lane.carries_topk and spec[1] and self.carry_topk:
            # a num_worst_tokens lane sized for carrying (no meta rows' room) and a call that cannot carry (more
            # experts per rank than COUNT_COLUMNS): the meta rows go in a lane with their room (every rank alike)
            key = key + ("meta",)
            lane = self._meta_rows_lane(key, T, spec[0], spec[1], K, P, False)
        if P:
            if T > tcap:
                self._refused_dispatch(lane, bool(spec[1]))
                raise CapacityError(f"num_tokens={T} exceeds the Buffer's token capacity max_tokens_per_rank={tcap}",
                                    needed=T, available=tcap)
            if carried:  # the caller's rows travel as they are, the tokens' alone: no kept input
                n, x_in, lane_x = T, None, None
            else:
                n = T + self.W * P
                x_in, lane_x = self._cached_view(self._inputs, key, lane, _new_input, n)
        else:
            n, x_in, lane_x = T, None, None
        got = (tcap, lane, key, P, x_in, lane_x, self._ones_rows(n, device), self._ops(device) if P or K else None,
               self._counted(lane, K, bool(spec[1]), E) or carried, carried)
        if self._sends_tcap != tcap:
            self._sends, self._sends_tcap = {}, tcap
        self._sends[(spec, T, E, device)] = got
        return got

    def _send(self, spec, payload, itr, topk_idx, topk_weights, T: int, E: int, device):
        """The rows lane's dispatch of ``spec`` with this call's inputs packed for it, growing the shared capacity when
        a synced call was refused for it (then the lane, and whether it carries meta rows, is chosen again). Returns
        ``(lane, P, slots, meta inputs or None, Dispatched, carried)``: with meta rows (``P > 0``) one launch writes
        the lane's input (x and the meta rows) and slots, or where the lane carries the top-k with the rows
        (:meth:`_carried`) the slots are the token rows' (one torch op; the received ids and weights come in the
        handle's ``carried``); else one launch packs both lanes' inputs (with top-k; the meta lane's are returned for it). A call whose peers
        read nothing (sync-free, sync checks off, capture) and that EPBuffer refused on this rank still takes part in
        the meta lane before raising (:meth:`_meta_refused`): the peers' dispatch goes on to it."""
        worst, K = spec[1], spec[2]
        sync_free = bool(worst)
        for attempt in range(2):
            got = self._sent(spec, T, E, device)
            if got is None:
                lane, P = self._spec_lane(spec, T)
                key = self._plan(spec)[0]
            else:
                lane, key, P = got[1], got[2], got[3]
            self._last_x_key, self._last_spec = key, spec
            try:
                meta = None
                if got is None:  # first seen under this capacity and lane: worked out (and kept) now
                    got = self._derive(spec, lane, key, P, T, E, device)
                    lane, key = got[1], got[2]
                    self._last_x_key = key
                _, _, _, _, x_in, lane_x, w, ops, counted, carried = got
                if carried:  # the ids and weights ride with the rows, in the lane's own launch
                    slots = itr  # the lane's bool rank mask (route r: pseudo-expert 2r), read by its kernel
                    return lane, P, slots, None, lane.dispatch(payload, slots, w, sync_free=sync_free,
                                                               count_ids=topk_idx, count_experts=E,
                                                               count_weights=topk_weights), True
                if P:  # x and the meta rows into the lane's input, and the slots: one launch
                    slots = ops.pack_rows(payload, itr, topk_idx, topk_weights, x_in, E, P)
                else:
                    lane_x = payload
                    if K:  # both lanes' inputs in one launch (twin: packing.pack_torch)
                        slots, *meta = ops.pack(itr, topk_idx, topk_weights)
                    else:
                        slots = rank_slots(itr, self._ranks_on(device))
                if counted:
                    # DeepEP's per-expert receive counts, exchanged and summed in the lane's own exchange (its count
                    # routing: handle.count_sums where the lane computes them, the decode tiles), read with its status
                    return lane, P, slots, meta, lane.dispatch(lane_x, slots, w, count_ids=topk_idx,
                                                               count_experts=E), False
                return lane, P, slots, meta, lane.dispatch(lane_x, slots, w, sync_free=sync_free), False
            except (InputError, CapacityError) as e:
                if attempt:
                    raise
                if not _synced(sync_free, self.lanes.sync_checks):
                    if not P:
                        self._meta_refused(K, worst)
                    self.lanes.unread(lane)
                    raise
                own = not isinstance(e, (PeerInputError, CapacityError))
                if not self.lanes.agree_regrow(T, own):
                    raise

    # -------------------------------------------------------------------------------------------------- layout
    def layout(self, topk_idx, num_experts):
        """``get_dispatch_layout``: one launch of :meth:`tritonep.compat.deep_ep.meta.MetaOps.layout` (twin:
        :func:`tritonep.compat.deep_ep.packing.layout_torch`)."""
        _tensor(topk_idx, "topk_idx", 2, _ID_DTYPES)
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % self.W:
            raise InputError(f"num_experts={num_experts!r} must be a positive multiple of the group size {self.W}")
        return self._ops(topk_idx.device).layout(topk_idx if topk_idx.is_contiguous() else topk_idx.contiguous(),
                                                 num_experts, self.W)

    # ------------------------------------------------------------------------------------------------ dispatch
    def dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                 topk_weights, expert_alignment: int, num_worst_tokens: int, refused=None):
        """DeepEP's ``Buffer.dispatch`` (intranode semantics; see the Buffer's docstring). Returns
        ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``. ``refused``: an
        error the Buffer found in this call's other arguments (raised after taking part, as any refusal here).

        A synced call (no ``num_worst_tokens``, host reads on) first reads the lanes that ran calls nobody read
        (:meth:`tritonep.compat.deep_ep.lanes.Lanes.check`): a refusal recorded there raises on every rank before
        this call moves anything. A ``num_worst_tokens`` call refused for capacity returns NaN rows and weights
        (:meth:`tritonep.compat.deep_ep.meta.MetaOps.poison`)."""
        if handle is not None:
            return self._cached(x, handle, topk_idx, topk_weights, refused)
        worst = num_worst_tokens
        plain = None if refused is not None else _plain_dispatch(
            x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, topk_idx, topk_weights, worst,
            expert_alignment, self.W)
        # the top-k width a refused call takes part with (the peers' lanes), whatever failed below
        k_part = plain[3] if plain is not None else self._k_part(topk_idx, topk_weights)
        eager = _synced(False, self.lanes.sync_checks)
        if isinstance(worst, int) and worst == 0 and eager and self.lanes.pending:
            key = self._lane_key((_width(x), 0, k_part or 0))
            self.lanes.check(skip=self.lanes.peek(key) if key is not None else None)
        if plain is not None:  # every check of _checked passes: the same values, without the checks' calls
            payload, T, E, K, dev, width = plain
            quant, spec = None, (width, worst, k_part)
        else:
            payload, T, E, K, dev, width, quant, spec = self._checked(
                x, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert, topk_idx, topk_weights, worst,
                expert_alignment, refused, k_part)
        lane, P, slots, meta_in, out, carried = self._send(spec, payload, is_token_in_rank, topk_idx, topk_weights,
                                                           T, E, dev)
        R = out.handle.num_recv_rows
        if worst:
            R = worst
        elif R is None:  # host reads off (TRITONEP_SYNC_CHECKS=0): the rows are known on the device only
            R = int(out.expert_offsets[0].item())
        elif not carried:
            R -= self.W * P  # the meta rows follow the token rows
        rows = out.x[:R] if out.x.shape[0] != R else out.x

        meta_lane = meta_handle = recv_idx = recv_w = None
        sums = out.handle.count_sums  # DeepEP's per-expert counts, from the rows lane's count routing (None: not)
        if carried:  # the lane's launch wrote them beside the rows (rows past the received ones: -1 and 0)
            recv_idx, recv_w = out.handle.carried
            if out.handle.num_recv_rows is None:  # rows unknown to the lane's host (num_worst_tokens, host reads
                recv_idx, recv_w = recv_idx[:R], recv_w[:R]  # off): its receive capacity's, cut to the call's
            hist = None if sums is not None or worst else \
                [0] + torch.bincount(recv_idx[recv_idx >= 0].to(torch.int64), minlength=E // self.W).tolist()
        elif P:  # the ids and weights came with the rows: unpacked from the meta rows (one launch); the per-expert
            # counts came with the lane's status (count_sums), else the unpacking's histogram is read through pinned
            # memory (worst: no read, the tokens past the received ones get ids -1, weight 0)
            recv_idx, recv_w, hist = self._ops(dev).unpack_rows(out.x, out.expert_offsets, R, K, E // self.W, self.W,
                                                                P, topk_idx.dtype, read=not worst and sums is None)
        elif K:
            meta_lane = self._meta_lane(K, worst, T)
            mout = meta_lane.dispatch(*meta_in, sync_free=True)
            meta_handle = mout.handle
            # worst: the tokens past the received ones (their lane rows are unspecified) get ids -1 and weight 0, and
            # no host read; else the counts came with the rows lane's status (count_sums), or the histogram arrives
            # as a list through pinned memory (no device-to-host copy)
            recv_idx, recv_w, hist = self._ops(dev).unpack_meta(
                mout.x, mout.weights, R, K, self.rank, E // self.W, topk_idx.dtype,
                live=out.expert_offsets[-1] if worst else None, read=not worst and sums is None)
        if worst or not eager:  # nobody read these lanes' status: the next synced call or check() does
            self.lanes.unread(lane, meta_lane)
        h = NormalHandle(owner=self.owner, x_lane=lane, x_handle=out.handle, meta_lane=meta_lane,
                         meta_handle=meta_handle, slots=slots, num_tokens=T, num_rows=R, topk=K,
                         is_token_in_rank=is_token_in_rank, worst=bool(worst), meta_rows=P, carried=carried)
        if worst:  # refused for capacity (no host read tells): NaN rows and weights, they cannot pass for a result
            c, shape = h.poison_counts()
            self._ops(rows.device).poison(c, worst, rows, recv_w, shape)
        recv_x = unpack_quantized(rows, *quant) if quant is not None else rows
        if worst:
            counts = []
        elif K:
            counts = hist[1:] if sums is None else sums[:]
        else:  # no ids travelled: DeepEP's list is the group's sum of num_tokens_per_expert (one all_reduce)
            counts = self._group_counts(num_tokens_per_expert)
        if topk_idx is not None and not K:  # DeepEP's top-k width 0: ids and weights [R, 0], not None
            recv_idx = torch.empty(R, 0, dtype=topk_idx.dtype, device=rows.device)
            recv_w = torch.empty(R, 0, dtype=torch.float32, device=rows.device)
        if expert_alignment > 1:
            a = expert_alignment
            counts = [(c + a - 1) // a * a for c in counts]
        self._last_meta, self._last_synced = meta_lane, out.handle.num_recv_rows is not None
        self._last_lazy = (K, worst, slots, T, carried) if P and K else None
        if K:
            self._last_topk = K
        return recv_x, recv_idx, recv_w, counts, h

    def _group_counts(self, num_tokens_per_expert) -> list:
        import torch.distributed as dist

        total = num_tokens_per_expert.to(torch.int64).clone()
        dist.all_reduce(total, group=self.lanes.group)
        L = total.shape[0] // self.W
        return total[self.rank * L:(self.rank + 1) * L].tolist()

    def _own(self, h) -> bool:
        return isinstance(h, NormalHandle) and h.owner == self.owner

    def _cached(self, x, h, topk_idx, topk_weights, refused):
        """Cached dispatch: the rows of ``x`` along the handle's layout (no ids, weights or counts: None). Sync-free
        (no host read): a refused input still takes part in the lane's exchange (the peers' next synced call or
        ``check()`` raises PeerInputError), then raises here."""
        own = self._own(h)
        try:
            if refused is not None:
                raise refused
            if not own:
                raise InputError("handle must be a NormalHandle made by this Buffer's dispatch")
            if topk_idx is not None or topk_weights is not None:
                raise InputError("a cached dispatch (handle=...) takes no topk_idx / topk_weights (as DeepEP)")
            payload, width, quant = self._payload(x)
            if payload.shape[0] != h.num_tokens or width != h.x_lane.hidden:
                raise InputError(f"cached dispatch: x has {payload.shape[0]} rows of {width}, the handle's dispatch "
                                 f"had {h.num_tokens} of {h.x_lane.hidden}")
        except TritonEPError:
            lane = h.x_lane if own else self.lanes.peek(self._last_x_key)
            if lane is not None:  # the lane the peers' cached dispatch most likely runs on
                self._refused_dispatch(lane, True)
                self.lanes.unread(lane)
            raise
        slots = h.slots[:h.num_tokens] if h.meta_rows and not h.carried else h.slots  # the token rows: the same again
        out = h.x_lane.dispatch(payload, slots, self._ones_rows(h.num_tokens, payload.device), sync_free=True)
        self.lanes.unread(h.x_lane)
        rows = out.x[:h.num_rows]
        return (unpack_quantized(rows, *quant) if quant is not None else rows), None, None, None, None

    # ------------------------------------------------------------------------------------------------- combine
    def combine(self, x, h, topk_weights, bias, refused=None):
        """DeepEP's ``Buffer.combine``: ``(combined_x [T, H], combined_topk_weights [T, K] or None)``.

        A refused input (or handle, or ``refused``: an error the Buffer found in the call's other arguments) still
        takes part (:meth:`_cancel_combine`), then raises here: the peers' combine of a synced dispatch raises
        PeerInputError naming this rank; otherwise their output is NaN and their next synced dispatch or
        ``check()`` raises it."""
        own = self._own(h)
        if not (refused is None and own and bias is None and _plain_rows(x, h)
                and (topk_weights is None or _plain_weights(topk_weights, h))):
            biases = self._combine_checked(x, h, topk_weights, bias, refused, own)
        else:  # the common calls (bf16 rows of the dispatch's shape, on its device, float32 weights of its [rows, K]
            biases = ()  # or none, no bias): every check of _combine_checked passes
        # whether the rows lane's combine reads its status
        reads = h.x_handle.num_recv_rows is not None and _synced(False, self.lanes.sync_checks)
        lane, T = h.x_lane, h.num_tokens
        if h.meta_rows and not h.carried or h.x_handle.num_recv_rows is None and h.num_rows != lane.max_recv_tokens:
            # the lane's layout holds the meta rows after the token rows, or its handle is a sync-free one whose
            # combine takes the lane's max_recv_tokens rows (host reads off, TRITONEP_SYNC_CHECKS=0: the caller has
            # the R rows received): the caller's rows go into the lane's expert-output buffer (one copy: a bound
            # launch, MetaOps.copy_rows); the meta rows' sums (rows T.. of the lane's output) are dropped. x is
            # checked above to hold h.num_rows rows (no torch call here: the host path's budget counts them)
            eo = self._eo.get(lane)
            if eo is None:
                eo = self._eo[lane] = _expert_out(lane)
            self._ops(lane.device).copy_rows(x if x.is_contiguous() else x.contiguous(), eo)
        else:
            eo = x
        try:
            y = lane.combine(eo, h.x_handle)
        except (InputError, ConfigError) as e:
            if isinstance(e, PeerInputError):
                raise
            self._cancel_combine(h, topk_weights is not None, rows_done=True)  # EPBuffer took part for the rows
            raise
        if h.meta_rows and not h.carried:
            y = y[:T]
        w = meta = None
        if topk_weights is not None and not h.topk:  # top-k width 0 (the check passed [rows, 0]): [T, 0]
            w = torch.empty(T, 0, dtype=torch.float32, device=y.device)
        elif topk_weights is not None:
            K = h.topk
            if h.meta_rows:  # the top-k came as meta rows: a meta lane routed like the rows lane takes the weights
                # back (its dispatch moves no payload: 16-byte rows)
                meta, mh = self._meta2_dispatch(K, h.num_rows if h.worst else 0,
                                                h.repeated_slots(self._rep_index(T, K, lane.device),
                                                                 self._ranks2_on(lane.device)), T, lane.device)
            else:
                meta, mh = h.meta_lane, h.meta_handle
            # the weights go back unsummed on the meta lane's routes (one per (token, rank, slot)), the meta lane's
            # handle is sync-free: its backward reads rows up to the lane's receive capacity
            wback = self._weights_back(meta, h.num_rows, K, topk_weights)
            zero_rows = self._zero_rows(meta.max_recv_tokens, meta.hidden, lane.device)
            _, per_slot = meta.dispatch_backward(zero_rows, wback, mh)  # [T, W*K]
            w = per_slot.view(T, self.W, K).sum(1)  # DeepEP: the ranks' values summed in float32
        if not reads:  # nobody read the status of these calls: the next synced call or check() does
            self.lanes.unread(lane, meta)
        if biases:  # DeepEP adds the biases to the fp32 sum before its one rounding; here after it (one more)
            yf = y.float()
            for b in biases:
                yf = yf + b.float()
            y = yf.to(torch.bfloat16)
        if h.worst:  # a dispatch refused for capacity: NaN, it cannot pass for a result (MetaOps.poison)
            c, shape = h.poison_counts()
            self._ops(y.device).poison(c, h.num_rows, y, w, shape)
        return y, w

    def _meta2_dispatch(self, K: int, worst: int, routes, T: int, device):
        """``(lane, handle)`` of the meta-lane dispatch a combine of ``topk_weights`` runs after a meta-rows dispatch
        (``routes``: int32 ``[T, W*K]``, that dispatch's :meth:`NormalHandle.repeated_slots`): K routes per (token,
        receiving rank) in the rows lane's order, sync-free, no payload (zero rows of 16 bytes), so its
        backward takes each received row's K weights back unsummed."""
        meta = self._meta_lane(K, worst, T, rows2=True)
        return meta, meta.dispatch(self._zero_rows(T, meta.hidden, device), routes,
                                   self._ones_wk(T, K, device), sync_free=True).handle

    def _rep_index(self, T: int, K: int, device) -> torch.Tensor:
        """int64 ``[T, W*K]`` on ``device``, ``[t, j] = t*W + j // K``: the elements of a dispatch's slots ``[>= T, W]``
        that :meth:`NormalHandle.repeated_slots` takes (made once per (T, K, device); at most 64 kept, then they are
        made again: meta rows only, so T is small)."""
        c = self._rep_idx.get((T, K, device))
        if c is None:
            W = self.W
            idx = torch.arange(T, device=device).unsqueeze(1) * W + torch.arange(W, device=device).repeat_interleave(K)
            c = remember(self._rep_idx, (T, K, device), idx.contiguous(), 64)
        return c

    def _weights_back(self, meta, rows: int, K: int, topk_weights):
        """The row weights of a combine's meta-lane backward: float32 ``[meta.max_recv_tokens]`` (the meta lane's
        handle is sync-free: its backward takes rows up to the lane's receive capacity), ``topk_weights [rows, K]``
        in its first ``rows*K`` (one per received meta row: (source rank, token, slot) order), zeros after. Kept per
        meta lane and zeroed once; a call writing fewer rows than the previous one zeroes the rows between, so the
        buffer holds what a fresh zeroed one would (no allocation and no fill per call). Reused in stream order, as
        the lanes' own buffers."""
        ent = self._wb.get(id(meta))
        if ent is None or ent[0] is not meta:
            ent = self._wb[id(meta)] = [meta, torch.zeros(meta.max_recv_tokens, dtype=torch.float32,
                                                          device=topk_weights.device), 0, {}]
        buf, m = ent[1], rows * K
        if ent[2] > m:
            buf[m:ent[2]].zero_()
        ent[2] = m
        v = ent[3].get((rows, K))
        if v is None:
            v = ent[3][(rows, K)] = buf[:m].view(rows, K)
        v.copy_(topk_weights)
        return buf

    def _ones_wk(self, n: int, K: int, device):
        """float32 ones ``[n, W*K]``: the route weights of a combine's meta-lane dispatch (made once per shape)."""
        t = self._ones_k.get((n, K, device))
        if t is None:
            t = self._ones_k[(n, K, device)] = torch.ones(n, self.W * K, dtype=torch.float32, device=device)
        return t
