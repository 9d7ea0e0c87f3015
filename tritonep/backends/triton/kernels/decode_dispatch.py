"""Decode dispatch: counts exchange, layout, send, receive-side wait and expand in ONE launch (small T).

At decode sizes (a few hundred tokens per rank) a dispatch moves little data and its time is launch latency: the
standard path makes 4 launches (chunk histograms, counts exchange, send, expand) and the fused one 3. Here every
program of one grid of ``G`` programs (``G <= cdiv(Tmax, BT)``, ``G <= 132``; the tiles' ``dec``) does:

1. loads ALL of this rank's ``topk_idx`` (one ``[TB, KB]`` tile, ``TB = next_pow2(Tmax)``, Tmax at most
   ``tritonep.backends.triton.tiles.DECODE_MAX_TOKENS``) and histograms it over the experts (redundantly in every
   program: no program waits for another program of its own grid);
2. program 0 writes the histogram row (column E = this rank's input-error count, :mod:`tritonep.backends.triton.kernels.layout`)
   into every rank's ``counts[rank]`` and raises ``flags[FLAG_COUNTS, rank]`` everywhere, exactly as
   :func:`tritonep.backends.triton.kernels.layout.exchange_kernel` does; every program waits (bounded, peer named) for the rows
   of the OTHER ranks and takes its own row from registers;
3. computes the layout (:func:`tritonep.backends.triton.kernels.layout.layout_tiles`) and the verdict (bad input anywhere /
   capacity: the same on every rank); program 0 stores ``num_tokens_per_expert``, ``expert_offsets``, the rows
   received and the counts snapshot and records the error;
4. sends its token chunks ``c = pid, pid + G, ...`` (after the sender prologue all dispatch kernels share,
   :func:`tritonep.backends.triton.kernels.dispatch.open_send`; :func:`tritonep.backends.triton.kernels.dispatch.send_chunk`, rows derived
   from a per-chunk prefix it histograms itself and stores in its own scratch rows ``pre[c]`` / ``hist[pid]``),
   publishing ``cflag[rank, c] = n`` in every destination after each chunk (also for chunks past its T);
5. expands the same chunk numbers of every source: waits for ``cflag[src, c] >= n`` (set by program ``pid`` of
   rank ``src``), scatters the rows (:func:`tritonep.backends.triton.kernels.dispatch.expand_arrived`; raw bf16 wire: the own rank's
   rows come from ``x`` and were never staged); program 0 also zeroes the alignment padding;
6. the last program to finish (a done counter ``calls[DONE_DECODE_DISPATCH]``) advances ``calls[CALL_DISPATCH]``
   and ``calls[CALL_EXCHANGE]``; every program reads them before it counts itself done, so no separate launch
   advances them (graph replays stay correct).

Co-residency (why this is safe on CPU and GPU). Waits inside the grid only ever target (a) program 0 of ANOTHER
rank (its counts row), (b) program ``pid`` of another rank (chunk flags; its own rank's program ``pid`` is the
waiting program itself, which published before it waits) and (c) earlier launches (the ACK of the previous call).
No program waits for another program of its own rank's grid, so the interpreter, which runs one program at a time
in order, never deadlocks, and every kernel is correct at grid=1. On the GPU, program ``pid`` of one rank waits for
program ``pid`` (and 0) of its peers: with ``G <= 132`` (one program per SM at most, the tiles enforce it) every
program is resident at once on every rank; when they are not (SMs busy with another stream), the bounded waits
report a timeout naming the peer instead of hanging.

Compatibility with the two-kernel path on the same buffer (combine backward, pull combine): the last program adds G
to DATA and ACK in every rank once every program has sent and expanded (one remote atomic per rank and launch
instead of one per program), and the tiles force ``grid_send == grid_expand == G``, so the per-call totals
equal the two-kernel path's; the chunk flags hold call numbers exactly as the fused dispatch's do.
Ideas: DeepEP's low-latency kernels and pplx-kernels (one kernel sends, counts and receives with per-expert / per-
rank signals; see ../shared/reference/ep_anchors.md), here with Triton programs paired across ranks.
Twin: :func:`tritonep.reference.dispatch_reference` (same bits as the two-kernel path).
"""

import triton
import triton.language as tl

from ....device.common import RowTile
from .carry import carry_arrived, carry_send, carry_tail
from .dispatch import ExpandIO, SendIO, expand_arrived, load_routes, open_send, send_chunk, zero_padding
from .layout import count_stamps, layout_tiles, record_verdict, refused_call, store_layout, write_count_stamp
from ....device.protocol import (CALL_DISPATCH, CALL_EXCHANGE, DONE_DECODE_DISPATCH, FLAG_COUNTS, ST_ROWS_RECEIVED,
                       STATUS_TIMEOUT, WAIT_COUNTS)
from ....device.signal import (finish_launch, mark_dead, peers_alive, publish_epoch, publish_host_status,
                              signal_peers, wait_ge)
from ....wire.kernels.wirecodec import RAW_BF16

__all__ = ["dispatch_decode_kernel"]


@triton.jit
def _own_histogram(topk_idx_ptr, T, limit, K: tl.constexpr, KB: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
                   TB: tl.constexpr, WB: tl.constexpr, LB: tl.constexpr):
    """Routes of tokens ``[0, min(T, limit))`` per expert as an int32 ``[WB, LB]`` tile (destination, local expert),
    and the count of ids outside ``[-1, E)`` among them."""
    t = tl.arange(0, TB)
    k = tl.arange(0, KB)
    m = ((t < T) & (t < limit))[:, None] & (k[None, :] < K)
    raw = load_routes(topk_idx_ptr, t[:, None].to(tl.int64) * K + k[None, :], m, k[None, :], L)
    # range-check at the ids' own width before the int32 cast (an int64 id 2**32 + 1 is not expert 1)
    bad = tl.sum(tl.sum(((raw < -1) | (raw >= E)).to(tl.int32), 1), 0)
    ok = (raw >= 0) & (raw < E)
    ids = tl.where(ok, raw, 0).to(tl.int32)
    pe = tl.where(ok, (ids // L) * LB + ids % L, 0)  # padded (destination, local expert) bin
    h = tl.histogram(tl.reshape(pe, (TB * KB,)), WB * LB, mask=tl.reshape(ok, (TB * KB,)))
    return tl.reshape(h, (WB, LB)), bad


@triton.jit(do_not_specialize=['T', 'host_bad', 'max_recv', 'nrows_w', 'counts_off', 'data_off', 'ack_off', 'timeout',
                               'Tmax', 'NCmax', 'ticket', 'rank', 'Tc'])
def dispatch_decode_kernel(x_ptr, topk_idx_ptr, topk_w_ptr, rows_ptr, T, host_bad, max_recv, nrows_w, hist_ptr, pre_ptr,
                           counts_tab, counts_ptr, stage_tab, meta_tab, wts_tab, ntok_tab, cflag_tab, cflag_ptr,
                           stage_ptr, meta_ptr, wts_ptr, ntok_ptr, out_ptr, out_w_ptr, hmeta_ptr, hwts_ptr,
                           hntok_ptr, ntpe_ptr, offs_ptr, rows_needed_ptr, counts_out_ptr,
                           flags_ptr, flags_tab, counts_off, data_off, ack_off, calls_ptr, status_ptr, timeout,
                           Tmax, NCmax, rank, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
                           K: tl.constexpr, KB: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr,
                           WB: tl.constexpr, LB: tl.constexpr, TB: tl.constexpr, BA: tl.constexpr, A: tl.constexpr,
                           HAS_TIMER: tl.constexpr, RB: tl.constexpr, WIRE: tl.constexpr = RAW_BF16,
                           POW2: tl.constexpr = False, KEEP_Q: tl.constexpr = False, q_ptr=None, s_ptr=None,
                           idx_out_ptr=None, w_out_ptr=None, COPY: tl.constexpr = False, host_st_ptr=None, ticket=0,
                           HOST_ST: tl.constexpr = 0, cid_ptr=None, Tc=0, xcounts_tab=None, xcounts_ptr=None,
                           xhost_ptr=None, XC: tl.constexpr = 0, CK: tl.constexpr = 0, CKB: tl.constexpr = 1,
                           CE: tl.constexpr = 1, CLB: tl.constexpr = 1, cw_ptr=None, carry_tab=None, carry_ptr=None,
                           cidx_ptr=None, cw_out_ptr=None, CARRY: tl.constexpr = False, CKC: tl.constexpr = 1):
    """Forward dispatch in one launch of ``G`` programs (see the module docstring).

    Inputs: ``x [T, H]`` bf16, ``topk_idx [T, K]`` int32/int64, ``topk_weights [T, K]`` fp32 (T <= Tmax <= TB),
    ``host_bad`` (1 = the host refused this rank's input), ``max_recv`` (rows a rank may receive), ``nrows_w``
    (length of ``out_w`` and rows of ``out`` / ``q`` / ``s``: no row at or past it is written; the entries of
    ``out_w`` past the rows received are zeroed here, so the host allocates it without a memset and a captured
    dispatch is one graph node). Outputs as the two-kernel path: ``rows [T, K]``,
    ``out``/``out_w`` (or ``q``/``s`` with KEEP_Q), the handle's ``hmeta``/``hwts``/``hntok``,
    ``num_tokens_per_expert``/``expert_offsets`` [L] int32, ``rows_needed`` [W],
    ``counts_out`` int32 ``[W, E]``, rows received in ``status[ST_ROWS_RECEIVED]``. Scratch owned by one program:
    ``pre[c]`` (chunk c's program) and ``hist[pid]`` (its send base), hence ``G <= NCmax``.
    Errors (status word, read by the host): STATUS_BAD_INPUT / STATUS_CAPACITY (no row moves on any rank),
    STATUS_TIMEOUT with the wait id and the peer. COPY: the last program also writes the handle's own copy of the routing
    (``idx_out [T, K]`` int32, ids outside ``[-1, E)`` as -1, every id of a refused call -1: its layout is empty;
    ``w_out [T, K]`` float32), as
    :func:`tritonep.backends.triton.kernels.layout.chunk_hist_kernel` does on the other paths. ``host_st_ptr`` (not None; HOST_ST: the number
    of status words the host reads, as :func:`tritonep.backends.triton.kernels.layout.exchange_kernel`): program 0 publishes ``status[:HOST_ST]`` and then ``ticket`` into the pinned host tensor
    ``host_st_ptr`` once the verdict is recorded, before any row moves (:func:`tritonep.device.signal.
    publish_host_status`): the host's one read of an eager dispatch waits for that, not for the whole launch (a
    wait that gives up later in this launch is recorded in the status word and raised by the next read, as on the
    two-kernel path, whose read follows the counts exchange).

    Count routing (``CK > 0``; the buffer has the ``xcounts`` region of ``XC`` columns, EPConfig.count_columns): a
    second routing ``cid [Tc, CK]`` (int32/int64 ids over ``CE`` experts, ``CL = CE / W <= XC`` per rank; ids
    outside ``[0, CE)`` count nowhere) whose routes per (destination, local expert) program 0 writes into every
    destination's ``xcounts`` row of this rank with the counts row (the same flag publishes both), and, once the
    other ranks' rows arrived, sums over the sources for this rank: ``sum_s routes of cid_s to expert rank*CL + j``
    (DeepEP's notify step: the receiver's routes per local expert, known before any row moves) stored as int32 into
    the pinned host tensor ``xhost[:CL]`` before the status words are published (a call that reads, ``ticket``
    non-zero, only). Twin: :func:`tritonep.reference.count_sums_reference`.

    Count stamp (``XC > 0``, every call whatever ``CK``): program 0 also writes this call's stamp (``CE`` with a
    count routing, 0 without) into column ``XC`` of this rank's ``xcounts`` row in every rank (rows ``XC + 1``
    wide), released by the same counts flag; every program reads the other ranks' stamps after their flags
    (:func:`tritonep.backends.triton.kernels.layout.count_stamps`, its own from its constexprs) and refuses the
    call when they differ (STATUS_COUNT_MISMATCH, the same verdict on every rank: no row moves, no sums published).

    Carried top-k (``CARRY``, with a count routing of the tokens themselves: ``Tc == T``; the buffer has the ``carry``
    region of ``CKC >= CK`` ids and weights a token, EPConfig.count_topk): the count routing's ids and its weights
    ``cw [T, CK]`` travel with each token's row (:mod:`tritonep.backends.triton.kernels.carry`), and every row this
    rank receives gets the token's ids local to this rank (-1 elsewhere) and weights (0 there) in ``cidx`` /
    ``cw_out`` ``[nrows_w, CK]``; the rows past the ones received: -1 and 0 (DeepEP's ``recv_topk_idx`` /
    ``recv_topk_weights``).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n = tl.load(calls_ptr + CALL_DISPATCH) + 1
    nx = tl.load(calls_ptr + CALL_EXCHANGE) + 1
    E1: tl.constexpr = E + 1
    CL: tl.constexpr = CE // W  # the count routing's local experts per rank (CK > 0)
    tile: tl.constexpr = RowTile(K, KB, H, BH, BT, RB, WIRE, HAS_TIMER)
    cbuf = (nx % 2) * (W * E1)  # the counts region's two matrices for alternate exchanges (exchange_kernel DOUBLE)
    xbuf = (nx % 2) * (W * (XC + 1))  # the same for the xcounts region (count routing and stamps), XC > 0
    d_off = tl.arange(0, WB)
    j_off = tl.arange(0, LB)
    s_off = tl.arange(0, WB)
    m2d = (d_off[:, None] < W) & (j_off[None, :] < L)
    e2d = d_off[:, None] * L + j_off[None, :]
    h2, bad = _own_histogram(topk_idx_ptr, T, T, K, KB, E, L, TB, WB, LB)
    bad += host_bad + (tl.load(status_ptr) == STATUS_TIMEOUT).to(tl.int32)  # as exchange_kernel: a timed-out rank
    # 1) the counts exchange: program 0 publishes this rank's row; everyone waits for the other ranks' rows
    if pid == 0:
        for d in range(W):
            dst = tl.load(counts_tab + d).to(tl.pointer_type(tl.int32)) + cbuf + rank * E1
            tl.store(dst + e2d, h2, mask=m2d)
            tl.store(dst + E, bad)
        if CK > 0:  # the count routing's routes per (destination, local expert), row d to rank d
            hc, _ = _own_histogram(cid_ptr, Tc, Tc, CK, CKB, CE, CL, TB, WB, CLB)
            jc = tl.arange(0, CLB)
            for d in range(W):
                xdst = tl.load(xcounts_tab + d).to(tl.pointer_type(tl.int32)) + xbuf + rank * (XC + 1)
                tl.store(xdst + jc, tl.sum(tl.where(d_off[:, None] == d, hc, 0), 0), mask=jc < CL)
        if XC > 0:  # every call: whether (and over how many experts) this rank counts, for the verdict
            write_count_stamp(xcounts_tab, xbuf, rank, W, XC, CK, CE, CARRY)
        mark_dead(flags_tab, status_ptr, W, rank, WB)  # a timed-out rank: no peer takes what it skips
        signal_peers(flags_tab, counts_off, W, rank, WB)
    ok = tl.full((), 1, tl.int32)
    for s in range(W):
        if s != rank:
            ok = ok & wait_ge(flags_ptr + FLAG_COUNTS * W + s, nx, status_ptr, WAIT_COUNTS, s, timeout, HAS_TIMER)
    ok = ok & peers_alive(flags_ptr, status_ptr, W, WB)  # a peer that gave up on this rank: take none of its rows
    # 2) layout from the full matrix: other ranks' rows from memory, this rank's row from registers
    m3 = (s_off[:, None, None] < W) & m2d[None, :, :]
    peer = (s_off[:, None, None] != rank) & (ok != 0)
    c3 = tl.load(counts_ptr + cbuf + s_off[:, None, None] * E1 + e2d[None, :, :], mask=m3 & peer, other=0)
    c3 = tl.where(s_off[:, None, None] == rank, h2[None, :, :], c3)
    total, aligned, seg_start, prefix, rows = layout_tiles(c3, s_off, rank, A)
    badv = tl.load(counts_ptr + cbuf + s_off * E1 + E, mask=(s_off < W) & (s_off != rank) & (ok != 0), other=0)
    badv = tl.where(s_off == rank, bad, badv)
    stamps = count_stamps(xcounts_ptr, xbuf, ok, rank, W, WB, XC, CK, CE, CARRY)
    refused = refused_call(badv, rows, max_recv, W, WB, stamps)
    if COPY:
        if pid == G - 1:  # not program 0: its work until the host publish is the host read's latency
            tt = tl.arange(0, TB)
            kk = tl.arange(0, KB)
            mc = (tt < T)[:, None] & (kk[None, :] < K)
            oc = tt[:, None].to(tl.int64) * K + kk[None, :]
            wide = load_routes(topk_idx_ptr, oc, mc, kk[None, :], L)
            # a refused call routes nowhere (its handle addresses no row: tritonep.backends.triton.kernels.dispatch.send_chunk)
            keep = (wide >= -1) & (wide < E) & (refused == 0)
            tl.store(idx_out_ptr + oc, tl.where(keep, wide, -1).to(tl.int32), mask=mc)
            tl.store(w_out_ptr + oc, tl.load(topk_w_ptr + oc, mask=mc, other=0.0), mask=mc)
    if pid == 0:
        store_layout(total, aligned, rows, ntpe_ptr, offs_ptr, rows_needed_ptr, status_ptr + ST_ROWS_RECEIVED, rank,
                     W, L, WB, LB, refused)
        record_verdict(badv, rows, max_recv, status_ptr, n, True, W, WB, stamps)
        if CK > 0:  # the count routing's sums over the sources, published before the status words
            if ticket != 0:
                hs, _ = _own_histogram(cid_ptr, Tc, Tc, CK, CKB, CE, CL, TB, WB, CLB)
                js = tl.arange(0, CLB)
                mx = ((s_off[:, None] < W) & (s_off[:, None] != rank) & (ok != 0)) & (js[None, :] < CL)
                xs = tl.sum(tl.load(xcounts_ptr + xbuf + s_off[:, None] * (XC + 1) + js[None, :], mask=mx, other=0),
                            0)
                tl.store(xhost_ptr + js, xs + tl.sum(tl.where(d_off[:, None] == rank, hs, 0), 0), mask=js < CL)
        if host_st_ptr is not None:
            publish_host_status(status_ptr, host_st_ptr, ticket, HOST_ST, HAS_TIMER)
        tl.store(counts_out_ptr + s_off[:, None, None] * E + e2d[None, :, :], c3, mask=m3)  # the handle's snapshot
    # out_w past the rows this rank receives (all of it for a refused call) is zero, as the two-kernel path leaves it
    zb = tl.arange(0, 256)
    w_from = tl.where(refused, 0, tl.sum(tl.where(d_off == rank, rows, 0), 0))
    for i0 in range(w_from + pid * 256, nrows_w, G * 256):
        tl.store(out_w_ptr + i0 + zb, tl.zeros((256,), tl.float32), mask=i0 + zb < nrows_w)
    if CARRY:
        carry_tail(w_from, nrows_w, cidx_ptr, cw_out_ptr, CK, CKB)
    send_base = hist_ptr + pid * E1  # this program's scratch row
    tl.store(send_base + e2d, seg_start + prefix, mask=m2d)
    # 3) send this program's chunks (after the destinations consumed the previous call's staging)
    timed_out, live = open_send(n, G, refused, 0, T, flags_ptr, flags_tab, status_ptr, ntok_tab, timeout, rank,
                                tile, W, WB)
    send_io = SendIO(x_ptr, topk_idx_ptr, topk_w_ptr, rows_ptr, T, pre_ptr, send_base, stage_tab, meta_tab, wts_tab,
                     Tmax, rank)
    for c in range(pid, NCmax, G):
        if c * BT < T:
            pre_c, _ = _own_histogram(topk_idx_ptr, T, c * BT, K, KB, E, L, TB, WB, LB)
            tl.store(pre_ptr + c * E + e2d, pre_c, mask=m2d)
            tl.debug_barrier()  # the scratch rows are read back by other threads of this program
            send_chunk(c, live, send_io, tile, W, E, L, True, POW2)
            if CARRY:  # released with the rows by the chunk flag below
                carry_send(c, T, live, topk_idx_ptr, cid_ptr, cw_ptr, carry_tab, rank, Tmax, BT, K, KB, E, L, W, CK,
                           CKB, CE, CKC)
        publish_epoch(cflag_tab, W, rank * NCmax + c, n, WB)
    # 4) expand the same chunk numbers of every source (published by program pid of that source)
    skip = timed_out | refused
    expand_io = ExpandIO(x_ptr, stage_ptr, meta_ptr, wts_ptr, ntok_ptr, out_ptr, out_w_ptr, hmeta_ptr, hwts_ptr,
                         hntok_ptr, out_ptr, out_w_ptr, q_ptr, s_ptr, Tmax, nrows_w, rank)
    for c in range(pid, NCmax, G):
        for src in range(W):
            expand_arrived(src, c, n, skip, cflag_ptr, NCmax, status_ptr, flags_ptr, timeout, expand_io, tile, KEEP_Q,
                           False, W, WB, POW2)
            if CARRY:  # the chunk arrived (waited for above); a timeout there skips its rows here too
                carry_arrived(src, c, skip | (tl.load(status_ptr) == STATUS_TIMEOUT), meta_ptr, ntok_ptr, carry_ptr,
                              cidx_ptr, cw_out_ptr, nrows_w, rank, Tmax, BT, K, KB, CK, CKB, CE, W, CKC)
    if A > 1:
        if pid == 0:
            if skip == 0:  # a refused call's segments may exceed the rows allocated: write nothing
                tl.debug_barrier()  # ntpe / offs were stored by this program's threads above
                zero_padding(0, 1, expand_io, ntpe_ptr, offs_ptr, tile, L, BA, KEEP_Q)
    finish_launch(calls_ptr, DONE_DECODE_DISPATCH, CALL_DISPATCH, n, CALL_EXCHANGE, nx, True, flags_tab, data_off,
                  ack_off, W, rank, WB)
