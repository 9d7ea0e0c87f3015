"""Local (no communication) fixed-order fp32 sums of the nccl backend's combine (one program per tile).

Host wrappers, exact arithmetic and torch twins: :mod:`tritonep.ep.nccl.pack` (``local_partials``,
``sum_partials``). Plain local loads and stores: no signals, no waits.
"""

import triton
import triton.language as tl

from .common import cast_rne, mul_rn, widen

__all__ = ["partials_kernel", "sum_kernel"]


@triton.jit(do_not_specialize=['N'])
def partials_kernel(eo_ptr, rows_ptr, w_ptr, out_ptr, N, out_stride, K: tl.constexpr, H: tl.constexpr,
                    BT: tl.constexpr, BH: tl.constexpr, WEIGHTED: tl.constexpr, USE_ASM: tl.constexpr):
    """Tile (rows ``[pid0*BT, +BT)`` of the N packets, columns ``[pid1*BH, +BH)``) of
    :func:`tritonep.ep.nccl.pack.local_partials`."""
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
    dst = out_ptr + t[:, None].to(tl.int64) * out_stride + h[None, :]
    tl.store(dst, cast_rne(acc, out_ptr.dtype.element_ty), mask=tm[:, None] & hm[None, :])


@triton.jit(do_not_specialize=['T'])
def sum_kernel(pp_ptr, pos_ptr, y_ptr, T, pp_stride, W: tl.constexpr, H: tl.constexpr, BT: tl.constexpr,
               BH: tl.constexpr):
    """Tile (tokens ``[pid0*BT, +BT)``, columns ``[pid1*BH, +BH)``) of
    :func:`tritonep.ep.nccl.pack.sum_partials`."""
    # the [BT, BH] tile prelude of partials_kernel, kept inline: five index lines before two different sums
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    tm = t < T
    hm = h < H
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    for r in tl.static_range(W):
        p = tl.load(pos_ptr + r * T + t, mask=tm, other=-1)
        v = tl.load(pp_ptr + p[:, None].to(tl.int64) * pp_stride + h[None, :],
                    mask=(p >= 0)[:, None] & hm[None, :], other=0.0)
        acc += widen(v)
    tl.store(y_ptr + t[:, None].to(tl.int64) * H + h[None, :], cast_rne(acc, y_ptr.dtype.element_ty),
             mask=tm[:, None] & hm[None, :])
