"""DeepEP's low-latency mode on an EPBuffer: ``[L, W*M, H]`` expert rows out, a weighted combine back.

DeepEP's low-latency kernels move one message per (token, selected expert) and reduce with the weights passed to the
combine. The composition here: each token is repeated K times ("pseudo-tokens" ``t*K + k``, one route each: expert
``topk_idx[t, k]``), so the EPBuffer (``num_experts = E``, ``topk = 1``, ``max_tokens_per_rank = M*K``) receives one
row per (token, expert) in (source rank, token) order inside each expert segment: DeepEP's messages, deterministic.
The route weight carries the source token index (``float(t)``, exact below 2^24): it comes out as each row's weight,
which is DeepEP's ``src_info``. The dispatch runs sync-free (no host read: CUDA-graph capturable); the flat
expert-grouped rows are then scattered into the padded ``[L, W*M, H]`` layout, each expert's rows a prefix
``[0, recv_count[e])`` (:func:`expert_slots` / :func:`scatter_rows`). The combine gathers the rows back into the
flat order, sends them with :meth:`tritonep.EPBuffer.dispatch_backward` (the dispatch's adjoint: one row back per
pseudo-token, unweighted, exact) and reduces on the source with the combine's weights (fp32, then bf16).

fp8 (``use_fp8=True``): the sender quantizes with :func:`tritonep.wire.fp8.quantize_fp8` (e4m3, one scale per 128
elements; ``round_scale``: power-of-two scales; ``use_ue8m0``: those scales' exponent bytes packed four per int32)
and the bytes travel in the bf16 rows bit for bit, so the rows keep the width the bf16 combine needs (an EPBuffer's
dispatch and combine share one row width): fp8 semantics, not fp8's byte saving (docs/deep_ep.md).

Idea: DeepEP ``csrc/kernels/internode_ll.cu`` (layout, ``src_info``, ``layout_range``, scale layout), written anew.
"""

from __future__ import annotations

import contextlib

import torch

from ...errors import InputError, TritonEPError
from .handles import LowLatencyHandle
from .packing import pack_quantized

__all__ = ["LowLatencyMode", "expert_slots", "padded", "scatter_rows", "ue8m0_pack"]

_ID_DTYPES = (torch.int32, torch.int64)


def expert_slots(expert_offsets: torch.Tensor, num_tokens_per_expert: torch.Tensor, num_rows: int, slots: int):
    """Where each flat expert-grouped row goes in the padded layout: ``(seg, pos, dropped)``, int64 ``[num_rows]``
    twice and bool ``[num_rows]``.

    Row i of segment e (``[offs[e] - n[e], offs[e])``) goes to ``(e, i - start_e)``; rows past the last segment and
    rows beyond ``slots`` in their expert go to ``(L, 0)`` (the spare expert the callers allocate) and are
    ``dropped``. Device ops only.
    """
    L = expert_offsets.shape[0]
    i = torch.arange(num_rows, device=expert_offsets.device)
    ends = expert_offsets.to(torch.int64)
    seg = torch.searchsorted(ends, i, right=True)
    start = torch.cat([ends - num_tokens_per_expert.to(torch.int64), ends.new_zeros(1)])
    pos = i - start[seg]
    bad = (seg >= L) | (pos >= slots)
    return torch.where(bad, L, seg), torch.where(bad, 0, pos), bad


def padded(num_experts_local: int, slots: int, tail: tuple, dtype, device, col_major: bool = False):
    """``(full, view)``: a ``[L + 1, slots, *tail]`` tensor (one spare expert that absorbs the rows that belong
    nowhere, :func:`expert_slots`) and its first L experts, contiguous, or for ``col_major`` (one trailing dim) with
    the last two dims column-major (strides ``(tail*slots, 1, slots)``, DeepEP's scale layout)."""
    if col_major:
        full = torch.empty((num_experts_local + 1, tail[0], slots), dtype=dtype, device=device).transpose(1, 2)
    else:
        full = torch.empty((num_experts_local + 1, slots) + tuple(tail), dtype=dtype, device=device)
    return full, full[:num_experts_local]


def scatter_rows(full: torch.Tensor, rows: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor) -> None:
    """``full[seg[i], pos[i]] = rows[i]`` for every flat row i (one indexed copy; slots not written keep their
    contents: DeepEP's rows past ``recv_count`` are unspecified too)."""
    full[seg, pos] = rows


def ue8m0_pack(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[R, S]`` (S % 4 == 0) -> int32 ``[R, S/4]``: each scale's exponent byte (UE8M0),
    scale 4j + b in byte b of int32 j (little-endian), as DeepEP's ``use_ue8m0``."""
    e = ((scales.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return e.contiguous().view(torch.int32)


def _version(t: torch.Tensor):
    """``t``'s version counter (bumped by every in-place edit); None for an inference tensor, which keeps none."""
    return None if t.is_inference() else t._version


class LowLatencyMode:
    """The low-latency calls of one compat Buffer."""

    def __init__(self, owner, lanes, rank: int, world_size: int):
        self.owner, self.lanes, self.rank, self.W = owner, lanes, rank, world_size
        self._tok = {}  # device -> int64 arange(n) // K tables, keyed (device, K)
        self._last_key = None

    def _token_of(self, n: int, K: int, device) -> torch.Tensor:
        key = (device, K)
        t = self._tok.get(key)
        if t is None or t.shape[0] < n:
            t = self._tok[key] = torch.arange(max(n, 64 * K), device=device) // K
        return t[:n]

    def _lane(self, M: int, H: int, E: int, K: int):
        key = ("ll", M, H, E, K)
        self._last_key = key
        L = E // self.W
        return self.lanes.get(key, 0, num_experts=E, hidden=H, topk=1, max_tokens_per_rank=M * K,
                              max_recv_tokens=self.W * M * min(K, L))

    def _refuse(self, err: TritonEPError, key):
        """As :meth:`tritonep.compat.deep_ep.normal.NormalMode._refuse` for the low-latency lane (sync-free: the peers
        raise at their next synced call or ``check``)."""
        key = key or self._last_key
        if key is None:
            raise err
        try:
            lane = self._lane(*key[1:])
        except TritonEPError:
            raise err from None
        try:
            dev = lane.device
            lane.dispatch(torch.empty(0, key[2], dtype=torch.bfloat16, device=dev),
                          torch.empty(0, 1, dtype=torch.float32, device=dev),
                          torch.empty(0, 1, dtype=torch.float32, device=dev), sync_free=True)
        except TritonEPError:
            pass
        self.lanes.unread(lane)
        raise err

    def dispatch(self, x, topk_idx, M, E, stats, use_fp8: bool, round_scale: bool, use_ue8m0: bool, refused=None):
        """``low_latency_dispatch``'s exchange. Returns ``(recv_x, recv_count, handle, receive)``: ``recv_x`` and the
        handle's tensors are filled by ``receive()`` (the hook, or called at once). ``refused``: an error the Buffer
        found in the call's other arguments (raised after taking part, as any refusal here)."""
        key = None
        try:
            if isinstance(x, torch.Tensor) and x.dim() == 2 and isinstance(topk_idx, torch.Tensor) \
                    and topk_idx.dim() == 2 and topk_idx.shape[1] >= 1 \
                    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (M, E)):
                # the lane the peers' call runs on, known from the shapes alone: a refusal of the dtypes below
                # takes part there too (also on the first call of this lane, or after M changed)
                key = ("ll", M, x.shape[1], E, topk_idx.shape[1])
            if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
                raise InputError(f"x must be a 2-D bfloat16 tensor, got "
                                 f"{(x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__}")
            T, H = x.shape
            if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.dtype not in _ID_DTYPES:
                raise InputError("topk_idx must be a 2-D int32/int64 tensor")
            K = topk_idx.shape[1]
            for name, v in (("num_max_dispatch_tokens_per_rank", M), ("num_experts", E)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise InputError(f"{name}={v!r} must be a positive int")
            if K < 1:
                raise InputError("topk_idx needs at least one column")
            if E % self.W:
                raise InputError(f"num_experts={E} is not a multiple of the group size {self.W}")
            if H % 128:
                raise InputError(f"hidden={H} must be a multiple of 128 (DeepEP's low-latency rows)")
            if topk_idx.shape[0] != T or T > M:
                raise InputError(f"x has {T} tokens, topk_idx {topk_idx.shape[0]}; both must be <= "
                                 f"num_max_dispatch_tokens_per_rank={M}")
            if topk_idx.device != x.device:
                raise InputError(f"topk_idx on {topk_idx.device}, x on {x.device}")
            if use_ue8m0 and not (use_fp8 and round_scale):
                raise InputError("use_ue8m0=True needs use_fp8=True and round_scale=True (as DeepEP)")
            if use_ue8m0 and H % 512:
                raise InputError(f"use_ue8m0 needs hidden % 512 == 0 (four scales per int32), got {H}")
            L = E // self.W
            if stats is not None and (not isinstance(stats, torch.Tensor) or stats.dtype != torch.int32
                                      or tuple(stats.shape) != (L,) or not stats.is_contiguous()):
                raise InputError(f"cumulative_local_expert_recv_stats must be a contiguous int32 [{L}] tensor")
            if refused is not None:
                raise refused
        except TritonEPError as e:
            self._refuse(e, key)

        lane = self._lane(M, H, E, K)
        if use_fp8:
            from ...wire.fp8 import quantize_fp8  # on first use: the package import loads no kernel module
        S = H // 128
        payload = x if not use_fp8 else pack_quantized(*quantize_fp8(x.contiguous(), pow2_scale=round_scale))
        tok = self._token_of(T * K, K, x.device)
        # every negative id selects nothing, as DeepEP's kernels skip them (EPBuffer takes -1 only); the clamped copy
        # is also the dispatch's ids as they were, for a combine given other ids (LowLatencyHandle.routes)
        ids = topk_idx.reshape(T * K, 1).clamp(min=-1)
        out = lane.dispatch(payload.index_select(0, tok), ids, tok.to(torch.float32).unsqueeze(1), sync_free=True)
        self.lanes.unread(lane)  # nothing read: the next synced call or check() reads its status
        WM = self.W * M
        ntpe = out.num_tokens_per_expert
        seg, pos, dropped = expert_slots(out.expert_offsets, ntpe, out.x.shape[0], WM)
        # an expert's rows past its W*M slots (a source sending it more than M messages: outside DeepEP's contract)
        # are dropped: counted nowhere, and the combine returns zeros for them (docs/deep_ep.md, "What differs")
        recv_count = ntpe.clamp(max=WM)
        if stats is not None:  # stats made inside inference mode, this call outside it: added inside it
            with torch.inference_mode() if stats.is_inference() and not torch.is_inference_mode_enabled() \
                    else contextlib.nullcontext():
                stats.add_(recv_count)
        dev = x.device
        si_full, src_info = padded(L, WM, (), torch.int32, dev)
        # routes per (expert, source); none where the expert received nothing (a refused call's counts name rows
        # that never arrived)
        c = out.handle.counts[:, self.rank * L:(self.rank + 1) * L].t().to(torch.int64) * (ntpe > 0).unsqueeze(1)
        ends = torch.cumsum(c, 1)
        begin = (ends - c).clamp_(max=WM)
        layout_range = (begin << 32) | (ends.clamp_(max=WM) - begin)
        if use_fp8:
            Sx = S // 4 if use_ue8m0 else S
            q_full, q = padded(L, WM, (H,), torch.float8_e4m3fn, dev)
            s_full, s = padded(L, WM, (Sx,), torch.int32 if use_ue8m0 else torch.float32, dev, col_major=True)
            recv = (q, s)
        else:
            x_full, recv = padded(L, WM, (H,), torch.bfloat16, dev)

        def receive():
            scatter_rows(si_full, out.weights.to(torch.int32), seg, pos)
            if not use_fp8:
                scatter_rows(x_full, out.x, seg, pos)
                return
            b = out.x.view(torch.uint8)
            scatter_rows(q_full.view(torch.uint8), b[:, :H], seg, pos)
            sc = b[:, H:H + 4 * S].view(torch.float32)
            scatter_rows(s_full, ue8m0_pack(sc) if use_ue8m0 else sc, seg, pos)

        gidx = seg.clamp(max=L - 1) * WM + pos  # flat row -> padded slot, for the combine's gather
        h = LowLatencyHandle(src_info, layout_range, M, H, E, owner=self.owner, lane=lane, ep_handle=out.handle,
                             num_tokens=T, topk=K, gather_index=gidx, dropped=dropped.unsqueeze(1),
                             routes=(topk_idx, _version(topk_idx), ids.view(T, K)))
        return recv, recv_count, h, receive

    def combine(self, x, topk_idx, topk_weights, h, zero_copy: bool, out, refused=None):
        """``low_latency_combine``'s exchange. Returns ``(combined_x, reduce)``: ``reduce()`` (the hook, or called at
        once) writes ``combined_x [T, H]`` bf16 = sum_k topk_weights[t, k] * row(t, k) over k with
        ``topk_idx >= 0`` (fp32, one bf16 rounding).

        A refused input, handle or ``refused`` (an error the Buffer found in the call's other arguments) takes part
        in the lane's backward as refused (:meth:`tritonep.EPBuffer.cancel_dispatch_backward`: no row moves, the
        peers' output is NaN and their next synced call or ``check()`` raises PeerInputError), then raises here."""
        own = isinstance(h, LowLatencyHandle) and h.owner == self.owner
        try:
            if refused is not None:
                raise refused
            if not own:
                raise InputError("handle must be a LowLatencyHandle made by this Buffer's low_latency_dispatch")
            M, H, E = h[2], h[3], h[4]
            L, WM, T, K = E // self.W, self.W * M, h.num_tokens, h.topk
            src = h.combine_buffer if zero_copy else x
            if zero_copy and src is None:
                raise InputError("zero_copy=True needs get_next_low_latency_combine_buffer(handle) filled first")
            if not isinstance(src, torch.Tensor) or tuple(src.shape) != (L, WM, H) or src.dtype != torch.bfloat16 \
                    or not src.is_contiguous():
                raise InputError(f"x must be a contiguous bfloat16 [{L}, {WM}, {H}] tensor, got "
                                 f"{(src.dtype, tuple(src.shape)) if isinstance(src, torch.Tensor) else type(src)}")
            for name, v, dts in (("topk_idx", topk_idx, _ID_DTYPES),
                                 ("topk_weights", topk_weights, (torch.float32,))):
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != (T, K) or v.dtype not in dts:
                    got = (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__
                    raise InputError(f"{name} must be [{T}, {K}] ({' / '.join(map(str, dts))}) as the dispatch's, "
                                     f"got {got}")
            if out is not None and (not isinstance(out, torch.Tensor) or tuple(out.shape) != (T, H)
                                    or out.dtype != torch.bfloat16 or not out.is_contiguous()):
                raise InputError(f"out must be a contiguous bfloat16 [{T}, {H}] tensor")
        except TritonEPError:
            lane = h.lane if own else (self.lanes.peek(self._last_key) if self._last_key is not None else None)
            if lane is not None:  # the lane the peers' combine most likely runs on
                try:
                    lane.cancel_dispatch_backward(h.ep_handle if own else None)
                except TritonEPError:
                    pass
                self.lanes.unread(lane)
            raise
        rows = src.view(L * WM, H).index_select(0, h.gather_index)
        rows.masked_fill_(h.dropped, 0.0)  # rows that had no slot (and rows past the received ones) send zeros back
        back, _ = h.lane.dispatch_backward(rows, None, h.ep_handle)
        self.lanes.unread(h.lane)  # nothing read: the next synced call or check() reads its status
        y = out if out is not None else torch.empty(T, H, dtype=torch.bfloat16, device=src.device)

        src_ids, version, ids = h.routes
        # back row k is the dispatch's column k: a call passing the dispatch's own ids tensor, unchanged since (its
        # version counter; an inference tensor keeps none, so it never counts as unchanged), pairs its weight
        # columns as they are; other ids pair each weight with the first column of the dispatch that named its
        # expert, as DeepEP's combine reads slot (expert id, token) once per column
        same = version is not None and topk_idx is src_ids and _version(topk_idx) == version

        def reduce():
            w = topk_weights.masked_fill(topk_idx < 0, 0.0)
            if not same:
                eq = ids.unsqueeze(2) == topk_idx.unsqueeze(1)  # [T, K, K]: dispatch column j names column k's expert
                w = ((eq & (eq.cumsum(1) == 1)) * w.unsqueeze(1)).sum(2)
            y.copy_((back.view(T, K, H).float() * w.unsqueeze(2)).sum(1))
        return y, reduce

    def next_combine_buffer(self, h) -> torch.Tensor:
        """The ``[L, W*M, H]`` bf16 tensor a ``zero_copy=True`` combine with ``h`` reads (made on first request)."""
        if h.combine_buffer is None:
            M, H, E = h[2], h[3], h[4]
            h.combine_buffer = torch.empty(E // self.W, self.W * M, H, dtype=torch.bfloat16,
                                           device=h.gather_index.device)
        return h.combine_buffer
