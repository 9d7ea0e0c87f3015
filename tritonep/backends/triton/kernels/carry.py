"""The carried top-k of the one-launch decode dispatch: a second routing's ids and weights travel with each token's
row and land, local to the receiver, beside every row it receives.

DeepEP's normal dispatch returns, per received row (one per (token, receiving rank)), the token's top-k ids local to
the receiver (``id - rank*CL`` for an id of this rank's ``CL`` experts, else -1) and its weights (0 where -1): the
``recv_topk_idx`` / ``recv_topk_weights`` of its API. An EPBuffer whose routing is another one (the compat Buffer's
rows lane: its experts are the ranks) gets them here in the dispatch's own launch, with no packing before it and no
unpacking after it:

* :func:`carry_send`: after a chunk's rows are sent (before its chunk flag is raised, which releases them), the
  sender stores each token's ``CK`` ids (int32, ids outside ``[0, CE)`` as -1) and weights (float32 bits) into
  ``carry[rank, t]`` of every destination its routing reaches (``2*CKC`` int32 words a token: ids, then weights;
  ``CKC`` the region's width, :attr:`tritonep.ep.config.EPConfig.count_topk`);
* :func:`carry_arrived`: once the chunk arrived (the expand's wait), the receiver writes, for each of the chunk's
  routes to this rank, the token's ids made local and its weights into ``cidx[row]`` / ``cw[row]`` (``[nrows, CK]``
  of the caller's dtypes); rows at or past ``nrows`` are never written;
* :func:`carry_tail`: the rows past the ones received (all of them in a refused call) get ids -1 and weights 0, so a
  ``num_worst_tokens`` caller's tail is defined.

Reuse of the region is ordered as the staging's: a sender writes it only after every destination acked the previous
call (:func:`tritonep.backends.triton.kernels.dispatch.open_send`). Twin: :func:`tritonep.reference.carry_reference`.
Idea: DeepEP's intranode dispatch (``recv_topk_idx`` written by the receiving channel), written anew.
"""

import triton
import triton.language as tl

from .dispatch import load_routes

__all__ = ["carry_send", "carry_arrived", "carry_tail"]


@triton.jit
def carry_send(c, T, live, topk_idx_ptr, cid_ptr, cw_ptr, carry_tab, rank, Tmax, BT: tl.constexpr, K: tl.constexpr,
               KB: tl.constexpr, E: tl.constexpr, L: tl.constexpr, W: tl.constexpr, CK: tl.constexpr,
               CKB: tl.constexpr, CE: tl.constexpr, CKC: tl.constexpr):
    """Store chunk ``c``'s carried ids and weights (``cid`` / ``cw`` ``[T, CK]``) into ``carry[rank, t]`` of every
    destination the token's routing (``topk_idx [T, K]`` over ``E`` experts, ``L`` per rank) reaches; nothing when
    the call moves no rows (``live`` 0)."""
    t = c * BT + tl.arange(0, BT)
    tm = (t < T) & (live != 0)
    k = tl.arange(0, KB)
    ids = load_routes(topk_idx_ptr, t[:, None].to(tl.int64) * K + k[None, :], tm[:, None] & (k[None, :] < K),
                      k[None, :], L)
    dest = tl.where((ids >= 0) & (ids < E), ids // L, -1)
    j = tl.arange(0, CKB)
    mj = tm[:, None] & (j[None, :] < CK)
    cj = t[:, None].to(tl.int64) * CK + j[None, :]
    raw = tl.load(cid_ptr + cj, mask=mj, other=-1)
    cid = tl.where((raw >= 0) & (raw < CE), raw, -1).to(tl.int32)  # range-checked at the ids' own width
    cwb = tl.load(cw_ptr + cj, mask=mj, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
    word = (rank * Tmax + t).to(tl.int64) * (2 * CKC)
    for d in range(W):
        has = (tl.sum((dest == d).to(tl.int32), 1) > 0) & tm
        base = tl.load(carry_tab + d).to(tl.pointer_type(tl.int32))
        m = has[:, None] & (j[None, :] < CK)
        tl.store(base + word[:, None] + j[None, :], cid, mask=m)
        tl.store(base + word[:, None] + CKC + j[None, :], cwb, mask=m)


@triton.jit
def carry_arrived(src, c, skip, meta_ptr, ntok_ptr, carry_ptr, cidx_ptr, cw_out_ptr, nrows, rank, Tmax,
                  BT: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, CK: tl.constexpr, CKB: tl.constexpr,
                  CE: tl.constexpr, W: tl.constexpr, CKC: tl.constexpr):
    """Chunk ``c`` of source ``src`` arrived (the caller waited for its flag): for each of its routes to this rank
    (the staged rows ``meta[src, t, k]``; none when ``skip``), write the token's carried ids local to this rank and
    its weights into ``cidx[row]`` / ``cw_out[row]`` (rows below ``nrows`` only)."""
    Ts = tl.load(ntok_ptr + src, volatile=True)
    t = c * BT + tl.arange(0, BT)
    tm = t < Ts
    k = tl.arange(0, KB)
    m2 = tm[:, None] & (k[None, :] < K)
    rows = tl.load(meta_ptr + (src * Tmax + t[:, None]).to(tl.int64) * K + k[None, :], mask=m2, other=-1)
    rows = tl.where(skip | (rows >= nrows), -1, rows)
    j = tl.arange(0, CKB)
    word = (src * Tmax + t).to(tl.int64) * (2 * CKC)
    has = tl.sum((rows >= 0).to(tl.int32), 1) > 0
    mj = has[:, None] & (j[None, :] < CK)
    cid = tl.load(carry_ptr + word[:, None] + j[None, :], mask=mj, other=-1)
    cw = tl.load(carry_ptr + word[:, None] + CKC + j[None, :], mask=mj, other=0).to(tl.float32, bitcast=True)
    CL: tl.constexpr = CE // W
    mine = (cid >= rank * CL) & (cid < rank * CL + CL)
    lid = tl.where(mine, cid - rank * CL, -1)
    lw = tl.where(mine, cw, 0.0)
    for kk in tl.static_range(K):
        rk = tl.sum(tl.where(k[None, :] == kk, rows, 0), 1)
        off = rk[:, None].to(tl.int64) * CK + j[None, :]
        m = (rk >= 0)[:, None] & (j[None, :] < CK)
        tl.store(cidx_ptr + off, lid, mask=m)
        tl.store(cw_out_ptr + off, lw, mask=m)


@triton.jit
def carry_tail(first, nrows, cidx_ptr, cw_out_ptr, CK: tl.constexpr, CKB: tl.constexpr):
    """Rows ``[first, nrows)`` of ``cidx`` / ``cw_out``: ids -1, weights 0 (this program's 256-row blocks of the
    grid-stride over them)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    r_off = tl.arange(0, 256)
    j = tl.arange(0, CKB)
    for r0 in range(first + pid * 256, nrows, G * 256):
        r = r0 + r_off
        m = (r < nrows)[:, None] & (j[None, :] < CK)
        off = r[:, None].to(tl.int64) * CK + j[None, :]
        tl.store(cidx_ptr + off, tl.full((256, CKB), -1, tl.int32), mask=m)
        tl.store(cw_out_ptr + off, tl.zeros((256, CKB), tl.float32), mask=m)
