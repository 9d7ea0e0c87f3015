"""The local kernels of the DeepEP-compatible normal mode, each one launch where the torch twin takes several ops
(their host side, bound once through the launch runtime: :class:`tritonep.compat.deep_ep.meta.MetaOps`):

* :func:`layout_kernel` (``get_dispatch_layout``): tokens per rank, routes per expert, ``is_token_in_rank``; one
  program per token tile. Twin: :func:`tritonep.compat.deep_ep.packing.layout_torch`.
* :func:`pack_kernel` (a dispatch's inputs of both lanes): the rows lane's slots, the meta lane's id rows, slots and
  route weights, into one int32 block. Twin: :func:`tritonep.compat.deep_ep.packing.pack_torch`.
* :func:`unpack_meta_kernel` (after the meta lane's dispatch): every received token's local ids (-1 off this rank,
  for -1 and for ids outside ``[-1, E)``), its weights (0 where the id is -1) and the per-local-expert histogram,
  handed to the host through pinned memory (no device-to-host copy). Twin:
  :func:`tritonep.compat.deep_ep.packing.unpack_meta`.

Counting: every program adds its counts into a persistent int32 accumulator with one relaxed atomic per counted
element of its (full, 2-D) tile: ``tl.histogram`` of a reshaped, partly masked tile and a vector atomic of its result
undercounted every bin by half on an H100 under triton 3.6, element-wise atomics are exact on every layout. The last
program of the launch (a done counter after the accumulator, acq_rel, reset by that program: grids follow the call's
tokens) moves the accumulator into the outputs with atomic exchanges that also zero it, so no call allocates or
fills zeros and a CUDA-graph replay finds the accumulator zeroed. Every kernel is correct at grid 1 and waits for
nobody (the interpreter runs the programs in order).

All are bit-exact with their twins (integer work and moves only; the weights are copied as bits).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["layout_kernel", "pack_kernel", "unpack_meta_kernel"]


@triton.jit
def _last_program(done_ptr):
    """Count this program done (acq_rel, after a block barrier); the launch's last one resets the counter to 0 and
    gets True (its acquire covers every other program's accumulator atomics)."""
    tl.debug_barrier()
    old = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    last = old == tl.num_programs(0) - 1
    if last:
        tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _drain(acc_ptr, out_ptr, n, NB: tl.constexpr, WIDE: tl.constexpr):
    """``out[:n] = acc[:n]`` (int64 when WIDE, else int32) and ``acc[:n] = 0``, by atomic exchanges."""
    for s in range(0, n, NB):
        o = s + tl.arange(0, NB)
        m = o < n
        v = tl.atomic_xchg(acc_ptr + o, tl.zeros((NB,), tl.int32), mask=m, sem="relaxed", scope="gpu")
        if WIDE:
            tl.store(out_ptr + o, v.to(tl.int64), mask=m)
        else:
            tl.store(out_ptr + o, v, mask=m)


@triton.jit(do_not_specialize=["T"])
def layout_kernel(ids_ptr, T, in_rank_ptr, counts_ptr, acc_ptr, K: tl.constexpr, KB: tl.constexpr,
                  E: tl.constexpr, L: tl.constexpr, W: tl.constexpr, WB: tl.constexpr, BT: tl.constexpr,
                  NB: tl.constexpr):
    """``ids [T, K]`` (int32/int64) -> ``in_rank [T, W]`` bool and ``counts [W + E]`` int32 (tokens per rank, then
    routes per expert). One program per ``BT`` tokens (at least one program: T may be 0); ``acc``: int32
    ``[W + E + 1]`` zeros (the accumulator and the done counter, left zeroed). An id outside ``[0, E)`` selects
    nothing."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    kk = tl.arange(0, KB)
    ww = tl.arange(0, WB)
    tm = t < T
    t64 = t.to(tl.int64)
    m2 = tm[:, None] & (kk < K)[None, :]
    ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=m2, other=-1)
    valid = m2 & (ids >= 0) & (ids < E)
    r = tl.where(valid, ids // L, -1)
    hit = tl.max((r[:, :, None] == ww[None, None, :]).to(tl.int32), axis=1)  # [BT, WB]: token t reaches rank w
    mw = tm[:, None] & (ww < W)[None, :]
    tl.store(in_rank_ptr + t64[:, None] * W + ww[None, :], hit != 0, mask=mw)
    zero = tl.zeros((BT, WB), tl.int32)
    tl.atomic_add(acc_ptr + (ww[None, :] + zero), 1, mask=mw & (hit != 0), sem="relaxed", scope="gpu")
    tl.atomic_add(acc_ptr + W + tl.where(valid, ids, 0), 1, mask=valid, sem="relaxed", scope="gpu")
    if _last_program(acc_ptr + W + E):
        _drain(acc_ptr, counts_ptr, W + E, NB, False)


@triton.jit(do_not_specialize=["T", "o_meta", "o_slots", "o_w"])
def pack_kernel(in_rank_ptr, ids_ptr, w_ptr, T, out_ptr, o_meta, o_slots, o_w, K: tl.constexpr, KB: tl.constexpr,
                W: tl.constexpr, WB: tl.constexpr, MW2: tl.constexpr, MB: tl.constexpr, WKB: tl.constexpr,
                BT: tl.constexpr):
    """One dispatch's lane inputs from ``in_rank [T, W]`` bool, ``ids [T, K]`` int32/int64 and ``w [T, K]`` float32,
    into the int32 block ``out``: ``[0, T*W)`` the rows lane's slots (``r`` where token t goes to rank r, else -1);
    from ``o_meta`` the meta rows ``[T, MW2]`` (the K ids as int32, -1 for an id outside ``[-1, 2^31)``, then
    zeros); from ``o_slots`` the meta lane's slots ``[T, W*K]`` (slot ``r*K + k`` = the rows lane's slot r); from
    ``o_w`` its route weights ``[T, W*K]`` (``w[t, k]`` for every r, float32 bits). One program per ``BT`` tokens."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < T
    t64 = t.to(tl.int64)
    ww = tl.arange(0, WB)
    mw = tm[:, None] & (ww < W)[None, :]
    hit = tl.load(in_rank_ptr + t64[:, None] * W + ww[None, :], mask=mw, other=0)
    tl.store(out_ptr + t64[:, None] * W + ww[None, :], tl.where(hit != 0, ww[None, :], -1), mask=mw)
    mm = tl.arange(0, MB)
    ids = tl.load(ids_ptr + t64[:, None] * K + mm[None, :], mask=tm[:, None] & (mm < K)[None, :], other=0)
    # range-checked at the ids' own width, then cast: an int64 id 2**32 + 1 travels as -1, never as expert 1
    ids = tl.where((ids >= -1) & (ids <= 2147483647), ids, -1)
    tl.store(out_ptr + o_meta + t64[:, None] * MW2 + mm[None, :], ids.to(tl.int32),
             mask=tm[:, None] & (mm < MW2)[None, :])
    j = tl.arange(0, WKB)
    r = j // K
    k = j % K
    mj = tm[:, None] & (j < W * K)[None, :]
    h2 = tl.load(in_rank_ptr + t64[:, None] * W + r[None, :], mask=mj, other=0)
    tl.store(out_ptr + o_slots + t64[:, None] * (W * K) + j[None, :], tl.where(h2 != 0, r[None, :], -1), mask=mj)
    wv = tl.load(w_ptr + t64[:, None] * K + k[None, :], mask=mj, other=0.0)
    tl.store(out_ptr + o_w + t64[:, None] * (W * K) + j[None, :], wv.to(tl.int32, bitcast=True), mask=mj)


@triton.jit
def _publish(acc_ptr, host_ptr, n, ticket, NB: tl.constexpr, GPU: tl.constexpr):
    """``host[:n] = acc[:n]`` (int64, acc zeroed), then ``host[n] = ticket`` after a system-scope fence (compiled):
    the host spins on that word (:class:`tritonep.runtime.host_status.HostStatus`). Ticket 0 (nobody reads):
    the accumulator is only zeroed."""
    if ticket != 0:
        _drain(acc_ptr, host_ptr, n, NB, True)
        tl.debug_barrier()
        if GPU:  # the interpreter runs stores in program order (and has no inline asm)
            tl.inline_asm_elementwise("fence.sc.sys;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                      pack=1)
        tl.store(host_ptr + n, ticket.to(tl.int64))
    else:
        for s in range(0, n, NB):
            o = s + tl.arange(0, NB)
            tl.atomic_xchg(acc_ptr + o, tl.zeros((NB,), tl.int32), mask=o < n, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["R", "lo", "ticket"])
def unpack_meta_kernel(rows_ptr, w_ptr, R, live_ptr, lo, idx_ptr, wout_ptr, acc_ptr, host_ptr, ticket,
                       RS: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, L: tl.constexpr, BR: tl.constexpr,
                       NB: tl.constexpr, LIVE: tl.constexpr, GPU: tl.constexpr):
    """Received tokens ``[BR]`` per program: ``rows`` bf16 ``[R*K, 2*RS]`` read as int32 ``[R*K, RS]`` (the token's
    K ids first in the first of its K rows), ``w`` float32 ``[R*K]`` (route weights) -> ``idx [R, K]`` local ids,
    ``wout [R, K]`` float32, and the histogram ``[L + 1]`` (``[1 + j]``: slots with local expert j, ``[0]``: slots
    with -1) published as int64 to the pinned ``host [L + 2]`` with ``ticket`` (:func:`_publish`). ``lo`` = rank * L;
    ``acc``: int32 ``[L + 2]`` zeros (left zeroed). ``LIVE``: tokens at or past ``*live_ptr`` are not received (ids
    -1, weight 0, not counted)."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    kk = tl.arange(0, KB)
    rm = i < R
    m2 = rm[:, None] & (kk < K)[None, :]
    if LIVE:
        rm = rm & (i < tl.load(live_ptr))
    live2 = rm[:, None] & (kk < K)[None, :]
    ids = tl.load(rows_ptr.to(tl.pointer_type(tl.int32)) + (i * K)[:, None].to(tl.int64) * RS + kk[None, :],
                  mask=live2, other=-1)
    loc = ids - lo
    ok = live2 & (loc >= 0) & (loc < L)
    local = tl.where(ok, loc, -1)
    off = i[:, None].to(tl.int64) * K + kk[None, :]
    w = tl.load(w_ptr + off, mask=ok, other=0.0)
    tl.store(idx_ptr + off, local.to(idx_ptr.dtype.element_ty), mask=m2)
    tl.store(wout_ptr + off, tl.where(ok, w, 0.0), mask=m2)
    tl.atomic_add(acc_ptr + (local + 1), 1, mask=live2, sem="relaxed", scope="gpu")
    if _last_program(acc_ptr + L + 1):
        _publish(acc_ptr, host_ptr, L + 1, ticket, NB, GPU)

