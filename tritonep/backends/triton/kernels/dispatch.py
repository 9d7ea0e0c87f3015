"""Dispatch data movement: send one copy per (token, destination rank), expand into expert segments.

Protocol (docs/protocols.md). Counters live in the receiver's symmetric ``flags`` region (int64):
``flags[DATA, src]`` counts the send programs of rank ``src`` that finished publishing into this rank's staging;
``flags[ACK, d]`` (in the sender's memory) counts the expand programs of rank ``d`` that finished reading the staging
this rank wrote. With n = the dispatch-like call number (device memory), a send waits for
``ACK >= (n-1) * G_expand`` from every destination before overwriting its staging, and an expand waits for
``DATA >= n * G_send`` from every source.

* :func:`dispatch_send_kernel`: per chunk of BT tokens computes every route's destination row (chunk prefix from
  the layout + the route's rank inside the chunk by pairwise comparison), then for each destination rank writes the
  token's K destination rows (or -1) and weights, and the token's row once (wire-encoded) into
  ``stage[rank, t]`` of that destination, if the token has at least one route there -- except into its OWN rank's
  staging: the expander reads those rows from the sender's input instead (one write + read of the rows through HBM
  fewer; on a quantized wire the expander encodes them itself, so a token routed to its own rank and to peers is
  encoded twice, to the same bits: at world 1 no row is staged at all). A wire whose codec has ``stage_own``
  (mxfp4, whose encode costs the expander more than the copy saves) stages its own rows like a peer's
  (:func:`own_source`).
* :func:`dispatch_expand_kernel`: waits for every source, then scatters each staged row (own rank: the input row,
  encoded, :func:`source_tile` / :func:`source_raw`) to its destination rows (one per route), writes the per-row
  weights, keeps a copy of
  the routing metadata for combine (the handle), and zeroes the alignment padding rows. Backward mode (``SCALE``/``DOT``) multiplies each row by its route weight and
  computes ``dot(row, expert_out[row])`` for the weight gradient (the combine backward); it also zeroes every row of
  its outputs that no route writes (padding, rows past the layout's end: :func:`zero_unwritten`), so the combine
  backward allocates them empty, and runs in its own token tile (``KernelTiles.bbt`` / ``bwarps``: the K expert-output
  tiles it keeps in flight spill registers in the dispatch's). A combine backward some rank took part in as refused
  (its send ran with ``T = -1``, writing ``ntok[src] = -1`` everywhere, no row) moves no row on any rank: every
  output row is NaN and the refusal is recorded (``STATUS_COMBINE_REFUSED``) for the next host read.

Twins: the whole dispatch is specified by :func:`tritonep.reference.dispatch_reference`; the row computation by
:func:`tritonep.backends.layout.route_rows_torch`.
"""

from collections import namedtuple

import triton
import triton.language as tl

from ....device.common import RowTile, cast_rne, chunk_index, widen
from ....device.protocol import (CALL_DISPATCH, DONE_EXPAND_BWD, FLAG_ACK, FLAG_DATA, ST_SKIP_CALL, STATUS_TIMEOUT, WAIT_ACK,
                       WAIT_DATA)
from ....device.signal import ack_on_last, mark_dead, peers_alive, signal_peers, wait_all_ge, wait_ge
from ....wire.kernels.wirecodec import (RAW_BF16, wire_encode, wire_load, wire_load_raw, wire_store_encoded,
                                       wire_store_raw, wire_to)
from .combine import record_refusal


SendIO = namedtuple("SendIO", "x_ptr topk_idx_ptr topk_w_ptr rows_ptr T pre_ptr send_base_ptr stage_tab meta_tab "
                              "wts_tab Tmax rank")
SendIO.__doc__ = """What :func:`send_chunk` reads and writes; the fields are the send kernels' parameters of the same
    names (``T``: this rank's token count, ``Tmax``: token rows per source in the staging and metadata, and ``rank``:
    this rank, runtime ints; ``*_tab``: int64 pointer tables of every rank's region)."""


ExpandIO = namedtuple("ExpandIO", "x_ptr stage_ptr meta_ptr wts_ptr ntok_ptr out_ptr out_w_ptr hmeta_ptr hwts_ptr "
                                  "hntok_ptr eo_ptr gw_ptr q_ptr s_ptr Tmax nrows rank")
ExpandIO.__doc__ = """What :func:`expand_item` / :func:`expand_arrived` / :func:`zero_padding` read and write; the
    fields are :func:`dispatch_expand_kernel`'s parameters of the same names (a kernel without the backward modes passes
    ``out_ptr`` / ``out_w_ptr`` as ``eo_ptr`` / ``gw_ptr``, unused there; ``q_ptr`` / ``s_ptr`` are None unless KEEP_Q;
    ``Tmax``: token rows per source in the staging and metadata, a runtime int; ``nrows``: the rows of the outputs
    (``out`` / ``q`` / ``s`` / ``out_w``, and ``eo`` / ``gw`` of the combine backward) the caller allocated, a runtime
    int: no row at or past it is ever written or read, whatever the layout says; ``rank``: this rank, a runtime
    int)."""


@triton.jit
def load_routes(ptr, off, m, k, L: tl.constexpr):
    """The routes at ``ptr + off`` (mask ``m``, -1 where masked): expert ids as stored (int32 / int64), or, for a bool
    rank mask (``ptr`` to int1: :meth:`tritonep.EPBuffer.dispatch`'s ``topk_idx`` of a buffer whose top-k is its
    world size), expert ``k * L`` (rank k's first local expert; ``k``: the column index, broadcast like ``off``) where
    set, else -1. Chosen at compile time by the pointer's element type."""
    if ptr.dtype.element_ty == tl.int1:
        v = tl.load(ptr + off, mask=m, other=0)
        ids = tl.where(v != 0, k * L, -1)
    else:
        ids = tl.load(ptr + off, mask=m, other=-1)
    return ids


@triton.jit
def _ptr(tab, r, DT: tl.constexpr):
    return tl.multiple_of(tl.load(tab + r).to(tl.pointer_type(DT)), 16)


@triton.jit
def open_send(n, G_expand, refused, writer, T, flags_ptr, flags_tab, status_ptr, ntok_tab, timeout, rank, tile,
              W: tl.constexpr, WB: tl.constexpr):
    """The sender prologue of every dispatch kernel: wait (bounded) until every destination consumed the staging of
    the previous call (``flags[ACK, d] >= (n - 1) * G_expand``), then, if ``writer == 0``, write ``ntok[rank] = T``
    in every destination (the two-kernel send passes its program id: program 0 writes; the one-launch kernels pass
    0: every sender writes, before its first chunk flag). ``refused``: this call's refusal (bad input / capacity)
    when the caller computed it, or None to read it from the status word (``status[ST_SKIP_CALL] == n``, recorded
    by the layout kernel). Returns ``(timed_out, live)``: the buffer timed out (this or an earlier call), and rows
    may move (neither timed out nor refused; a capacity overflow skips only this call, a timeout poisons the
    buffer). A timed-out sender marks itself in every destination before its signals (:func:`tritonep.device.
    signal.mark_dead`), so no late peer takes the rows it skips."""
    wait_all_ge(flags_ptr + FLAG_ACK * W, W, (n - 1) * G_expand, status_ptr, WAIT_ACK, timeout, tile.HAS_TIMER, WB)
    timed_out = mark_dead(flags_tab, status_ptr, W, rank, WB)
    if refused is None:
        refused = tl.load(status_ptr + ST_SKIP_CALL) == n
    live = (timed_out == 0) & (refused == 0)
    if writer == 0:
        for d in range(W):
            nt = tl.load(ntok_tab + d).to(tl.pointer_type(tl.int32))
            tl.store(nt + rank, T)
    return timed_out, live


@triton.jit
def send_chunk(c, live, io, tile, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr, COMPUTE_ROWS: tl.constexpr,
               POW2: tl.constexpr, OWN_IDX: tl.constexpr = False):
    """Send token chunk ``c`` (tokens ``[c*BT, c*BT+BT)``) of :class:`SendIO` ``io``: rows/weights metadata and the
    wire row to every destination rank that the token routes to (see :func:`dispatch_send_kernel`); ``tile``: the
    :class:`tritonep.device.common.RowTile` (HAS_TIMER, True exactly on the GPU, selects the wire's inline-PTX
    encoder: same bits).

    A call that moves no rows (``live`` 0: refused or timed out) routes nowhere: its rows (COMPUTE_ROWS) and the
    metadata every destination receives are -1, and with OWN_IDX (``io.topk_idx_ptr`` is the handle's own int32 copy
    of the routing, not the caller's tensor) that copy is set to -1 too, so the combine and both backward passes of
    the refused call's handle address no row and read no stale partial (a token without routes combines to 0)."""
    R: tl.constexpr = tile.BT * tile.KB
    t, k_off, h_off, tm, m2 = chunk_index(c, io.T, tile)
    tk = t[:, None].to(tl.int64) * tile.K + k_off[None, :]
    ids = load_routes(io.topk_idx_ptr, tk, m2, k_off[None, :], L).to(tl.int32)
    valid = (ids >= 0) & (ids < E) & (live != 0)  # ids outside [-1, E) are refused by the counts exchange
    ids = tl.where(valid, ids, -1)
    if OWN_IDX:
        if live == 0:
            tl.store(io.topk_idx_ptr + tk, ids, mask=m2)
    if COMPUTE_ROWS:
        fid = tl.reshape(ids, (R,))
        fv = fid >= 0
        i_off = tl.arange(0, R)
        eq = (fid[:, None] == fid[None, :]) & (i_off[None, :] < i_off[:, None]) & fv[None, :]
        within = tl.reshape(tl.sum(eq.to(tl.int32), 1), (tile.BT, tile.KB))
        carry = tl.load(io.pre_ptr + c * E + ids, mask=valid, other=0)
        base = tl.load(io.send_base_ptr + ids, mask=valid, other=0)
        rows = tl.where(valid, base + carry + within, -1)
        tl.store(io.rows_ptr + tk, rows, mask=m2)
    else:
        rows = tl.load(io.rows_ptr + tk, mask=m2, other=-1)
    w = tl.load(io.topk_w_ptr + tk, mask=m2, other=0.0)
    dest = tl.where(valid, ids // L, -1)
    mt = tm[:, None] & (k_off[None, :] < tile.K)
    for d in range(W):
        md = tl.load(io.meta_tab + d).to(tl.pointer_type(tl.int32))
        wd = tl.load(io.wts_tab + d).to(tl.pointer_type(tl.float32))
        off = (io.rank * io.Tmax + t[:, None]).to(tl.int64) * tile.K + k_off[None, :]
        tl.store(md + off, tl.where(dest == d, rows, -1), mask=mt)
        tl.store(wd + off, tl.where(dest == d, w, 0.0), mask=mt)
    # a world of one stages nothing (the expander reads x; unless the wire stages own rows): no row loads either
    own = own_source(io, tile)
    for h0 in range(0, tile.H if (W > 1 or tile.WIRE.stage_own) else 0, tile.BH):
        h = h0 + h_off
        hm = h < tile.H
        xt = tl.load(io.x_ptr + t[:, None].to(tl.int64) * tile.H + h[None, :], mask=tm[:, None] & hm[None, :],
                     other=0.0)
        pay, sc = wire_encode(xt, tile.BT, tile.BH, tile.WIRE, POW2, tile.HAS_TIMER)  # quantize once, store to all
        row_off = (io.rank * io.Tmax + t).to(tl.int64) * tile.RB
        for dd in range(W):
            d = (dd + io.rank) % W  # each rank's stores start at a different destination (no W-to-1 incast)
            # own-rank rows: the expander reads (and encodes) x itself, no staging copy (own: -1 where the wire
            # stages them)
            has = (tl.sum((dest == d).to(tl.int32), 1) > 0) & tm & live & (d != own)
            sd = _ptr(io.stage_tab, d, tl.uint8)
            wire_store_encoded(sd, row_off, h0, pay, sc, has, tile.H, tile.BH, tile.WIRE)


@triton.jit
def source_tile(src, t, has, io, row_off, h0, tile, POW2: tl.constexpr = False):
    """Columns [h0, h0+BH) of the wire rows of tokens ``t`` of source ``src`` as the expander sees them (quantized
    wires: decoded, exact fp32 values; raw: the bf16 tile).

    Rows of other sources come from the staging (``row_off``: byte offsets of the rows in ``io.stage_ptr``). The
    own rank's rows (``src == rank``) are read straight from the sender's input ``io.x_ptr`` (``[Ts, H]``, the
    tensor :func:`send_chunk` encodes; it stays unchanged until the expander ran: same stream or same launch) and
    passed through the wire's encoder (``POW2``: the sender's scale rule) and decoder, so the tile has the bits the
    staged row would hold, without the staging write + read through HBM. Masked rows read as zero. On the GPU
    (``tile.HAS_TIMER``) the codec multiplies exactly and takes its FAST path (same bits). A wire that stages its
    own rows (``tile.WIRE.stage_own``) reads every source from the staging, and its expander holds no encoder at all
    (a runtime ``src == -1`` test would keep the never-taken encode in the kernel, with its registers: sm_90 spilled
    for it, ``benchmarks/probes/sass_stats.py``)."""
    # (one return after the runtime branch: Triton does not lower a return inside it)
    if tile.WIRE.stage_own:  # every source's rows are staged: no encode compiled into the expander
        xt = wire_load(io.stage_ptr, row_off, h0, has, tile.H, tile.BH, tile.BT, tile.WIRE, tile.HAS_TIMER,
                       tile.HAS_TIMER)
    elif src == io.rank:
        pay, sc = own_encoded(t, has, io, h0, tile, POW2)
        if tile.WIRE.quantized:
            G: tl.constexpr = tile.BT * (tile.BH // tile.WIRE.block)
            PB: tl.constexpr = tile.WIRE.block * tile.WIRE.pay_mul // tile.WIRE.pay_div
            xt = tl.reshape(tile.WIRE.decode(tl.reshape(pay, (G, PB)), tl.reshape(sc, (G,)), tile.HAS_TIMER,
                                             tile.HAS_TIMER), (tile.BT, tile.BH))
        else:
            xt = pay
    else:
        xt = wire_load(io.stage_ptr, row_off, h0, has, tile.H, tile.BH, tile.BT, tile.WIRE, tile.HAS_TIMER,
                       tile.HAS_TIMER)
    return xt


@triton.jit
def own_source(io, tile):
    """The source whose rows the expander encodes from ``io.x_ptr`` itself instead of reading them staged: this rank,
    or -1 (none) on a wire that stages its own rows too (``tile.WIRE.stage_own``: mxfp4)."""
    own = io.rank
    if tile.WIRE.stage_own:
        own = -1
    return own


@triton.jit
def own_encoded(t, has, io, h0, tile, POW2: tl.constexpr):
    """The encoded tile (payload, scales: :func:`tritonep.wire.kernels.wirecodec.wire_encode`) of columns
    [h0, h0+BH) of the own rank's input rows ``t`` (``io.x_ptr``), as :func:`send_chunk` would stage it (masked rows
    encode a zero row)."""
    h = h0 + tl.arange(0, tile.BH)
    v = tl.load(io.x_ptr + t[:, None].to(tl.int64) * tile.H + h[None, :], mask=has[:, None] & (h < tile.H)[None, :],
                other=0.0)
    return wire_encode(v, tile.BT, tile.BH, tile.WIRE, POW2, tile.HAS_TIMER)


@triton.jit
def source_raw(src, t, has, io, row_off, h0, tile, POW2: tl.constexpr = False):
    """Columns [h0, h0+BH) of source ``src``'s wire rows still encoded (payload, scales; quantized wires only): from
    the staging, or for the own rank encoded from ``io.x_ptr`` (see :func:`source_tile`; a ``stage_own`` wire: every
    source from the staging, no encoder compiled in)."""
    if tile.WIRE.stage_own:  # every source's rows are staged: no encode compiled into the expander
        q, sc = wire_load_raw(io.stage_ptr, row_off, h0, has, tile.H, tile.BH, tile.WIRE)
    elif src == io.rank:
        q, sc = own_encoded(t, has, io, h0, tile, POW2)
    else:
        q, sc = wire_load_raw(io.stage_ptr, row_off, h0, has, tile.H, tile.BH, tile.WIRE)
    return q, sc


@triton.jit
def expand_item(src, c, Ts, skip, io, tile, SCALE: tl.constexpr, DOT: tl.constexpr, KEEP_HANDLE: tl.constexpr,
                KEEP_Q: tl.constexpr, PF: tl.constexpr, POW2: tl.constexpr = False):
    """Expand chunk ``c`` of source ``src`` (``Ts`` tokens there) of :class:`ExpandIO` ``io`` from the staging (raw
    wire, own rank: from ``io.x_ptr``, see :func:`source_tile`) into the expert rows (see
    :func:`dispatch_expand_kernel`). ``PF``: load the next hidden tile's source rows before storing the current one
    (its latency then overlaps the K stores); ``POW2``: the sender's scale rule (own-rank rows are encoded here)."""
    t, k_off, h_off, tm, m2 = chunk_index(c, Ts, tile)
    off = (src * io.Tmax + t[:, None]).to(tl.int64) * tile.K + k_off[None, :]
    rows = tl.load(io.meta_ptr + off, mask=m2, other=-1)
    # every access below is bounded by the rows the caller allocated (a route past them is dropped, also from the
    # handle's copy, so the combine never reads past the expert rows either)
    rows = tl.where(skip | (rows >= io.nrows), -1, rows)
    w = tl.load(io.wts_ptr + off, mask=m2, other=0.0)
    if KEEP_HANDLE:
        tl.store(io.hmeta_ptr + off, rows, mask=m2)
        tl.store(io.hwts_ptr + off, w, mask=m2)
    if not DOT:  # the combine backward has no row weights to return (its out_w_ptr is gw_ptr)
        tl.store(io.out_w_ptr + rows, w, mask=rows >= 0)
    has = tl.sum((rows >= 0).to(tl.int32), 1) > 0
    dots = tl.zeros((tile.BT, tile.KB), dtype=tl.float32)
    row_off = (src * io.Tmax + t).to(tl.int64) * tile.RB
    PREFETCH: tl.constexpr = PF and not KEEP_Q
    if PREFETCH:
        xt = source_tile(src, t, has, io, row_off, 0, tile, POW2)
    for h0 in range(0, tile.H, tile.BH):
        h = h0 + h_off
        hm = h < tile.H
        if KEEP_Q:  # the encoded tile, loaded once and stored to each of the K routes' rows
            xt = tl.zeros((tile.BT, tile.BH), dtype=tl.float32)
            qt, st = source_raw(src, t, has, io, row_off, h0, tile, POW2)
        elif PREFETCH:  # the next tile (masked past H); xt holds this one
            xn = source_tile(src, t, has, io, row_off, h0 + tile.BH, tile, POW2)
        else:
            xt = source_tile(src, t, has, io, row_off, h0, tile, POW2)
        for k in tl.static_range(tile.K):
            rk = tl.sum(tl.where(k_off[None, :] == k, rows, 0), 1)
            mk = (rk >= 0)[:, None] & hm[None, :]
            dst = io.out_ptr + rk[:, None].to(tl.int64) * tile.H + h[None, :]
            if KEEP_Q:
                wire_store_raw(qt, st, h0, io.q_ptr, io.s_ptr, rk, rk >= 0, tile.H, tile.BH, tile.WIRE)
            elif SCALE:
                wk = tl.sum(tl.where(k_off[None, :] == k, w, 0.0), 1)
                tl.store(dst, cast_rne(widen(xt) * wk[:, None], io.out_ptr.dtype.element_ty), mask=mk)
            else:
                tl.store(dst, wire_to(xt, io.out_ptr.dtype.element_ty), mask=mk)
            if DOT:
                eo = tl.load(io.eo_ptr + rk[:, None].to(tl.int64) * tile.H + h[None, :], mask=mk, other=0.0)
                part = tl.sum(widen(eo) * widen(xt), 1)
                dots += tl.where(k_off[None, :] == k, part[:, None], 0.0)
        if PREFETCH:
            xt = xn
    if DOT:
        tl.store(io.gw_ptr + rows, dots, mask=rows >= 0)


@triton.jit
def expand_arrived(src, c, n, skip, cflag_ptr, NCmax, status_ptr, flags_ptr, timeout, io, tile,
                   KEEP_Q: tl.constexpr, PF: tl.constexpr, W: tl.constexpr, WB: tl.constexpr, POW2: tl.constexpr = False):
    """The receive step of the one-launch dispatches (fused, decode): wait (bounded, naming ``src``) for chunk
    ``c`` of source ``src`` (its flag ``cflag[src, c]`` reaches the call number ``n``), read the source's token
    count (``ntok[src]``, written before its first flag; kept in the handle with chunk 0) and expand the chunk with
    the handle kept (:func:`expand_item`); ``skip``: the call moves no rows (a timeout during this wait skips too,
    and so does a peer that marked itself timed out: :func:`tritonep.device.signal.peers_alive`, ``flags_ptr``
    this rank's flags region)."""
    wait_ge(cflag_ptr + src * NCmax + c, n, status_ptr, WAIT_DATA, src, timeout, tile.HAS_TIMER)
    peers_alive(flags_ptr, status_ptr, W, WB)
    skip_now = skip | (tl.load(status_ptr) == STATUS_TIMEOUT)
    Ts = tl.load(io.ntok_ptr + src, volatile=True)
    if c == 0:
        tl.store(io.hntok_ptr + src, Ts)
    if c * tile.BT < Ts:
        expand_item(src, c, Ts, skip_now, io, tile, False, False, True, KEEP_Q, PF, POW2)


@triton.jit
def zero_padding(pid, G, io, ntpe_ptr, offs_ptr, tile, L: tl.constexpr, BA: tl.constexpr, KEEP_Q: tl.constexpr):
    """Zero the alignment padding rows of local expert segments ``pid, pid+G, ...`` of a forward dispatch (rows
    ``io.out_ptr``, weights ``io.out_w_ptr``; the combine backward zeroes its own with :func:`zero_unwritten`)."""
    h_off = tl.arange(0, tile.BH)
    a_off = tl.arange(0, BA)
    for j in range(pid, L, G):
        end = tl.minimum(tl.load(offs_ptr + j), io.nrows)
        begin = tl.load(offs_ptr + j - 1, mask=j > 0, other=0)
        real_end = begin + tl.load(ntpe_ptr + j)
        r = real_end + a_off
        rm = r < end
        tl.store(io.out_w_ptr + r, tl.zeros((BA,), dtype=tl.float32), mask=rm)
        if KEEP_Q:  # quantized rows: the encoding of a zero row (payload 0, the wire's zero scale), as the twin
            zq, zs = wire_encode(tl.zeros((BA, tile.BH), dtype=tl.float32), BA, tile.BH, tile.WIRE, False)
            for h0 in range(0, tile.H, tile.BH):
                wire_store_raw(zq, zs, h0, io.q_ptr, io.s_ptr, r, rm, tile.H, tile.BH, tile.WIRE)
        else:
            for h0 in range(0, tile.H, tile.BH):
                h = h0 + h_off
                tl.store(io.out_ptr + r[:, None].to(tl.int64) * tile.H + h[None, :],
                         tl.zeros((BA, tile.BH), dtype=io.out_ptr.dtype.element_ty),
                         mask=rm[:, None] & (h < tile.H)[None, :])


@triton.jit
def zero_rows(begin, end, part, parts, out_ptr, gw_ptr, tile, fill=0.0):
    """Zero rows ``[begin, end)`` of ``out_ptr`` (``[*, H]``) and ``gw_ptr`` (``[*]`` float32) in blocks of
    ``tile.BT`` rows x ``tile.BH`` columns (the caller's own tile: no extra registers); this program takes blocks
    ``part, part + parts, ...``. ``begin`` / ``end`` are runtime values (read on the device). ``fill``: the value
    written instead of zero (NaN: a refused call's outputs, which must not pass for a result)."""
    r_off = tl.arange(0, tile.BT)
    h_off = tl.arange(0, tile.BH)
    for r0 in range(begin + part * tile.BT, end, parts * tile.BT):
        r = r0 + r_off
        rm = r < end
        tl.store(gw_ptr + r, tl.full((tile.BT,), fill, dtype=tl.float32), mask=rm)
        for h0 in range(0, tile.H, tile.BH):
            h = h0 + h_off
            tl.store(out_ptr + r[:, None].to(tl.int64) * tile.H + h[None, :],
                     tl.full((tile.BT, tile.BH), fill, dtype=out_ptr.dtype.element_ty),
                     mask=rm[:, None] & (h < tile.H)[None, :])


@triton.jit
def zero_unwritten(pid, G, skip, nrows, out_ptr, gw_ptr, ntpe_ptr, offs_ptr, tile, L: tl.constexpr, A: tl.constexpr,
                   refused=0):
    """The rows of the combine backward's ``[nrows, H]`` outputs that no route writes, zeroed in the same launch (no
    memset of the whole output first): the alignment padding of every local expert segment (A > 1; segments
    ``pid, pid+G, ...``), and the rows past the segments' end ``offs[L-1]`` -- every row when the call moves none
    (``skip``: a timeout, a refused call) -- in ``tile.BT``-row blocks spread over the grid; ``refused`` (a source
    took part as refused: :func:`refused_sources`): every row is NaN instead. Rows at or past ``nrows`` are never
    touched (a caller's ``expert_out`` shorter than the layout)."""
    total = tl.load(offs_ptr + L - 1)
    if A > 1:
        if skip == 0:
            for j in range(pid, L, G):
                end = tl.minimum(tl.load(offs_ptr + j), nrows)
                begin = tl.load(offs_ptr + j - 1, mask=j > 0, other=0)
                zero_rows(begin + tl.load(ntpe_ptr + j), end, 0, 1, out_ptr, gw_ptr, tile)
    zero_rows(tl.where(skip, 0, total), nrows, pid, G, out_ptr, gw_ptr, tile,
              tl.where(refused != 0, float("nan"), 0.0))


@triton.jit
def refused_sources(ntok_ptr, W: tl.constexpr, WB: tl.constexpr):
    """``(mask, lowest)``: the int64 bitmask of the sources that took part in this combine backward as refused (their
    send wrote ``ntok[src] = -1`` here, :func:`dispatch_send_kernel` with ``T`` = -1; read after acquiring their
    data signals) and the lowest of them (WB when none)."""
    offs = tl.arange(0, WB)
    v = tl.load(ntok_ptr + offs, mask=offs < W, other=0, volatile=True)
    hit = (offs < W) & (v < 0)
    mask = tl.sum(tl.where(hit, tl.full((WB,), 1, tl.int64) << offs.to(tl.int64), 0), 0)
    return mask, tl.min(tl.where(hit, offs, WB), 0)


@triton.jit(do_not_specialize=['T', 'NC', 'data_off', 'timeout', 'G_expand', 'Tmax', 'rank'])
def dispatch_send_kernel(x_ptr, topk_idx_ptr, topk_w_ptr, rows_ptr, T, NC, pre_ptr, send_base_ptr,
                         stage_tab, meta_tab, wts_tab, ntok_tab,
                         flags_ptr, flags_tab, data_off, calls_ptr, status_ptr, timeout, G_expand, Tmax,
                         rank, W: tl.constexpr, E: tl.constexpr, L: tl.constexpr, K: tl.constexpr,
                         KB: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, WB: tl.constexpr,
                         COMPUTE_ROWS: tl.constexpr, HAS_TIMER: tl.constexpr, RB: tl.constexpr = 0,
                         WIRE: tl.constexpr = RAW_BF16, POW2: tl.constexpr = False, ADV: tl.constexpr = 0):
    """Send side of a dispatch (see the module docstring). Grid-stride over chunks of BT tokens.

    Writes, for every destination rank d: ``ntok[rank]`` (program 0), each token's K destination rows (or -1) and
    weights into d's ``meta``/``wts[rank, t]``, and the wire-encoded row into d's ``stage[rank, t]`` if the token
    has a route on d (raw wire: not for d == rank, whose expander reads ``x_ptr``); then raises ``flags[DATA, rank]``
    on every rank. COMPUTE_ROWS: derive the rows from the layout (forward) instead of reading ``rows_ptr`` (combine
    backward). Waits first (bounded) until every destination consumed the previous call's staging. ``ADV`` (the
    combine backward, whose call has no histogram launch to advance the counter): this call's number is
    ``calls[CALL_DISPATCH] + 1`` and the expand's last program advances the counter. ``T = -1`` with ``NC = 0`` (the
    combine backward of a rank that takes part as refused): no row moves and ``ntok[rank] = -1`` in every destination
    is the refused mark its expand reads (:func:`refused_sources`).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n = tl.load(calls_ptr + CALL_DISPATCH) + ADV
    tile: tl.constexpr = RowTile(K, KB, H, BH, BT, RB, WIRE, HAS_TIMER)
    _, live = open_send(n, G_expand, None, pid, T, flags_ptr, flags_tab, status_ptr, ntok_tab, timeout, rank, tile, W,
                        WB)
    io = SendIO(x_ptr, topk_idx_ptr, topk_w_ptr, rows_ptr, T, pre_ptr, send_base_ptr, stage_tab, meta_tab, wts_tab,
                Tmax, rank)
    for c in range(pid, NC, G):
        send_chunk(c, live, io, tile, W, E, L, COMPUTE_ROWS, POW2, COMPUTE_ROWS)
    signal_peers(flags_tab, data_off, W, rank, WB)


@triton.jit(do_not_specialize=['ack_off', 'timeout', 'G_send', 'Tmax', 'NCmax', 'nrows', 'rank'])
def dispatch_expand_kernel(x_ptr, stage_ptr, meta_ptr, wts_ptr, ntok_ptr, out_ptr, out_w_ptr, hmeta_ptr, hwts_ptr,
                           hntok_ptr, ntpe_ptr, offs_ptr, eo_ptr, gw_ptr,
                           flags_ptr, flags_tab, ack_off, calls_ptr, status_ptr, timeout, G_send, Tmax, NCmax,
                           rank, W: tl.constexpr, L: tl.constexpr, K: tl.constexpr, KB: tl.constexpr,
                           H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, WB: tl.constexpr, LB: tl.constexpr,
                           BA: tl.constexpr, A: tl.constexpr, SCALE: tl.constexpr, DOT: tl.constexpr,
                           KEEP_HANDLE: tl.constexpr, HAS_TIMER: tl.constexpr, RB: tl.constexpr = 0,
                           WIRE: tl.constexpr = RAW_BF16, KEEP_Q: tl.constexpr = False, q_ptr=None, s_ptr=None,
                           PF: tl.constexpr = False, ADV: tl.constexpr = 0, nrows=0, GA: tl.constexpr = 0,
                           POW2: tl.constexpr = False):
    """Receive side of a dispatch: wait for every source, scatter staged rows into the expert-grouped output.

    ``x_ptr``: the ``[T, H]`` input the send kernel of this call read on this rank (``x`` forward, ``grad_y`` for
    the combine backward); on the raw wire the own rank's rows are read from it (:func:`source_tile`), so it must
    stay alive and unchanged until this kernel ran (launched right after the send on the same stream).

    ``out[row]`` = decoded staged row for each route (SCALE: times its weight; KEEP_Q: copy payload + scales to
    ``q_ptr``/``s_ptr``), ``out_w[row]`` = route weight (not with DOT), DOT: ``gw[row] = <staged row, eo[row]>``;
    KEEP_HANDLE copies the routing metadata into the handle; A > 1 zeroes the alignment padding rows. DOT (the
    combine backward) writes every one of its ``nrows`` output rows (:func:`zero_unwritten`: padding and the rows
    past the layout's end are zero), so its outputs need no zero fill. ``nrows``: the rows of the outputs (``out``,
    ``q``/``s``, ``out_w``; DOT: ``out``, ``eo``, ``gw``): no row at or past it is written or read. A source that
    marked itself timed out (:func:`tritonep.device.signal.peers_alive`) makes the call skip its rows (DOT: records
    it after them); DOT: a source that took part as refused (``ntok[src] = -1``, :func:`refused_sources`) makes it
    move no row and write NaN into every output row, and program 0 records the refusal. Then acks every source.
    PF: prefetch the next hidden tile of each source row (:func:`expand_item`). ``ADV``: as
    :func:`dispatch_send_kernel`; this kernel's last program advances ``calls[CALL_DISPATCH]`` and acks every source
    once for ``GA`` programs (the senders wait for ``grid_expand`` acks per call), so its grid may differ.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n = tl.load(calls_ptr + CALL_DISPATCH) + ADV
    wait_all_ge(flags_ptr + FLAG_DATA * W, W, n * G_send, status_ptr, WAIT_DATA, timeout, HAS_TIMER, WB)
    if not DOT:  # a sender that timed out skipped its rows: take none (records it; the combine backward: below)
        peers_alive(flags_ptr, status_ptr, W, WB)
    skip = (tl.load(status_ptr) == STATUS_TIMEOUT) | (tl.load(status_ptr + ST_SKIP_CALL) == n)
    refused = 0
    if DOT:  # a source that took part as refused (its combine backward input was refused: ntok[src] = -1): no row
        # moves, every output row is NaN, program 0 records it after its rows (scalar loads: the tile sits at the
        # register limit, and a vector reduction here spilled)
        for s in tl.static_range(W):
            refused = refused | (tl.load(ntok_ptr + s, volatile=True) < 0).to(tl.int32)
        skip = skip | (refused != 0)
    if KEEP_HANDLE:
        if pid == 0:
            w_off = tl.arange(0, WB)
            tl.store(hntok_ptr + w_off, tl.load(ntok_ptr + w_off, mask=w_off < W, other=0), mask=w_off < W)
    tile: tl.constexpr = RowTile(K, KB, H, BH, BT, RB, WIRE, HAS_TIMER)
    io = ExpandIO(x_ptr, stage_ptr, meta_ptr, wts_ptr, ntok_ptr, out_ptr, out_w_ptr, hmeta_ptr, hwts_ptr, hntok_ptr,
                  eo_ptr, gw_ptr, q_ptr, s_ptr, Tmax, nrows, rank)
    for item in range(pid, W * NCmax, G):
        src = item // NCmax
        c = item % NCmax
        Ts = tl.load(ntok_ptr + src)
        if c * BT < Ts:
            expand_item(src, c, Ts, skip, io, tile, SCALE, DOT, KEEP_HANDLE, KEEP_Q, PF, POW2)
    if DOT:
        zero_unwritten(pid, G, skip, nrows, out_ptr, gw_ptr, ntpe_ptr, offs_ptr, tile, L, A, refused)
        if refused != 0:
            if pid == 0:  # the refusal, for the next read on the host (PeerInputError naming the refused ranks)
                rmask, rlow = refused_sources(ntok_ptr, W, WB)
                record_refusal(status_ptr, rmask, rlow)
        # the combine backward's tile sits at the register limit (tests/backends/test_compile_sm90.py: no spill), so
        # it looks for a peer's timed-out mark after its rows: a mark records the timeout (its outputs are then
        # unspecified and the next read raises), as the forward expand does before them
        peers_alive(flags_ptr, status_ptr, W, WB)
    elif A > 1:
        if skip == 0:  # a refused call's segments may exceed the rows allocated: write nothing
            zero_padding(pid, G, io, ntpe_ptr, offs_ptr, tile, L, BA, KEEP_Q)
    if ADV:  # its own grid: the last program acks every source for GA programs (the forward's grid_expand)
        ack_on_last(calls_ptr, DONE_EXPAND_BWD, CALL_DISPATCH, n, flags_tab, ack_off, GA, W, rank, WB)
    else:
        signal_peers(flags_tab, ack_off, W, rank, WB)
