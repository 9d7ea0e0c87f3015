"""Every kernel launch of one triton-backend buffer, bound once at construction (:class:`KernelSet`).

Each launch of a dispatch, combine or backward is a :class:`tritonep.runtime.bound.BoundKernel` whose static
arguments (regions, pointer tables, flag offsets, call counters, status word, wait bound, tiles, ranks, wires,
grids) come from the buffer's :class:`tritonep.ep.config.EPConfig` and regions here, once; a call passes only its
per-call values, named in the ``dyn`` tuple of each kernel below, in that order. Variants that depend on the call
kind (wire, push / pull, weighted, weight-gradient return, keep_quantized) are bound on first use and cached: the
dry run of :meth:`tritonep.backends.triton.backend.TritonEP._precompile` touches every one at construction.

The launch sequence of each call, and what every flag, counter and wait means, is documented in
:mod:`tritonep.backends.triton.backend` and docs/protocols.md.
"""

from __future__ import annotations

import torch
import triton

from ...device import protocol as P
from .kernels.combine import combine_out_kernel, combine_partial_kernel
from .kernels.combine_fused import combine_fused_kernel
from .kernels.decode_combine import combine_decode_kernel
from .kernels.decode_dispatch import dispatch_decode_kernel
from .kernels.dispatch import dispatch_expand_kernel, dispatch_send_kernel
from .kernels.dispatch_fused import dispatch_fused_kernel
from .kernels.layout import chunk_hist_kernel, exchange_kernel, exchange_tiles
from ...wire.formats import get_wire
from ...runtime.bound import STORE, BoundKernel
from .status import ST_HOST

__all__ = ["KernelSet", "RAW", "one_pass_combine"]

RAW = get_wire("bf16").codec  # backward passes move bf16
_p2 = triton.next_power_of_2


def one_pass_combine(cfg, wire, kind: str = "push", wgrad: bool = False) -> bool:
    """Whether a combine (weighted, or the unweighted dispatch backward) runs as the one-pass ("DIRECT") world-1
    combine: the ``direct`` flag of :meth:`KernelSet.partial`, :meth:`KernelSet.out`, :meth:`KernelSet.combine_fused`
    and :meth:`KernelSet.combine_decode`.

    True exactly when the buffer has ONE rank (``cfg.world_size == 1``), its rows are bf16 (``cfg.dtype``: the
    expert outputs and the combine's output; every combine's ``eo`` has that dtype, checked at the front door), the
    combine travels on the raw bf16 wire (``wire`` not quantized), it is a push combine (``kind``) and returns no
    weight gradients (``wgrad`` False). Then a token's one partial is its output row bit for bit (the output's sum
    over one rank rounds the bf16 partial to itself), so the partial step stores the output rows and they are read
    once; the output step (or role) only finishes the call (counters, acks, status).

    Args:
        cfg: the buffer's :class:`tritonep.ep.config.EPConfig`. wire: the combine's device codec. kind: ``"push"`` or
            ``"pull"``. wgrad: the dispatch backward returns the weight gradients.
    """
    return cfg.world_size == 1 and cfg.dtype is torch.bfloat16 and kind == "push" and not wgrad and not wire.quantized


class KernelSet:
    """The bound kernels of one :class:`tritonep.backends.triton.backend.TritonEP` (see the module docstring).

    Args:
        cfg: the buffer's config (its kernel tiles, sizes, wires). views: its
            :class:`tritonep.backends.triton.regions.RegionViews`. hl: its handle layout
            (:class:`tritonep.backends.triton.outputs.HandleLayout`). launch: its
            :class:`tritonep.runtime.launch.Launch`. rank / device: this rank's. timeout: the wait bound in the
            kernels' unit (:func:`tritonep.runtime.status.wait_bound`). host_mapped: the pinned tensor the verdict
            launches publish into (:class:`tritonep.backends.triton.status.CallStatus`). dwire: the dispatch wire's
            device codec.

    Attributes: ``xhost`` (int32 pinned ``[count_columns]``: the count routing's sums, or None; ``xhost_np`` its
    numpy view), ``hist``, ``exchange``, ``send`` (forward, dispatch wire), ``send_bwd`` (combine backward, raw),
    ``expand_bwd``; methods ``count_sums(count, status_read)``, and ``expand(kq)``, ``fused(kq)``, ``decode(kq)``,
    ``partial(kind, weighted, wgrad, wire, direct)``, ``out(kind, wgrad, wire, direct)``,
    ``combine_fused(wire, direct)``, ``combine_decode(wire, weighted, wgrad)`` for the variants.
    """

    def __init__(self, cfg, views, hl, launch, *, rank: int, device, timeout: int, host_mapped, dwire):
        g, b, v = cfg.tiles, views, views
        self._cfg, self._v, self._hl, self._lau = cfg, views, hl, launch
        self._dwire, self._host_mapped = dwire, host_mapped
        # the count routing's per-local-expert sums of an eager decode dispatch (EPConfig.count_columns; pinned: the
        # kernel stores into it before it publishes the status words, kernels/decode_dispatch.py)
        self.xhost = torch.zeros(max(1, cfg.count_columns), dtype=torch.int32,
                                 pin_memory=device.type == "cuda") if cfg.count_columns else None
        self.xhost_np = self.xhost.numpy() if self.xhost is not None else None  # the host's view (no torch call)
        self._xviews: dict = {}  # n -> xhost_np[:n] (count_sums)
        W, E, K, L, A = cfg.world_size, cfg.num_experts, cfg.topk, cfg.num_local_experts, cfg.expert_alignment
        Tm, H = cfg.max_tokens_per_rank, cfg.hidden
        opts = {"num_warps": g.num_warps}
        if device.type == "cuda":
            opts["num_stages"] = 1  # waits guard later loads: the pipeliner must not hoist them (docs/protocols.md)
        self.ncmax = max(1, triton.cdiv(Tm, g.bt))
        self.ncmax_c = max(1, triton.cdiv(Tm, g.cbt))
        ck = dict(rank=rank, W=W, K=K, KB=_p2(K), H=H, BH=g.bh, BT=g.bt, WB=max(2, _p2(W)),
                  HAS_TIMER=device.type == "cuda", RB=2 * H, **opts)
        self._ck = ck
        self._cck = dict(ck, BT=g.cbt, num_warps=g.cwarps)
        common = dict(flags_ptr=v.flags, flags_tab=v.tab["flags"], calls_ptr=v.calls, status_ptr=v.status,
                      timeout=timeout)
        self._common = common
        fo = lambda row: P.flag_row_bytes(row, W)  # noqa: E731 - byte offset of a flag row
        self._fo = fo
        calls = lambda which: v.calls[P.v(which):P.v(which) + 1]  # noqa: E731 - one counter's view
        cx = P.v(P.CALL_EXCHANGE)
        xopts = dict(opts, num_warps=g.xwarps or g.num_warps)  # the count kernels' warps (KernelTiles.xwarps)
        self.hist = self._lau.bind(chunk_hist_kernel, dict(
            hist_ptr=v.hist, K=K, E=E, EB=_p2(E), BT=g.bt, KB=_p2(K), bump_a=calls(P.CALL_DISPATCH),
            bump_b=calls(P.CALL_EXCHANGE), NBUMP=2, COPY=True, **xopts),
            ("topk_idx_ptr", "w_ptr", STORE, "T", "NC"), grid=(g.grid_hist,),
            fields=hl.fields_of(idx_out_ptr="idx", w_out_ptr="w"))
        # static tiles: never derived from this call's T
        xgrid, xt = exchange_tiles(self.ncmax, E, cfg.max_programs, g.xeb)
        self._xgrid = xgrid
        self._xstatic = dict(
            hist_ptr=v.hist, counts_tab=v.tab["counts"], flags_ptr=v.flags, flags_tab=v.tab["flags"],
            flag_off=fo(P.FLAG_COUNTS), calls_ptr=v.calls[cx:], status_ptr=v.status, timeout=timeout,
            pre_ptr=v.pre, send_base_ptr=v.send_base, rows_needed_ptr=v.rows_needed,
            max_recv=cfg.max_recv_tokens, rank=rank, W=W, E=E, L=L, A=A, WB=ck["WB"], LB=_p2(L), EB=_p2(E),
            HAS_TIMER=ck["HAS_TIMER"], DOUBLE=True, dcall_ptr=calls(P.CALL_DISPATCH),
            rows_out_ptr=v.status[P.v(P.ST_ROWS_RECEIVED):P.v(P.ST_ROWS_RECEIVED) + 1], host_st_ptr=self._host_mapped,
            HOST_ST=ST_HOST, DEAD=True, **xt, **xopts)
        # a buffer with count_columns: every exchange (with a count routing or not) writes and compares the ranks'
        # count stamps (kernels/layout.py write_count_stamp / count_stamps)
        self._xregion = dict(xcounts_tab=v.tab["xcounts"], xcounts_ptr=v.xcounts,
                             XC=cfg.count_columns) if cfg.count_columns else {}
        self._xstatic.update(self._xregion)
        self.exchange = self._lau.bind(exchange_kernel, self._xstatic,
            ("NC", STORE, "host_bad", "ticket"), grid=(xgrid,),
            fields=hl.fields_of(ntpe_ptr="ntpe", offs_ptr="offs", counts_out_ptr="counts"))
        send = dict(pre_ptr=v.pre, send_base_ptr=v.send_base, stage_tab=v.tab["stage"], meta_tab=v.tab["meta"],
                    wts_tab=v.tab["wts"], ntok_tab=v.tab["ntok"], data_off=fo(P.FLAG_DATA), G_expand=g.grid_expand,
                    Tmax=Tm, E=E, L=L, **common, **ck)
        sdyn, sf = ("x_ptr", STORE, "T", "NC"), hl.fields_of(topk_idx_ptr="idx", topk_w_ptr="w", rows_ptr="rows")
        self.send = self._lau.bind(dispatch_send_kernel, dict(send, COMPUTE_ROWS=True, WIRE=self._dwire), sdyn,
                                   grid=(g.grid_send,), fields=sf)
        self.send_bwd = self._lau.bind(dispatch_send_kernel, dict(send, COMPUTE_ROWS=False, WIRE=RAW, ADV=1), sdyn,
                                       grid=(g.grid_send,), fields=sf)
        # the receiver-side fields of the handle (expand, partial, combine)
        self._recv = hl.fields_of(hmeta_ptr="meta", hwts_ptr="wts", hntok_ptr="ntok")
        self._layout = dict(self._recv, **hl.fields_of(ntpe_ptr="ntpe", offs_ptr="offs"))
        self._expand_static = dict(stage_ptr=b.local("stage"), meta_ptr=b.local("meta"), wts_ptr=b.local("wts"),
                                   ntok_ptr=b.local("ntok"), ack_off=fo(P.FLAG_ACK), G_send=g.grid_send, Tmax=Tm,
                                   NCmax=self.ncmax, L=L, LB=_p2(L), PF=g.prefetch, **common, **ck)
        # the combine backward's expand: its own tile and grid (KernelTiles.bbt / bwarps / bgrid: the weight gradient's
        # expert-output loads spill registers in the dispatch's tile; its last program acks the sources for
        # grid_expand programs); it zeroes the rows no route writes itself (padding, rows past the layout's end), so
        # its outputs are allocated empty
        self.expand_bwd = self._lau.bind(dispatch_expand_kernel, dict(
            self._expand_static, BT=g.bbt, num_warps=g.bwarps, NCmax=max(1, triton.cdiv(Tm, g.bbt)), PF=False,
            GA=g.grid_expand,
            BA=1, A=A, SCALE=True, DOT=True, KEEP_HANDLE=False, WIRE=RAW, KEEP_Q=False, ADV=1),
            ("x_ptr", "out_ptr", STORE, "eo_ptr", "gw_ptr", "out_w_ptr", "nrows"), grid=(g.bgrid,),
            fields=self._layout)
        # a combine's refusal marks (every peer's cbad) and the eager combine's status publish (last program)
        self._refusal = dict(cbad_ptr=v.local("cbad"), host_st_ptr=self._host_mapped, HOST_ST=ST_HOST)

    # ------------------------------------------------------------------------------------------------ dispatch
    def count_sums(self, count, status_read) -> list | None:
        """The count routing's per-local-expert sums of a dispatch that had one (``count``: its
        ``(count_ids, count_experts, Tc, CK)``, or None) and whose status words were read (``status_read``): the first
        ``count_experts / W`` words of ``xhost``, which the verdict launch stored before it published the status
        words (no second read); else None."""
        if count is None or not status_read:
            return None
        n = count[1] // self._cfg.world_size
        v = self._xviews.get(n)
        if v is None:  # the first n words' numpy view, made once per n
            v = self._xviews[n] = self.xhost_np[:n]
        return v.tolist()

    def expand(self, kq: bool) -> BoundKernel:
        """Forward expand (dispatch wire; ``kq``: keep_quantized output)."""
        bk = self._lau.bound(("expand", kq))  # every call after the first: no closure built
        if bk is not None:
            return bk
        v, g, cfg = self._v, self._cfg.tiles, self._cfg

        def make():
            return self._lau.bind(dispatch_expand_kernel, dict(
                self._expand_static, BA=_p2(max(cfg.expert_alignment, 1)), A=cfg.expert_alignment, SCALE=False,
                DOT=False, KEEP_HANDLE=True, WIRE=self._dwire, KEEP_Q=kq),
                ("x_ptr", "out_ptr", "out_w_ptr", STORE, "eo_ptr", "gw_ptr", "q_ptr", "s_ptr", "nrows"),
                grid=(g.grid_expand,),
                fields=self._layout)
        return self._lau.variant(("expand", kq), make)

    def fused(self, kq: bool) -> BoundKernel:
        """One-launch forward dispatch (send and expand roles; ``kq``: keep_quantized output)."""
        bk = self._lau.bound(("fused", kq))  # every call after the first: no closure built
        if bk is not None:
            return bk
        v, g, cfg, b = self._v, self._cfg.tiles, self._cfg, self._v

        def make():
            return self._lau.bind(dispatch_fused_kernel, dict(
                pre_ptr=v.pre, send_base_ptr=v.send_base, stage_tab=v.tab["stage"], meta_tab=v.tab["meta"],
                wts_tab=v.tab["wts"], ntok_tab=v.tab["ntok"], cflag_tab=v.tab["cflag"],
                cflag_ptr=b.local("cflag"), stage_ptr=b.local("stage"), meta_ptr=b.local("meta"),
                wts_ptr=b.local("wts"), ntok_ptr=b.local("ntok"), data_off=self._fo(P.FLAG_DATA),
                ack_off=self._fo(P.FLAG_ACK), G_send_std=g.grid_send, G_expand_std=g.grid_expand,
                Tmax=cfg.max_tokens_per_rank, NCmax=self.ncmax, GS=g.fused_send, E=cfg.num_experts,
                L=cfg.num_local_experts, BA=_p2(max(cfg.expert_alignment, 1)), A=cfg.expert_alignment,
                WIRE=self._dwire, KEEP_Q=kq, PF=g.prefetch, **self._common, **self._ck),
                ("x_ptr", STORE, "T", "out_ptr", "out_w_ptr", "q_ptr", "s_ptr", "nrows"),
                grid=(g.fused_send + g.fused_expand,),
                fields=dict(self._layout, **self._hl.fields_of(topk_idx_ptr="idx", topk_w_ptr="w", rows_ptr="rows")))
        return self._lau.variant(("fused", kq), make)

    def exchange_count(self, ck: int, ce: int) -> BoundKernel:
        """The counts exchange with a count routing of ``ck`` ids per token over ``ce`` experts (its sums go to
        :attr:`xhost`): :attr:`exchange`'s launch with the dynamic arguments ``cid_ptr``, ``Tc`` after the others."""
        key = ("exchange", ck, ce)
        bk = self._lau.bound(key)
        if bk is not None:
            return bk
        v, cfg = self._v, self._cfg

        def make():
            return self._lau.bind(exchange_kernel, dict(
                self._xstatic, xhost_ptr=self.xhost, CK=ck, CKB=_p2(ck), CE=ce,
                CLB=_p2(max(ce // cfg.world_size, 2)),
                TCB=max(1, 2048 // _p2(ck))),
                ("NC", STORE, "host_bad", "ticket", "cid_ptr", "Tc"), grid=(self._xgrid,),
                fields=self._hl.fields_of(ntpe_ptr="ntpe", offs_ptr="offs", counts_out_ptr="counts"))
        return self._lau.variant(key, make)

    def decode(self, kq: bool, ck: int = 0, ce: int = 0, carry: bool = False) -> BoundKernel:
        """One-launch decode dispatch (counts exchange folded in; ``kq``: keep_quantized output; ``ck`` > 0: with a
        count routing of ``ck`` ids per token over ``ce`` experts, whose per-expert sums go to :attr:`xhost`,
        dynamic arguments ``cid_ptr``, ``Tc`` after the others; ``carry``: the routing travels with the rows,
        :mod:`tritonep.backends.triton.kernels.carry`, dynamic arguments ``cw_ptr``, ``cidx_ptr``, ``cw_out_ptr``
        after those)."""
        key = ("decode", kq, ck, ce, carry)
        bk = self._lau.bound(key)  # every call after the first: no closure built
        if bk is not None:
            return bk
        v, g, cfg, b = self._v, self._cfg.tiles, self._cfg, self._v
        extra, dyn = dict(self._xregion), ()  # the count stamps of a buffer with count_columns, every call
        if ck:
            W = cfg.world_size
            extra.update(xhost_ptr=self.xhost, CK=ck, CKB=_p2(ck), CE=ce, CLB=_p2(max(ce // W, 2)))
            dyn = ("cid_ptr", "Tc")
        if carry:
            extra.update(CARRY=True, CKC=cfg.count_topk, carry_tab=v.tab["carry"], carry_ptr=v.carry)
            dyn += ("cw_ptr", "cidx_ptr", "cw_out_ptr")

        def make():
            return self._lau.bind(dispatch_decode_kernel, dict(
                max_recv=cfg.max_recv_tokens, hist_ptr=v.hist, pre_ptr=v.pre, counts_tab=v.tab["counts"],
                counts_ptr=b.local("counts"), stage_tab=v.tab["stage"], meta_tab=v.tab["meta"],
                wts_tab=v.tab["wts"], ntok_tab=v.tab["ntok"], cflag_tab=v.tab["cflag"],
                cflag_ptr=b.local("cflag"), stage_ptr=b.local("stage"), meta_ptr=b.local("meta"),
                wts_ptr=b.local("wts"), ntok_ptr=b.local("ntok"), rows_needed_ptr=v.rows_needed,
                counts_off=self._fo(P.FLAG_COUNTS), data_off=self._fo(P.FLAG_DATA), ack_off=self._fo(P.FLAG_ACK),
                Tmax=cfg.max_tokens_per_rank, NCmax=self.ncmax, E=cfg.num_experts, L=cfg.num_local_experts,
                LB=_p2(cfg.num_local_experts), TB=_p2(cfg.max_tokens_per_rank),
                BA=_p2(max(cfg.expert_alignment, 1)), A=cfg.expert_alignment, WIRE=self._dwire, KEEP_Q=kq, COPY=True,
                host_st_ptr=self._host_mapped, HOST_ST=ST_HOST, **extra, **self._common, **self._ck),
                ("x_ptr", "topk_idx_ptr", "topk_w_ptr", STORE, "T", "host_bad", "nrows_w", "out_ptr", "q_ptr",
                     "s_ptr", "ticket") + dyn, grid=(g.decode,),
                fields=dict(self._layout, **self._hl.fields_of(rows_ptr="rows", counts_out_ptr="counts",
                                                           idx_out_ptr="idx", w_out_ptr="w", out_w_ptr="rw")))
        return self._lau.variant(key, make)

    # ------------------------------------------------------------------------------------------------ combine
    def partial(self, kind: str, weighted: bool, wgrad: bool, wire, direct: bool = False) -> BoundKernel:
        """Expert-rank side of a combine (``kind`` push / pull, weighted, weight-gradient return, wire; ``direct``:
        the world-1 push combine that stores the output rows itself, called with ``y_ptr`` last)."""
        key = ("partial", kind, weighted, wgrad, wire, direct)
        bk = self._lau.bound(key)  # every call after the first: no closure built
        if bk is not None:
            return bk
        v, g, cfg = self._v, self._cfg.tiles, self._cfg

        def make():
            return self._lau.bind(combine_partial_kernel, dict(
                stage_tab=v.tab["cstage"], wback_tab=v.tab["wback"], cdata_off=self._fo(P.FLAG_CDATA),
                G_out=g.grid_out, Tmax=cfg.max_tokens_per_rank, NCmax=self.ncmax_c, PUSH=kind == "push",
                WEIGHTED=weighted, SEND_WGRAD=wgrad, WIRE=wire, cbad_tab=v.tab["cbad"], **self._common,
                **self._cck),
                ("eo_ptr", STORE, "gw_ptr", "bad") + (("y_ptr",) if direct else ()), grid=(g.grid_partial,),
                fields=self._recv)
        return self._lau.variant(key, make)

    def out(self, kind: str, wgrad: bool, wire, direct: bool = False) -> BoundKernel:
        """Source side of a combine (sums the partials in rank order; ``wgrad``: gathers the weight gradients;
        ``direct``: the partial kernel stored the output, this launch only finishes the call)."""
        key = ("out", kind, wgrad, wire, direct)
        bk = self._lau.bound(key)  # every call after the first: no closure built
        if bk is not None:
            return bk
        v, g, cfg = self._v, self._cfg.tiles, self._cfg

        # the raw wire's output kernel in a 32-warp tile: ptxas's own choice was 32 registers and an 8-byte spill
        # with the rank a runtime value; a 40-register cap gives 32-39 registers and no spill on every variant
        # (tests/backends/test_compile_sm90.py; the quantized wires' variants take 54-64 registers, left uncapped)
        cap = {"maxnreg": 40} if not wire.quantized and self._cck["num_warps"] == 32 else {}

        def make():
            return self._lau.bind(combine_out_kernel, dict(
                stage_tab=v.tab["cstage"], wback_ptr=v.local("wback"), cack_off=self._fo(P.FLAG_CACK),
                G_partial=g.grid_partial, Tmax=cfg.max_tokens_per_rank, L=cfg.num_local_experts,
                PULL=kind == "pull", RECV_WGRAD=wgrad, WIRE=wire, DIRECT=direct, **self._refusal, **self._common,
                **self._cck, **cap),
                (STORE, "y_ptr", "T", "NC", "gtw_ptr", "ticket"), grid=(g.grid_out,),
                fields=self._hl.fields_of(topk_idx_ptr="idx"))
        return self._lau.variant(key, make)

    def combine_fused(self, wire, direct: bool = False) -> BoundKernel:
        """Weighted push combine in one launch (partial and out roles; ``direct``: the world-1 one that stores the
        output rows from the partial role, :func:`tritonep.backends.triton.kernels.combine_fused.combine_fused_kernel`'s
        DIRECT)."""
        key = ("combine_fused", wire, direct)
        bk = self._lau.bound(key)  # every call after the first: no closure built
        if bk is not None:
            return bk
        v, g, cfg = self._v, self._cfg.tiles, self._cfg

        def make():
            return self._lau.bind(combine_fused_kernel, dict(
                stage_tab=v.tab["cstage"], ccflag_tab=v.tab["ccflag"], ccflag_ptr=v.local("ccflag"),
                cdata_off=self._fo(P.FLAG_CDATA), cack_off=self._fo(P.FLAG_CACK), G_partial_std=g.grid_partial,
                G_out_std=g.grid_out, Tmax=cfg.max_tokens_per_rank, NCmax=self.ncmax_c, GS=g.fused_send,
                L=cfg.num_local_experts, WIRE=wire, cbad_tab=v.tab["cbad"], DIRECT=direct, **self._refusal,
                **self._common, **self._cck),
                ("eo_ptr", STORE, "y_ptr", "T", "bad", "ticket"), grid=(g.fused_send + g.fused_expand,),
                fields=dict(self._recv, **self._hl.fields_of(topk_idx_ptr="idx")))
        return self._lau.variant(key, make)

    def combine_decode(self, wire, weighted: bool = True, wgrad: bool = False) -> BoundKernel:
        """Push combine of the decode tiles in one launch: weighted (combine) or not (dispatch backward,
        ``wgrad``: with the weight gradients' return); the world-1 one whose partial step stores the output rows
        (:func:`tritonep.backends.triton.kernels.decode_combine.combine_decode_kernel`'s DIRECT) where
        :func:`one_pass_combine` says so, decided when the variant is bound (the buffer's config and the variant
        decide it: no per-call work)."""
        key = ("combine_decode", wire, weighted, wgrad)
        bk = self._lau.bound(key)  # every call after the first: no closure built (a combine's host path)
        if bk is not None:
            return bk
        v, g, cfg = self._v, self._cfg.tiles, self._cfg
        direct = one_pass_combine(cfg, wire, wgrad=wgrad)

        def make():
            return self._lau.bind(combine_decode_kernel, dict(
                stage_tab=v.tab["cstage"], ccflag_tab=v.tab["ccflag"], ccflag_ptr=v.local("ccflag"),
                cdata_off=self._fo(P.FLAG_CDATA), cack_off=self._fo(P.FLAG_CACK), Tmax=cfg.max_tokens_per_rank,
                NCmax=self.ncmax, L=cfg.num_local_experts, WIRE=wire, wback_tab=v.tab["wback"],
                wback_ptr=v.local("wback"), WEIGHTED=weighted, WGRAD=wgrad, cbad_tab=v.tab["cbad"], DIRECT=direct,
                **self._refusal, **self._common, **self._ck),
                ("eo_ptr", STORE, "y_ptr", "T", "gw_ptr", "gtw_ptr", "bad", "ticket"), grid=(g.decode,),
                fields=dict(self._recv, **self._hl.fields_of(topk_idx_ptr="idx")))
        return self._lau.variant(key, make)
