"""The local kernels of the DeepEP-compatible normal dispatch with meta rows: the top-k ids and weights travel as extra
rows of the rows lane itself (one exchange per dispatch; docs/deep_ep.md, "Meta rows"). Their host side is
:class:`tritonep.compat.deep_ep.meta.MetaOps` (``pack_rows`` / ``unpack_rows``).

The rows lane of this path is an EPBuffer with two pseudo-experts per rank: ``2r`` (the token rows rank r receives,
DeepEP's ``recv_x``) and ``2r + 1`` (its meta rows). Its input is ``x_in [T + W*P, H]``: the T token rows, then for
every destination rank r a group of P pseudo-tokens routed to ``2r + 1`` only, whose rows, read as int32 words (a
bf16 row of H elements holds ``H / 2`` words, moved bit for bit), hold ``n_r`` (the tokens rank r receives from this
rank) and then, for the j-th of them, its K ids local to rank r (-1 where the expert lives elsewhere, for -1 and for
ids outside ``[-1, E)``) and its K weights (float32 bits; 0 where the local id is -1): DeepEP's
``recv_topk_idx`` / ``recv_topk_weights`` rows, made on the sender; the rest of the group's words are 0. On the
receiver the meta segment starts right after the token rows (``expert_offsets[0]``) and holds every source's group
in rank order (P rows each), so received token row i of source s (``i - start[s]``-th of its rows, ``start`` the
prefix sum of the groups' ``n``) finds its ids and weights without any other state.

* :func:`pack_rows_kernel`: ``x_in`` (x copied bit for bit as int16, the meta groups) and the rows lane's slots
  ``[T + W*P, W]`` (token t: ``2r`` where it goes to rank r, else -1; pseudo-token ``(r, p)``: ``2r + 1`` at slot r
  only). One program per ``BT`` tokens; each counts the tokens of earlier tiles per rank itself (a chunked load of
  ``is_token_in_rank``), so no program waits for another; the launch's last program writes every group's ``n_r``,
  zeroes its unused words and writes the pseudo-tokens' slots. Twin: :func:`tritonep.compat.deep_ep.packing.
  pack_rows_torch`.
* :func:`copy_rows_kernel`: a combine's rows (the caller's ``x [n, H]`` bf16) into the first n rows of the rows lane's
  expert-output buffer, whose meta rows follow them (a bound launch: ``Tensor.copy_`` into that symmetric region
  costs ~14 us of ``cudaMemcpyAsync`` host time, docs/deep_ep.md). Twin: ``dst[:n].copy_(src)``.
* :func:`unpack_rows_kernel`: the received meta rows -> ``recv_topk_idx`` (the caller's id dtype),
  ``recv_topk_weights`` and the per-local-expert histogram, published to pinned host memory with a ticket (as
  :func:`tritonep.compat.deep_ep.kernels.meta.unpack_meta_kernel`). Twin: :func:`tritonep.compat.deep_ep.packing.
  unpack_rows_torch`.

Both move integers and bits only (bit-exact with their twins); both are correct at grid 1 and wait for nobody.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .meta import _last_program, _publish

__all__ = ["copy_rows_kernel", "pack_rows_kernel", "unpack_rows_kernel"]


@triton.jit
def _copy_rows(src_ptr, dst_ptr, t64, tm, H: tl.constexpr, BH: tl.constexpr):
    """Rows ``t64`` (int64, masked by ``tm``) of ``src [*, H]`` into the same rows of ``dst [*, H]``, 2-byte elements
    moved as int16 bits, ``BH`` columns a step."""
    xs = src_ptr.to(tl.pointer_type(tl.int16))
    xd = dst_ptr.to(tl.pointer_type(tl.int16))
    hh = tl.arange(0, BH)
    for h0 in range(0, H, BH):
        h = h0 + hh
        m = tm[:, None] & (h < H)[None, :]
        tl.store(xd + t64[:, None] * H + h[None, :], tl.load(xs + t64[:, None] * H + h[None, :], mask=m), mask=m)


@triton.jit(do_not_specialize=["T"])
def pack_rows_kernel(x_ptr, in_rank_ptr, ids_ptr, w_ptr, T, xin_ptr, slots_ptr, H: tl.constexpr, BH: tl.constexpr,
                     W: tl.constexpr, WB: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, L: tl.constexpr,
                     P: tl.constexpr, HW: tl.constexpr, BT: tl.constexpr, CH: tl.constexpr, ZB: tl.constexpr,
                     QB: tl.constexpr):
    """``x [T, H]`` bf16, ``in_rank [T, W]`` bool, ``ids [T, K]`` int32/int64, ``w [T, K]`` float32 -> ``x_in``
    (bf16 ``[>= T + W*P, H]``, ``HW = H // 2`` int32 words a row) and ``slots [T + W*P, W]`` int32 (module
    docstring). ``L``: experts per rank. One program per ``BT`` tokens (at least one: T may be 0); ``CH``: tokens per
    chunk of the earlier-tile count; ``ZB``: words per zeroing step; ``QB``: ``next_pow2(W * P)``."""
    pid = tl.program_id(0)
    t = pid * BT + tl.arange(0, BT)
    tm = t < T
    t64 = t.to(tl.int64)
    ww = tl.arange(0, WB)
    wm = ww < W
    mw = tm[:, None] & wm[None, :]
    hit = (tl.load(in_rank_ptr + t64[:, None] * W + ww[None, :], mask=mw, other=0) != 0).to(tl.int32)
    tl.store(slots_ptr + t64[:, None] * W + ww[None, :], tl.where(hit != 0, 2 * ww[None, :], -1), mask=mw)
    _copy_rows(x_ptr, xin_ptr, t64, tm, H, BH)  # the token rows, as int16 bits
    # this tile's tokens' position among the tokens each rank receives: earlier tiles' count + the exclusive prefix
    carry = tl.zeros((WB,), tl.int32)
    cc = tl.arange(0, CH)
    for c0 in range(0, pid * BT, CH):
        tc = c0 + cc
        mc = (tc < pid * BT)[:, None] & wm[None, :]
        prev = tl.load(in_rank_ptr + tc[:, None].to(tl.int64) * W + ww[None, :], mask=mc, other=0)
        carry += tl.sum((prev != 0).to(tl.int32), 0)
    pos = carry[None, :] + tl.cumsum(hit, 0) - hit  # [BT, WB]
    kk = tl.arange(0, KB)
    km = tm[:, None] & (kk < K)[None, :]
    ids = tl.load(ids_ptr + t64[:, None] * K + kk[None, :], mask=km, other=-1)
    wbits = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + t64[:, None] * K + kk[None, :], mask=km, other=0)
    words = xin_ptr.to(tl.pointer_type(tl.int32))
    for r in range(W):
        lo = r * L
        ok = (ids >= lo) & (ids < lo + L)  # -1 and ids outside [0, E) are never in [lo, lo + L)
        local = tl.where(ok, ids - lo, -1).to(tl.int32)
        wr = tl.where(ok, wbits, 0)
        sel = ww[None, :] == r
        to_r = tl.sum(tl.where(sel, hit, 0), 1) != 0
        pr = tl.sum(tl.where(sel, pos, 0), 1)
        base = (T + r * P).to(tl.int64) * HW + 1 + pr.to(tl.int64) * (2 * K)
        ms = to_r[:, None] & km
        tl.store(words + base[:, None] + kk[None, :], local, mask=ms)
        tl.store(words + base[:, None] + K + kk[None, :], wr, mask=ms)
    if pid == tl.num_programs(0) - 1:  # the last tile: every group's count and unused words, the pseudo-tokens
        total = carry + tl.sum(hit, 0)
        zz = tl.arange(0, ZB)
        for r in range(W):
            nr = tl.sum(tl.where(ww == r, total, 0), 0)
            gbase = (T + r * P).to(tl.int64) * HW
            tl.store(words + gbase, nr)
            for z0 in range(1 + nr * (2 * K), P * HW, ZB):
                z = z0 + zz
                tl.store(words + gbase + z, tl.zeros((ZB,), tl.int32), mask=z < P * HW)
        q = tl.arange(0, QB)
        rq = q // P
        rows = (T + q).to(tl.int64)
        tl.store(slots_ptr + rows[:, None] * W + ww[None, :], tl.where(ww[None, :] == rq[:, None], 2 * rq[:, None] + 1,
                                                                       -1),
                 mask=(q < W * P)[:, None] & wm[None, :])


@triton.jit(do_not_specialize=["N"])
def copy_rows_kernel(src_ptr, dst_ptr, N, H: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """``dst[:N] = src`` bit for bit: ``src [N, H]`` and ``dst [>= N, H]`` contiguous, 2-byte elements (moved as
    int16). One program per ``BT`` rows, ``BH`` columns a step."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    _copy_rows(src_ptr, dst_ptr, t.to(tl.int64), t < N, H, BH)


@triton.jit(do_not_specialize=["R", "ticket"])
def unpack_rows_kernel(rows_ptr, offs_ptr, R, idx_ptr, wout_ptr, acc_ptr, host_ptr, ticket, W: tl.constexpr,
                       WB: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, L: tl.constexpr, P: tl.constexpr,
                       HW: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr, GPU: tl.constexpr):
    """The rows lane's received rows (bf16, ``HW`` int32 words a row; token rows ``[0, offs[0])``, then every source's
    P meta rows) -> ``idx [R, K]`` (its dtype), ``wout [R, K]`` float32 and the histogram ``[L + 1]`` (``[1 + j]``:
    slots with local expert j, ``[0]``: slots with -1) published as int64 to the pinned ``host [L + 2]`` with
    ``ticket`` (:func:`tritonep.compat.deep_ep.kernels.meta._publish`). Rows at or past ``offs[0]`` (a
    ``num_worst_tokens`` call's tail) get ids -1 and weight 0 and are not counted. ``acc``: int32 ``[L + 2]`` zeros
    (left zeroed). One program per ``BR`` rows."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = i < R
    base = tl.load(offs_ptr)
    live = rm & (i < base)
    words = rows_ptr.to(tl.pointer_type(tl.int32))
    ss = tl.arange(0, WB)
    n = tl.load(words + (base + ss * P).to(tl.int64) * HW, mask=ss < W, other=0)
    ends = tl.cumsum(n, 0)
    src = tl.sum(((ends[None, :] <= i[:, None]) & (ss < W)[None, :]).to(tl.int32), 1)
    start = tl.sum(tl.where(ss[None, :] == src[:, None], (ends - n)[None, :], 0), 1)
    wb = (base + src * P).to(tl.int64) * HW + 1 + (i - start).to(tl.int64) * (2 * K)
    kk = tl.arange(0, KB)
    m2 = live[:, None] & (kk < K)[None, :]
    got = tl.load(words + wb[:, None] + kk[None, :], mask=m2, other=-1)
    wbits = tl.load(words + wb[:, None] + K + kk[None, :], mask=m2, other=0)
    ok = (got >= 0) & (got < L)
    local = tl.where(ok, got, -1)
    off = i[:, None].to(tl.int64) * K + kk[None, :]
    mo = rm[:, None] & (kk < K)[None, :]
    tl.store(idx_ptr + off, local.to(idx_ptr.dtype.element_ty), mask=mo)
    tl.store(wout_ptr.to(tl.pointer_type(tl.int32)) + off, tl.where(ok, wbits, 0), mask=mo)
    tl.atomic_add(acc_ptr + (local + 1), 1, mask=m2, sem="relaxed", scope="gpu")
    if _last_program(acc_ptr + L + 1):
        _publish(acc_ptr, host_ptr, L + 1, ticket, NB, GPU)
