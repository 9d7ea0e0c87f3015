"""Layout of a dispatch: per-expert counts, the counts exchange, expert segments and every route's row.

Names: W = world_size, E = num_experts, L = E // W local experts, K = topk, A = expert_alignment.
Expert e lives on rank e // L as local expert e % L. A route is a (token t, slot k) with topk_idx[t, k] >= 0.

On the receiving rank d, local expert j owns the segment ``[seg_start[d, j], seg_start[d, j] + aligned[d, j])`` of
the expert-grouped rows, with ``total[d, j] = sum_src counts[src, d*L + j]`` and
``aligned = round_up(total, A)``. Inside a segment the rows are ordered by (source rank, token, k). So the row of
route (t, k) of source rank s to expert e is

    row = seg_start[e] + sum_{s' < s} counts[s', e] + rank_s(t, k)

where rank_s(t, k) counts the routes of rank s to the same expert that come before (t, k) in (t, k) order. The
sender knows every term once the counts matrix is exchanged, so it computes the destination row itself and sends
it along with the token (the receiver's expand is then a pure scatter).

Triton kernels (each correct at grid=1; see docs/platform.md):

* :func:`chunk_hist_kernel` (grid = chunks): per chunk of BT tokens, the histogram of its routes over E experts
  and the count of ids outside ``[-1, E)``.
* :func:`exchange_kernel` (grid: one program per expert block, :func:`exchange_tiles`; any grid >= 1 is correct):
  each program sums the chunk histograms of its experts (exclusive chunk prefixes) into this rank's counts row and
  writes it into every peer's ``counts[rank, :]``; the last program to arrive (ticket ``calls[DONE_EXCHANGE]``)
  raises the counts signal, waits for every peer (bounded), then computes the layout: ``send_base[e]``, this
  rank's ``num_tokens_per_expert`` / ``expert_offsets`` and the rows every rank needs (capacity check, identical
  on every rank); with ``HOST_ST`` it then publishes the status words and the call's ticket into pinned host memory
  (the host's copy-free read, :class:`tritonep.runtime.host_status.HostStatus`).

Twins (the specification, next to the ops that launch these kernels): :func:`tritonep.backends.layout.counts_torch`,
:func:`tritonep.backends.layout.layout_torch`, :func:`tritonep.backends.layout.route_rows_torch`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ....device.protocol import (CALL_EXCHANGE, DONE_EXCHANGE, ST_BAD_RANK_MASK, ST_NEEDED_ROWS, ST_SKIP_CALL, ST_THIS_CALL,
                       ST_WAITED, STATUS_BAD_INPUT, STATUS_CAPACITY, STATUS_COUNT_MISMATCH, STATUS_TIMEOUT,
                       WAIT_COUNTS)
from ....device.protocol import STAMP_CARRIED, STAMP_TOPK
from ....device.signal import mark_dead, peers_alive, publish_host_status, record_error, signal_peers, wait_all_ge

__all__ = ["chunk_hist_kernel", "exchange_kernel", "exchange_tiles", "layout_tiles", "store_layout", "refused_call", "record_verdict",
           "count_histogram", "count_stamps", "write_count_stamp"]


@triton.jit(do_not_specialize=['T', 'NC'])
def chunk_hist_kernel(topk_idx_ptr, hist_ptr, T, NC, K: tl.constexpr, E: tl.constexpr, EB: tl.constexpr,
                      BT: tl.constexpr, KB: tl.constexpr, bump_a=None, bump_b=None, NBUMP: tl.constexpr = 0,
                      w_ptr=None, idx_out_ptr=None, w_out_ptr=None, COPY: tl.constexpr = False):
    """hist[c, :E] = histogram over experts of the routes of tokens [c*BT, (c+1)*BT) (grid-stride over chunks);
    hist[c, E] = how many of those ids lie outside ``[-1, E)`` (the input check travels with the counts exchange).

    ``hist`` rows are ``E + 1`` wide. Program 0 also advances up to two call counters (``*bump_a += 1``,
    ``*bump_b += 1``): no program of this launch reads them, and every later kernel of the call does, so the bump
    costs no launch of its own.

    COPY: also write the dispatch handle's own copy of the routing: ``idx_out[t, k]`` = the id as int32, or -1 for
    an id outside ``[-1, E)`` (checked at full width, before the cast), ``w_out[t, k] = w[t, k]`` (float32), for
    every ``t < T`` (combine and the backward passes read the handle's copy, never the caller's tensors).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    if NBUMP >= 1:
        if pid == 0:
            tl.store(bump_a, tl.load(bump_a) + 1)
            if NBUMP >= 2:
                tl.store(bump_b, tl.load(bump_b) + 1)
    t_off = tl.arange(0, BT)
    k_off = tl.arange(0, KB)
    e_off = tl.arange(0, EB)
    for c in range(pid, NC, G):
        t = c * BT + t_off
        m = (t[:, None] < T) & (k_off[None, :] < K)
        off = t[:, None].to(tl.int64) * K + k_off[None, :]
        ids = tl.load(topk_idx_ptr + off, mask=m, other=-1)
        bad = tl.sum(tl.sum(((ids < -1) | (ids >= E)).to(tl.int32), 1), 0)
        if COPY:
            clean = tl.where((ids >= -1) & (ids < E), ids, -1).to(tl.int32)
            tl.store(idx_out_ptr + off, clean, mask=m)
            tl.store(w_out_ptr + off, tl.load(w_ptr + off, mask=m, other=0.0), mask=m)
        # range-check at the ids' own width, then cast: an int64 id 2**32 + 1 is flagged, never counted as expert 1
        ok = tl.reshape((ids >= 0) & (ids < E), (BT * KB,))
        ids = tl.reshape(tl.where((ids >= 0) & (ids < E), ids, 0).to(tl.int32), (BT * KB,))
        h = tl.histogram(ids, EB, mask=ok)
        tl.store(hist_ptr + c * (E + 1) + e_off, h, mask=e_off < E)
        tl.store(hist_ptr + c * (E + 1) + E, bad)


def exchange_tiles(max_chunks: int, num_experts: int, max_programs: int = 0, eblk: int = 0) -> tuple[int, dict]:
    """``(grid, {"NCB", "EBLK"})`` of :func:`exchange_kernel` for at most ``max_chunks`` chunk rows and
    ``num_experts`` experts: every chunk row in one tile (up to 256), at most 32 experts per tile and 8K counters
    (no spills at 8 warps), one program per expert block. Measured on one H200 at 256 chunks x 256 experts: one
    program with 64 x 64 tiles 43 us, with 256 x 32 tiles 30 us; at most ``max_programs`` programs when it is not 0
    (the configuration's cap: ranks that share a GPU under MPS; the programs loop over the expert blocks). Depends
    only on the static configuration (docs/protocols.md (host protocol rule)).

    ``eblk`` (a power of two, 0: the rule above): experts per tile, given; the chunk rows per tile are then as many
    as fit 8K counters (up to every chunk row, at most 1024), so a narrower block scans its chunks in fewer steps on
    more programs (``KernelTiles.xeb``)."""
    eb = triton.next_power_of_2(num_experts)
    chunks = triton.next_power_of_2(max(1, max_chunks))
    if eblk:
        eblk = min(eb, eblk)
        ncb = min(chunks, 1024, max(1, 8192 // eblk))
    else:
        ncb = min(chunks, 256)
        eblk = max(1, min(eb, 32, 8192 // ncb))
    grid = triton.cdiv(eb, eblk)
    return (min(grid, max_programs) if max_programs else grid), dict(NCB=ncb, EBLK=eblk)


@triton.jit(do_not_specialize=['NC', 'flag_off', 'timeout', 'max_recv', 'host_bad', 'ticket', 'rank', 'Tc'])
def exchange_kernel(hist_ptr, NC, counts_tab, flags_ptr, flags_tab, flag_off, calls_ptr, status_ptr, timeout,
                    pre_ptr, send_base_ptr, ntpe_ptr, offs_ptr, rows_needed_ptr, max_recv, host_bad,
                    rank, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr, A: tl.constexpr,
                    WB: tl.constexpr, LB: tl.constexpr, EB: tl.constexpr, NCB: tl.constexpr, EBLK: tl.constexpr,
                    HAS_TIMER: tl.constexpr, DOUBLE: tl.constexpr = False, dcall_ptr=None, rows_out_ptr=None,
                    counts_out_ptr=None, host_st_ptr=None, ticket=0, HOST_ST: tl.constexpr = 0,
                    DEAD: tl.constexpr = False, cid_ptr=None, Tc=0, xcounts_tab=None, xcounts_ptr=None,
                    xhost_ptr=None, XC: tl.constexpr = 0, CK: tl.constexpr = 0, CKB: tl.constexpr = 1,
                    CE: tl.constexpr = 1, CLB: tl.constexpr = 1, TCB: tl.constexpr = 1):
    """Counts exchange + layout (grid: one program per expert block, :func:`exchange_tiles`; any grid >= 1 is
    correct). See the module docstring for every output.

    flags_ptr: this rank's int64 counters for the counts signal (one per source rank); flags_tab/flag_off: every
    rank's address of the same counters. calls_ptr[0]: number of this counts exchange (1-based, advanced on the
    device before launch). Counts rows are ``E + 1`` wide: column E carries the source's input-error count (ids
    outside ``[-1, E)`` found by :func:`chunk_hist_kernel` plus ``host_bad``, a refusal by the host's front door),
    so a bad input on one rank is known to every rank after the one exchange they run anyway (docs/protocols.md (host protocol rule)).

    Errors recorded (first one wins the code, but a later timeout replaces a refusal: signal.record_error; data
    kernels of THIS dispatch, number ``*dcall_ptr`` stored in status[5], skip their rows on every rank; later calls
    are not poisoned): STATUS_BAD_INPUT with status[2] = the
    lowest bad rank and status[6] = the bitmask of bad ranks; STATUS_CAPACITY with the rows needed (status[4]).

    NCB (chunk rows per step) and EBLK (experts per step) are static tile sizes: the chunk loop bound NC is a
    runtime value, so the compiled variant never depends on this call's T (a data-dependent constexpr made one rank
    compile, and once barrier, alone).

    Optional outputs (so the host needs no extra torch op per call): ``rows_out_ptr[0]`` = rows this rank receives
    (int64, next to the status word: one device->host copy reads both); ``counts_out_ptr`` = int32 ``[W, E]`` copy
    of this call's counts matrix (the handle's snapshot).

    ``host_st_ptr`` (not None; HOST_ST: the number of status words the host reads, ``rows_out_ptr`` among them;
    the MoE layer's counts exchange passes neither): the last program, after
    it recorded the verdict and the rows received (no other program of the launch writes the status word), publishes
    ``status_ptr[:HOST_ST]`` and then ``ticket`` into the pinned host tensor ``host_st_ptr``
    (:func:`tritonep.device.signal.publish_host_status`): the host's one read of an eager dispatch spins on that
    ticket instead of a device-to-host copy + event + synchronize (a timed-out wait still publishes).

    ``DEAD`` (an EPBuffer's exchange: ``flags_ptr`` / ``flags_tab`` are its whole flags region): a timed-out rank
    marks itself in every peer before it signals, and the peers' rows are taken only if none did (``FLAG_DEAD``,
    :func:`tritonep.device.signal.mark_dead` / :func:`tritonep.device.signal.peers_alive`).

    Count routing (``CK > 0``, an EPBuffer's exchange with the ``xcounts`` region): as the decode dispatch's
    (:func:`tritonep.backends.triton.kernels.decode_dispatch.dispatch_decode_kernel`): program 0 writes this rank's
    routes of ``cid [Tc, CK]`` per (destination, local expert) into every destination's ``xcounts`` row (tiles of
    ``TCB`` tokens, :func:`count_histogram`) before the last program signals; the last program, once the rows
    arrived, stores this rank's sums over the sources into ``xhost[:CE / W]`` before it publishes the status words
    (an eager call only: ``ticket`` non-zero).

    Count stamp (``XC > 0``: an EPBuffer made with ``count_columns``, every call whatever ``CK``): program 0 also
    writes this call's stamp (``CE`` with a count routing, 0 without) into column ``XC`` of this rank's ``xcounts``
    row in every destination (:func:`write_count_stamp`), released by the same counts signal; the last program reads
    every rank's stamp (:func:`count_stamps`) and refuses the call on every rank when they differ
    (STATUS_COUNT_MISMATCH, :func:`record_verdict`): no rank's sums are then read from a peer's columns that this
    call did not write.
    """
    n = tl.load(calls_ptr)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    E1: tl.constexpr = E + 1
    # DOUBLE: the counts region holds two [W, E+1] matrices used by alternate calls, so a rank that runs ahead can
    # write call n+1's row while a slower peer still reads call n's matrix (when no later collective orders them)
    cbuf = (n % 2) * (W * E1) if DOUBLE else 0
    # 1) exclusive prefix of chunk histograms and this rank's row, one expert block [NCB, EBLK] per program (the
    # blocks are independent): the time of this part is its dependent memory round trips, one per block when NCB
    # covers every chunk (exchange_tiles). Program 0 also sums the input-error column.
    c_off = tl.arange(0, NCB)
    # a rank whose buffer timed out earlier (a wait that gave up, not read yet) flags its row too: its data kernels
    # would skip their rows while signalling, so its peers refuse the call instead of taking stale rows
    bad = host_bad + (tl.load(status_ptr) == STATUS_TIMEOUT).to(tl.int32)
    for e0 in range(pid * EBLK, EB, G * EBLK):
        eb = e0 + tl.arange(0, EBLK)
        carry = tl.zeros((EBLK,), dtype=tl.int32)
        for c0 in range(0, NC, NCB):
            cc = c0 + c_off
            m2 = (cc[:, None] < NC) & (eb[None, :] < E)
            h = tl.load(hist_ptr + cc[:, None].to(tl.int64) * E1 + eb[None, :], mask=m2, other=0)
            inc = tl.cumsum(h, 0)
            tl.store(pre_ptr + cc[:, None].to(tl.int64) * E + eb[None, :], carry[None, :] + inc - h, mask=m2)
            carry += tl.sum(h, 0)
            if e0 == 0:
                bad += tl.sum(tl.load(hist_ptr + cc.to(tl.int64) * E1 + E, mask=cc < NC, other=0), 0)
        # 2) write the row into every peer's counts[rank, :]
        for d in range(W):
            dst = tl.load(counts_tab + d).to(tl.pointer_type(tl.int32))
            tl.store(dst + cbuf + rank * E1 + eb, carry, mask=eb < E)
    if pid == 0:
        for d in range(W):
            dst = tl.load(counts_tab + d).to(tl.pointer_type(tl.int32))
            tl.store(dst + cbuf + rank * E1 + E, bad)
        if CK > 0:  # the count routing's rows, one per destination (released with this program's arrival)
            hc = count_histogram(cid_ptr, Tc, CK, CKB, CE, CE // W, TCB, WB, CLB)
            jc = tl.arange(0, CLB)
            wo = tl.arange(0, WB)
            for d in range(W):
                xdst = (tl.load(xcounts_tab + d).to(tl.pointer_type(tl.int32)) + (n % 2) * (W * (XC + 1))
                        + rank * (XC + 1))
                tl.store(xdst + jc, tl.sum(tl.where(wo[:, None] == d, hc, 0), 0), mask=jc < CE // W)
        if XC > 0:  # every call: whether (and over how many experts) this rank counts, for the verdict
            write_count_stamp(xcounts_tab, (n % 2) * (W * (XC + 1)), rank, W, XC, CK, CE)
    # the last program to arrive (ticket ``DONE_EXCHANGE``, never reset: every call adds G) signals, waits and lays
    # out; the acq_rel tickets order every program's row stores before its signal (release, cumulative). In the
    # interpreter programs run in order and the last one is the last to arrive.
    last = G == 1
    if G > 1:
        tl.debug_barrier()
        arrival = tl.atomic_add(calls_ptr + (DONE_EXCHANGE - CALL_EXCHANGE), 1, sem="acq_rel", scope="sys")
        last = arrival % G == G - 1
    if last:
        _exchange_finish(counts_tab, flags_ptr, flags_tab, flag_off, n, cbuf, status_ptr, timeout, send_base_ptr,
                         ntpe_ptr, offs_ptr, rows_needed_ptr, max_recv, rank, W, E, L, A, WB, LB, EB, HAS_TIMER,
                         dcall_ptr, rows_out_ptr, counts_out_ptr, host_st_ptr, ticket, HOST_ST, DEAD, cid_ptr, Tc,
                         xcounts_ptr, xhost_ptr, XC, CK, CKB, CE, CLB, TCB)


@triton.jit
def count_histogram(cid_ptr, Tc, CK: tl.constexpr, CKB: tl.constexpr, CE: tl.constexpr, CL: tl.constexpr,
                    TCB: tl.constexpr, WB: tl.constexpr, CLB: tl.constexpr):
    """Routes of ``cid [Tc, CK]`` (int32/int64 ids over ``CE`` experts, ``CL`` per rank; ids outside ``[0, CE)``
    count nowhere) per (destination, local expert) as an int32 ``[WB, CLB]`` tile, in tiles of ``TCB`` tokens."""
    acc = tl.zeros((WB * CLB,), dtype=tl.int32)
    k = tl.arange(0, CKB)
    for t0 in range(0, Tc, TCB):
        t = t0 + tl.arange(0, TCB)
        m = (t < Tc)[:, None] & (k[None, :] < CK)
        raw = tl.load(cid_ptr + t[:, None].to(tl.int64) * CK + k[None, :], mask=m, other=-1)
        ok = m & (raw >= 0) & (raw < CE)  # range-checked at the ids' own width before the int32 cast
        ids = tl.where(ok, raw, 0).to(tl.int32)
        pe = tl.where(ok, (ids // CL) * CLB + ids % CL, 0)
        acc += tl.histogram(tl.reshape(pe, (TCB * CKB,)), WB * CLB, mask=tl.reshape(ok, (TCB * CKB,)))
    return tl.reshape(acc, (WB, CLB))


@triton.jit
def _exchange_finish(counts_tab, flags_ptr, flags_tab, flag_off, n, cbuf, status_ptr, timeout, send_base_ptr,
                     ntpe_ptr, offs_ptr, rows_needed_ptr, max_recv, rank, W: tl.constexpr,
                     E: tl.constexpr, L: tl.constexpr, A: tl.constexpr, WB: tl.constexpr, LB: tl.constexpr,
                     EB: tl.constexpr, HAS_TIMER: tl.constexpr, dcall_ptr, rows_out_ptr, counts_out_ptr, host_st_ptr,
                     ticket, HOST_ST: tl.constexpr, DEAD: tl.constexpr, cid_ptr, Tc, xcounts_ptr, xhost_ptr,
                     XC: tl.constexpr, CK: tl.constexpr, CKB: tl.constexpr, CE: tl.constexpr, CLB: tl.constexpr,
                     TCB: tl.constexpr):
    """Second half of :func:`exchange_kernel` (one program): signal the peers, wait for their rows, lay out, and
    (``host_st_ptr`` not None) publish the status words and ``ticket`` to the host after the last status store."""
    E1: tl.constexpr = E + 1
    CL: tl.constexpr = CE // W  # the count routing's local experts per rank (CK > 0)
    if DEAD:
        mark_dead(flags_tab, status_ptr, W, rank, WB)
    signal_peers(flags_tab, flag_off, W, rank, WB)
    ok = wait_all_ge(flags_ptr, W, n, status_ptr, WAIT_COUNTS, timeout, HAS_TIMER, WB)
    if DEAD:
        ok = ok & peers_alive(flags_ptr, status_ptr, W, WB)
    # 3) layout from the full matrix (3-D tile [src, dest, local expert])
    s_off = tl.arange(0, WB)
    d_off = tl.arange(0, WB)
    j_off = tl.arange(0, LB)
    counts_local = tl.load(counts_tab + rank).to(tl.pointer_type(tl.int32))
    m3 = (s_off[:, None, None] < W) & (d_off[None, :, None] < W) & (j_off[None, None, :] < L)
    e3 = d_off[None, :, None] * L + j_off[None, None, :]
    c3 = tl.load(counts_local + cbuf + s_off[:, None, None] * E1 + e3, mask=m3 & (ok != 0), other=0)
    total, aligned, seg_start, prefix, rows = layout_tiles(c3, s_off, rank, A)
    m2d = (d_off[:, None] < W) & (j_off[None, :] < L)
    tl.store(send_base_ptr + d_off[:, None] * L + j_off[None, :], seg_start + prefix, mask=m2d)
    # input errors of any rank (column E), then capacity: every rank sees the same matrix, so the same verdict; a
    # refused call's layout is empty (no segment, no row received), so nothing later addresses the refused rows
    badv = tl.load(counts_local + cbuf + s_off * E1 + E, mask=(s_off < W) & (ok != 0), other=0)
    xb = (n % 2) * (W * (XC + 1))
    stamps = count_stamps(xcounts_ptr, xb, ok, rank, W, WB, XC, CK, CE)
    refused = refused_call(badv, rows, max_recv, W, WB, stamps)
    store_layout(total, aligned, rows, ntpe_ptr, offs_ptr, rows_needed_ptr, rows_out_ptr, rank, W, L, WB, LB,
                 refused)
    if counts_out_ptr is not None:  # the whole [W, E] matrix in one tile (one round trip)
        eb = tl.arange(0, EB)
        m = (s_off[:, None] < W) & (eb[None, :] < E)
        v = tl.load(counts_local + cbuf + s_off[:, None] * E1 + eb[None, :], mask=m & (ok != 0), other=0)
        tl.store(counts_out_ptr + s_off[:, None] * E + eb[None, :], v, mask=m)
    if dcall_ptr is not None:
        record_verdict(badv, rows, max_recv, status_ptr, tl.load(dcall_ptr), True, W, WB, stamps)
    else:
        record_verdict(badv, rows, max_recv, status_ptr, 0, False, W, WB, stamps)
    if CK > 0:  # the count routing's sums over the sources (exchange_kernel), before the status words
        if ticket != 0:
            own = count_histogram(cid_ptr, Tc, CK, CKB, CE, CL, TCB, WB, CLB)
            js = tl.arange(0, CLB)
            mx = (s_off[:, None] < W) & (s_off[:, None] != rank) & (ok != 0) & (js[None, :] < CL)
            xs = tl.sum(tl.load(xcounts_ptr + xb + s_off[:, None] * (XC + 1) + js[None, :], mask=mx, other=0), 0)
            tl.store(xhost_ptr + js, xs + tl.sum(tl.where(d_off[:, None] == rank, own, 0), 0), mask=js < CL)
    if host_st_ptr is not None:  # every status store of this launch is above (this program's): words, then ticket
        publish_host_status(status_ptr, host_st_ptr, ticket, HOST_ST, HAS_TIMER)


@triton.jit
def layout_tiles(c3, s_off, rank, A: tl.constexpr):
    """Segment layout from the counts tile ``c3[src, dest, local expert]`` (int32 ``[WB, WB, LB]``, zero outside
    the real ranks / experts), as seen by ``rank``: ``(total, aligned, seg_start, prefix, rows)`` where ``total``,
    ``aligned`` (rounded up to A), ``seg_start`` (exclusive prefix of ``aligned`` over the local experts of each
    destination) and ``prefix`` (routes of the sources below rank) are ``[WB, LB]`` and ``rows`` ``[WB]`` is the
    aligned rows every destination receives. The send base of expert ``(d, j)`` is ``seg_start + prefix``.
    """
    total = tl.sum(c3, 0)  # [WB, LB]
    aligned = (total + A - 1) // A * A
    seg_start = tl.cumsum(aligned, 1) - aligned
    prefix = tl.sum(tl.where(s_off[:, None, None] < rank, c3, 0), 0)
    rows = tl.sum(aligned, 1)  # [WB]
    return total, aligned, seg_start, prefix, rows


@triton.jit
def store_layout(total, aligned, rows, ntpe_ptr, offs_ptr, rows_needed_ptr, rows_out_ptr, rank, W: tl.constexpr,
                 L: tl.constexpr, WB: tl.constexpr, LB: tl.constexpr, refused=0):
    """Store this rank's receive layout from :func:`layout_tiles`: ``num_tokens_per_expert`` (int32 ``[L]``),
    ``expert_offsets`` (cumulative aligned ends, int32 ``[L]``), ``rows_needed`` (int64 ``[W]``) and, when
    ``rows_out_ptr`` is not None, the rows this rank receives (int64, one word). ``refused`` (the call's verdict,
    :func:`refused_call`): the layout stored is the empty one (segment sizes, offsets and rows received 0), so a
    refused call's outputs, handle and backward passes address no row (``rows_needed`` keeps the rows asked for)."""
    d_off = tl.arange(0, WB)
    j_off = tl.arange(0, LB)
    tl.store(rows_needed_ptr + d_off, rows.to(tl.int64), mask=d_off < W)
    keep = refused == 0
    mine_total = tl.sum(tl.where((d_off[:, None] == rank) & keep, total, 0), 0)  # [LB]
    mine_aligned = tl.sum(tl.where((d_off[:, None] == rank) & keep, aligned, 0), 0)
    tl.store(ntpe_ptr + j_off, mine_total, mask=j_off < L)
    tl.store(offs_ptr + j_off, tl.cumsum(mine_aligned, 0), mask=j_off < L)
    if rows_out_ptr is not None:
        tl.store(rows_out_ptr, tl.sum(tl.where((d_off == rank) & keep, rows, 0), 0).to(tl.int64))


@triton.jit
def write_count_stamp(xcounts_tab, xbuf, rank, W: tl.constexpr, XC: tl.constexpr, CK: tl.constexpr,
                      CE: tl.constexpr, CARRY: tl.constexpr = False):
    """Store this call's count stamp (``CE`` when the call has a count routing, ``CK > 0``, plus
    :data:`tritonep.device.protocol.STAMP_CARRIED` and ``CK * STAMP_TOPK`` when that routing is carried with
    the rows, ``CARRY``: the ranks must agree on that and on its width too, or a receiver would read a sender's
    carried words of an earlier call; else 0) into column
    ``XC`` of this rank's row of the ``xcounts`` matrix at ``xbuf`` (rows ``XC + 1`` int32 wide) in every rank
    (``xcounts_tab``: every rank's base address); the caller's counts signal releases it."""
    stamp = tl.full((), (CE + (CK * STAMP_TOPK + STAMP_CARRIED if CARRY else 0)) if CK > 0 else 0,
                    tl.int32)
    for d in range(W):
        xdst = tl.load(xcounts_tab + d).to(tl.pointer_type(tl.int32)) + xbuf + rank * (XC + 1)
        tl.store(xdst + XC, stamp)


@triton.jit
def count_stamps(xcounts_ptr, xbuf, ok, rank, W: tl.constexpr, WB: tl.constexpr, XC: tl.constexpr,
                 CK: tl.constexpr, CE: tl.constexpr, CARRY: tl.constexpr = False):
    """Every rank's count stamp of this call (:func:`write_count_stamp`) as an int32 ``[WB]`` vector: this rank's
    from its constexprs, the other ranks' from column ``XC`` of their rows of this rank's ``xcounts`` matrix at
    ``xbuf`` (read only once their counts signal arrived, ``ok``; a rank not heard from, or past W, counts as
    agreeing). Without the region (``XC == 0``) every stamp is 0 (no call can count)."""
    s = tl.arange(0, WB)
    own = tl.full((WB,), (CE + (CK * STAMP_TOPK + STAMP_CARRIED if CARRY else 0)) if CK > 0 else 0,
                  tl.int32)
    if XC > 0:
        peer = tl.load(xcounts_ptr + xbuf + s * (XC + 1) + XC, mask=(s < W) & (s != rank) & (ok != 0), other=0)
        own = tl.where((s < W) & (s != rank) & (ok != 0), peer, own)
    return own


@triton.jit
def _stamps_differ(stamps, W: tl.constexpr, WB: tl.constexpr):
    """1 when the ranks' count stamps (``[WB]``, :func:`count_stamps`) are not all equal."""
    s = tl.arange(0, WB)
    first = tl.sum(tl.where(s == 0, stamps, 0), 0)
    return tl.max(((s < W) & (stamps != first)).to(tl.int32), 0) > 0


@triton.jit
def refused_call(badv, rows, max_recv, W: tl.constexpr, WB: tl.constexpr, stamps):
    """1 when the call is refused on every rank: some rank flagged bad input (``badv [WB]``, column E of the counts
    rows), the ranks' count stamps differ (``stamps [WB]``, :func:`count_stamps`) or some destination would receive
    more than ``max_recv`` rows (``rows [WB]``)."""
    d_off = tl.arange(0, WB)
    over = tl.max(tl.where(d_off < W, rows, 0), 0)
    return (tl.max(tl.where(d_off < W, badv, 0), 0) > 0) | _stamps_differ(stamps, W, WB) | (over > max_recv)


@triton.jit
def record_verdict(badv, rows, max_recv, status_ptr, skip_call, HAS_SKIP: tl.constexpr, W: tl.constexpr,
                   WB: tl.constexpr, stamps):
    """Record the counts exchange's verdict (see :func:`exchange_kernel`): STATUS_BAD_INPUT with the lowest bad rank
    and the bitmask of bad ranks, else STATUS_COUNT_MISMATCH when the ranks' count stamps differ (``stamps [WB]``,
    :func:`count_stamps`: peer = the lowest rank whose stamp differs from rank 0's, ``status[ST_NEEDED_ROWS]`` =
    ``rank 0's stamp << 32 | that rank's``, ``status[ST_WAITED]`` = the bitmask of the ranks whose stamp is not 0,
    i.e. that pass a count routing), else STATUS_CAPACITY with the rows needed; HAS_SKIP: ``skip_call`` is this
    dispatch's number, stored in ``status[ST_THIS_CALL]`` always and in ``status[ST_SKIP_CALL]`` when the call is
    refused (every rank's data kernels then skip its rows): the host tells this call's refusal from an earlier one
    nobody read. Refusals nobody read yet pile up until the next read (which clears the word): the code, peer and
    rows needed stay the first one's (record_error), the bad-rank mask gathers every refused call's bad ranks (this
    program is the only writer of its rank's word), so each bad rank still names its own value."""
    s_off = tl.arange(0, WB)
    if HAS_SKIP:
        tl.store(status_ptr + ST_THIS_CALL, skip_call)
    badv = tl.where(s_off < W, badv, 0)
    over = tl.max(tl.where(s_off < W, rows, 0), 0)
    if tl.max(badv, 0) > 0:
        record_error(status_ptr, STATUS_BAD_INPUT, WAIT_COUNTS, tl.argmax(tl.where(badv > 0, 1, 0), 0))
        mask = tl.sum(tl.where(badv > 0, tl.full((WB,), 1, tl.int64) << s_off.to(tl.int64), 0), 0)
        tl.store(status_ptr + ST_BAD_RANK_MASK, tl.load(status_ptr + ST_BAD_RANK_MASK) | mask)
        if HAS_SKIP:
            tl.store(status_ptr + ST_SKIP_CALL, skip_call)
    elif _stamps_differ(stamps, W, WB):
        first = tl.sum(tl.where(s_off == 0, stamps, 0), 0)
        odd = tl.argmax(((s_off < W) & (stamps != first)).to(tl.int32), 0)
        if record_error(status_ptr, STATUS_COUNT_MISMATCH, WAIT_COUNTS, odd):  # with its numbers: the first one's
            other = tl.sum(tl.where(s_off == odd, stamps, 0), 0)
            tl.store(status_ptr + ST_NEEDED_ROWS, (first.to(tl.int64) << 32) | other.to(tl.int64))
            counting = tl.sum(tl.where((s_off < W) & (stamps != 0),
                                       tl.full((WB,), 1, tl.int64) << s_off.to(tl.int64), 0), 0)
            tl.store(status_ptr + ST_WAITED, counting)
        if HAS_SKIP:
            tl.store(status_ptr + ST_SKIP_CALL, skip_call)
    elif over > max_recv:
        if record_error(status_ptr, STATUS_CAPACITY, WAIT_COUNTS, tl.argmax(tl.where(s_off < W, rows, 0), 0)):
            tl.store(status_ptr + ST_NEEDED_ROWS, over.to(tl.int64))  # with its peer: one refusal's numbers
        if HAS_SKIP:
            # the data kernels of THIS dispatch (number skip_call) skip their rows; later calls are not poisoned
            tl.store(status_ptr + ST_SKIP_CALL, skip_call)
