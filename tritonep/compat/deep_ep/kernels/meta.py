"""Two local kernels of the DeepEP-compatible normal mode, each one launch where the torch twin takes ten ops (their
host side, bound once through the launch runtime: :class:`tritonep.compat.deep_ep.meta.MetaOps`):

* :func:`layout_kernel` (``get_dispatch_layout``): tokens per rank, routes per expert, ``is_token_in_rank``; one
  program walks the token tiles and holds both histograms in registers (no atomics, deterministic), like DeepEP's
  layout kernel one pass over ``topk_idx``. Twin: :func:`tritonep.compat.deep_ep.packing.layout_torch`.
* :func:`unpack_meta_kernel` (after the meta lane's dispatch): every received token's local ids (-1 off this rank, for
  -1 and for ids outside ``[-1, E)``), its weights (0 where the id is -1) and the per-local-expert histogram (one
  relaxed atomic per received slot into a zeroed ``[L + 1]`` int32). Twin: :func:`tritonep.compat.deep_ep.packing.unpack_meta`.

Both are bit-exact with their twins (integer work and moves only).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["layout_kernel", "unpack_meta_kernel"]


@triton.jit
def layout_kernel(ids_ptr, T, in_rank_ptr, per_rank_ptr, per_expert_ptr, K: tl.constexpr, KB: tl.constexpr,
                  E: tl.constexpr, EB: tl.constexpr, L: tl.constexpr, W: tl.constexpr, WB: tl.constexpr,
                  BT: tl.constexpr):
    """``ids [T, K]`` (int32/int64) -> ``in_rank [T, W]`` bool, ``per_rank [W]`` / ``per_expert [E]`` int32. One
    program (grid 1); an id outside ``[0, E)`` selects nothing."""
    kk = tl.arange(0, KB)
    ww = tl.arange(0, WB)
    per_rank = tl.zeros((WB,), tl.int32)
    per_expert = tl.zeros((EB,), tl.int32)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        tm = t < T
        m2 = tm[:, None] & (kk < K)[None, :]
        ids = tl.load(ids_ptr + t[:, None].to(tl.int64) * K + kk[None, :], mask=m2, other=-1)
        valid = m2 & (ids >= 0) & (ids < E)
        r = tl.where(valid, ids // L, -1)
        hit = tl.max((r[:, :, None] == ww[None, None, :]).to(tl.int32), axis=1)  # [BT, WB]: token t reaches rank w
        tl.store(in_rank_ptr + t[:, None].to(tl.int64) * W + ww[None, :], hit != 0,
                 mask=tm[:, None] & (ww < W)[None, :])
        per_rank += tl.sum(hit, axis=0)
        per_expert += tl.histogram(tl.reshape(tl.where(valid, ids, 0).to(tl.int32), (BT * KB,)), EB,
                                   mask=tl.reshape(valid, (BT * KB,)))
    tl.store(per_rank_ptr + ww, per_rank, mask=ww < W)
    tl.store(per_expert_ptr + tl.arange(0, EB), per_expert, mask=tl.arange(0, EB) < E)


@triton.jit
def unpack_meta_kernel(rows_ptr, RS, w_ptr, R, live_ptr, lo, idx_ptr, wout_ptr, hist_ptr, K: tl.constexpr,
                       KB: tl.constexpr, L: tl.constexpr, BR: tl.constexpr, LIVE: tl.constexpr):
    """Received tokens ``[BR]`` per program: ``rows`` int32 ``[R*K, RS]`` (the token's K ids first in the first of its
    K rows), ``w`` float32 ``[R*K]`` (route weights) -> ``idx [R, K]`` local ids, ``wout [R, K]`` float32, and
    ``hist[1 + j] += slots with local expert j`` (``hist[0]``: slots with -1). ``lo`` = rank * L. ``LIVE``: tokens at
    or past ``*live_ptr`` are not received (ids -1, weight 0, not counted)."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    kk = tl.arange(0, KB)
    rm = i < R
    m2 = rm[:, None] & (kk < K)[None, :]
    if LIVE:
        rm = rm & (i < tl.load(live_ptr))
    live2 = rm[:, None] & (kk < K)[None, :]
    ids = tl.load(rows_ptr + (i * K)[:, None].to(tl.int64) * RS + kk[None, :], mask=live2, other=-1)
    loc = ids - lo
    ok = live2 & (loc >= 0) & (loc < L)
    local = tl.where(ok, loc, -1)
    off = i[:, None].to(tl.int64) * K + kk[None, :]
    w = tl.load(w_ptr + off, mask=ok, other=0.0)
    tl.store(idx_ptr + off, local.to(idx_ptr.dtype.element_ty), mask=m2)
    tl.store(wout_ptr + off, tl.where(ok, w, 0.0), mask=m2)
    # one atomic per slot: tl.histogram of this reshaped, partly masked tile undercounted on an H100 under
    # triton 3.6 (half of every bin); element-wise atomics are exact on every layout
    tl.atomic_add(hist_ptr + (local + 1), tl.full((BR, KB), 1, tl.int32), mask=live2, sem="relaxed")
