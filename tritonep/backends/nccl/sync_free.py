"""The nccl backend's sync-free dispatch (``dispatch(..., sync_free=True)``; :class:`SyncFreeDispatch`, a part of
:class:`tritonep.backends.nccl.backend.NcclEP` with its own state) and its status word.

No host read and nothing data-dependent on the host: every size is static (``max_recv_tokens`` rows returned, the
real ones ``[0, expert_offsets[-1])`` bit-identical to the synced dispatch), so the call can be captured in a CUDA
graph and never waits for the device. Every peer gets ``max_tokens_per_rank`` fixed packet slots and ONE
``all_to_all_single`` with equal splits moves them. Two modes, chosen once at construction (:func:`sync_free_mode`):
**one-hop** (:mod:`tritonep.backends.nccl.onehop`, bf16 only: the counts travel as a header slot of every per-peer block;
2 launches, 1 collective) and **gather** (every wire: an ``all_gather`` of the counts, a device plan, pack,
``all_to_all_single``, unpack; 4 launches, 2 collectives). Outputs come from the output pool
(:mod:`tritonep.runtime.pool`); the send and receive rows are persistent. Errors (a bad id or refused input on any rank,
capacity) are recorded in the status word on every rank and raised by :meth:`check` or the next synced dispatch;
combine and both backward passes run unchanged on its handles. The protocol step by step: docs/protocols.md, "The
nccl backend"; the measurements behind the mode rule: docs/performance.md, "Why the defaults".
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from ...errors import CapacityError, ConfigError, InputError, PeerInputError, WireError
from ...wire.formats import get_wire
from .kernels.plan import sync_free_plan_kernel
from .handle import NcclHandle
from ...runtime.pool import OutputPool, acquire_shared, release_shared
from ...runtime.status import STATUS_BAD_INPUT, STATUS_CAPACITY, STATUS_COMBINE_REFUSED
from ..checks import check_expert_ids
from .collectives import BoundCollective, all_gather_flat
from .onehop import OneHopDispatch
from .pack import pow2
from .plan import device_plan_torch, plan_size, sf_plan_size

__all__ = ["SyncFreeDispatch", "sync_free_mode", "ONEHOP_MAX_TOKENS"]


ONEHOP_MAX_TOKENS = 256  # the unset variable's rule picks one-hop up to this max_tokens_per_rank (decode buffers)


def sync_free_mode(cfg) -> str:
    """The sync-free mode of an nccl buffer of configuration ``cfg``: ``cfg.sync_free_mode`` (TRITONEP_NCCL_SYNC_FREE
    as read by :func:`tritonep.ep.config.build_config`, agreed by every rank) or, unset, the measured rule: ``onehop``
    for a decode-sized buffer (``max_tokens_per_rank <= ONEHOP_MAX_TOKENS``, bf16 wire and dtype, ``world_size <=
    63``), else ``gather`` (one H200: at 128 tokens one-hop 83 us vs gather 151; at 4096 tokens gather 432 us vs
    one-hop 1543, whose send scans are quadratic in T). A rule of the agreed config only: every rank picks the same
    mode.

    Raises:
        WireError: ``onehop`` asked for with a quantized dispatch wire (one-hop moves bf16 rows only).
        ConfigError: ``onehop`` asked for with ``world_size > 63`` (its status mask).
    """
    mode = cfg.sync_free_mode
    bf16 = cfg.dispatch_wire == "bf16" and cfg.dtype == torch.bfloat16
    if mode == "onehop":
        if not bf16:
            raise WireError(f"TRITONEP_NCCL_SYNC_FREE=onehop: dispatch_wire={cfg.dispatch_wire!r} is not supported "
                            f"by the one-hop mode (bf16 only); use gather or leave the variable unset")
        if cfg.world_size > 63:
            raise ConfigError(f"TRITONEP_NCCL_SYNC_FREE=onehop: world_size={cfg.world_size} > 63 is not supported "
                              f"(its status mask); use gather")
        return mode
    if mode == "gather":
        return mode
    small = cfg.max_tokens_per_rank <= ONEHOP_MAX_TOKENS
    return "onehop" if small and bf16 and cfg.world_size <= 63 else "gather"


class SyncFreeDispatch:
    """The sync-free dispatch of one nccl buffer and the refusals its status word records (module docstring).

    Args:
        cfg: the buffer's :class:`tritonep.ep.config.EPConfig`. group / rank / device: the backend's.
        launch: the backend's :class:`tritonep.runtime.launch.Launch`. router / unpacker: its
            :class:`tritonep.backends.nccl.route.Router` and :class:`tritonep.backends.nccl.unpack.Unpacker` (shared
            with the synced dispatch). gathered: the backend's int32 ``[W * (E + W + 2)]`` counts matrix (the
            all_gather's target). status: its int32 status word ``[4 + 2W]`` (read by the synced dispatch's one
            host read and by ``check``).

    Attributes: ``mode`` (``"onehop"`` | ``"gather"``: :func:`sync_free_mode`), ``buffer_id`` (set by the backend:
    handles carry it).
    """

    POOL_KEYS = 4  # token counts whose small per-call outputs are pooled at once (least recently used dropped)

    def __init__(self, cfg, *, group, rank: int, device: torch.device, launch, router, unpacker,
                 gathered: torch.Tensor, status: torch.Tensor):
        self.cfg, self.group, self.rank, self.device = cfg, group, rank, device
        self._launch, self._router, self._unpacker = launch, router, unpacker
        self._gathered, self._status = gathered, status
        self.buffer_id = 0
        self._lay, self._dfmt = router.lay, get_wire(cfg.dispatch_wire)
        self._es = torch.empty(0, dtype=cfg.dtype).element_size()
        H, K = cfg.hidden, cfg.topk
        self._kept = (self._dfmt.payload_bytes(H), self._dfmt.num_scales(H)) if self._dfmt.quantized else None
        self._no_routes = torch.empty(0, K, dtype=torch.int32, device=device)  # shared empties (never written)
        self._no_w = torch.empty(0, K, dtype=torch.float32, device=device)
        W, E, L = cfg.world_size, cfg.num_experts, cfg.num_local_experts
        self._tcap = cfg.max_tokens_per_rank
        self._slots_n = W * self._tcap
        self._eq_splits = (self._tcap,) * W
        self._sf_size = sf_plan_size(W, E)
        self._sf_split = [E + W, L, L, W * E, W]
        self._sf_slots = (self._tcap, plan_size(W, E), cfg.max_recv_tokens)
        self._sf_a2a = None  # the gather mode's bound all_to_all (made with the send / receive rows)
        self._sf_bufs = None  # (send [W*Tcap, width], receive [W*Tcap + 1, width], its first W*Tcap rows)
        self._recent_idx: deque = deque(maxlen=4)  # the last sync-free calls' topk_idx (to name a bad id)
        self.deferred = None  # this rank's refusal's own error, deferred to the read that finds it (defer_refusal)
        self._codes = (STATUS_CAPACITY, STATUS_BAD_INPUT)
        self._sf_plan = self._launch.bind(sync_free_plan_kernel, dict(
            m_ptr=self._gathered, st_ptr=self._status, rank=self.rank, W=W, E=E, L=L, A=cfg.expert_alignment,
            TCAP=self._tcap, MAXR=cfg.max_recv_tokens, WB=pow2(W), LB=pow2(L), CODE_CAP=STATUS_CAPACITY,
            CODE_BAD=STATUS_BAD_INPUT, num_warps=4), ("plan_ptr",))
        self.mode = sync_free_mode(cfg)
        self._oh = None  # the one-hop dispatcher (made on the first one-hop call: its buffers, bound launches)
        # the gather mode's per-call outputs, reused once nobody holds them (:mod:`tritonep.runtime.pool`): a pool of
        # the small tensors per (T, topk_idx dtype) (the POOL_KEYS most recent), the [max_recv_tokens, H] rows from
        # the process-wide pool of that shape (shared with every buffer of the same shape, both backends)
        # pooled only for a decode-sized buffer (where a call's host time matters; a prefill-sized set of rows is
        # hundreds of MB that the caching allocator had better share)
        self._sf_slots_n = cfg.output_pool if cfg.max_tokens_per_rank <= ONEHOP_MAX_TOKENS else 0
        self._sf_pools: OrderedDict = OrderedDict()
        self._sf_last = None  # the key of the most recently used pool
        dev, MR, H, dt = self.device, cfg.max_recv_tokens, cfg.hidden, cfg.dtype
        self._sf_rows_key = ("rows", str(dev), MR, H, dt)
        self._sf_rpool = acquire_shared(self._sf_rows_key, lambda: ((torch.empty(MR, H, dtype=dt, device=dev),), ()),
                                        self._sf_slots_n, dev)

    def _onehop(self) -> OneHopDispatch:
        """The one-hop dispatcher of this buffer (:class:`OneHopDispatch`, its verdicts merged into the status word;
        its send / receive rows persistent, made here on the first one-hop call)."""
        with torch.inference_mode(False):  # persistent state: normal tensors even when made by an inference call
            self._oh = OneHopDispatch(self.cfg, group=self.group, rank=self.rank, device=self.device,
                                      status_word=self._status)
        return self._oh

    def _sf_make(self, T: int, idt: torch.dtype):
        """The gather mode's per-call tensors (a pooled set, or a call's own when no set is free) for ``T > 0``
        tokens and ``topk_idx`` dtype ``idt``: ``(plan, rows, pkt, idx_c, w_c, rr, rw, out_w), (ntpe, offs,
        counts [W, E])``."""
        cfg, dev = self.cfg, self.device
        K, N, i32 = cfg.topk, self._slots_n, torch.int32
        plan = torch.empty(self._sf_size, dtype=i32, device=dev)
        _, ntpe, offs, counts, _ = torch.split(plan, self._sf_split)
        return ((plan, torch.empty(T, K, dtype=i32, device=dev), torch.empty(T, K, dtype=i32, device=dev),
                 torch.empty(T, K, dtype=idt, device=dev), torch.empty(T, K, dtype=torch.float32, device=dev),
                 torch.empty(N, K, dtype=i32, device=dev), torch.empty(N, K, dtype=torch.float32, device=dev),
                 torch.empty(cfg.max_recv_tokens, dtype=torch.float32, device=dev)),
                (ntpe, offs, counts.view(cfg.world_size, cfg.num_experts)))

    def _sf_take(self, T: int, idt: torch.dtype, rows: bool):
        """``(small set or None, rows block or None)`` of this call from the pools (None: allocate; ``rows``: the
        call returns ``[max_recv_tokens, H]`` rows of the buffer's dtype, not kept-quantized ones). The small set
        is the pool's set object (``objs``, ``extra``)."""
        key = self._sf_rpool.stream_key()  # None while capturing: a capture's outputs come from its own pool
        if key is None:
            return None, None
        pk = (T, idt)
        if pk == self._sf_last:  # the common case: the token count of the last call (already last in LRU order)
            pool = self._sf_pools[pk]
        else:
            pool = self._sf_pools.get(pk)
            if pool is None:
                if len(self._sf_pools) >= self.POOL_KEYS:
                    self._sf_pools.popitem(last=False)[1].clear()
                make = self._oh_make if self.mode == "onehop" else self._sf_make
                pool = self._sf_pools[pk] = OutputPool(lambda: make(T, idt), self._sf_slots_n, self.device)
            else:
                self._sf_pools.move_to_end(pk)
            self._sf_last = pk
        return pool.take_set(key), (self._sf_rpool.take(key) if rows else None)

    def close(self):
        """Let the pools and the persistent rows go (the buffer's close): sets a caller still holds live on through
        their references."""
        self._sf_bufs = None
        self._oh = None
        for pool in self._sf_pools.values():
            pool.clear()
        self._sf_pools.clear()
        self._sf_last = None
        if self._sf_rpool.slots:
            self._sf_rpool = OutputPool(None, 0, self.device)
            release_shared(self._sf_rows_key, self._sf_slots_n)

    def _sf_buffers(self):
        """The persistent send / receive rows (made on the first sync-free call, as normal tensors also inside
        ``torch.inference_mode()``). The receive rows have one more row holding the encoding of a zero row (padding
        rows of a ``keep_quantized`` dispatch copy it)."""
        N, lay, dev = self._slots_n, self._lay, self.device
        with torch.inference_mode(False):  # persistent: normal tensors even when made by an inference call
            send = torch.empty(N, lay.width, dtype=torch.uint8, device=dev)
            recv = torch.zeros(N + 1, lay.width, dtype=torch.uint8, device=dev)
            if self._dfmt.quantized:
                self._dfmt.wire_views(recv[N:], self.cfg.hidden)[1].fill_(self._dfmt.zero_scale)
            self._sf_bufs = send, recv, recv[:N]
        return self._sf_bufs

    def _sf_bind_a2a(self):
        """The gather mode's all_to_all between the persistent send / receive rows, bound once."""
        send, _, recv_n = self._sf_bufs or self._sf_buffers()
        self._sf_a2a = BoundCollective(recv_n, send, self.group)
        return self._sf_a2a

    def dispatch(self, x, topk_idx, topk_weights, keep_quantized: bool, bad_input: bool, ut: bool):
        """The sync-free dispatch (module docstring); arguments and return as :meth:`NcclEP.dispatch_fwd` (``ut``:
        the Triton kernels, else their torch twins)."""
        cfg, dev, lay, fmt = self.cfg, self.device, self._lay, self._dfmt
        W, E, K, H, MR = cfg.world_size, cfg.num_experts, cfg.topk, cfg.hidden, cfg.max_recv_tokens
        T = x.shape[0]
        if not bad_input:
            self._recent_idx.append(topk_idx)
        if self.mode == "onehop":
            return self._dispatch_onehop(x, topk_idx, topk_weights, bad_input, T, ut)
        # 1) counts row, exchanged into the persistent matrix
        row = self._router.count(topk_idx, T, bad_input, ut)
        all_gather_flat(self._gathered, row, self.group)
        # the call's outputs: pooled sets or fresh allocations (the rows and row weights handed out as aliases:
        # a mark autograd or an in-place op with a differentiable operand puts on them must not outlive the call)
        got = rows_blk = None
        if T and self._sf_slots_n:
            got, rows_blk = self._sf_take(T, topk_idx.dtype, not (keep_quantized and fmt.quantized))
        N = self._slots_n
        pooled = got is not None
        if pooled:
            got = got.objs
        elif T:  # every set held, capture, or the pool off: the same tensors, allocated
            got = sum(self._sf_make(T, topk_idx.dtype), ())
        if got is not None:
            plan, rows, pkt, idx_c, w_c, rr, rw, out_w, ntpe, offs, counts = got
            if pooled:
                out_w = out_w.detach()
        else:  # no tokens: the shared empty routing tensors
            plan = torch.empty(self._sf_size, dtype=torch.int32, device=dev)
            _, ntpe, offs, counts, _ = torch.split(plan, self._sf_split)
            counts = counts.view(W, E)
            rr = torch.empty(N, K, dtype=torch.int32, device=dev)
            rw = torch.empty(N, K, dtype=torch.float32, device=dev)
            out_w = torch.empty(MR, dtype=torch.float32, device=dev)
        # 2) the device plan and verdict
        if ut:
            self._sf_plan((1,), plan)
        else:
            device_plan_torch(self._gathered, self.rank, W, E, cfg.expert_alignment, self._tcap, MR, plan,
                              self._status, self._codes)
        send, recv, recv_n = self._sf_bufs or self._sf_buffers()
        # 3) pack into the fixed slots
        if T:
            src0, src1 = fmt.quantize_bytes(x) if fmt.quantized else (x, None)
            self._router.pack(src0, src1, topk_idx, topk_weights, plan, send, rows, pkt, T, ut, idx_c, w_c)
        else:
            rows = pkt = self._no_routes
            idx_c, w_c = topk_idx.new_empty(0, K), self._no_w
        # 4) one all_to_all, equal host-static splits
        (self._sf_a2a or self._sf_bind_a2a())()
        # 5) unpack the live slots (every row weight written by the unpack launch: the tail's zeroed there)
        kq = keep_quantized and fmt.quantized
        zero_row = kq and cfg.expert_alignment > 1
        sc = None
        if not fmt.quantized:
            out = rows_blk[0].detach() if rows_blk is not None else torch.empty(MR, H, dtype=cfg.dtype, device=dev)
            srcs, widths = [(recv, 0, lay.width // self._es)], (H,)
        elif kq:
            pb, ns = self._kept
            out = torch.empty(MR, pb, dtype=torch.uint8, device=dev)
            sc = torch.empty(MR, ns, dtype=fmt.scale_dtype, device=dev)
            se = fmt.codec.scale_bytes
            srcs, widths = [(recv, 0, lay.width), (recv, pb // se, lay.width // se)], (pb, ns)
        else:
            out = rows_blk[0].detach() if rows_blk is not None else torch.empty(MR, H, dtype=cfg.dtype, device=dev)
            srcs, widths = [(fmt.dequantize_rows(recv_n, H, cfg.dtype), 0, H)], (H,)
        self._unpacker.unpack(recv, srcs, [out] if sc is None else [out, sc], widths, out_w, rr, rw, plan, N,
                              zero_row, ut, self._sf_slots, MR)
        handle = NcclHandle._new(topk_idx=idx_c, topk_weights=w_c, rows=rows, counts=counts,
                                 num_tokens=T, num_recv_rows=None, x_scales=sc, recv_weights=out_w,
                                 buffer_id=self.buffer_id, send_splits=self._eq_splits,
                                 recv_splits=self._eq_splits, num_send=N, num_recv=N, pkt=pkt, recv_rows=rr,
                                 recv_w=rw)
        return out, out_w, ntpe, offs, handle

    def _oh_make(self, T: int, idt: torch.dtype):
        """The one-hop mode's per-call tensors for ``T`` tokens and ``topk_idx`` dtype ``idt`` (a pooled set, or a
        call's own when none is free): ``(blk, idx_c), (out_w, ntpe, offs, w_c, counts, pkt, rr, rw), handle
        fields`` -- the int32 block of every small output (:meth:`OneHopDispatch.outputs`), the routing ids' copy,
        EVERY view a call hands out (returned or held by its handle: the pool counts each, so a caller that keeps
        any one of them, e.g. ``handle.counts``, keeps the set) and the handle's fields made of them (a call makes
        its handle from them without a constructor)."""
        oh = self._oh
        blk, idx_c = oh.outputs(T, idt)
        v = oh.views(blk, T)
        N = oh.nslot
        fields = dict(topk_idx=idx_c, topk_weights=v["w_c"], rows=self._no_routes, counts=v["counts"], num_tokens=T,
                      num_recv_rows=None, x_scales=None, recv_weights=v["out_w"], buffer_id=self.buffer_id,
                      send_splits=oh.splits, recv_splits=oh.splits, num_send=N, num_recv=N, pkt=v["pkt"],
                      recv_rows=v["rr"], recv_w=v["rw"], count_sums=None, carried=None)
        views = tuple(v[n] for n in ("out_w", "ntpe", "offs", "w_c", "counts", "pkt", "rr", "rw"))
        return (blk, idx_c), views, fields

    def _dispatch_onehop(self, x, topk_idx, topk_weights, bad_input: bool, T: int, ut: bool):
        """The one-hop mode (module docstring): send launch, one even ``all_to_all_single``, receive launch (its
        verdict merged into the status word). Outputs: :meth:`_oh_make`'s tensors and the rows, from the pools
        (also without tokens), else allocated; the pooled rows and row weights are handed out as aliases (a mark
        autograd or an in-place op with a differentiable operand puts on them must not stay on a pooled tensor),
        the handle holding the row weights' alias as the dispatch returns it."""
        oh = self._oh or self._onehop()
        st = rows = None
        if self._sf_slots_n:  # a rank without tokens too (its outputs are the same fixed-size set)
            st, rows = self._sf_take(T, topk_idx.dtype, True)
        if st is None:
            (blk, idx_c), (out_w, ntpe, offs, *_), fields = self._oh_make(T, topk_idx.dtype)
        else:
            (blk, idx_c, out_w, ntpe, offs, *_), fields = st.objs, st.extra
            out_w = out_w.detach()
        if rows is None:
            out = torch.empty(self.cfg.max_recv_tokens, self.cfg.hidden, dtype=self.cfg.dtype, device=self.device)
        else:
            out = rows[0]
        oh.run(x, topk_idx, topk_weights, bad_input, out, blk, idx_c, ut, T)
        handle = NcclHandle.__new__(NcclHandle)
        d = handle.__dict__
        d.update(fields)
        d["recv_weights"] = out_w
        return (out if rows is None else out.detach()), out_w, ntpe, offs, handle

    # ---------------------------------------------------------------------------------------------- status
    def raise_status(self, st: list, what: str):
        """Raise the refusal of an earlier sync-free dispatch nobody read yet that the host copy ``st`` of the status
        word holds (its code is nonzero); the caller cleared the word (reported once; the buffer stays usable).
        Collective in effect: every rank holds the same word, so every rank raises the same error.

        Raises:
            InputError: this rank's own ids were outside ``[-1, E)`` (names the value when the call's ``topk_idx``
                is still among the last four sync-free calls').
            PeerInputError: another rank's input was bad or refused (``bad_ranks``); this rank's own refusal raises
                the error its caller deferred instead (``deferred``: ``EPBuffer.refuse_dispatch``).
            CapacityError: some rank would have received more than ``max_recv_tokens`` rows.
            PeerInputError: the word records a refused combine (STATUS_COMBINE_REFUSED, written by
                :meth:`tritonep.backends.nccl.backend.NcclEP._raise_pending` for a combine some rank took part in as
                refused).
        """
        W, E, MR = self.cfg.world_size, self.cfg.num_experts, self.cfg.max_recv_tokens
        code, peer, seen, needed = st[:4]
        bad_ids = [r for r in range(W) if st[4 + r]]
        refused = [r for r in range(W) if st[4 + W + r]]
        bad = sorted(set(bad_ids) | set(refused))
        recent, self._recent_idx = self._recent_idx, deque(maxlen=4)
        deferred, self.deferred = self.deferred, None
        when = (f"{seen} sync_free dispatch(es) since the last read were refused on every rank and moved no rows; "
                f"this is the first one's error")
        if code == STATUS_COMBINE_REFUSED:  # written for a refused combine (tritonep.backends.nccl.combine), not a dispatch
            raise PeerInputError(f"{what} on rank {self.rank}: rank(s) {bad} took part in a combine or a backward "
                                 f"pass as refused (its input was refused, or it cancelled the call: "
                                 f"EPBuffer.cancel_combine / cancel_combine_backward / cancel_dispatch_backward), so "
                                 f"that call failed on every rank and its outputs are NaN; the buffer stays usable",
                                 bad_ranks=bad, rank=self.rank)
        if deferred is not None and self.rank in refused:  # this rank's own error, deferred by its caller
            raise deferred
        if self.rank in bad_ids:  # this rank's own ids (also behind an earlier capacity refusal, as on triton)
            for idx in reversed(recent):
                check_expert_ids(idx, E)  # raises the InputError naming the value and its (token, k)
            raise InputError(f"{what} on rank {self.rank}: the topk_idx of an earlier sync_free dispatch held an "
                             f"id outside [-1, num_experts={E}) ({when})")
        if code == STATUS_BAD_INPUT:
            why = "; ".join(f"rank {r}: " + ("expert ids outside [-1, E)" if r in bad_ids else
                                             "input refused by EPBuffer") for r in bad)
            raise PeerInputError(f"{what} on rank {self.rank}: invalid input on rank(s) {bad} ({why}); {when}",
                                 bad_ranks=bad, rank=self.rank)
        also = f"; the input of rank(s) {bad} was refused too" if bad else ""
        raise CapacityError(f"{what}: rank {peer} would receive {needed} rows but max_recv_tokens={MR}; {when}{also}",
                            needed=needed, available=MR)
