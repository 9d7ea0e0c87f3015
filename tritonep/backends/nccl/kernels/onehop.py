"""The two launches of the one-hop nccl dispatch: send side and receive side of ONE even ``all_to_all_single``.

Buffers (uint8, ``[W * BLK, ROW32 * 4]`` with ``BLK = 1 + TCAP``, TCAP = ``max_tokens_per_rank``): block d holds
slot 0 = the HEADER (int32 columns ``[0, E + W + 2)``: the sender's counts row, exactly
:func:`tritonep.backends.nccl.route.count_row_torch`) and slots ``1 .. TCAP`` = packets (one per (token, rank d) with at
least one route to d, tokens ascending). A packet row: the token's wire row (src0 elements at 0, optional src1 at
element COL1 of its own dtype), then int32 meta at column META: ``lr[t, :K] | topk_idx[t, :K] | weight bits[t, :K]``
where ``lr[t, k]`` is the rank of route (t, k) among the SENDER's routes to expert ``idx[t, k]`` in (t, k) order
(-1 for masked / invalid ids).

* :func:`onehop_send_kernel` (grid = ``max(1, cdiv(T, BT))`` token tiles x column splits of the row): tile c
  computes the routes and packets of tokens before it by redundant pairwise scans of the earlier tiles (no chunk
  scratch, no ticket, no grid sync; ``c * BT * KB`` pairwise compares of ``BT * KB`` routes: free at decode, about
  4096^2 * K^2 / (2 * BT * KB) compares per program at T = 4096 -- use the two-launch route kernels there);
  program 0 also scans every tile for the histograms and writes the header into slot 0 of EVERY block. Packets are
  written for every valid id whatever the flags (the receiver ignores a call whose headers say bad input).
* :func:`onehop_recv_kernel` (static grid = packet tiles over all ``W * BLK`` slots, then row tiles over
  ``[0, MAXR)``; x column splits of the row): every program reads the W headers and derives the verdict (bad
  input: any source's bad-id count or refused flag; capacity: some rank's aligned total rows > MAXR -- every rank
  sees every source's full row, so every rank reaches the same verdict) and this rank's layout
  (:func:`tritonep.backends.layout.layout_torch`); a packet tile scatters its valid packets (index in block < header
  packets-to-this-rank) to ``row = seg_start[j] + sum_{s' < s} counts[s', e] + lr`` and writes the per-slot
  routes ``rr`` / ``rw``; a row tile zeros the weights of padding and tail rows and the padding rows; program 0
  writes ``ntpe``, ``offs``, ``status``, the ``counts`` snapshot and (``MERGE``, the nccl backend's sync-free
  one-hop mode) merges the verdict into the backend's status word. A refused verdict writes no rows (``rr`` -1,
  weights 0, ``ntpe`` / ``offs`` 0).

Twins: :mod:`tritonep.backends.nccl.onehop`. Plain local loads and stores: no signals, no waits. Idea source: DeepEP's
low-latency mode (fixed per-expert receive slots, counts carried with the data), pplx-kernels' dispatch.
"""

import triton
import triton.language as tl

from .route import column, first_route

__all__ = ["onehop_send_kernel", "onehop_recv_kernel"]


@triton.jit
def _tile_ids(idx_ptr, c, T, K: tl.constexpr, KB: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
              BT: tl.constexpr):
    """Token tile ``c``: ``(raw ids [BT, KB] (-1 outside), valid, ids int32 (-1 unless valid), dest rank (-1),
    first route of each packet, slot mask m2)``."""
    t = c * BT + tl.arange(0, BT)
    k_off = tl.arange(0, KB)
    m2 = (t[:, None] < T) & (k_off[None, :] < K)
    raw = tl.load(idx_ptr + t[:, None].to(tl.int64) * K + k_off[None, :], mask=m2, other=-1)
    valid = (raw >= 0) & (raw < E)
    ids = tl.where(valid, raw, -1).to(tl.int32)
    dest = tl.where(valid, ids // L, -1)
    first = first_route(dest, KB)
    return raw, valid, ids, dest, first, m2


@triton.jit(do_not_specialize=["T", "refused", "HC"])
def onehop_send_kernel(idx_ptr, w_ptr, src0_ptr, src1_ptr, send_ptr, pkt_ptr, idx_copy_ptr, w_copy_ptr, T, refused,
                       HC,
                       K: tl.constexpr, KB: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
                       EB: tl.constexpr, WB: tl.constexpr, BT: tl.constexpr, TCAP: tl.constexpr, N0: tl.constexpr,
                       ROW0: tl.constexpr, N1: tl.constexpr, ROW1: tl.constexpr, COL1: tl.constexpr,
                       META: tl.constexpr, ROW32: tl.constexpr, BH: tl.constexpr, HT: tl.constexpr = 0,
                       ST: tl.constexpr = 0):
    """Send side of tokens ``[pid0 * BT, +BT)`` (module docstring); program column ``pid1`` copies src0 elements
    ``[pid1 * HC, +HC)`` (HC a multiple of BH; the index work is redone per column), column 0 also writes ``pkt``,
    the routing copies, the meta, src1 and (program (0, 0)) the headers.

    ``idx`` int32 / int64 ``[T, K]``, ``w`` float32 ``[T, K]``, ``src0 [T, N0]`` (wire row; ROW0 elements of its
    dtype a send row), ``src1 [T, N1]`` (scale bytes at element COL1, ROW1 a row; N1 = 0: none), ``send`` uint8
    ``[W * (1 + TCAP), 4 * ROW32]``; writes ``pkt`` int32 ``[T, K]`` (absolute send slot, -1 masked) and the
    routing copies ``idx_copy`` / ``w_copy``. ``HT``: tokens per step of program (0, 0)'s header scan, ``ST``:
    tokens per step of a tile's scan of the tokens before it (0: BT); large steps keep these serial chains of loads,
    compares and histograms short (a step or a few at decode sizes).
    """
    R: tl.constexpr = BT * KB
    BLK: tl.constexpr = 1 + TCAP
    pid = tl.program_id(0)
    col0 = tl.program_id(1) == 0
    hs = tl.program_id(1) * HC
    he = tl.minimum(hs + HC, N0)
    t_off = tl.arange(0, BT)
    k_off = tl.arange(0, KB)
    i_off = tl.arange(0, R)
    h_off = tl.arange(0, BH)
    send32 = send_ptr.to(tl.pointer_type(tl.int32))
    send0 = send_ptr.to(tl.pointer_type(src0_ptr.dtype.element_ty))
    t = pid * BT + t_off
    tm = t < T
    raw, valid, ids, dest, first, m2 = _tile_ids(idx_ptr, pid, T, K, KB, E, L, BT)
    tk = t[:, None].to(tl.int64) * K + k_off[None, :]
    tl.store(idx_copy_ptr + tk, raw, mask=m2 & col0)
    fid = tl.reshape(ids, (R,))
    dflat = tl.reshape(dest, (R,))
    fd = tl.reshape(tl.where(first, dest, -1), (R,))
    tok = i_off // KB
    # ranks inside the tile: earlier routes to the same expert, earlier tokens with a packet to the same rank
    eq = (fid[:, None] == fid[None, :]) & (i_off[None, :] < i_off[:, None]) & (fid[None, :] >= 0)
    lr_acc = tl.sum(eq.to(tl.int32), 1)
    eqp = (dflat[:, None] == fd[None, :]) & (tok[None, :] < tok[:, None]) & (fd[None, :] >= 0)
    pr_acc = tl.sum(eqp.to(tl.int32), 1)
    # the same over every earlier token (redundant scans, ST tokens a step: no scratch, no grid sync)
    SS: tl.constexpr = BT if ST == 0 else ST
    lim = pid * BT  # the tokens before this tile
    for c0 in range(0, tl.cdiv(lim, SS)):
        _r0, _v0, ids0, dest0, first0, _m0 = _tile_ids(idx_ptr, c0, lim, K, KB, E, L, SS)
        f0 = tl.reshape(ids0, (SS * KB,))
        fd0 = tl.reshape(tl.where(first0, dest0, -1), (SS * KB,))
        lr_acc += tl.sum(((fid[:, None] == f0[None, :]) & (f0[None, :] >= 0)).to(tl.int32), 1)
        pr_acc += tl.sum(((dflat[:, None] == fd0[None, :]) & (fd0[None, :] >= 0)).to(tl.int32), 1)
    lr = tl.where(valid, tl.reshape(lr_acc, (BT, KB)), -1)
    slot = tl.where(valid, dest * BLK + 1 + tl.reshape(pr_acc, (BT, KB)), -1)
    tl.store(pkt_ptr + tk, slot, mask=m2 & col0)
    wv = tl.load(w_ptr + tk, mask=m2, other=0.0)
    tl.store(w_copy_ptr + tk, wv, mask=m2 & col0)
    wbits = wv.to(tl.int32, bitcast=True)
    raw32 = raw.to(tl.int32)
    fi = first.to(tl.int32)
    for k in tl.static_range(K):  # the meta of each packet, by its first route
        sk = column(slot, k, KB)
        fk = (column(fi, k, KB) > 0) & tm & col0
        mk = fk[:, None] & (k_off[None, :] < K)
        mb = send32 + sk.to(tl.int64)[:, None] * ROW32 + META + k_off[None, :]
        tl.store(mb, lr, mask=mk)
        tl.store(mb + K, raw32, mask=mk)
        tl.store(mb + 2 * K, wbits, mask=mk)
    for h0 in range(hs, he, BH):  # the token's wire row: loaded once, stored once per packet
        h = h0 + h_off
        hm = h < he
        v = tl.load(src0_ptr + t[:, None].to(tl.int64) * N0 + h[None, :], mask=tm[:, None] & hm[None, :])
        for k in tl.static_range(K):
            sk = column(slot, k, KB)
            fk = (column(fi, k, KB) > 0) & tm
            tl.store(send0 + sk.to(tl.int64)[:, None] * ROW0 + h[None, :], v, mask=fk[:, None] & hm[None, :])
    if N1 > 0:
        send1 = send_ptr.to(tl.pointer_type(src1_ptr.dtype.element_ty))
        for h0 in range(0, N1, BH):
            h = h0 + h_off
            hm = (h < N1) & col0
            v = tl.load(src1_ptr + t[:, None].to(tl.int64) * N1 + h[None, :], mask=tm[:, None] & hm[None, :])
            for k in tl.static_range(K):
                sk = column(slot, k, KB)
                fk = (column(fi, k, KB) > 0) & tm
                tl.store(send1 + sk.to(tl.int64)[:, None] * ROW1 + COL1 + h[None, :], v,
                         mask=fk[:, None] & hm[None, :])
    if (pid == 0) & col0:  # the header: this rank's counts row, into slot 0 of every block
        HS: tl.constexpr = BT if HT == 0 else HT
        RH: tl.constexpr = HS * KB
        e_off = tl.arange(0, EB)
        w_off = tl.arange(0, WB)
        hist_e = tl.zeros((EB,), dtype=tl.int32)
        hist_d = tl.zeros((WB,), dtype=tl.int32)
        badv = tl.zeros((HS,), dtype=tl.int32)
        for c0 in range(0, tl.cdiv(T, HS)):
            r0, v0, ids0, dest0, first0, m0 = _tile_ids(idx_ptr, c0, T, K, KB, E, L, HS)
            badv += tl.sum((m0 & ((r0 < -1) | (r0 >= E))).to(tl.int32), 1)
            hist_e += tl.histogram(tl.reshape(tl.where(v0, ids0, 0), (RH,)), EB, mask=tl.reshape(v0, (RH,)))
            hist_d += tl.histogram(tl.reshape(tl.where(first0, dest0, 0), (RH,)), WB, mask=tl.reshape(first0, (RH,)))
        bad = tl.sum(badv, 0)
        hb = send32  # a 64-bit pointer stepped per block (no 32-bit block offsets)
        for d in range(W):
            tl.store(hb + e_off, hist_e, mask=e_off < E)
            tl.store(hb + E + w_off, hist_d, mask=w_off < W)
            tl.store(hb + E + W, bad)
            tl.store(hb + E + W + 1, refused)
            hb += BLK * ROW32


@triton.jit(do_not_specialize=["HC", "rank"])
def onehop_recv_kernel(recv_ptr, out_ptr, out_w_ptr, rr_ptr, rw_ptr, ntpe_ptr, offs_ptr, status_ptr, counts_ptr,
                       st_ptr, HC, MERGE: tl.constexpr,
                       K: tl.constexpr, KB: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
                       rank, EB: tl.constexpr, LB: tl.constexpr, WB: tl.constexpr,
                       TCAP: tl.constexpr, A: tl.constexpr, MAXR: tl.constexpr, BP: tl.constexpr,
                       BZ: tl.constexpr, N0: tl.constexpr, S0: tl.constexpr, META: tl.constexpr,
                       ROW32: tl.constexpr, BH: tl.constexpr, CODE_CAP: tl.constexpr, CODE_BAD: tl.constexpr):
    """Receive side (module docstring): ``recv`` uint8 ``[W * (1 + TCAP), 4 * ROW32]`` (block s from rank s; the
    wire row read as ``out``'s dtype, S0 elements a row, N0 elements copied); writes ``out [MAXR, N0]`` (real and
    padding rows), ``out_w`` float32 ``[MAXR]`` (every row), ``rr`` int32 / ``rw`` float32 ``[W * (1 + TCAP), K]``,
    ``ntpe`` / ``offs`` int32 ``[L]``, ``status`` int64 ``[4]`` = ``[code, bad-rank mask, rows needed by the worst
    rank, that rank]``, ``counts`` int32 ``[W, E]`` (every source's routes per expert, from the headers; written
    whatever the verdict) and, when ``MERGE``, merges the verdict into the nccl backend's int32 status word ``st``
    ``[4 + 2W]`` exactly as :func:`tritonep.backends.nccl.kernels.plan.sync_free_plan_kernel` does (the first unread
    refusal's code / worst rank / rows, refusals counted, per-rank bad-id and refused flags gathered). Program
    column ``pid1`` moves (or zeros) elements ``[pid1 * HC, +HC)`` of the rows; column 0 also writes ``rr``,
    ``rw``, the weights and (program (0, 0)) ``ntpe``, ``offs``, ``status``, ``counts`` and the merge.
    """
    BLK: tl.constexpr = 1 + TCAP
    NSLOT: tl.constexpr = W * BLK
    NT: tl.constexpr = (NSLOT + BP - 1) // BP
    pid = tl.program_id(0)
    col0 = tl.program_id(1) == 0
    hs = tl.program_id(1) * HC
    he = tl.minimum(hs + HC, N0)
    recv32 = recv_ptr.to(tl.pointer_type(tl.int32))
    # the verdict, from the W headers (every rank reads the same W rows: the same verdict everywhere)
    s_off = tl.arange(0, WB)
    sm = s_off < W
    hrow = s_off.to(tl.int64) * BLK * ROW32
    nbad = tl.load(recv32 + hrow + E + W, mask=sm, other=0)
    refd = tl.load(recv32 + hrow + E + W + 1, mask=sm, other=0)
    badv = sm & ((nbad != 0) | (refd != 0))
    mask = tl.sum(tl.where(badv, tl.full((WB,), 1, tl.int64) << s_off.to(tl.int64), 0), 0)
    any_bad = tl.max(badv.to(tl.int32), 0) > 0
    e_off = tl.arange(0, EB)
    em = e_off < E
    tot = tl.zeros((EB,), dtype=tl.int32)
    hb = recv32  # header of source s (a 64-bit pointer stepped per block)
    for s in range(W):
        tot += tl.load(hb + e_off, mask=em, other=0)
        hb += BLK * ROW32
    alig = (tot + (A - 1)) // A * A
    need = tl.sum(tl.where(((e_off // L)[None, :] == s_off[:, None]) & em[None, :], alig[None, :], 0), 1)
    worst = tl.max(need, 0)
    worst_rank = tl.argmax(need, 0)
    code = tl.where(any_bad, CODE_BAD, tl.where(worst > MAXR, CODE_CAP, 0))
    ok = code == 0
    # this rank's layout (zero on a refused verdict: every row is then a tail row)
    j_off = tl.arange(0, LB)
    jm = j_off < L
    cnt = tl.zeros((LB,), dtype=tl.int32)
    hb = recv32
    for s in range(W):
        cnt += tl.load(hb + rank * L + j_off, mask=jm & ok, other=0)
        hb += BLK * ROW32
    al_loc = (cnt + (A - 1)) // A * A
    ends = tl.cumsum(al_loc, 0)
    starts = ends - al_loc
    used = tl.sum(al_loc, 0)
    k_off = tl.arange(0, KB)
    h_off = tl.arange(0, BH)
    src = recv_ptr.to(tl.pointer_type(out_ptr.dtype.element_ty))
    if pid < NT:
        p = pid * BP + tl.arange(0, BP)
        pm = p < NSLOT
        s_p = p // BLK
        i_p = p % BLK
        npk = tl.load(recv32 + s_p.to(tl.int64) * BLK * ROW32 + E + rank, mask=pm, other=0)
        live = pm & (i_p >= 1) & (i_p - 1 < npk) & ok
        m2 = live[:, None] & (k_off[None, :] < K)
        mb = recv32 + p.to(tl.int64)[:, None] * ROW32 + META + k_off[None, :]
        lr = tl.load(mb, mask=m2, other=-1)
        ids = tl.load(mb + K, mask=m2, other=-1)
        w = tl.load(mb + 2 * K, mask=m2, other=0).to(tl.float32, bitcast=True)
        here = m2 & (ids >= 0) & (ids < E) & (ids // L == rank)
        pre = tl.zeros((BP, KB), dtype=tl.int32)
        hb = recv32
        for s in range(W):  # routes of earlier sources to the same expert
            pre += tl.load(hb + ids, mask=here & (s < s_p[:, None]), other=0)
            hb += BLK * ROW32
        jj = tl.reshape(tl.where(here, ids - rank * L, 0), (BP * KB,))
        row = tl.reshape(tl.gather(starts, jj, 0), (BP, KB)) + pre + lr
        here = here & (lr >= 0) & (row < MAXR)
        rr = tl.where(here, row, -1)
        pk = p.to(tl.int64)[:, None] * K + k_off[None, :]
        km = pm[:, None] & (k_off[None, :] < K)
        tl.store(rr_ptr + pk, rr, mask=km & col0)
        tl.store(rw_ptr + pk, tl.where(here, w, 0.0), mask=km & col0)
        tl.store(out_w_ptr + rr, w, mask=here & col0)
        for h0 in range(hs, he, BH):
            h = h0 + h_off
            hm = h < he
            v = tl.load(src + p.to(tl.int64)[:, None] * S0 + h[None, :], mask=live[:, None] & hm[None, :])
            for k in tl.static_range(K):
                rk = column(rr, k, KB)
                tl.store(out_ptr + rk.to(tl.int64)[:, None] * N0 + h[None, :], v,
                         mask=(rk >= 0)[:, None] & hm[None, :])
    else:  # rows [z * BZ, +BZ): weights of padding and tail rows, zeros in the padding rows
        r = (pid - NT) * BZ + tl.arange(0, BZ)
        rm = r < MAXR
        tail = r >= used
        if A > 1:  # padding rows (none when A == 1: no segment search, large row tiles)
            seg = tl.sum((jm[None, :] & (ends[None, :] <= r[:, None])).to(tl.int32), 1)
            # (a row past every segment, seg >= L, is a tail row whatever real_end says: the index is clamped)
            real_end = tl.gather(starts + cnt, tl.minimum(seg, LB - 1), 0)
            pad = rm & (r < used) & (r >= real_end)
            tl.store(out_w_ptr + r, tl.zeros((BZ,), dtype=tl.float32), mask=rm & (tail | pad) & col0)
            for h0 in range(hs, he, BH):
                h = h0 + h_off
                hm = h < he
                tl.store(out_ptr + r.to(tl.int64)[:, None] * N0 + h[None, :],
                         tl.zeros((BZ, BH), dtype=out_ptr.dtype.element_ty), mask=pad[:, None] & hm[None, :])
        else:
            tl.store(out_w_ptr + r, tl.zeros((BZ,), dtype=tl.float32), mask=rm & tail & col0)
    if (pid == 0) & col0:
        tl.store(ntpe_ptr + j_off, cnt, mask=jm)
        tl.store(offs_ptr + j_off, ends, mask=jm)
        tl.store(status_ptr, code.to(tl.int64))
        tl.store(status_ptr + 1, mask)
        tl.store(status_ptr + 2, worst.to(tl.int64))
        tl.store(status_ptr + 3, worst_rank.to(tl.int64))
        hb = recv32
        for s in range(W):  # the handle's counts snapshot: every source's routes per expert
            tl.store(counts_ptr + s * E + e_off, tl.load(hb + e_off, mask=em, other=0), mask=em)
            hb += BLK * ROW32
        if MERGE:  # the backend's status word (the gather mode's plan kernel writes it the same way)
            err = code != 0
            code0 = tl.load(st_ptr)
            first = err & (code0 == 0)
            tl.store(st_ptr, tl.where(first, code, code0))
            tl.store(st_ptr + 1, tl.where(first, worst_rank.to(tl.int32), tl.load(st_ptr + 1)))
            tl.store(st_ptr + 2, tl.load(st_ptr + 2) + err.to(tl.int32))
            tl.store(st_ptr + 3, tl.where(first, worst, tl.load(st_ptr + 3)))
            fb = tl.load(st_ptr + 4 + s_off, mask=sm, other=0)
            tl.store(st_ptr + 4 + s_off, tl.maximum(fb, (nbad != 0).to(tl.int32)), mask=sm)
            fr = tl.load(st_ptr + 4 + W + s_off, mask=sm, other=0)
            tl.store(st_ptr + 4 + W + s_off, tl.maximum(fr, (refd != 0).to(tl.int32)), mask=sm)
