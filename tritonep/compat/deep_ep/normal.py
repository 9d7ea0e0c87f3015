"""DeepEP's normal (high-throughput) mode on EPBuffers: layout, dispatch (fresh and cached), combine.

The composition (docs/deep_ep.md, "How it is built"): the rows travel in an EPBuffer whose experts are the ranks
(``num_experts = W``, ``topk = W``, slot r of token t = r where the token goes to rank r, weight 1,
:func:`tritonep.compat.deep_ep.packing.rank_slots`). Its expert-grouped output is then exactly DeepEP's: one row per
(token, receiving rank), ordered by (source rank, source token), the caller's own tensor when ``x`` is bf16 (no
copy); its combine is DeepEP's combine: the unweighted sum over the receiving ranks (fp32, ranks in order, one bf16
rounding). The top-k ids and weights travel in a second, narrow EPBuffer with the same routing (the "meta lane"),
so the rows lane never copies ``x`` (the alternative, widening every row by the meta columns, costs a copy of the rows on
both sides of both calls: docs/deep_ep.md). Its routing has K slots per rank, so each received token arrives there
as K rows; the route weights are the top-k weights, which EPBuffer moves as float32 both ways (dispatch, and back
unsummed through ``dispatch_backward`` for DeepEP's combine of ``topk_weights``).

Every call runs on the caller's current stream; an ``async_finish`` call returns an event recorded after its work.
"""

from __future__ import annotations

import torch

from ... import envs
from ...errors import CapacityError, InputError, PeerInputError, TritonEPError
from .handles import NormalHandle
from .packing import meta_width, pack_quantized, rank_slots, unpack_quantized

__all__ = ["NormalMode"]

_ID_DTYPES = (torch.int32, torch.int64)


def _synced(sync_free: bool, sync_checks: int) -> bool:
    """Whether a refused EPBuffer call raises on every rank in the call itself (an eager call with host reads on:
    ``sync_checks``, the lanes' mode, not ``SYNC_NONE``): only then may the refusal path run a collective."""
    if sync_free or sync_checks == envs.SYNC_NONE:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _tensor(v, name: str, dims: int, dtypes=None) -> torch.Tensor:
    if not isinstance(v, torch.Tensor) or v.dim() != dims:
        raise InputError(f"{name} must be a {dims}-D torch.Tensor, got "
                         f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
    if dtypes is not None and v.dtype not in dtypes:
        raise InputError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {v.dtype}")
    return v


class NormalMode:
    """The normal-mode calls of one compat Buffer (its lanes, rank and cached constant tensors)."""

    def __init__(self, owner, lanes, rank: int, world_size: int):
        self.owner, self.lanes, self.rank, self.W = owner, lanes, rank, world_size
        self._ranks = {}   # device -> int32 arange(W)
        self._ones = {}    # device -> float32 ones [n, W] (grown on demand)
        self._zeros = {}   # (rows, width, device) -> bf16 zeros: the meta lane's rows in a weights-only backward
        self._last_x_key = None
        self._meta_ops = {}  # device -> MetaOps (the layout and meta-unpacking launches, bound on first use)

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

    def _ones_rows(self, n: int, device):
        t = self._ones.get(device)
        if t is None or t.shape[0] < n:
            t = self._ones[device] = torch.ones(max(n, 64 if t is None else 2 * t.shape[0]), self.W,
                                                dtype=torch.float32, device=device)
        return t[:n]

    def _zero_rows(self, n: int, width: int, device):
        key = (n, width, device)
        t = self._zeros.get(key)
        if t is None:
            t = self._zeros[key] = torch.zeros(n, width, dtype=torch.bfloat16, device=device)
        return t

    def _x_lane(self, key, T: int):
        width, worst = key[1], key[2]
        mrt = worst if worst else (lambda tcap: self.W * tcap)
        return self.lanes.get(key, T, num_experts=self.W, hidden=width, topk=self.W, max_recv_tokens=mrt)

    def _meta_lane(self, K: int, worst: int, T: int):
        key = ("meta", K, worst)
        mrt = worst * K if worst else (lambda tcap: self.W * tcap * K)
        return self.lanes.get(key, T, num_experts=self.W, hidden=meta_width(K), topk=self.W * K,
                              max_recv_tokens=mrt)

    def _send(self, key, payload, slots, T: int, sync_free: bool, device):
        """One rows-lane dispatch, growing the shared capacity when a synced call was refused for it."""
        lane = self._x_lane(key, T)
        self._last_x_key = key
        try:
            return lane, lane.dispatch(payload, slots, self._ones_rows(T, device), sync_free=sync_free)
        except (InputError, CapacityError) as e:
            if not _synced(sync_free, self.lanes.sync_checks):
                raise
            own = not isinstance(e, (PeerInputError, CapacityError))
            if not self.lanes.agree_regrow(T, own):
                raise
        lane = self._x_lane(key, T)
        return lane, lane.dispatch(payload, slots, self._ones_rows(T, device), sync_free=sync_free)

    def _refuse(self, err: TritonEPError, x_key, sync_free: bool):
        """This rank's input was refused before the exchange: run the rows lane's call with an input EPBuffer refuses
        (its flag reaches every peer in the counts exchange: they raise PeerInputError, no row moves), take part in
        the refusal's collective, then raise ``err`` here. With no lane to use yet (the first call), the lane is made
        with an invalid width: its constructor's agreement then raises on every rank (PeerConfigError there)."""
        key = x_key or self._last_x_key or ("x", 0, 0)
        try:
            lane = self._x_lane(key, 0)
        except TritonEPError:
            raise err from None  # the constructor's agreement raised on every rank: nothing left to pair
        try:
            dev = lane.device
            lane.dispatch(torch.empty(0, key[1], dtype=torch.bfloat16, device=dev),
                          torch.empty(0, self.W, dtype=torch.float32, device=dev),
                          torch.empty(0, self.W, dtype=torch.float32, device=dev), sync_free=sync_free)
        except TritonEPError:
            pass
        if _synced(sync_free, self.lanes.sync_checks):
            self.lanes.agree_regrow(0, True)
        raise err

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
                 topk_weights, expert_alignment: int, num_worst_tokens: int):
        """DeepEP's ``Buffer.dispatch`` (intranode semantics; see the Buffer's docstring). Returns
        ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``."""
        if handle is not None:
            return self._cached(x, handle)
        worst = num_worst_tokens
        x_key = None
        try:
            payload, width, quant = self._payload(x)
            x_key = ("x", width, worst)
            T = payload.shape[0]
            if not isinstance(worst, int) or isinstance(worst, bool) or worst < 0:
                raise InputError(f"num_worst_tokens={worst!r} must be an int >= 0")
            if not isinstance(expert_alignment, int) or isinstance(expert_alignment, bool) or expert_alignment < 1:
                raise InputError(f"expert_alignment={expert_alignment!r} must be a positive int")
            _tensor(is_token_in_rank, "is_token_in_rank", 2, (torch.bool,))
            if tuple(is_token_in_rank.shape) != (T, self.W):
                raise InputError(f"is_token_in_rank must be [num_tokens={T}, num_ranks={self.W}], got "
                                 f"{tuple(is_token_in_rank.shape)}")
            if num_tokens_per_rank is None or num_tokens_per_expert is None:
                raise InputError("dispatch without a handle needs num_tokens_per_rank and num_tokens_per_expert "
                                 "(get_dispatch_layout gives them)")
            _tensor(num_tokens_per_expert, "num_tokens_per_expert", 1)
            E = num_tokens_per_expert.shape[0]
            if E < 1 or E % self.W:
                raise InputError(f"num_tokens_per_expert has {E} experts, not a positive multiple of {self.W}")
            if (topk_idx is None) != (topk_weights is None):
                raise InputError("topk_idx and topk_weights must be given together")
            K = 0
            if topk_idx is not None:
                _tensor(topk_idx, "topk_idx", 2, _ID_DTYPES)
                _tensor(topk_weights, "topk_weights", 2, (torch.float32,))
                K = topk_idx.shape[1]
                if topk_idx.shape[0] != T or tuple(topk_weights.shape) != (T, K):
                    raise InputError(f"topk_idx {tuple(topk_idx.shape)} and topk_weights "
                                     f"{tuple(topk_weights.shape)} must both be [num_tokens={T}, K]")
            elif worst:
                raise InputError("num_worst_tokens needs topk_idx and topk_weights (as DeepEP)")
            for name, t in (("is_token_in_rank", is_token_in_rank), ("topk_idx", topk_idx),
                            ("topk_weights", topk_weights)):
                if t is not None and t.device != payload.device:
                    raise InputError(f"{name} is on {t.device}, x on {payload.device}")
        except TritonEPError as e:
            self._refuse(e, x_key, bool(worst) if isinstance(worst, int) else False)

        dev = payload.device
        if K:  # both lanes' inputs in one launch (twin: packing.pack_torch)
            slots, mrows, mslots, mw = self._ops(dev).pack(is_token_in_rank, topk_idx, topk_weights)
        else:
            slots = rank_slots(is_token_in_rank, self._ranks_on(dev))
        lane, out = self._send(x_key, payload, slots, T, bool(worst), dev)
        R = out.handle.num_recv_rows
        if worst:
            R = worst
        elif R is None:  # host reads off (TRITONEP_SYNC_CHECKS=0): the rows are known on the device only
            R = int(out.expert_offsets[-1].item())
        rows = out.x[:R] if out.x.shape[0] != R else out.x
        recv_x = unpack_quantized(rows, *quant) if quant is not None else rows

        meta_lane = meta_handle = recv_idx = recv_w = None
        if K:
            meta_lane = self._meta_lane(K, worst, T)
            mout = meta_lane.dispatch(mrows, mslots, mw, sync_free=True)
            meta_handle = mout.handle
            # worst: the tokens past the received ones (their lane rows are unspecified) get ids -1 and weight 0, and
            # no host read; else the histogram arrives as a list through pinned memory (no device-to-host copy)
            recv_idx, recv_w, hist = self._ops(dev).unpack_meta(
                mout.x, mout.weights, R, K, self.rank, E // self.W, topk_idx.dtype,
                live=out.expert_offsets[-1] if worst else None, read=not worst)
        if worst:
            counts = []
        elif K:
            counts = hist[1:]
        else:  # no ids travelled: DeepEP's list is the group's sum of num_tokens_per_expert (one all_reduce)
            counts = self._group_counts(num_tokens_per_expert)
        if expert_alignment > 1:
            a = expert_alignment
            counts = [(c + a - 1) // a * a for c in counts]
        h = NormalHandle(owner=self.owner, x_lane=lane, x_handle=out.handle, meta_lane=meta_lane,
                         meta_handle=meta_handle, slots=slots, num_tokens=T, num_rows=R, topk=K,
                         is_token_in_rank=is_token_in_rank, worst=bool(worst))
        return recv_x, recv_idx, recv_w, counts, h

    def _group_counts(self, num_tokens_per_expert) -> list:
        import torch.distributed as dist

        total = num_tokens_per_expert.to(torch.int64).clone()
        dist.all_reduce(total, group=self.lanes.group)
        L = total.shape[0] // self.W
        return total[self.rank * L:(self.rank + 1) * L].tolist()

    def _payload(self, x):
        """``x`` -> (bf16 rows to send, their width, None or (x dtype, scale dtype, scales per row))."""
        if isinstance(x, tuple):
            if len(x) != 2:
                raise InputError(f"x as a tuple must be (x_fp8, scales), got {len(x)} elements")
            xq, sc = x
            _tensor(xq, "x[0]", 2)
            _tensor(sc, "x[1] (scales)", 2)
            if xq.element_size() != 1:
                raise InputError(f"quantized x must have a one-byte dtype, got {xq.dtype}")
            if sc.element_size() != 4 or sc.shape[0] != xq.shape[0]:
                raise InputError(f"scales must be [num_tokens={xq.shape[0]}, S] of a 4-byte dtype (float32 or "
                                 f"int32 UE8M0), got {sc.dtype} {tuple(sc.shape)}")
            H, S = xq.shape[1], sc.shape[1]
            if H % 2 or 4 * S > H:
                raise InputError(f"quantized rows of {H} elements with {S} scales do not fit a {H}-element bf16 "
                                 f"row (need an even hidden and 4 * scales <= hidden)")
            if sc.device != xq.device:
                raise InputError(f"scales on {sc.device}, x on {xq.device}")
            return pack_quantized(xq, sc), H, (xq.dtype, sc.dtype, S)
        _tensor(x, "x", 2)
        if x.dtype != torch.bfloat16:
            raise InputError(f"x must be bfloat16 (or a (one-byte x, scales) tuple), got {x.dtype}")
        return (x if x.is_contiguous() else x.contiguous()), x.shape[1], None

    def _cached(self, x, h):
        """Cached dispatch: the rows of ``x`` along the handle's layout (no ids, weights or counts: None)."""
        payload, width, quant = self._payload(x)
        if payload.shape[0] != h.num_tokens or width != h.x_lane.hidden:
            raise InputError(f"cached dispatch: x has {payload.shape[0]} rows of {width}, the handle's dispatch had "
                             f"{h.num_tokens} of {h.x_lane.hidden}")
        out = h.x_lane.dispatch(payload, h.slots, self._ones_rows(h.num_tokens, payload.device), sync_free=True)
        rows = out.x[:h.num_rows]
        return (unpack_quantized(rows, *quant) if quant is not None else rows), None, None, None, None

    # ------------------------------------------------------------------------------------------------- combine
    def combine(self, x, h, topk_weights, bias):
        """DeepEP's ``Buffer.combine``: ``(combined_x [T, H], combined_topk_weights [T, K] or None)``."""
        _tensor(x, "x", 2, (torch.bfloat16,))
        if tuple(x.shape) != (h.num_rows, h.x_lane.hidden):
            raise InputError(f"combine: x must be [{h.num_rows}, {h.x_lane.hidden}] (the dispatch's rows), got "
                             f"{tuple(x.shape)}")
        wback = None
        if topk_weights is not None:
            _tensor(topk_weights, "topk_weights", 2, (torch.float32,))
            K = h.topk
            if h.meta_lane is None or tuple(topk_weights.shape) != (h.num_rows, K):
                raise InputError(f"combine(topk_weights {tuple(topk_weights.shape)}) needs a dispatch that carried "
                                 f"top-k and one weight row per received row: [{h.num_rows}, {K}]")
            # the weights go back unsummed on the meta lane's routes (one per (token, rank, slot)), the meta lane's
            # handle is sync-free: its backward reads rows up to the lane's receive capacity
            n = h.meta_lane.max_recv_tokens
            wback = torch.zeros(n, dtype=torch.float32, device=x.device)
            wback[:h.num_rows * K] = topk_weights.reshape(-1)
        biases = ()
        if bias is not None:
            biases = [b for b in (bias if isinstance(bias, tuple) else (bias,)) if b is not None]
            if isinstance(bias, tuple) and len(bias) != 2:
                raise InputError(f"bias must be a tensor or a tuple of two, got a tuple of {len(bias)}")
            for b in biases:
                _tensor(b, "bias", 2, (torch.bfloat16,))
                if tuple(b.shape) != (h.num_tokens, x.shape[1]):
                    raise InputError(f"bias must be [{h.num_tokens}, {x.shape[1]}], got {tuple(b.shape)}")
        y = h.x_lane.combine(x, h.x_handle)
        w = None
        if wback is not None:
            rows = self._zero_rows(n, h.meta_lane.hidden, x.device)
            _, per_slot = h.meta_lane.dispatch_backward(rows, wback, h.meta_handle)  # [T, W*K], exact
            w = per_slot.view(h.num_tokens, self.W, K).sum(1)  # DeepEP: the ranks' values summed in float32
        if biases:  # DeepEP adds the biases to the fp32 sum before its one rounding; here after it (one more)
            yf = y.float()
            for b in biases:
                yf = yf + b.float()
            y = yf.to(torch.bfloat16)
        return y, w
