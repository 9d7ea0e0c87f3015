"""Triton virtual-expert planner: placement + route remap in TWO launches (kernel bodies only).

Spec: :func:`tritonep.balance.placement.place_torch` and :func:`tritonep.balance.remap.remap_torch` (bit-equal).
Idea: the fused planner of Megatron-LM ``virtual_expert_triton.py`` (PR #7450, after MoonEP); see
``shared/reference/balance_anchors.md`` §1.3-§1.5. Ours takes the already gathered ``counts [W, E]`` (the dispatch
counts exchange), supports uneven token counts and masked (-1) routes, and keeps the whole placement in registers.

Register layout of the placement: a per-expert vector is a ``[W_PAD, L_PAD]`` matrix (row = owner rank ``s``,
column = local index ``j``, expert ``e = s*L + j``). Because every receiver has exactly one sender, the migrated
routes also fit one ``[W_PAD, L_PAD]`` matrix (row = receiver ``d``, column = the sender's local expert), so no
``[E, W]`` tensor is ever held in registers.

Minimal mode (``MODE=1``, spec ``place_torch(counts, "minimal")``): a receiver may take pieces from several
senders, so the pieces live in a ``[W_PAD, L_PAD]`` matrix indexed by (receiver, arrival order): each round of the
greedy fills one slot, so ``L`` columns always suffice. Program 0 writes the native rows of ``[E, W]``, scatters the
pieces over them and reads the rows back for ``segment_ends`` (``tl.debug_barrier`` between the phases orders the
global writes and reads of its threads). No register spills for sm_90 at any ``W <= 64, E <= 1024`` (ptxas -v).

Launch 1 (:func:`plan_kernel`, grid ``G + 1``): program 0 computes the placement (``O(W*(W+L))`` small vector
steps; minimal mode: one step per piece, at most ``W*L``), stores it (expanding to ``[E, W]`` one owner at a time)
and writes row 0 of the scratch ``hist [G+1, E_PAD]``: ``prefix[e] = sum_{r < rank} counts[r, e]``. Program
``c + 1`` writes row ``c + 1``: the per-expert histogram of route chunk ``c`` (``chunk`` routes each). Launch 2
(:func:`plan_remap_kernel`, grid ``G``): program ``c`` sums rows ``0..c`` of the scratch (= the global ordinal of
chunk ``c``'s first route to each expert), then per tile of ``BLOCK`` routes computes ``g = base[e] + rank within
tile`` (stable), loads the route's run ends ``segment_ends[e, :]`` (written by launch 1) and takes the first
destination whose run end exceeds ``g``. No program ever waits on another program of its grid; both kernels are
correct at any grid size, including 1.

Status word (``[G + 1]`` int32, OR them): 1 = a negative count (entry 0, launch 1), 2 = ``topk_idx`` histogram
differs from ``counts[rank]`` (checked by the programs of launch 2 whose chunk reaches the end), 4 = an expert id
outside ``[-1, E)`` (its output is -1).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["plan_kernel", "plan_remap_kernel"]


@triton.jit
def _totals(counts_ptr, stride_cr, stride_ce, rank,
            W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr, RB: tl.constexpr):
    """Step 1 of both modes: ``(total, prefix, low, cap, bal)``: ``total[s, j]`` routes to expert ``s*L+j`` from
    all ranks, ``prefix[s, j]`` from ranks below ``rank``, ``low`` the elementwise minimum over source rows (< 0 =
    a negative count), ``cap[d]`` (remainder to the lowest ranks, 0 past ``W``), ``bal[d] = load[d] - cap[d]``."""
    s2 = tl.arange(0, W_PAD)[:, None]
    j2 = tl.arange(0, L_PAD)[None, :]
    ev2 = (s2 < W) & (j2 < L)
    e2 = s2 * L + j2
    total = tl.zeros([W_PAD, L_PAD], tl.int32)
    prefix = tl.zeros([W_PAD, L_PAD], tl.int32)
    low = tl.zeros([W_PAD, L_PAD], tl.int32)
    for r0 in range(0, W, RB):
        for i in tl.static_range(RB):  # RB independent row loads in flight, not a chain of W dependent ones
            r = r0 + i
            row = tl.load(counts_ptr + r * stride_cr + e2 * stride_ce, mask=ev2 & (r < W), other=0).to(tl.int32)
            total += row
            prefix += tl.where(r < rank, row, 0)
            low = tl.minimum(low, row)

    # Step 1: capacity (remainder to the lowest ranks) and balance.
    dvec = tl.arange(0, W_PAD)
    dvalid = dvec < W
    n_routes = tl.sum(tl.sum(total, axis=1), axis=0)
    cap = n_routes // W + tl.where(dvec < n_routes % W, 1, 0)
    cap = tl.where(dvalid, cap, 0)
    bal = tl.sum(total, axis=1) - cap
    return total, prefix, low, cap, bal


@triton.jit
def _placement(counts_ptr, stride_cr, stride_ce, rank,
               W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr, RB: tl.constexpr):
    """Placement in registers, all tensors ``[W_PAD]``, ``[W_PAD, L_PAD]`` or ``[W_PAD, W_PAD]``.

    Returns ``(rem, moved, slot, n_used, sender_of, quota, cap, prefix, neg)``: ``rem[s, j]`` routes expert
    ``s*L+j`` keeps on its owner; ``moved[d, j]`` routes of expert ``sender_of[d]*L + j`` served by receiver ``d``
    (single sender, so one row per receiver suffices); ``slot[d, j]`` its slot or -1; ``n_used[d]`` the used
    slots (``0..n_used-1``); ``sender_of[d]`` the one rank ``d`` takes routes from, or -1. ``RB`` = source rows
    of ``counts`` per load step (unrolled).
    """
    BIG: tl.constexpr = 2147483647
    j2 = tl.arange(0, L_PAD)[None, :]
    total, prefix, low, cap, bal = _totals(counts_ptr, stride_cr, stride_ce, rank, W, L, W_PAD, L_PAD, RB)
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
    neg = (tl.min(tl.min(low, axis=1), axis=0) < 0).to(tl.int32)
    return rem, moved, slot, n_used, sender_of, quota, cap, prefix, neg


@triton.jit
def _placement_minimal(counts_ptr, stride_cr, stride_ce, rank,
                       W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr, L_PAD: tl.constexpr,
                       RB: tl.constexpr):
    """Minimal-mode placement in registers (spec: ``_minimal_moves`` of :mod:`tritonep.balance.placement`).

    One piece per round: sender = largest excess, its hottest remaining expert, receiver = largest deficit among
    ranks with a free slot (all ties: lowest index), ``m = min(excess, remaining, deficit)``; each round fills one
    slot of its receiver, so a piece matrix ``[W_PAD, L_PAD]`` (row = receiver ``d``, column = arrival order ``k``)
    holds them all. Returns ``(rem, pe, pm, slot, n_used, quota, cap, prefix, neg)``: ``pe[d, k]`` / ``pm[d, k]``
    the expert / routes of receiver ``d``'s ``k``-th piece (-1 / 0 past ``n_used[d]``), ``slot[d, k]`` its slot
    (allocation desc, ties to the highest expert id, maintained like the reference's step 4) or -1.
    """
    BIG: tl.constexpr = 2147483647
    s2 = tl.arange(0, W_PAD)[:, None]
    j2 = tl.arange(0, L_PAD)[None, :]
    total, prefix, low, cap, bal = _totals(counts_ptr, stride_cr, stride_ce, rank, W, L, W_PAD, L_PAD, RB)
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
    neg = (tl.min(tl.min(low, axis=1), axis=0) < 0).to(tl.int32)
    return rem, pe, pm, slot, n_used, quota, cap, prefix, neg


@triton.jit
def plan_kernel(counts_ptr, stride_cr, stride_ce,
                topk_ptr, stride_tt, stride_tk, num_routes, chunk,
                hist_ptr, alloc_ptr, etc_ptr, slot_ptr, ends_ptr, quota_ptr, cap_ptr, status_ptr,
                rank,
                W: tl.constexpr, L: tl.constexpr, K: tl.constexpr,
                W_PAD: tl.constexpr, L_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
                RB: tl.constexpr, MODE: tl.constexpr = 0):
    """Launch 1: program 0 = placement (+ prefix row), program ``c+1`` = histogram of routes ``[c*chunk, ...)``.

    counts: ``[W, W*L]`` int32/int64 (any strides); topk: ``[T, K]`` int32/int64 (any strides), ``num_routes =
    T*K``; hist: ``[G+1, E_PAD]`` int32 scratch (row 0: columns ``< E`` written); alloc/slot/ends: ``[E, W]``
    int32; etc: ``[W, L]``; quota: ``[W, W]``; cap: ``[W]``; status: entry 0 written (bit 1). ``RB``: source
    rows of ``counts`` per load in the placement (a power of two, the host keeps ``RB*W_PAD*L_PAD`` small).
    ``MODE``: 0 = reference placement (:func:`_placement`), 1 = minimal (:func:`_placement_minimal`).
    """
    E: tl.constexpr = W * L
    pid = tl.program_id(0)
    if pid == 0:
        if MODE == 0:
            rem, moved, slot, n_used, sender_of, quota, cap, prefix, neg = _placement(
                counts_ptr, stride_cr, stride_ce, rank, W, L, W_PAD, L_PAD, RB)
        else:
            rem, pe, pm, slot, n_used, quota, cap, prefix, neg = _placement_minimal(
                counts_ptr, stride_cr, stride_ce, rank, W, L, W_PAD, L_PAD, RB)
        dd = tl.arange(0, W_PAD)[None, :]
        rows = tl.arange(0, W_PAD)[:, None]
        kcol = tl.arange(0, L_PAD)[None, :]
        tl.store(hist_ptr + rows * L + kcol, prefix, mask=(rows < W) & (kcol < L))
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
        tl.store(status_ptr, neg)
    else:
        ii = tl.arange(0, BLOCK)
        acc = tl.zeros([E_PAD], tl.int32)
        first = (pid - 1) * chunk
        last = tl.minimum(first + chunk, num_routes)
        for start in range(first, last, BLOCK):
            i = start + ii
            inb = i < last
            ev = tl.load(topk_ptr + (i // K) * stride_tt + (i % K) * stride_tk, mask=inb, other=-1).to(tl.int32)
            valid = inb & (ev >= 0) & (ev < E)
            acc += tl.histogram(tl.where(valid, ev, 0), E_PAD, mask=valid)
        tl.store(hist_ptr + pid * E_PAD + tl.arange(0, E_PAD), acc)


@triton.jit
def _run_rows(ends_ptr, slot_ptr, esafe, valid, W: tl.constexpr, W_PAD: tl.constexpr):
    """``[BLOCK, W_PAD]`` rows ``segment_ends[e, :]`` (BIG past W / invalid) and ``expert_slot[e, :]`` (-1) of
    each route's expert ``esafe``, loaded together (no dependent second load)."""
    BIG: tl.constexpr = 2147483647
    dd = tl.arange(0, W_PAD)[None, :]
    ends_row = tl.load(ends_ptr + esafe[:, None] * W + dd, mask=valid[:, None] & (dd < W), other=BIG)
    slot_row = tl.load(slot_ptr + esafe[:, None] * W + dd, mask=valid[:, None] & (dd < W), other=-1)
    return ends_row, slot_row


@triton.jit
def plan_remap_kernel(counts_ptr, stride_cr, stride_ce,
                      topk_ptr, stride_tt, stride_tk, num_routes, chunk,
                      hist_ptr, ends_ptr, slot_ptr, out_ptr, status_ptr,
                      rank,
                      W: tl.constexpr, L: tl.constexpr, K: tl.constexpr,
                      W_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, CH: tl.constexpr):
    """Launch 2: program ``c`` remaps routes ``[c*chunk, (c+1)*chunk)`` using launch 1's scratch and placement.

    hist: ``[G+1, E_PAD]`` int32 from :func:`plan_kernel`; ends/slot: ``[E, W]`` int32 (the placement's
    ``segment_ends`` / ``expert_slot``); out: ``[T*K]`` int32; status: entry ``c + 1`` written (bits 2, 4).
    ``CH`` = scratch rows summed per step (a power of two).
    """
    E: tl.constexpr = W * L
    pid = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    cmask = cols < E
    # rows 1..pid of the scratch: routes of the earlier chunks of this rank, per expert
    earlier = tl.zeros([E_PAD], tl.int32)
    rr = tl.arange(0, CH)[:, None]
    for r0 in range(1, pid + 1, CH):
        rows = r0 + rr
        blk = tl.load(hist_ptr + rows * E_PAD + cols[None, :], mask=(rows <= pid) & cmask[None, :], other=0)
        earlier += tl.sum(blk, axis=0)
    run = tl.load(hist_ptr + cols, mask=cmask, other=0) + earlier  # global ordinal of the next route, per expert
    ii = tl.arange(0, BLOCK)
    dd = tl.arange(0, W_PAD)[None, :]
    mine = tl.zeros([E_PAD], tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    first = pid * chunk
    last = tl.minimum(first + chunk, num_routes)
    for start in range(first, last, BLOCK):
        i = start + ii
        inb = i < last
        ev = tl.load(topk_ptr + (i // K) * stride_tt + (i % K) * stride_tk, mask=inb, other=-1).to(tl.int32)
        valid = inb & (ev >= 0) & (ev < E)
        bad = tl.maximum(bad, (inb & ((ev < -1) | (ev >= E))).to(tl.int32))
        esafe = tl.where(valid, ev, 0)
        owner = esafe // L
        j = esafe % L
        if W_PAD <= 16:  # issued before the ordinal work below so their latency overlaps it (small rows only)
            ends_row, slot_row = _run_rows(ends_ptr, slot_ptr, esafe, valid, W, W_PAD)
        key = tl.where(valid, esafe, -1)
        earlier_in_tile = (key[:, None] == key[None, :]) & (ii[None, :] < ii[:, None])
        within = tl.sum(earlier_in_tile.to(tl.int32), axis=1)
        g = tl.gather(run, esafe, 0) + within
        h = tl.histogram(esafe, E_PAD, mask=valid)
        run += h
        mine += h
        if W_PAD > 16:
            ends_row, slot_row = _run_rows(ends_ptr, slot_ptr, esafe, valid, W, W_PAD)
        # first destination whose run end exceeds g
        dest = tl.sum((ends_row <= g[:, None]).to(tl.int32), axis=1)
        vslot = tl.sum(tl.where(dd == tl.minimum(dest, W - 1)[:, None], slot_row, 0), axis=1)
        rid = tl.where(dest == owner, dest * (2 * L) + j, dest * (2 * L) + L + vslot)
        # masked routes stay -1; an id outside [-1, E) becomes 2E, outside the runtime range [0, 2E), so the
        # dispatch that follows refuses it on every rank (its counts exchange carries the flag, DESIGN.md 6a)
        rid = tl.where(valid, rid, tl.where((ev < -1) | (ev >= E), 2 * E, -1))
        tl.store(out_ptr + i, rid, mask=inb)

    status = tl.max(bad, axis=0) * 4
    if last >= num_routes:  # earlier chunks + this one = every route: compare with counts[rank]
        own = tl.load(counts_ptr + rank * stride_cr + cols * stride_ce, mask=cmask, other=0).to(tl.int32)
        mismatch = tl.max(((own != earlier + mine) & cmask).to(tl.int32), axis=0)
        status = status | (mismatch * 2)
    tl.store(status_ptr + 1 + pid, status)
