"""Local (no communication) fixed-order fp32 sums of the nccl backend's combine (one program per tile).

Host wrappers, exact arithmetic and torch twins: :mod:`tritonep.backends.nccl.pack` (``local_partials``,
``sum_partials``). Plain local loads and stores: no signals, no waits. Both kernels take the send / receive rows
as raw buffers and read or write them in the dtype a constexpr names (a row = the partial, then optional fp32
per-route scalars at int32 column GCOL).
"""

import triton
import triton.language as tl

from ....device.common import cast_rne, mul_rn, widen

__all__ = ["partials_kernel", "sum_kernel"]


@triton.jit(do_not_specialize=['N'])
def partials_kernel(eo_ptr, rows_ptr, w_ptr, out_ptr, gw_ptr, N, K: tl.constexpr, KB: tl.constexpr,
                    H: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, OUT_BF16: tl.constexpr,
                    OSTRIDE: tl.constexpr, WEIGHTED: tl.constexpr, GW: tl.constexpr, GCOL: tl.constexpr,
                    GSTRIDE: tl.constexpr, USE_ASM: tl.constexpr):
    """Tile (rows ``[pid0*BT, +BT)`` of the N packets, columns ``[pid1*BH, +BH)``) of
    :func:`tritonep.backends.nccl.pack.local_partials`: the partial of packet p goes to ``out`` read as bfloat16
    (OUT_BF16, rounded to nearest even) or float32 (row stride OSTRIDE elements); with GW the programs of column
    tile 0 also store ``gw[rows[p, k]]`` (0 where ``rows`` is -1) as float32 at int32 column ``GCOL + k`` of
    ``out`` (row stride GSTRIDE)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    tm = t < N
    hm = h < H
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    for k in tl.static_range(K):
        rk = tl.load(rows_ptr + t.to(tl.int64) * K + k, mask=tm, other=-1)
        mk = (rk >= 0)[:, None] & hm[None, :]
        v = tl.load(eo_ptr + rk[:, None].to(tl.int64) * H + h[None, :], mask=mk, other=0.0)
        if WEIGHTED:
            wk = tl.load(w_ptr + t.to(tl.int64) * K + k, mask=tm, other=0.0)
            acc += mul_rn(widen(v), tl.broadcast_to(wk[:, None], (BT, BH)), USE_ASM)
        else:
            acc += widen(v)
    dst = t[:, None].to(tl.int64) * OSTRIDE + h[None, :]
    if OUT_BF16:
        tl.store(out_ptr.to(tl.pointer_type(tl.bfloat16)) + dst, cast_rne(acc, tl.bfloat16),
                 mask=tm[:, None] & hm[None, :])
    else:
        tl.store(out_ptr.to(tl.pointer_type(tl.float32)) + dst, acc, mask=tm[:, None] & hm[None, :])
    if GW:
        if tl.program_id(1) == 0:
            k_off = tl.arange(0, KB)
            m2 = tm[:, None] & (k_off[None, :] < K)
            rr = tl.load(rows_ptr + t[:, None].to(tl.int64) * K + k_off[None, :], mask=m2, other=-1)
            g = tl.load(gw_ptr + rr, mask=m2 & (rr >= 0), other=0.0)
            go = out_ptr.to(tl.pointer_type(tl.float32)) + GCOL
            tl.store(go + t[:, None].to(tl.int64) * GSTRIDE + k_off[None, :], g, mask=m2)


@triton.jit(do_not_specialize=['T'])
def sum_kernel(pp_ptr, pkt_ptr, y_ptr, gb_ptr, gtw_ptr, T, K: tl.constexpr, KB: tl.constexpr, H: tl.constexpr,
               BT: tl.constexpr, BH: tl.constexpr, PP_BF16: tl.constexpr, PSTRIDE: tl.constexpr, GTW: tl.constexpr,
               GCOL: tl.constexpr, GSTRIDE: tl.constexpr):
    """Tile (tokens ``[pid0*BT, +BT)``, columns ``[pid1*BH, +BH)``) of :func:`tritonep.backends.nccl.pack.sum_partials`:
    ``pp`` read as bfloat16 (PP_BF16) or float32 (row stride PSTRIDE elements); the packets of a token are the
    distinct values of ``pkt[t, :]``, taken in ascending order (= destination ranks ascending); with GTW the
    programs of column tile 0 also store ``gtw[t, k]`` = the float32 at int32 column ``GCOL + k`` of ``gb``'s row
    ``pkt[t, k]`` (row stride GSTRIDE; 0 where ``pkt`` is -1)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    tm = t < T
    hm = h < H
    k_off = tl.arange(0, KB)
    m2 = tm[:, None] & (k_off[None, :] < K)
    pk = tl.load(pkt_ptr + t[:, None].to(tl.int64) * K + k_off[None, :], mask=m2, other=-1)
    if PP_BF16:
        pp = pp_ptr.to(tl.pointer_type(tl.bfloat16))
    else:
        pp = pp_ptr.to(tl.pointer_type(tl.float32))
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    prev = tl.full((BT,), -1, dtype=tl.int32)
    big = 2147483647
    for i in tl.static_range(K):
        cur = tl.min(tl.where(pk > prev[:, None], pk, big), 1)  # the next packet of each token
        has = cur < big
        v = tl.load(pp + cur[:, None].to(tl.int64) * PSTRIDE + h[None, :], mask=has[:, None] & hm[None, :],
                    other=0.0)
        acc += widen(v)  # a masked slot adds +0.0: an fp32 sum started at +0 stays as it is
        prev = tl.where(has, cur, prev)
    tl.store(y_ptr + t[:, None].to(tl.int64) * H + h[None, :], cast_rne(acc, y_ptr.dtype.element_ty),
             mask=tm[:, None] & hm[None, :])
    if GTW:
        if tl.program_id(1) == 0:
            gb = gb_ptr.to(tl.pointer_type(tl.float32)) + GCOL
            g = tl.load(gb + pk.to(tl.int64) * GSTRIDE + k_off[None, :], mask=m2 & (pk >= 0), other=0.0)
            tl.store(gtw_ptr + t[:, None].to(tl.int64) * K + k_off[None, :], g, mask=m2)
