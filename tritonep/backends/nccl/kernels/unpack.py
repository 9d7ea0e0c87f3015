"""The receiving side of the nccl backend's dispatch and its combine backward: packets to expert rows and back.

A received packet p carries a wire row and the meta of its token (K destination rows, K expert ids, K weight
bits, int32); route k of the packet is HERE when ``0 <= id < E`` and ``id // L == rank``.

* :func:`route_unpack_kernel` (grid = packet tiles, plus L programs when the segments have padding rows, plus
  tail programs in the sync-free dispatch, which zero the weights of the rows past the real and padding ones): writes
  every packet's row to the expert row of each of its routes here (one or two sources: the wire row, or payload
  and scales when the rows stay quantized), the row weights, and the per-packet routes of the handle
  (``rr [Nr, K]`` row or -1, ``rw [Nr, K]`` weight or 0); the extra programs fill the padding rows of one local
  expert each (zeros, or a copy of source row ``Nr``: the encoding of a zero row) with weight 0.
* :func:`pack_rows_kernel` (grid = token tiles): ``send[pkt[t, k]] = src[t]`` for every valid route (the packets
  of a dispatch, written again by each further route of the same packet with the same bits).
* :func:`grad_expand_kernel` (grid = packet tiles): the combine backward on the expert rank, per route here:
  ``grad_expert_out[row] = bf16(w * grad_y[p])`` (product rounded once in fp32, then to bf16 by
  round-to-nearest-even) and ``grad_w[row] = <grad_y[p], expert_out[row]>`` in fp32 (tile order).

Twins: :mod:`tritonep.backends.nccl.unpack`. Plain local loads and stores: no signals, no waits.
"""

import triton
import triton.language as tl

from ....device.common import cast_rne, mul_rn, widen
from .route import column

__all__ = ["route_unpack_kernel", "pack_rows_kernel", "grad_expand_kernel"]


@triton.jit
def _pad_rows(j, lay_ptr, src, out_ptr, zrow, hs, he, NTPE: tl.constexpr, OFFS: tl.constexpr, S: tl.constexpr,
              N: tl.constexpr, PAD: tl.constexpr, BA: tl.constexpr, BH: tl.constexpr):
    """Elements ``[hs, he)`` of the padding rows of local expert ``j`` (``[offs[j-1] + ntpe[j], offs[j])``) of
    ``out`` (N elements a row): zeros (PAD == 1) or row ``zrow`` of ``src`` (row stride S; PAD == 2). Returns the
    rows and their mask."""
    end = tl.load(lay_ptr + OFFS + j)
    begin = tl.load(lay_ptr + OFFS + j - 1, mask=j > 0, other=0)
    r = begin + tl.load(lay_ptr + NTPE + j) + tl.arange(0, BA)
    rm = r < end
    h_off = tl.arange(0, BH)
    for h0 in range(hs, he, BH):
        h = h0 + h_off
        hm = h < he
        if PAD == 1:
            v = tl.zeros((BA, BH), dtype=out_ptr.dtype.element_ty)
        else:
            z = tl.load(src + zrow.to(tl.int64) * S + h, mask=hm)
            v = tl.broadcast_to(z[None, :], (BA, BH))
        tl.store(out_ptr + r[:, None].to(tl.int64) * N + h[None, :], v, mask=rm[:, None] & hm[None, :])
    return r, rm


@triton.jit
def _scatter_rows(src, out_ptr, p, pm, rr, hs, he, S: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                  KB: tl.constexpr, BH: tl.constexpr):
    """``out[rr[i, k], hs:he] = src[p[i], hs:he]`` for every ``rr >= 0`` (each source row loaded once; N elements
    a row of ``out``)."""
    h_off = tl.arange(0, BH)
    for h0 in range(hs, he, BH):
        h = h0 + h_off
        hm = h < he
        v = tl.load(src + p.to(tl.int64)[:, None] * S + h[None, :], mask=pm[:, None] & hm[None, :])
        for k in tl.static_range(K):
            rk = column(rr, k, KB)
            tl.store(out_ptr + rk.to(tl.int64)[:, None] * N + h[None, :], v, mask=(rk >= 0)[:, None] & hm[None, :])


@triton.jit(do_not_specialize=["Nr", "HC", "NR", "rank"])
def route_unpack_kernel(recv_ptr, src0_ptr, src1_ptr, out0_ptr, out1_ptr, out_w_ptr, rr_ptr, rw_ptr, lay_ptr, Nr, HC, NR,
                        K: tl.constexpr, KB: tl.constexpr, E: tl.constexpr, L: tl.constexpr,
                        rank, BP: tl.constexpr, META: tl.constexpr, ROW32: tl.constexpr,
                        S0: tl.constexpr, C0: tl.constexpr, N0: tl.constexpr, S1: tl.constexpr, C1: tl.constexpr,
                        N1: tl.constexpr, NTPE: tl.constexpr, OFFS: tl.constexpr, PAD: tl.constexpr,
                        BA: tl.constexpr, BH: tl.constexpr, SLOTS: tl.constexpr, RCNT: tl.constexpr,
                        NPAD: tl.constexpr = 0, MAXR: tl.constexpr = 0, BZ: tl.constexpr = 1024):
    """Packets ``[pid0*BP, +BP)`` to expert rows, or (``pid0 >= cdiv(Nr, BP)``, PAD != 0) the padding rows of local
    expert ``pid0 - cdiv(Nr, BP)`` (module docstring); program column ``pid1`` moves src0 elements
    ``[pid1 * HC, +HC)`` (HC a multiple of BH), column 0 also the routes, weights and src1.

    ``recv``: the receive rows (any dtype; int32 meta at int32 column META, row stride ROW32 int32 words).
    ``src0``: any tensor read as ``out0``'s dtype: row p's N0 elements start at element ``C0 + p * S0``; they go to
    ``out0 [R, N0]``. ``src1`` / ``out1`` likewise when N1 > 0. ``out_w`` float32 ``[R]``; ``rr`` int32 /
    ``rw`` float32 ``[Nr, K]``; ``lay`` int32 with ``num_tokens_per_expert`` at NTPE and ``expert_offsets`` at
    OFFS (L each).

    ``SLOTS`` > 0 (the sync-free dispatch: fixed packet slots, ``SLOTS`` per source rank): packet p is live only when
    ``p % SLOTS < lay[RCNT + p // SLOTS]`` (the packets that source sent); the others are dropped (their routes
    ``rr = -1``, ``rw = 0``, nothing written).

    ``MAXR`` > 0 (the sync-free dispatch's ``max_recv_tokens`` rows, a fresh ``out_w``): programs after the
    ``NPAD`` (L when PAD != 0, else 0) padding programs zero the tail weights ``out_w[offs[L-1]:MAXR]``, BZ rows
    each; with the real and padding rows' weights written above, every weight of the call is written (no zeroing
    launch, no ``torch.zeros``).
    """
    pid = tl.program_id(0)
    col0 = tl.program_id(1) == 0
    hs = tl.program_id(1) * HC
    he = tl.minimum(hs + HC, N0)
    ntiles = tl.cdiv(Nr, BP)
    k_off = tl.arange(0, KB)
    s0 = src0_ptr.to(tl.pointer_type(out0_ptr.dtype.element_ty)) + C0
    s1 = src1_ptr.to(tl.pointer_type(out1_ptr.dtype.element_ty)) + C1
    if pid < ntiles:
        p = pid * BP + tl.arange(0, BP)
        pm = p < Nr
        m2 = pm[:, None] & (k_off[None, :] < K)
        if SLOTS > 0:
            live = pm & ((p % SLOTS) < tl.load(lay_ptr + RCNT + p // SLOTS, mask=pm, other=0))
        else:
            live = pm
        ml = live[:, None] & (k_off[None, :] < K)
        mb = recv_ptr.to(tl.pointer_type(tl.int32)) + p.to(tl.int64)[:, None] * ROW32 + META + k_off[None, :]
        rows = tl.load(mb, mask=ml, other=-1)
        ids = tl.load(mb + K, mask=ml, other=-1)
        w = tl.load(mb + 2 * K, mask=ml, other=0).to(tl.float32, bitcast=True)
        # NR: the rows of the outputs (a route past them is dropped: no write outside the rows given, whatever
        # the packet says; the route's -1 in ``rr`` keeps combine and the backward passes inside them too)
        here = ml & (ids >= 0) & (ids < E) & (ids // L == rank) & (rows < NR)
        rr = tl.where(here, rows, -1)
        pk = p.to(tl.int64)[:, None] * K + k_off[None, :]
        tl.store(rr_ptr + pk, rr, mask=m2 & col0)
        tl.store(rw_ptr + pk, tl.where(here, w, 0.0), mask=m2 & col0)
        tl.store(out_w_ptr + rr, w, mask=here & col0)
        _scatter_rows(s0, out0_ptr, p, live, rr, hs, he, S0, N0, K, KB, BH)
        if N1 > 0:
            if col0:
                _scatter_rows(s1, out1_ptr, p, live, rr, 0, N1, S1, N1, K, KB, BH)
    elif pid < ntiles + NPAD:
        j = pid - ntiles
        r, rm = _pad_rows(j, lay_ptr, s0, out0_ptr, Nr, hs, he, NTPE, OFFS, S0, N0, PAD, BA, BH)
        tl.store(out_w_ptr + r, tl.zeros((BA,), dtype=tl.float32), mask=rm & col0)
        if N1 > 0:
            if col0:
                _pad_rows(j, lay_ptr, s1, out1_ptr, Nr, 0, N1, NTPE, OFFS, S1, N1, PAD, BA, BH)
    elif MAXR > 0:  # the tail rows' weights
        rt = (pid - ntiles - NPAD) * BZ + tl.arange(0, BZ)  # (not `r`: a name's type must agree across branches)
        used = tl.load(lay_ptr + OFFS + L - 1)
        tl.store(out_w_ptr + rt, tl.zeros((BZ,), dtype=tl.float32), mask=(rt >= used) & (rt < MAXR) & col0)


@triton.jit(do_not_specialize=["T", "HC"])
def pack_rows_kernel(src_ptr, pkt_ptr, send_ptr, T, HC, K: tl.constexpr, KB: tl.constexpr, N: tl.constexpr,
                     BT: tl.constexpr, BH: tl.constexpr):
    """``send[pkt[t, k], h] = src[t, h]`` for tokens ``[pid0*BT, +BT)``, elements ``h`` in ``[pid1 * HC, +HC)``
    and every k with ``pkt >= 0`` (both contiguous with N elements a row)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < T
    k_off = tl.arange(0, KB)
    h_off = tl.arange(0, BH)
    pk = tl.load(pkt_ptr + t[:, None].to(tl.int64) * K + k_off[None, :], mask=tm[:, None] & (k_off[None, :] < K),
                 other=-1)
    hs = tl.program_id(1) * HC
    he = tl.minimum(hs + HC, N)
    for h0 in range(hs, he, BH):
        h = h0 + h_off
        hm = h < he
        v = tl.load(src_ptr + t[:, None].to(tl.int64) * N + h[None, :], mask=tm[:, None] & hm[None, :])
        for k in tl.static_range(K):
            sk = column(pk, k, KB)
            tl.store(send_ptr + sk.to(tl.int64)[:, None] * N + h[None, :], v, mask=(sk >= 0)[:, None] & hm[None, :])


@triton.jit(do_not_specialize=["Nr"])
def grad_expand_kernel(gy_ptr, eo_ptr, rr_ptr, rw_ptr, geo_ptr, gw_ptr, Nr, K: tl.constexpr, KB: tl.constexpr,
                       H: tl.constexpr, BP: tl.constexpr, BH: tl.constexpr, USE_ASM: tl.constexpr):
    """Combine backward of packets ``[pid*BP, +BP)`` (module docstring): ``gy [Nr, H]`` bf16 (the received
    ``grad_y`` rows), ``eo`` / ``geo`` ``[>= R, H]`` bf16, ``rr`` / ``rw`` ``[Nr, K]``, ``gw`` float32 ``[R]``."""
    p = tl.program_id(0) * BP + tl.arange(0, BP)
    pm = p < Nr
    k_off = tl.arange(0, KB)
    h_off = tl.arange(0, BH)
    m2 = pm[:, None] & (k_off[None, :] < K)
    pk = p.to(tl.int64)[:, None] * K + k_off[None, :]
    rr = tl.load(rr_ptr + pk, mask=m2, other=-1)
    rw = tl.load(rw_ptr + pk, mask=m2, other=0.0)
    dots = tl.zeros((BP, KB), dtype=tl.float32)
    for h0 in range(0, H, BH):
        h = h0 + h_off
        hm = h < H
        g = widen(tl.load(gy_ptr + p.to(tl.int64)[:, None] * H + h[None, :], mask=pm[:, None] & hm[None, :],
                          other=0.0))
        for k in tl.static_range(K):
            rk = column(rr, k, KB)
            wk = tl.sum(tl.where(k_off[None, :] == k, rw, 0.0), 1)
            mk = (rk >= 0)[:, None] & hm[None, :]
            off = rk.to(tl.int64)[:, None] * H + h[None, :]
            e = widen(tl.load(eo_ptr + off, mask=mk, other=0.0))
            tl.store(geo_ptr + off, cast_rne(mul_rn(g, tl.broadcast_to(wk[:, None], (BP, BH)), USE_ASM),
                                             geo_ptr.dtype.element_ty), mask=mk)
            d = tl.sum(g * e, 1)
            dots += tl.where(k_off[None, :] == k, d[:, None], 0.0)
    tl.store(gw_ptr + rr, dots, mask=rr >= 0)
