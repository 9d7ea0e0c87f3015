"""The Triton backend of EPBuffer: symmetric memory + the kernels of :mod:`tritonep.kernels`.

One symmetric allocation per buffer holds every region (:func:`regions`); the same list answers
``EPBuffer.required_bytes``. Call sequence of a dispatch (all on the current stream, no host sync except the one
optional status read after the counts exchange, see ``sync``):

1. chunk histograms (program 0 also advances ``calls[CALL_DISPATCH]`` and ``calls[CALL_EXCHANGE]`` on the device), 3. counts exchange +
layout (grid 1),
4. [eager only] one host read of (status, rows) -> CapacityError / PeerTimeoutError before any row moves,
5. send, 6. expand (or 5+6 as one launch when the geometry has ``fused_send > 0``: sends and expands overlap).

Combine: ``calls[CALL_COMBINE] += 1``, partial (push into the source, or into own memory for pull), output (a weighted push
combine runs both as one launch when the geometry has ``fused_combine``). With the geometry's ``decode`` (small
``max_tokens_per_rank``) the forward dispatch and the weighted push combine are ONE launch each, counts exchange
and counter advances included (:mod:`tritonep.ep.triton_decode`). Every flag row, counter and status field is
named in :mod:`tritonep.kernels.protocol`.
"""

from __future__ import annotations


import torch
import triton

from .. import envs
from ..errors import BufferStateError, InputError, PeerTimeoutError
from ..kernels.combine import combine_out_kernel, combine_partial_kernel
from ..kernels.combine_fused import combine_fused_kernel
from ..kernels import protocol as P
from ..kernels.dispatch import dispatch_expand_kernel, dispatch_send_kernel
from ..kernels.dispatch_fused import dispatch_fused_kernel
from ..kernels.layout import chunk_hist_kernel, exchange_kernel, exchange_tiles
from ..memory import get_heap, group_barrier
from .geometry import select_geometry
from ..wire.formats import get_wire
from .launch import Launcher
from .triton_decode import DecodePath
from .triton_outputs import ST_HOST as _ST_HOST, DispatchOutputs
from .triton_regions import regions
from .status import STATUS_BAD_INPUT, STATUS_CAPACITY, bad_ranks, raise_for_status, resolve_timeout, wait_bound
from .validate import check_expert_ids

__all__ = ["regions", "TritonEP"]

_ST_ERR = P.v(P.STATUS_WORDS)  # the status word's error part
_CODE = P.v(P.ST_CODE)
_ROWS = P.v(P.ST_ROWS_RECEIVED)
_CX = P.v(P.CALL_EXCHANGE)
_RAW = get_wire("bf16").codec  # backward passes move bf16


class TritonEP(DispatchOutputs, DecodePath):
    """Triton + symmetric-memory implementation behind :class:`tritonep.EPBuffer` (see the module docstring)."""

    name = "triton"

    def __init__(self, group, rank, world_size, num_experts, hidden, max_tokens_per_rank, topk, expert_alignment,
                 max_recv_tokens, device, dtype=torch.bfloat16, num_sms=None, dispatch_wire="bf16",
                 combine_wire="bf16", timeout_s=None):
        self.rank, self.W = rank, world_size
        self.E, self.H, self.Tm, self.K = num_experts, hidden, max_tokens_per_rank, topk
        self.L = num_experts // world_size
        self.A = expert_alignment
        self.max_recv = max_recv_tokens
        self.device = device
        self.dtype = dtype
        self.dispatch_wire, self.combine_wire = dispatch_wire, combine_wire
        self.dfmt = get_wire(dispatch_wire, "dispatch_wire")
        self.dwire, self.cwire = self.dfmt.codec, get_wire(combine_wire, "combine_wire").codec  # kernels' WIRE
        self.geo = select_geometry(device.type, world_size, hidden, max_tokens_per_rank, topk, wire=dispatch_wire,
                                   num_sms=num_sms)
        self.ncmax = max(1, triton.cdiv(max_tokens_per_rank, self.geo.bt))
        heap = get_heap(group, device)
        self.buf = heap.allocate(regions(world_size, num_experts, hidden, max_tokens_per_rank, topk,
                                         max_recv_tokens, dtype, self.geo.bt))
        b = self.buf
        self.flags = b.local("flags")
        self.status = b.local("status")
        self.calls = b.local("calls")
        self.hist, self.pre = b.local("hist"), b.local("pre")
        self.send_base, self.rows_needed = b.local("send_base"), b.local("rows_needed")
        self.tab = {n: b.ptr_table(n) for n in ("flags", "counts", "ntok", "meta", "wts", "wback", "stage",
                                                 "cstage", "cflag", "ccflag")}
        self.has_timer = device.type == "cuda"
        self.timeout_s = resolve_timeout(timeout_s)
        self.timeout = wait_bound(device, self.timeout_s)
        self.broken: str | None = None
        self.host_reads = 0  # device->host reads made by calls (the eager-path budget: one per dispatch)
        if device.type == "cuda":
            self._st_host = torch.empty(_ST_HOST, dtype=torch.int64, pin_memory=True)
            self._st_event = torch.cuda.Event()
        self._recent_idx: list = []  # topk_idx of the last dispatches: check() names a bad id found on the device
        self._launch = Launcher(device, group)
        p2 = triton.next_power_of_2
        self.c = dict(RANK=rank, W=world_size, K=topk, KB=p2(topk), H=hidden, BH=self.geo.bh, BT=self.geo.bt,
                      WB=max(2, p2(world_size)), HAS_TIMER=self.has_timer, RB=2 * hidden)
        self._kw = {"num_warps": self.geo.num_warps}
        if device.type == "cuda":
            self._kw["num_stages"] = 1
        # the constexpr keyword arguments every data kernel takes, built once (not per launch)
        self._ck = {k: self.c[k] for k in ("RANK", "W", "K", "KB", "H", "BH", "BT", "WB", "HAS_TIMER", "RB")}
        self._ck.update(self._kw)
        # the combine kernels' tile and warps (Geometry.cbt / cwarps), and their chunk count per source
        g = self.geo
        self._cbt = g.cbt or g.bt
        self.ncmax_c = max(1, triton.cdiv(max_tokens_per_rank, self._cbt))
        self._cck = dict(self._ck, BT=self._cbt, num_warps=g.cwarps or g.num_warps)
        EB = p2(num_experts)
        # static tiles of the counts exchange: never derived from this call's T (docs/protocols.md (host protocol rule))
        self._xgrid, xt = exchange_tiles(self.ncmax, num_experts)
        self._ex = dict(RANK=rank, W=world_size, E=num_experts, L=self.L, A=self.A, WB=self.c["WB"], LB=p2(self.L),
                        EB=EB, **xt, HAS_TIMER=self.has_timer, DOUBLE=True,
                        **self._kw)
        self._precompile(group)

    # ---------------------------------------------------------------------------------------------- helpers
    def expert_out_buffer(self) -> torch.Tensor:
        """The symmetric ``[max_recv_tokens, H]`` expert-output region (zero copy into combine)."""
        return self.buf.local("expert_out")

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes of this rank's allocation (0 once closed)."""
        return self.buf.nbytes if self.buf is not None else 0

    @property
    def geometry(self):
        """The :class:`tritonep.ep.geometry.Geometry` every launch of this buffer uses."""
        return self.geo

    def _check_usable(self):
        if self.broken:
            raise BufferStateError(f"EPBuffer on rank {self.rank} is unusable: {self.broken}")

    def check(self, what="EPBuffer"):
        """Read the status word on the host and raise its typed error (one sync).

        A capacity error is reported once and cleared (the buffer stays usable); a timeout makes it unusable.
        """
        self.host_reads += 1
        st = self.status[:_ST_ERR].cpu().clone()  # .cpu() of a CPU tensor is the tensor itself
        if int(st[_CODE]) in (STATUS_CAPACITY, STATUS_BAD_INPUT):
            self.status.zero_()
        if int(st[_CODE]) == STATUS_BAD_INPUT and self.rank in bad_ranks(st):
            self._raise_own_bad_ids()
        try:
            raise_for_status(st, self.rank, self.max_recv, what, self.timeout_s, self.device.type)
        except PeerTimeoutError as e:
            self.broken = str(e)
            raise

    def _raise_own_bad_ids(self):
        """This rank's input was refused on the device (sync checks off): raise InputError naming the value, from
        the most recent of the last dispatches' ``topk_idx`` that holds an id outside ``[-1, E)``."""
        for idx in reversed(self._recent_idx):
            check_expert_ids(idx, self.E)
        raise InputError(f"rank {self.rank}: the topk_idx of an earlier dispatch held an id outside "
                         f"[-1, num_experts={self.E}) (found on the device; no longer held to name the value)")

    def _eager_check(self, what):
        """Strict eager calls (TRITONEP_SYNC_CHECKS=1, not capturing) raise a wait the kernels gave up on in the same
        call (one sync). By default (deferred) the next dispatch's one host read raises it instead.
        """
        if envs.sync_checks() != envs.SYNC_STRICT or self._launch.warming or (
                self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        self.check(what)

    def _calls(self, which):
        """One-element view of call counter ``which`` (a ``P.CALL_*``)."""
        i = P.v(which)
        return self.calls[i:i + 1]

    def _flag_off(self, row):
        """Byte offset of flag row ``row`` (a ``P.FLAG_*``) in every rank's flags region."""
        return P.flag_row_bytes(row, self.W)

    # ---------------------------------------------------------------------------------------------- construction
    def _precompile(self, group):
        """Compile every kernel variant this buffer can launch (GPU), then one barrier of the group (every device).

        The dry run walks the real code paths (dispatch with and without keep_quantized, push and pull combine,
        both backwards) with every launch turned into ``kernel.warmup`` (:meth:`Launcher.dry_run`), and puts the
        call counters and status back. No call ever compiles-and-barriers lazily (docs/protocols.md (host protocol rule)).
        """
        def walk():
            T, H, K, dev = self.Tm, self.H, self.K, self.device
            x = torch.zeros(T, H, dtype=self.dtype, device=dev)
            idx = torch.zeros(T, K, dtype=torch.int64, device=dev)
            w = torch.zeros(T, K, dtype=torch.float32, device=dev)
            variants = [False, True] if self.dwire.quantized else [False]
            for kq in variants:
                out, out_w, _, _, handle = self.dispatch_fwd(x, idx, w, sync=False, keep_quantized=kq)
            eo = self.expert_out_buffer()
            for kind in ("push", "pull"):
                self._combine(eo, handle, weighted=True, kind=kind, wire=self.cwire)
            self.dispatch_bwd(eo, None, handle)
            self.dispatch_bwd(eo, out_w, handle)
            self.combine_bwd(x, eo, handle)

        self._launch.dry_run(walk, restore=(self.calls, self.status))
        group_barrier(group, self.device)  # NCCL or gloo (ranks that share a GPU)

    # ---------------------------------------------------------------------------------------------- dispatch
    def dispatch_fwd(self, x, topk_idx, topk_weights, sync: bool, keep_quantized: bool = False,
                     bad_input: bool = False):
        """Forward dispatch (see the module docstring for the launch sequence).

        ``bad_input=True``: the front door refused this rank's input; ``x``/``topk_idx``/``topk_weights`` are
        empty and the rank still runs the whole launch sequence, flagging the refusal in its counts row, so every
        rank fails this call together (:class:`PeerInputError`) and the next call pairs correctly.

        Raises (eager, ``sync``): PeerInputError / InputError (ids outside ``[-1, E)`` on this rank),
        CapacityError, PeerTimeoutError; no row moves on any rank for the first two.
        """
        self._check_usable()
        g, c = self.geo, self.c
        T = x.shape[0]
        if not bad_input:
            self._recent_idx = (self._recent_idx + [topk_idx])[-4:]
        if g.decode:
            return self._dispatch_decode(x, topk_idx, topk_weights, sync, keep_quantized, bad_input)
        nc = triton.cdiv(T, g.bt)
        self._launch(chunk_hist_kernel, (g.grid_hist,), topk_idx, self.hist, T, nc, K=self.K, E=self.E,
                     EB=self._ex["EB"], BT=g.bt, KB=c["KB"], bump_a=self._calls(P.CALL_DISPATCH), bump_b=self._calls(P.CALL_EXCHANGE), NBUMP=2,
                     **self._kw)
        ntpe = torch.empty(self.L, dtype=torch.int32, device=self.device)
        offs = torch.empty(self.L, dtype=torch.int32, device=self.device)
        counts = torch.empty(self.W, self.E, dtype=torch.int32, device=self.device)
        self._launch(exchange_kernel, (self._xgrid,), self.hist, nc, self.tab["counts"], self.flags, self.tab["flags"],
                     self._flag_off(P.FLAG_COUNTS), self.calls[_CX:], self.status, self.timeout, self.pre,
                     self.send_base, ntpe, offs, self.rows_needed, self.max_recv, int(bad_input),
                     dcall_ptr=self._calls(P.CALL_DISPATCH), rows_out_ptr=self.status[_ROWS:_ROWS + 1], counts_out_ptr=counts, **self._ex)
        handle = self._new_handle(topk_idx, topk_weights, T, counts)
        fused = g.fused_send > 0
        st = None
        if sync:
            # the one host read: (status, rows this rank receives), staged right after the exchange; the send is
            # queued before the host waits, so its NVLink time overlaps the read and the expand's launch
            self.host_reads += 1
            if self.device.type == "cuda":
                self._st_host.copy_(self.status[:_ST_HOST], non_blocking=True)
                self._st_event.record()
                if not fused:
                    self._send(x, handle, topk_weights, compute_rows=True, nc=nc, wire=self.dwire)
                self._st_event.synchronize()
                st = self._st_host.clone()
            else:
                if not fused:
                    self._send(x, handle, topk_weights, compute_rows=True, nc=nc, wire=self.dwire)
                st = self.status[:_ST_HOST].clone()
        elif not fused:
            self._send(x, handle, topk_weights, compute_rows=True, nc=nc, wire=self.dwire)
        code, refused, R = self._verdict(st, handle)
        out, out_w, q, sc = self._alloc_out(R if R is not None else self.max_recv, R is not None, keep_quantized)
        # the data kernels run on every rank whatever the verdict (a refused call's kernels move no row: the
        # exchange recorded this dispatch's number in status[ST_SKIP_CALL]), so the flags advance identically everywhere
        if fused:
            self._fused(x, handle, topk_weights, out, out_w, ntpe, offs, q, sc)
        else:
            self._expand(x, out, out_w, handle, ntpe, offs, keep_handle=True, wire=self.dwire, q=q, sc=sc)
        return self._dispatch_result(code, refused, st, sync, bad_input, topk_idx, out, out_w, q, sc, ntpe, offs,
                                     handle, R)

    def _send(self, x, handle, topk_weights, compute_rows, nc, wire=_RAW):
        g = self.geo
        self._launch(dispatch_send_kernel, (g.grid_send,),
                     x, handle.topk_idx, topk_weights, handle.rows, handle.num_tokens, nc, self.pre, self.send_base,
                     self.tab["stage"], self.tab["meta"], self.tab["wts"], self.tab["ntok"],
                     self.flags, self.tab["flags"], self._flag_off(P.FLAG_DATA), self.calls, self.status, self.timeout,
                     g.grid_expand, self.Tm, E=self.E, L=self.L, COMPUTE_ROWS=compute_rows, WIRE=wire,
                     **self._ck)

    def _fused(self, x, handle, topk_weights, out, out_w, ntpe, offs, q, sc):
        """Forward dispatch as one launch (send and expand overlapped; :mod:`tritonep.kernels.dispatch_fused`)."""
        g = self.geo
        b = self.buf
        self._launch(dispatch_fused_kernel, (g.fused_send + g.fused_expand,),
                     x, handle.topk_idx, topk_weights, handle.rows, handle.num_tokens, self.pre, self.send_base,
                     self.tab["stage"], self.tab["meta"], self.tab["wts"], self.tab["ntok"], self.tab["cflag"],
                     b.local("cflag"), b.local("stage"), b.local("meta"), b.local("wts"), b.local("ntok"), out, out_w,
                     handle.meta, handle.wts, handle.ntok, ntpe, offs,
                     self.flags, self.tab["flags"], self._flag_off(P.FLAG_DATA), self._flag_off(P.FLAG_ACK), self.calls, self.status,
                     self.timeout, g.grid_send, g.grid_expand, self.Tm, self.ncmax, GS=g.fused_send, E=self.E,
                     L=self.L, BA=triton.next_power_of_2(max(self.A, 1)), A=self.A, WIRE=self.dwire,
                     KEEP_Q=q is not None, q_ptr=q, s_ptr=sc, PF=g.prefetch,
                     **self._ck)

    def _expand(self, x, out, out_w, handle, ntpe, offs, keep_handle, scale=False, eo=None, gw=None, wire=_RAW,
                q=None, sc=None):
        """Expand launch. ``x``: the tensor the send of this call read (raw wire: own-rank rows come from it)."""
        g = self.geo
        b = self.buf
        self._launch(dispatch_expand_kernel, (g.grid_expand,),
                     x, b.local("stage"), b.local("meta"), b.local("wts"), b.local("ntok"), out, out_w,
                     handle.meta, handle.wts, handle.ntok, ntpe, offs,
                     eo if eo is not None else out, gw if gw is not None else out_w,
                     self.flags, self.tab["flags"], self._flag_off(P.FLAG_ACK), self.calls, self.status, self.timeout,
                     g.grid_send, self.Tm, self.ncmax, L=self.L, LB=triton.next_power_of_2(self.L),
                     BA=triton.next_power_of_2(max(self.A, 1)) if keep_handle else 1, A=self.A if keep_handle else 1,
                     SCALE=scale, DOT=eo is not None,
                     KEEP_HANDLE=keep_handle, WIRE=wire, KEEP_Q=q is not None, q_ptr=q, s_ptr=sc, PF=g.prefetch,
                     **self._ck)

    # ---------------------------------------------------------------------------------------------- combine
    def _combine(self, eo, handle, weighted, gw=None, want_wgrad=False, kind=None, wire=_RAW):
        self._check_usable()
        g = self.geo
        kind = kind or g.combine
        if want_wgrad or wire.quantized:
            kind = "push"  # quantized partials and weight-gradient return are push-only
        if g.decode and kind == "push" and weighted and not want_wgrad:
            return self._combine_decode(eo, handle, wire), None  # one launch; it advances CALL_COMBINE itself
        T = handle.num_tokens
        nc = triton.cdiv(T, self._cbt)
        self._calls(P.CALL_COMBINE).add_(1)
        stage = self.tab["cstage"]
        if g.fused_combine and kind == "push" and weighted and not want_wgrad:
            y = torch.empty(T, self.H, dtype=eo.dtype, device=self.device)
            self._launch(combine_fused_kernel, (g.fused_send + g.fused_expand,),
                         eo, handle.meta, handle.wts, handle.ntok, stage, self.tab["ccflag"], self.buf.local("ccflag"),
                         handle.topk_idx, y, T, self.flags, self.tab["flags"], self._flag_off(P.FLAG_CDATA), self._flag_off(P.FLAG_CACK),
                         self.calls, self.status, self.timeout, g.grid_partial, g.grid_out, self.Tm, self.ncmax_c,
                         GS=g.fused_send, L=self.L, WIRE=wire,
                         **self._cck)
            self._eager_check("combine")
            return y, None
        self._launch(combine_partial_kernel, (g.grid_partial,),
                     eo, handle.meta, handle.wts, handle.ntok, gw if gw is not None else handle.wts, stage,
                     self.tab["wback"], self.flags, self.tab["flags"], self._flag_off(P.FLAG_CDATA), self.calls, self.status,
                     self.timeout, g.grid_out, self.Tm, self.ncmax_c, PUSH=kind == "push", WEIGHTED=weighted,
                     SEND_WGRAD=want_wgrad, WIRE=wire,
                     **self._cck)
        y = torch.empty(T, self.H, dtype=eo.dtype, device=self.device)
        gtw = torch.empty(T, self.K, dtype=torch.float32, device=self.device) if want_wgrad else None
        self._launch(combine_out_kernel, (g.grid_out,),
                     handle.topk_idx, y, T, nc, stage, self.buf.local("wback"), gtw if gtw is not None else y,
                     self.flags, self.tab["flags"], self._flag_off(P.FLAG_CACK), self.calls, self.status, self.timeout,
                     g.grid_partial, self.Tm, L=self.L, PULL=kind == "pull", RECV_WGRAD=want_wgrad, WIRE=wire,
                     **self._cck)
        self._eager_check("combine" if weighted else "dispatch backward")
        return y, gtw

    def combine_fwd(self, expert_out, handle, kind=None):
        y, _ = self._combine(expert_out, handle, weighted=True, kind=kind, wire=self.cwire)
        return y

    # ---------------------------------------------------------------------------------------------- backward
    def dispatch_bwd(self, grad_recv_x, grad_recv_w, handle):
        """grad_x[t] = sum_k grad_recv_x[row(t,k)]; grad_topk_weights[t,k] = grad_recv_w[row(t,k)]."""
        gw = grad_recv_w
        y, gtw = self._combine(grad_recv_x.contiguous(), handle, weighted=False,
                               gw=gw.contiguous() if gw is not None else None, want_wgrad=gw is not None)
        return y, gtw

    def combine_bwd(self, grad_y, expert_out, handle):
        """grad_expert_out[row] = w * grad_y[t]; grad_recv_w[row] = <grad_y[t], expert_out[row]>."""
        self._check_usable()
        R = expert_out.shape[0]
        g_eo = torch.zeros(R, self.H, dtype=self.dtype, device=self.device)
        g_w = torch.zeros(R, dtype=torch.float32, device=self.device)
        out_w_scratch = torch.empty(R, dtype=torch.float32, device=self.device)
        self._calls(P.CALL_DISPATCH).add_(1)
        nc = triton.cdiv(handle.num_tokens, self.geo.bt)
        gy = grad_y.contiguous()  # held until the expand ran: it reads the own rank's rows from it (raw wire)
        self._send(gy, handle, handle.topk_weights, compute_rows=False, nc=nc)
        dummy = torch.empty(self.L, dtype=torch.int32, device=self.device)
        self._expand(gy, g_eo, out_w_scratch, handle, dummy, dummy, keep_handle=False, scale=True,
                     eo=expert_out.contiguous(), gw=g_w)
        self._eager_check("combine backward")
        return g_eo, g_w

    def close(self):
        if self.buf is not None:
            self.buf.close()
            self.buf = None
