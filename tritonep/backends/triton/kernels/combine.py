"""Combine data movement: reduce a token's routes per expert rank, move one partial row per (token, rank), sum.

Counters (receiver-side int64, see :mod:`tritonep.backends.triton.kernels.dispatch`): ``flags[CDATA, r]`` on the source rank counts
the partial programs of rank r whose partials for this rank are ready; ``flags[CACK, s]`` on the expert rank
counts the programs of source s that finished reading its partials. With m = the combine-like call number, the
partial kernel waits for ``CACK >= (m-1) * G_out`` before overwriting partials and the output kernel waits for
``CDATA >= m * G_partial``.

* :func:`combine_partial_kernel` (on the expert rank): for every (source s, token t) with routes here,
  ``p = sum_k w[s,t,k] * expert_out[row(s,t,k)]`` over k ascending in fp32, rounded to the wire dtype; PUSH writes it
  into ``stage[rank, t]`` of rank s, pull into this rank's own ``stage[s, t]``. ``WEIGHTED=False`` gives the
  dispatch backward (sum without weights); ``SEND_WGRAD`` also pushes per-route scalars (weight gradients).
* :func:`combine_out_kernel` (on the source rank): ``y[t] = sum over ranks r ascending (with a route of t on r)
  of partial_r[t]`` in fp32 -> output dtype; PULL reads the partials from peer memory. ``RECV_WGRAD`` gathers the
  per-route scalars into ``[T, K]``.

The summation order is fixed (k ascending per rank, then ranks ascending), so results are bitwise reproducible run
to run. Twin: :func:`tritonep.reference.combine_reference_partial`.
"""

from collections import namedtuple

import triton
import triton.language as tl

from ....device.common import RowTile, cast_rne, chunk_index, mul_rn, widen
from ....device.protocol import (CALL_COMBINE, DONE_COMBINE_OUT, FLAG_CACK, FLAG_CDATA, STATUS_COMBINE_REFUSED, STATUS_TIMEOUT,
                       ST_BAD_RANK_MASK, WAIT_CACK, WAIT_CDATA)
from ....device.signal import (last_program, mark_dead, peers_alive, publish_epoch_one, publish_host_status, record_error,
                              signal_peers, wait_all_ge)
from ....wire.kernels.wirecodec import RAW_BF16, wire_load, wire_store


PartialIO = namedtuple("PartialIO", "eo_ptr hmeta_ptr hwts_ptr hntok_ptr gw_ptr stage_tab wback_tab Tmax rank")
PartialIO.__doc__ = """What :func:`partial_item` / :func:`partial_step` read and write; the fields are
    :func:`combine_partial_kernel`'s parameters of the same names (the weighted push combines pass ``hwts_ptr`` /
    ``stage_tab`` as the unused ``gw_ptr`` / ``wback_tab``; ``Tmax``: token rows per source in the handle and the
    staging, and ``rank``: this rank, runtime ints)."""


OutIO = namedtuple("OutIO", "topk_idx_ptr y_ptr T stage_tab wback_ptr gtw_ptr Tmax rank")
OutIO.__doc__ = """What :func:`out_chunk` / :func:`sum_arrived` read and write; the fields are
    :func:`combine_out_kernel`'s parameters of the same names (``T``: this rank's token count, a runtime int; the push
    combines pass ``y_ptr`` as the unused ``wback_ptr`` / ``gtw_ptr``; ``Tmax``: token rows per source in the staging
    and ``rank``: this rank, runtime ints)."""


@triton.jit
def mark_refused(cbad_tab, m, W: tl.constexpr, rank, WB: tl.constexpr):
    """This rank takes part in combine number ``m`` as refused (its input was refused, or it cancelled the call):
    ``cbad[rank] = m`` in every OTHER rank's memory. Plain stores: the caller's later signals and publishes (block
    barrier + release) order them, so a peer that acquired any of them sees the mark."""
    offs = tl.arange(0, WB)
    msk = (offs < W) & (offs != rank)
    bases = tl.load(cbad_tab + offs, mask=msk, other=0)
    tl.store(bases.to(tl.pointer_type(tl.int64)) + rank, tl.zeros([WB], tl.int64) + m, mask=msk)


@triton.jit
def refused_ranks(cbad_ptr, m, W: tl.constexpr, WB: tl.constexpr):
    """``(mask, lowest)``: the int64 bitmask of the ranks that marked combine number ``m`` refused in this rank's
    ``cbad`` (after an acquire of their signals) and the lowest of them (WB when none)."""
    offs = tl.arange(0, WB)
    v = tl.load(cbad_ptr + offs, mask=offs < W, other=0, volatile=True)
    hit = (offs < W) & (v == m)
    mask = tl.sum(tl.where(hit, tl.full((WB,), 1, tl.int64) << offs.to(tl.int64), 0), 0)
    return mask, tl.min(tl.where(hit, offs, WB), 0)


@triton.jit
def record_refusal(status_ptr, mask, lowest):
    """Record STATUS_COMBINE_REFUSED (peer: ``lowest``) and OR ``mask`` into the bad-rank bitmask (atomic: the
    partial and output roles of one launch may both record)."""
    if mask != 0:
        record_error(status_ptr, STATUS_COMBINE_REFUSED, WAIT_CDATA, lowest)
        tl.atomic_or(status_ptr + ST_BAD_RANK_MASK, mask, sem="relaxed", scope="gpu")


@triton.jit
def open_partial(bad, m, cbad_tab, status_ptr, flags_tab, W: tl.constexpr, rank, WB: tl.constexpr):
    """The partial side's prologue after its CACK wait: ``live`` (rows move: no timeout, not refused) and, for a
    refused call (``bad`` 1: record it in this rank's status too, for the host's next read; 2: the host raises it
    itself and reads nothing), the mark in every peer (:func:`mark_refused`); a timed-out rank marks itself in every
    peer (:func:`tritonep.device.signal.mark_dead`: no late peer takes the partials it skips). Every program marks
    before its first signal or publish."""
    live = (mark_dead(flags_tab, status_ptr, W, rank, WB) == 0) & (bad == 0)
    if bad != 0:
        mark_refused(cbad_tab, m, W, rank, WB)
        if bad == 1:
            if tl.program_id(0) == 0:
                record_refusal(status_ptr, tl.full((), 1, tl.int64) << rank, rank)
    return live


@triton.jit
def partial_item_source(idx, G, W: tl.constexpr):
    """(chunk, source) of the partial item ``idx`` taken by a program striding the items by ``G``.

    Items are chunk-major (every source's chunk c before chunk c + 1: the fused combine's output role waits for
    chunks in order), and a program's i-th item (``i = idx // G``) rotates its source by i when ``G % W == 0``, so
    each program alternates between its own rank and the peers and, at any moment, about (W-1)/W of every rank's
    programs push over NVLink to all peers evenly. (Source-major order made every rank push to one rank at a time:
    with W = 2 each NVLink direction idled half of the combine; with W = 8 seven ranks pushed into one.) The map is a
    bijection on ``[0, W * NCmax)``: within a chunk's W items the rotation is one constant (``G`` a multiple of W).
    """
    c = idx // W
    rot = tl.where(G % W == 0, idx // G, 0)
    return c, (idx % W + rot) % W


@triton.jit
def staged_partials(stage_tab, peer, t, Tmax, rank, tile, AT_PEER: tl.constexpr):
    """Where the partial rows of tokens ``t`` exchanged with rank ``peer`` live, as ``(uint8 base, byte offset of
    each row)``: in ``peer``'s staging at rows ``[rank, t]`` (AT_PEER: the partial kernel's PUSH, the output
    kernel's PULL) or in this rank's own staging at rows ``[peer, t]``. Both sides of a combine take their rows here,
    so they agree by construction."""
    if AT_PEER:
        base = tl.multiple_of(tl.load(stage_tab + peer).to(tl.pointer_type(tl.uint8)), 16)
        rows = (rank * Tmax + t).to(tl.int64) * tile.RB
    else:
        base = tl.multiple_of(tl.load(stage_tab + rank).to(tl.pointer_type(tl.uint8)), 16)
        rows = (peer * Tmax + t).to(tl.int64) * tile.RB
    return base, rows


@triton.jit
def partial_item(src, c, Ts, live, io, tile, PUSH: tl.constexpr, WEIGHTED: tl.constexpr,
                 SEND_WGRAD: tl.constexpr, POW2: tl.constexpr, y_ptr=None):
    """Partials of chunk ``c`` of source ``src`` (``Ts`` tokens there) of :class:`PartialIO` ``io``, see
    :func:`combine_partial_kernel`; ``tile``: the :class:`tritonep.device.common.RowTile`. ``y_ptr`` (world 1, raw
    bf16 wire, bf16 output: :func:`combine_partial_kernel`'s DIRECT): the partials are the output rows, stored there
    for every token of the chunk (zeros where it has no route), not staged."""
    t, k_off, h_off, tm, m2 = chunk_index(c, Ts, tile, live)
    off = (src * io.Tmax + t[:, None]).to(tl.int64) * tile.K + k_off[None, :]
    rows = tl.load(io.hmeta_ptr + off, mask=m2, other=-1)
    if WEIGHTED:
        w = tl.load(io.hwts_ptr + off, mask=m2, other=0.0)
    if y_ptr is not None:
        has = tm
        dst = y_ptr.to(tl.pointer_type(tl.uint8))
        drow = t.to(tl.int64) * (2 * tile.H)
    else:
        has = tl.sum((rows >= 0).to(tl.int32), 1) > 0
        dst, drow = staged_partials(io.stage_tab, src, t, io.Tmax, io.rank, tile, PUSH)
    for h0 in range(0, tile.H, tile.BH):
        h = h0 + h_off
        hm = h < tile.H
        acc = tl.zeros((tile.BT, tile.BH), dtype=tl.float32)
        for k in tl.static_range(tile.K):
            rk = tl.sum(tl.where(k_off[None, :] == k, rows, 0), 1)
            mk = (rk >= 0)[:, None] & hm[None, :]
            v = tl.load(io.eo_ptr + rk[:, None].to(tl.int64) * tile.H + h[None, :], mask=mk, other=0.0)
            if WEIGHTED:
                wk = tl.sum(tl.where(k_off[None, :] == k, w, 0.0), 1)
                acc += mul_rn(widen(v), tl.broadcast_to(wk[:, None], (tile.BT, tile.BH)), tile.HAS_TIMER)
            else:
                acc += widen(v)
        # bf16: the RNE-rounded partial
        wire_store(dst, drow, h0, acc, has, tile.H, tile.BH, tile.BT, tile.WIRE, POW2, tile.HAS_TIMER)
    if SEND_WGRAD:
        g = tl.load(io.gw_ptr + rows, mask=rows >= 0, other=0.0)
        wb = tl.load(io.wback_tab + src).to(tl.pointer_type(tl.float32))
        tl.store(wb + (io.rank * io.Tmax + t[:, None]).to(tl.int64) * tile.K + k_off[None, :], g,
                 mask=m2 & (rows >= 0))


@triton.jit
def partial_step(src, c, live, m, ccflag_tab, io, tile, W: tl.constexpr, PUSH: tl.constexpr,
                 WEIGHTED: tl.constexpr, SEND_WGRAD: tl.constexpr, POW2: tl.constexpr, y_ptr=None):
    """One (chunk ``c``, source ``src``) item of a partial role: the partials of the source's chunk if it has one
    (``c * BT < hntok[src]``, :func:`partial_item`; ``y_ptr``: stored as the output rows there); with a
    ``ccflag_tab`` (the one-launch combines) then raise ``ccflag[c, rank] = m`` in ``src``'s memory, also for chunks
    past the source's T, so its waits complete."""
    Ts = tl.load(io.hntok_ptr + src)
    if c * tile.BT < Ts:
        partial_item(src, c, Ts, live, io, tile, PUSH, WEIGHTED, SEND_WGRAD, POW2, y_ptr)
    if ccflag_tab is not None:
        publish_epoch_one(ccflag_tab, src, c * W + io.rank, m)


@triton.jit
def out_chunk(c, live, io, tile, W: tl.constexpr, L: tl.constexpr, PULL: tl.constexpr, RECV_WGRAD: tl.constexpr,
              poison=0):
    """Output rows of this rank's token chunk ``c`` of :class:`OutIO` ``io``, see :func:`combine_out_kernel`.
    ``poison``: the call failed (a wait gave up, a peer refused the call): every row (and per-route scalar) of the
    chunk is NaN, so it cannot pass for a result."""
    t, k_off, h_off, tm, m2 = chunk_index(c, io.T, tile)
    tk = t[:, None].to(tl.int64) * tile.K + k_off[None, :]
    ids = tl.load(io.topk_idx_ptr + tk, mask=m2, other=-1).to(tl.int32)
    dest = tl.where((ids >= 0) & (ids < W * L), ids // L, -1)  # ids outside [-1, E) are refused, never followed
    for h0 in range(0, tile.H, tile.BH):
        h = h0 + h_off
        hm = h < tile.H
        acc = tl.zeros((tile.BT, tile.BH), dtype=tl.float32)
        for r in range(W):
            has = (tl.sum((dest == r).to(tl.int32), 1) > 0) & tm & live
            base, srow = staged_partials(io.stage_tab, r, t, io.Tmax, io.rank, tile, PULL)
            v = wire_load(base, srow, h0, has, tile.H, tile.BH, tile.BT, tile.WIRE, tile.HAS_TIMER, tile.HAS_TIMER)
            acc += widen(v)
        acc = tl.where(poison != 0, float("nan"), acc)
        tl.store(io.y_ptr + t[:, None].to(tl.int64) * tile.H + h[None, :], cast_rne(acc, io.y_ptr.dtype.element_ty),
                 mask=tm[:, None] & hm[None, :])
    if RECV_WGRAD:
        g = tl.load(io.wback_ptr + ((dest * io.Tmax + t[:, None]).to(tl.int64) * tile.K + k_off[None, :]),
                    mask=m2 & (dest >= 0) & live, other=0.0)
        tl.store(io.gtw_ptr + tk, tl.where(poison != 0, float("nan"), g), mask=m2)


@triton.jit
def sum_arrived(c, m, ccflag_ptr, status_ptr, timeout, io, tile, W: tl.constexpr, L: tl.constexpr,
                WB: tl.constexpr, RECV_WGRAD: tl.constexpr, cbad_ptr, flags_ptr, DIRECT: tl.constexpr = False):
    """The output step of the one-launch combines (fused, decode): wait (bounded) until every rank's partial of
    this rank's token chunk ``c`` arrived (``ccflag[c, r] >= m``, the combine call number) and sum it
    (:func:`out_chunk`, push; RECV_WGRAD: also gather the per-route scalars the partial step pushed before raising
    the flag); a wait that gives up, or a rank that took part as refused (:func:`mark_refused`), makes the chunk
    NaN, and so does a peer that marked itself timed out (:func:`tritonep.device.signal.peers_alive`, ``flags_ptr``
    this rank's flags region: it skipped its partials). Chunk 0 (or, with no token, :func:`watch_refusals`) records
    a refusal in the status word: every rank's program that publishes chunk 0 here marked before it. DIRECT (world
    1: the partial step stored the chunk's output rows before raising its flag): the chunk is written only when
    the call failed (NaN)."""
    wait_all_ge(ccflag_ptr + c * W, W, m, status_ptr, WAIT_CDATA, timeout, tile.HAS_TIMER, WB)
    peers_alive(flags_ptr, status_ptr, W, WB)
    live = tl.load(status_ptr) != STATUS_TIMEOUT
    mask, lowest = refused_ranks(cbad_ptr, m, W, WB)
    poison = (live == 0) | (mask != 0)
    if DIRECT:
        if poison:
            out_chunk(c, live, io, tile, W, L, False, RECV_WGRAD, poison)
    else:
        out_chunk(c, live, io, tile, W, L, False, RECV_WGRAD, poison)
    if c == 0:
        record_refusal(status_ptr, mask, lowest)


@triton.jit
def watch_refusals(m, ccflag_ptr, status_ptr, timeout, cbad_ptr, W: tl.constexpr, WB: tl.constexpr,
                   HAS_TIMER: tl.constexpr):
    """A rank with no token still learns, in the same call, whether some rank refused the one-launch combine number
    ``m``: wait (bounded) for chunk 0's flags of every rank (every rank publishes every chunk here, also past this
    rank's T) and record the refused ranks (:func:`sum_arrived` does it for chunk 0 when there is one)."""
    wait_all_ge(ccflag_ptr, W, m, status_ptr, WAIT_CDATA, timeout, HAS_TIMER, WB)
    mask, lowest = refused_ranks(cbad_ptr, m, W, WB)
    record_refusal(status_ptr, mask, lowest)


@triton.jit(do_not_specialize=['cdata_off', 'timeout', 'G_out', 'Tmax', 'NCmax', 'bad', 'rank'])
def combine_partial_kernel(eo_ptr, hmeta_ptr, hwts_ptr, hntok_ptr, gw_ptr, stage_tab, wback_tab,
                           flags_ptr, flags_tab, cdata_off, calls_ptr, status_ptr, timeout, G_out, Tmax, NCmax,
                           rank, W: tl.constexpr, K: tl.constexpr, KB: tl.constexpr,
                           H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, WB: tl.constexpr,
                           PUSH: tl.constexpr, WEIGHTED: tl.constexpr, SEND_WGRAD: tl.constexpr,
                           HAS_TIMER: tl.constexpr, RB: tl.constexpr = 0, WIRE: tl.constexpr = RAW_BF16,
                           POW2: tl.constexpr = False, bad=0, cbad_tab=None, y_ptr=None):
    """Expert-rank side of a combine: one partial row per (source, token) with routes here (see module docstring).

    PUSH writes into the source's ``stage[rank, t]``, pull into this rank's ``stage[src, t]``; WIRE encodes the fp32
    partial (bf16 RNE, fp8, mxfp4); SEND_WGRAD also pushes ``gw[row]`` to the source's ``wback``. Signals
    ``flags[CDATA, rank]`` on every rank after waiting (bounded) for the previous call's readers. ``bad`` != 0: this
    rank takes part as refused (:func:`open_partial`: no partial row, the mark in every peer).

    ``y_ptr`` given (DIRECT, :func:`tritonep.backends.triton.calls.one_pass_combine`: world 1, push, no SEND_WGRAD,
    raw bf16 wire and bf16 expert rows, so the output kernel's sum over one rank would be the staged partial itself,
    bit for bit): the partials are stored as the output rows
    ``y [T, H]`` (zeros for a token without a route), one pass over the rows instead of two; the output kernel then
    runs as DIRECT (counters, acks, the status and the NaN of a failed call only).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    m = tl.load(calls_ptr + CALL_COMBINE) + 1  # this combine's number (combine_out_kernel advances the counter)
    wait_all_ge(flags_ptr + FLAG_CACK * W, W, (m - 1) * G_out, status_ptr, WAIT_CACK, timeout, HAS_TIMER, WB)
    live = open_partial(bad, m, cbad_tab, status_ptr, flags_tab, W, rank, WB)
    tile: tl.constexpr = RowTile(K, KB, H, BH, BT, RB, WIRE, HAS_TIMER)
    io = PartialIO(eo_ptr, hmeta_ptr, hwts_ptr, hntok_ptr, gw_ptr, stage_tab, wback_tab, Tmax, rank)
    for item in range(pid, W * NCmax, G):
        c, src = partial_item_source(item, G, W)
        partial_step(src, c, live, m, None, io, tile, W, PUSH, WEIGHTED, SEND_WGRAD, POW2, y_ptr)
    signal_peers(flags_tab, cdata_off, W, rank, WB)


@triton.jit
def finish_combine(calls_ptr, DONE: tl.constexpr, m, status_ptr, host_st_ptr, ticket, HOST_ST: tl.constexpr,
                   HAS_TIMER: tl.constexpr):
    """The last program of a combine's last launch (a done ticket ``calls[DONE]``, :func:`last_program`) advances
    ``calls[CALL_COMBINE]`` to ``m`` and, when the host reads this call (``ticket`` != 0), publishes the status words
    and the ticket into the pinned host tensor (:func:`publish_host_status`): every status store of the call is
    done (the last program's acquire covers every program's)."""
    if last_program(calls_ptr + DONE):
        tl.store(calls_ptr + CALL_COMBINE, m)
        if HOST_ST > 0:
            if ticket != 0:
                publish_host_status(status_ptr, host_st_ptr, ticket, HOST_ST, HAS_TIMER)


@triton.jit(do_not_specialize=['T', 'NC', 'cack_off', 'timeout', 'G_partial', 'Tmax', 'ticket', 'rank'])
def combine_out_kernel(topk_idx_ptr, y_ptr, T, NC, stage_tab, wback_ptr, gtw_ptr,
                       flags_ptr, flags_tab, cack_off, calls_ptr, status_ptr, timeout, G_partial, Tmax,
                       rank, W: tl.constexpr, L: tl.constexpr, K: tl.constexpr, KB: tl.constexpr,
                       H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, WB: tl.constexpr,
                       PULL: tl.constexpr, RECV_WGRAD: tl.constexpr, HAS_TIMER: tl.constexpr,
                       RB: tl.constexpr = 0, WIRE: tl.constexpr = RAW_BF16, cbad_ptr=None, host_st_ptr=None,
                       ticket=0, HOST_ST: tl.constexpr = 0, DIRECT: tl.constexpr = False):
    """Source side of a combine: wait for every expert rank's partials, sum them in rank order (fp32) into ``y``.

    PULL reads the partials from the peers' memory; RECV_WGRAD gathers the per-route scalars into ``gtw [T, K]``.
    Tokens without a valid route get zeros. A wait that gave up, or a rank that took part as refused (its mark in
    ``cbad``, :func:`mark_refused`; program 0 records it), makes every output NaN. Acks every expert rank
    afterwards; its last program advances ``calls[CALL_COMBINE]`` (no host op does) and publishes the status for the
    host's read of an eager combine (:func:`finish_combine`). DIRECT: the partial kernel stored ``y`` itself
    (:func:`combine_partial_kernel`'s ``y_ptr``); the chunks are written only when the call failed (NaN).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    m = tl.load(calls_ptr + CALL_COMBINE) + 1  # this combine's number; its last program advances the counter
    wait_all_ge(flags_ptr + FLAG_CDATA * W, W, m * G_partial, status_ptr, WAIT_CDATA, timeout, HAS_TIMER, WB)
    peers_alive(flags_ptr, status_ptr, W, WB)  # a rank that timed out skipped its partials: NaN, never stale rows
    live = tl.load(status_ptr) != STATUS_TIMEOUT
    mask, lowest = refused_ranks(cbad_ptr, m, W, WB)
    if pid == 0:
        record_refusal(status_ptr, mask, lowest)
    tile: tl.constexpr = RowTile(K, KB, H, BH, BT, RB, WIRE, HAS_TIMER)
    io = OutIO(topk_idx_ptr, y_ptr, T, stage_tab, wback_ptr, gtw_ptr, Tmax, rank)
    poison = (live == 0) | (mask != 0)
    for c in range(pid, NC, G):
        if DIRECT:
            if poison:
                out_chunk(c, live, io, tile, W, L, PULL, RECV_WGRAD, poison)
        else:
            out_chunk(c, live, io, tile, W, L, PULL, RECV_WGRAD, poison)
    signal_peers(flags_tab, cack_off, W, rank, WB)
    finish_combine(calls_ptr, DONE_COMBINE_OUT, m, status_ptr, host_st_ptr, ticket, HOST_ST, HAS_TIMER)
