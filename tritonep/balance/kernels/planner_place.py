"""Triton virtual-expert placement in registers (device functions of :func:`tritonep.balance.kernels.planner.plan_kernel`).

Spec: :func:`tritonep.balance.placement.place_torch` (bit-equal, both modes). Idea: the fused planner of Megatron-LM
``virtual_expert_triton.py`` (PR #7450, after MoonEP); see ``shared/reference/balance_anchors.md`` §1.3-§1.5.

Register layout: a per-expert vector is a ``[W_PAD, L_PAD]`` matrix (row = owner rank ``s``, column = local index
``j``, expert ``e = s*L + j``). Because every receiver has exactly one sender (reference mode), the migrated routes
also fit one ``[W_PAD, L_PAD]`` matrix (row = receiver ``d``, column = the sender's local expert), so no ``[E, W]``
tensor is ever held in registers. Minimal mode (``MODE=1``, spec ``place_torch(counts, "minimal")``): a receiver
may take pieces from several senders, so the pieces live in a ``[W_PAD, L_PAD]`` matrix indexed by (receiver,
arrival order): each round of the greedy fills one slot, so ``L`` columns always suffice; :func:`place_and_store`
writes the native rows of ``[E, W]``, scatters the pieces over them and reads the rows back for ``segment_ends``
(``tl.debug_barrier`` between the phases orders the global writes and reads of its threads). No register spills for
sm_90 at any ``W <= 64, E <= 1024`` (ptxas -v).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...device.protocol import PLAN_COUNT_OVERFLOW, PLAN_NEGATIVE_COUNT

__all__ = ["place_and_store"]


@triton.jit
def _totals(counts_ptr, stride_cr, stride_ce, rank,
            W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr, RB: tl.constexpr):
    """Step 1 of both modes: ``(total, prefix, bad, cap, bal)``: ``total[s, j]`` routes to expert ``s*L+j`` from
    all ranks, ``prefix[s, j]`` from ranks below ``rank``, ``bad`` the status bits of the counts
    (``PLAN_NEGATIVE_COUNT``: a negative entry; ``PLAN_COUNT_OVERFLOW``: a total past int32, as
    :func:`tritonep.balance.placement.place_torch` refuses; the counts then plan as all zero, so no sum wraps),
    ``cap[d]`` (remainder to the lowest ranks, 0 past ``W``), ``bal[d] = load[d] - cap[d]``. The rows are summed
    in int64 (an int64 entry is never truncated first)."""
    s2 = tl.arange(0, W_PAD)[:, None]
    j2 = tl.arange(0, L_PAD)[None, :]
    ev2 = (s2 < W) & (j2 < L)
    e2 = s2 * L + j2
    total64 = tl.zeros([W_PAD, L_PAD], tl.int64)
    prefix64 = tl.zeros([W_PAD, L_PAD], tl.int64)
    low = tl.zeros([W_PAD, L_PAD], tl.int64)
    for r0 in range(0, W, RB):
        for i in tl.static_range(RB):  # RB independent row loads in flight, not a chain of W dependent ones
            r = r0 + i
            row = tl.load(counts_ptr + r * stride_cr + e2 * stride_ce, mask=ev2 & (r < W), other=0).to(tl.int64)
            total64 += row
            prefix64 += tl.where(r < rank, row, 0)
            low = tl.minimum(low, row)
    neg = tl.min(tl.min(low, axis=1), axis=0) < 0
    # with no negative entry every partial sum fits int32 when the total does
    over = tl.sum(tl.sum(total64, axis=1), axis=0) > 2147483647
    bad = neg.to(tl.int32) * PLAN_NEGATIVE_COUNT | over.to(tl.int32) * PLAN_COUNT_OVERFLOW
    total = tl.where(over, 0, total64).to(tl.int32)
    prefix = tl.where(over, 0, prefix64).to(tl.int32)

    # Step 1: capacity (remainder to the lowest ranks) and balance.
    dvec = tl.arange(0, W_PAD)
    dvalid = dvec < W
    n_routes = tl.sum(tl.sum(total, axis=1), axis=0)
    cap = n_routes // W + tl.where(dvec < n_routes % W, 1, 0)
    cap = tl.where(dvalid, cap, 0)
    bal = tl.sum(total, axis=1) - cap
    return total, prefix, bad, cap, bal


@triton.jit
def _placement(counts_ptr, stride_cr, stride_ce, rank,
               W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr, RB: tl.constexpr):
    """Placement in registers, all tensors ``[W_PAD]``, ``[W_PAD, L_PAD]`` or ``[W_PAD, W_PAD]``.

    Returns ``(rem, moved, slot, n_used, sender_of, quota, cap, prefix, bad)``: ``rem[s, j]`` routes expert
    ``s*L+j`` keeps on its owner; ``moved[d, j]`` routes of expert ``sender_of[d]*L + j`` served by receiver ``d``
    (single sender, so one row per receiver suffices); ``slot[d, j]`` its slot or -1; ``n_used[d]`` the used
    slots (``0..n_used-1``); ``sender_of[d]`` the one rank ``d`` takes routes from, or -1. ``RB`` = source rows
    of ``counts`` per load step (unrolled).
    """
    BIG: tl.constexpr = 2147483647
    j2 = tl.arange(0, L_PAD)[None, :]
    total, prefix, bad, cap, bal = _totals(counts_ptr, stride_cr, stride_ce, rank, W, L, W_PAD, L_PAD, RB)
    dvec = tl.arange(0, W_PAD)
    dvalid = dvec < W

    # Step 2: quota greedy, single-sender rule (ties: lowest rank). Stops at the twin's break (max balance <= 0),
    # after which a round would change nothing.
    rows = tl.arange(0, W_PAD)[:, None]
    cols = tl.arange(0, W_PAD)[None, :]
    quota = tl.zeros([W_PAD, W_PAD], tl.int32)
    sender_of = tl.full([W_PAD], -1, tl.int32)
    smax, sender = tl.max(tl.where(dvalid, bal, -BIG), axis=0, return_indices=True,
                          return_indices_tie_break_left=True)
    it2 = 0
    while (smax > 0) & (it2 < W):
        rmin, receiver = tl.min(tl.where(dvalid, bal, BIG), axis=0, return_indices=True,
                                return_indices_tie_break_left=True)
        quota += tl.where((rows == sender) & (cols == receiver), -rmin, 0)
        bal = tl.where(dvec == sender, bal + rmin, bal)
        bal = tl.where(dvec == receiver, 0, bal)
        sender_of = tl.where(dvec == receiver, sender, sender_of)
        smax, sender = tl.max(tl.where(dvalid, bal, -BIG), axis=0, return_indices=True,
                              return_indices_tie_break_left=True)
        it2 += 1

    # Step 3: all senders at once: largest quota destination x hottest remaining expert. A round that moves
    # nothing leaves the state unchanged for good, so the loop stops there (at most W + L rounds, like the twin).
    # Step 4 (slot = rank among the receiver's migrated experts, allocation desc, ties to the highest id) rides
    # along: a (receiver, expert) pair gets routes in one round only (that round empties the quota or the
    # expert), so its allocation is final on arrival; it takes the rank = number of earlier pieces that beat it,
    # and every earlier piece it beats moves one slot down.
    rem = total
    q = quota
    moved = tl.zeros([W_PAD, L_PAD], tl.int32)
    slot = tl.zeros([W_PAD, L_PAD], tl.int32)
    n_used = tl.zeros([W_PAD], tl.int32)  # migrated experts per receiver = used slots
    go = it2 > 0  # some quota > 0 (every active step-2 round books a positive amount)
    it3 = 0
    while go & (it3 < W + L):
        qmax, dsel = tl.max(q, axis=1, return_indices=True, return_indices_tie_break_left=True)
        rmax, jsel = tl.max(tl.where(j2 < L, rem, -1), axis=1, return_indices=True,
                            return_indices_tie_break_left=True)
        m = tl.maximum(tl.where(qmax > 0, tl.minimum(qmax, rmax), 0), 0)
        rem -= tl.where(j2 == jsel[:, None], m[:, None], 0)
        q -= tl.where(cols == dsel[:, None], m[:, None], 0)
        hit = (dsel[:, None] == cols) & (m[:, None] > 0)  # [sender, receiver]
        m_d = tl.sum(tl.where(hit, m[:, None], 0), axis=0)  # this round's piece per receiver (routes, or 0)
        m_n = m_d[:, None]
        j_n = tl.sum(tl.where(hit, jsel[:, None], 0), axis=0)[:, None]
        new = (j2 == j_n) & (m_n > 0)
        old = moved > 0
        beats = old & ((moved > m_n) | ((moved == m_n) & (j2 > j_n)))  # earlier piece ranks before the new one
        slot += ((m_n > 0) & old & ~beats).to(tl.int32)
        slot = tl.where(new, tl.sum(beats.to(tl.int32), axis=1)[:, None], slot)
        n_used += (m_d > 0).to(tl.int32)
        moved += tl.where(new, m_n, 0)
        go = tl.max(m, axis=0) > 0
        it3 += 1
    slot = tl.where(moved > 0, slot, -1)
    return rem, moved, slot, n_used, sender_of, quota, cap, prefix, bad


@triton.jit
def _placement_minimal(counts_ptr, stride_cr, stride_ce, rank,
                       W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr,
                       RB: tl.constexpr):
    """Minimal-mode placement in registers (spec: ``_minimal_moves`` of :mod:`tritonep.balance.placement`).

    One piece per round: sender = largest excess, its hottest remaining expert, receiver = largest deficit among
    ranks with a free slot (all ties: lowest index), ``m = min(excess, remaining, deficit)``; each round fills one
    slot of its receiver, so a piece matrix ``[W_PAD, L_PAD]`` (row = receiver ``d``, column = arrival order ``k``)
    holds them all. Returns ``(rem, pe, pm, slot, n_used, quota, cap, prefix, bad)``: ``pe[d, k]`` / ``pm[d, k]``
    the expert / routes of receiver ``d``'s ``k``-th piece (-1 / 0 past ``n_used[d]``), ``slot[d, k]`` its slot
    (allocation desc, ties to the highest expert id, maintained like the reference's step 4) or -1.
    """
    BIG: tl.constexpr = 2147483647
    s2 = tl.arange(0, W_PAD)[:, None]
    j2 = tl.arange(0, L_PAD)[None, :]
    total, prefix, bad, cap, bal = _totals(counts_ptr, stride_cr, stride_ce, rank, W, L, W_PAD, L_PAD, RB)
    dvec = tl.arange(0, W_PAD)
    dvalid = dvec < W
    rows = tl.arange(0, W_PAD)[:, None]
    cols = tl.arange(0, W_PAD)[None, :]
    rem = total
    quota = tl.zeros([W_PAD, W_PAD], tl.int32)
    pe = tl.full([W_PAD, L_PAD], -1, tl.int32)
    pm = tl.zeros([W_PAD, L_PAD], tl.int32)
    slot = tl.zeros([W_PAD, L_PAD], tl.int32)
    n_used = tl.zeros([W_PAD], tl.int32)
    smax, sender = tl.max(tl.where(dvalid, bal, -BIG), axis=0, return_indices=True,
                          return_indices_tie_break_left=True)
    rmin, receiver = tl.min(tl.where(dvalid & (bal < 0) & (n_used < L), bal, BIG), axis=0, return_indices=True,
                            return_indices_tie_break_left=True)
    it = 0
    while (smax > 0) & (rmin < 0) & (it < W * L):  # every round fills one of the W*L slots
        rowmax, rowarg = tl.max(tl.where(j2 < L, rem, -1), axis=1, return_indices=True,
                                return_indices_tie_break_left=True)
        rmax = tl.sum(tl.where(dvec == sender, rowmax, 0), axis=0)
        j = tl.sum(tl.where(dvec == sender, rowarg, 0), axis=0)
        m = tl.minimum(tl.minimum(smax, rmax), -rmin)  # > 0: a sender's excess never exceeds its native load
        e = sender * L + j
        rem -= tl.where((s2 == sender) & (j2 == j), m, 0)
        bal = tl.where(dvec == sender, bal - m, bal)
        bal = tl.where(dvec == receiver, bal + m, bal)
        quota += tl.where((rows == sender) & (cols == receiver), m, 0)
        k = tl.sum(tl.where(dvec == receiver, n_used, 0), axis=0)
        row_d = s2 == receiver
        old = row_d & (pm > 0)
        beats = old & ((pm > m) | ((pm == m) & (pe > e)))  # earlier piece ranks before the new one
        slot += (old & ~beats).to(tl.int32)
        new = row_d & (j2 == k)
        slot = tl.where(new, tl.sum(beats.to(tl.int32), axis=1)[:, None], slot)
        pe = tl.where(new, e, pe)
        pm = tl.where(new, m, pm)
        n_used += (dvec == receiver).to(tl.int32)
        smax, sender = tl.max(tl.where(dvalid, bal, -BIG), axis=0, return_indices=True,
                              return_indices_tie_break_left=True)
        rmin, receiver = tl.min(tl.where(dvalid & (bal < 0) & (n_used < L), bal, BIG), axis=0,
                                return_indices=True, return_indices_tie_break_left=True)
        it += 1
    slot = tl.where(pm > 0, slot, -1)
    return rem, pe, pm, slot, n_used, quota, cap, prefix, bad


@triton.jit
def place_and_store(counts_ptr, stride_cr, stride_ce, alloc_ptr, etc_ptr, slot_ptr, ends_ptr, quota_ptr, cap_ptr,
                    rank, W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr,
                    RB: tl.constexpr, MODE: tl.constexpr):
    """Compute the placement of ``counts [W, W*L]`` (int32/int64, any strides) and store it: alloc/slot/ends
    ``[E, W]`` int32, etc ``[W, L]``, quota ``[W, W]``, cap ``[W]``. Returns the counts' status bits (``bad`` of
    :func:`_totals`; 0 = ok).
    ``MODE``: 0 = reference (:func:`_placement`), 1 = minimal (:func:`_placement_minimal`). ``RB``: source rows of
    ``counts`` per load step (a power of two, the host keeps ``RB*W_PAD*L_PAD`` small)."""
    if MODE == 0:
        rem, moved, slot, n_used, sender_of, quota, cap, prefix, bad = _placement(
            counts_ptr, stride_cr, stride_ce, rank, W, L, W_PAD, L_PAD, RB)
    else:
        rem, pe, pm, slot, n_used, quota, cap, prefix, bad = _placement_minimal(
            counts_ptr, stride_cr, stride_ce, rank, W, L, W_PAD, L_PAD, RB)
    dd = tl.arange(0, W_PAD)[None, :]
    rows = tl.arange(0, W_PAD)[:, None]
    kcol = tl.arange(0, L_PAD)[None, :]
    tl.store(quota_ptr + rows * W + dd, quota, mask=(rows < W) & (dd < W))
    dvec = tl.arange(0, W_PAD)
    tl.store(cap_ptr + dvec, cap, mask=dvec < W)
    # experts_to_copy: -1 in the unused slots, a scatter into the used ones (disjoint: no ordering needed)
    tl.store(etc_ptr + rows * L + kcol, tl.full([W_PAD, L_PAD], -1, tl.int32),
             mask=(rows < W) & (kcol < L) & (kcol >= n_used[:, None]))
    remT = tl.trans(rem)  # [L_PAD, W_PAD]: column s = what owner s keeps of its expert j
    jr = tl.arange(0, L_PAD)[:, None]
    if MODE == 0:
        tl.store(etc_ptr + rows * L + slot, sender_of[:, None] * L + kcol,
                 mask=(slot >= 0) & (rows < W))  # kcol = j
        slotT = tl.trans(slot)
        movedT = tl.trans(moved)  # [L_PAD, W_PAD]: moved routes of the sender's local expert j on receiver d
        for s in range(W):  # one owner's L experts at a time: [L_PAD, W_PAD] rows of [E, W], no reduction
            from_s = sender_of[None, :] == s
            alloc_rows = tl.where(from_s, movedT, 0) + tl.where(dd == s, remT, 0)
            offs = (s * L + jr) * W + dd
            msk = (jr < L) & (dd < W)
            tl.store(alloc_ptr + offs, alloc_rows, mask=msk)
            tl.store(ends_ptr + offs, tl.cumsum(alloc_rows, axis=1), mask=msk)
            tl.store(slot_ptr + offs, tl.where(from_s, slotT, -1), mask=msk)
    else:
        # Pieces come from several senders, so no [W_PAD, L_PAD] per-owner view exists: write the natives,
        # scatter the pieces over them (each (expert, receiver) pair holds at most one piece), then read the
        # rows back for the run ends. The barriers order these global writes and reads within the program.
        tl.store(etc_ptr + rows * L + slot, pe, mask=(slot >= 0) & (rows < W))
        for s in range(W):
            offs = (s * L + jr) * W + dd
            msk = (jr < L) & (dd < W)
            tl.store(alloc_ptr + offs, tl.where(dd == s, remT, 0), mask=msk)
            tl.store(slot_ptr + offs, tl.full([L_PAD, W_PAD], -1, tl.int32), mask=msk)
        tl.debug_barrier()
        piece = (pm > 0) & (rows < W)
        tl.store(alloc_ptr + pe * W + rows, pm, mask=piece)
        tl.store(slot_ptr + pe * W + rows, slot, mask=piece)
        tl.debug_barrier()
        for s in range(W):
            offs = (s * L + jr) * W + dd
            msk = (jr < L) & (dd < W)
            alloc_rows = tl.load(alloc_ptr + offs, mask=msk, other=0)
            tl.store(ends_ptr + offs, tl.cumsum(alloc_rows, axis=1), mask=msk)
    return bad
