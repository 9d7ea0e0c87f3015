"""Triton virtual-expert planner: placement + route remap in ONE launch (kernel bodies only).

Spec: :func:`tritonep.balance.placement.place_torch` and :func:`tritonep.balance.remap.remap_torch` (bit-equal).
Idea: the fused planner of Megatron-LM ``virtual_expert_triton.py`` (PR #7450, after MoonEP), see
``shared/reference/balance_anchors.md`` §1.3-§1.5; the chunk prefix is a two-level look-back (group totals,
then chunks) in the spirit of single-pass prefix scans (Merrill & Garland, "Single-pass Parallel Prefix Scan with
Decoupled Look-back", NVIDIA 2016), and
the roles come from an arrival ticket as in that paper, so a program only ever waits on programs already running.
Ours takes the already gathered ``counts [W, E]`` (the dispatch counts exchange), supports uneven token counts and
masked (-1) routes, and keeps the whole placement in registers (:mod:`tritonep.balance.kernels.planner_place`).

:func:`plan_kernel`, grid ``G + 1``. Every program first takes a ticket from the packed ``sync`` word
(:func:`tritonep.device.signal.take_ticket`: one int64 atomic, call number ``n`` above ``TICKET_CALL_SHIFT``,
arrivals below); the ticket is its role, the last arrival resets the arrivals and bumps ``n``, and ``n + 1`` is this
call's flag mark (set by ``publish_mark``, awaited by ``wait_all_eq``, both in :mod:`tritonep.device.signal`).
Flags therefore never need a reset (CUDA-graph replays stay correct) and a role waits only on lower roles, which
took their tickets before it did, so every wait ends on any GPU schedule; in the interpreter programs run in order and no wait ever spins.
(the "correct at grid=1" rule (docs/platform.md) exists so the interpreter never waits on a program it has not run yet; here
every role needs its own program, the grid is exactly ``G + 1``, and a role only waits on earlier tickets.)

- Role 0: the placement (:func:`tritonep.balance.kernels.planner_place.place_and_store`), then ``flag[0] = mark``.
- Role ``c + 1``, route chunk ``c`` (``chunk`` routes from ``c * chunk``): (A) one pass over its routes computes
  each route's ordinal among the chunk's routes to the same expert (stable: running histogram + rank within the
  ``BLOCK`` tile; the next tile's ids load before this tile's work), stashed in ``out``, and the chunk histogram,
  stored as ``hist[c]`` and published (``flag[c + 1] = mark``); then it loads its first pass-(C) tile (``CB``
  routes: ids and stashed ordinals, independent of the placement); (B) two-level look-back (chunks form groups
  of ``group``): it waits for the flags of the earlier chunks of its group and sums their rows; the last chunk of
  a group stores the group's total as ``gtot[g]`` (``flag[G + 1 + g] = mark``, only when its own waits ended);
  every chunk then waits for the totals of the earlier groups and adds them + the counts of the lower ranks
  (= the global ordinal of the chunk's first route to each expert). The last chunk sums ``group - 1 +
  ceil(G / group) - 1`` rows (21 at G = 128, group 12), not ``G - 1``. (C) waits for ``flag[0]`` and maps each
  route's global ordinal through ``segment_ends[e, :]`` / ``expert_slot[e, :]`` to its runtime expert: one
  gather + one store per tile when the chunk fits one tile (the default on the GPU).
  The heavy pass (A) overlaps the placement; only (C) follows it.

Status word (``[G + 1]`` int32, OR them; bits named in :mod:`tritonep.device.protocol`): ``PLAN_NEGATIVE_COUNT``
(1) = a negative count (entry 0), ``PLAN_HISTOGRAM_MISMATCH`` (2) = ``topk_idx`` histogram differs from
``counts[rank]`` (checked by the chunks that reach the end), ``PLAN_BAD_EXPERT_ID`` (4) = an expert id outside
``[-1, E)`` (its output is ``2E``), ``PLAN_WAIT_GAVE_UP`` (8) = an internal wait gave up after ``timeout`` (ns of
wall time; then every valid route of that chunk is ``2E``, which the dispatch of the runtime ids refuses on every
rank), ``PLAN_COUNT_OVERFLOW`` (16) = counts whose total does not fit int32 (entry 0; the twin's PlanError; the
placement is then computed from all-zero counts).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .planner_place import place_and_store
from ...device.protocol import PLAN_BAD_EXPERT_ID, PLAN_HISTOGRAM_MISMATCH, PLAN_WAIT_GAVE_UP
from ...device.signal import publish_mark, take_ticket, wait_all_eq

__all__ = ["plan_kernel"]


@triton.jit
def _sum_rows(ptr, row_stride, n_rows, cols, cmask, CH: tl.constexpr):
    """``sum_{r < n_rows} ptr[r * row_stride + cols]`` as int32, ``CH`` rows per load step."""
    acc = tl.zeros(cols.shape, tl.int32)
    rr = tl.arange(0, CH)[:, None]
    for r0 in range(0, n_rows, CH):
        rows = r0 + rr
        blk = tl.load(ptr + rows * row_stride + cols[None, :], mask=(rows < n_rows) & cmask[None, :], other=0)
        acc += tl.sum(blk.to(tl.int32), axis=0)
    return acc


@triton.jit
def _load_routes(topk_ptr, stride_tt, stride_tk, i, inb, E: tl.constexpr, K: tl.constexpr):
    """Expert ids of routes ``i`` (flat ``t*K + k``): ``(ev, valid, esafe)``; out of bounds = -1, invalid -> 0.

    The range check runs at the ids' own width (int64 ids are not truncated first: 2**32 + 1 is not expert 1);
    an id outside ``[-1, E)`` becomes -2 in the int32 ``ev``, so it stays outside ``[-1, E)`` after the cast."""
    raw = tl.load(topk_ptr + (i // K) * stride_tt + (i % K) * stride_tk, mask=inb, other=-1)
    ev = tl.where((raw >= -1) & (raw < E), raw, -2).to(tl.int32)
    valid = inb & (ev >= 0) & (ev < E)
    return ev, valid, tl.where(valid, ev, 0)


@triton.jit
def _chunk_ordinals(topk_ptr, stride_tt, stride_tk, out_ptr, first, last,
                    E: tl.constexpr, K: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Pass (A): ``out[i]`` = ordinal of route ``i`` among the chunk's earlier routes to its expert (stable);
    returns ``(hist [E_PAD], bad)``: the chunk's per-expert histogram and 1 if an id is outside ``[-1, E)``."""
    ii = tl.arange(0, BLOCK)
    run = tl.zeros([E_PAD], tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    i = first + ii
    inb = i < last
    ev, valid, esafe = _load_routes(topk_ptr, stride_tt, stride_tk, i, inb, E, K)
    for start in range(first, last, BLOCK):
        # the next tile's ids are loaded before this tile's work (one load latency per chunk, not per tile)
        i_n = start + BLOCK + ii
        inb_n = i_n < last
        ev_n, valid_n, esafe_n = _load_routes(topk_ptr, stride_tt, stride_tk, i_n, inb_n, E, K)
        bad = tl.maximum(bad, (inb & ((ev < -1) | (ev >= E))).to(tl.int32))
        key = tl.where(valid, esafe, -1)
        within = tl.sum(((key[:, None] == key[None, :]) & (ii[None, :] < ii[:, None])).to(tl.int32), axis=1)
        tl.store(out_ptr + i, tl.gather(run, esafe, 0) + within, mask=inb)
        run += tl.histogram(esafe, E_PAD, mask=valid)
        i, inb, ev, valid, esafe = i_n, inb_n, ev_n, valid_n, esafe_n
    return run, tl.max(bad, axis=0)


@triton.jit
def _remap_tile(out_ptr, i, inb, ev, valid, esafe, g, ends_ptr, slot_ptr, ok,
                W: tl.constexpr, L: tl.constexpr, W_PAD: tl.constexpr):
    """Pass (C) on one tile: route ``i`` with global ordinal ``g`` goes to the first destination whose run end
    ``segment_ends[e, d]`` exceeds ``g``: runtime id ``d*2L + j`` (native) or ``d*2L + L + expert_slot[e, d]``."""
    BIG: tl.constexpr = 2147483647
    E: tl.constexpr = W * L
    dd = tl.arange(0, W_PAD)[None, :]
    ends_row = tl.load(ends_ptr + esafe[:, None] * W + dd, mask=valid[:, None] & (dd < W), other=BIG)
    slot_row = tl.load(slot_ptr + esafe[:, None] * W + dd, mask=valid[:, None] & (dd < W), other=-1)
    dest = tl.sum((ends_row <= g[:, None]).to(tl.int32), axis=1)
    vslot = tl.sum(tl.where(dd == tl.minimum(dest, W - 1)[:, None], slot_row, 0), axis=1)
    rid = tl.where(dest == esafe // L, dest * (2 * L) + esafe % L, dest * (2 * L) + L + vslot)
    # masked routes stay -1; an id outside [-1, E) (or a chunk whose wait gave up) becomes 2E, outside the
    # runtime range [0, 2E), so the dispatch that follows refuses it on every rank (docs/protocols.md (host protocol rule))
    rid = tl.where(valid & (ok != 0), rid, tl.where((ev < -1) | (ev >= E) | (valid & (ok == 0)), 2 * E, -1))
    tl.store(out_ptr + i, rid, mask=inb)


@triton.jit
def _tile_routes(topk_ptr, stride_tt, stride_tk, out_ptr, i, last, E: tl.constexpr, K: tl.constexpr):
    """Routes ``i`` (< ``last``) of one pass-(C) tile: ``(inb, ev, valid, esafe, o)``, ``o = out[i]`` (the pass-(A)
    ordinal among the chunk's routes to the same expert). Independent of the placement: loaded before its wait."""
    inb = i < last
    ev, valid, esafe = _load_routes(topk_ptr, stride_tt, stride_tk, i, inb, E, K)
    return inb, ev, valid, esafe, tl.load(out_ptr + i, mask=inb, other=0)


# one variant for every rank, and for every token count T whose launch geometry (the constexprs, chunk, group) is
# the same: num_routes = T*K is not specialised on == 1 / divisibility by 16 (chunk is a multiple of BLOCK >= 16
# whatever T, so its divisibility hint is kept and costs no variant)
@triton.jit(do_not_specialize=['num_routes', 'timeout', 'rank'])
def plan_kernel(counts_ptr, stride_cr, stride_ce,
                topk_ptr, stride_tt, stride_tk, num_routes, chunk, group,
                hist_ptr, gtot_ptr, alloc_ptr, etc_ptr, slot_ptr, ends_ptr, quota_ptr, cap_ptr, out_ptr, status_ptr,
                sync_ptr, flag_ptr, timeout, rank,
                W: tl.constexpr, L: tl.constexpr, K: tl.constexpr,
                W_PAD: tl.constexpr, L_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
                CB: tl.constexpr, RB: tl.constexpr, CH: tl.constexpr, FB: tl.constexpr, HAS_TIMER: tl.constexpr,
                MODE: tl.constexpr = 0):
    """The whole planner step in one launch (see the module docstring), grid ``G + 1``.

    counts: ``[W, W*L]`` int32/int64 (any strides); topk: ``[T, K]`` int32/int64 (any strides), ``num_routes =
    T*K``; hist: ``[G, E_PAD]`` int32 scratch (chunk histograms); gtot: ``[ceil(G / group), E_PAD]`` int32
    scratch (look-back group totals, ``group`` >= 1 chunks per group); alloc/slot/ends: ``[E, W]`` int32; etc:
    ``[W, L]``; quota: ``[W, W]``; cap: ``[W]``; out: ``[T*K]`` int32 runtime ids; status: ``[G + 1]`` int32.
    sync: int64 ``[1]`` and flag: int64 ``[>= G + 1 + ceil(G / group)]``, persistent state zeroed once (never
    between calls; see :func:`tritonep.balance.planner.plan`). ``FB`` >= max(group, ceil(G / group)) (power of
    two); ``CH`` rows per summing load; ``CB`` routes per pass-(C) tile (the first is loaded before the placement
    wait); ``RB`` count rows per placement load step; ``MODE`` 0 = reference placement, 1 = minimal.
    """
    E: tl.constexpr = W * L
    nprog = tl.num_programs(0)
    role, mark = take_ticket(sync_ptr)
    if role == 0:
        bad_counts = place_and_store(counts_ptr, stride_cr, stride_ce, alloc_ptr, etc_ptr, slot_ptr, ends_ptr,
                                     quota_ptr, cap_ptr, rank, W, L, W_PAD, L_PAD, RB, MODE)
        tl.store(status_ptr, bad_counts)
        publish_mark(flag_ptr, mark)
    else:
        c = role - 1
        first = c * chunk
        last = tl.minimum(first + chunk, num_routes)
        mine, bad = _chunk_ordinals(topk_ptr, stride_tt, stride_tk, out_ptr, first, last, E, K, E_PAD, BLOCK)
        cols = tl.arange(0, E_PAD)
        cmask = cols < E
        tl.store(hist_ptr + c * E_PAD + cols, mine)
        publish_mark(flag_ptr + role, mark)
        # pass (C)'s first tile does not depend on the placement: load it now, its latency hides under the waits
        ic = first + tl.arange(0, CB)
        inb, ev, valid, esafe, o = _tile_routes(topk_ptr, stride_tt, stride_tk, out_ptr, ic, last, E, K)
        # (B) lower ranks' routes (from counts) + this rank's earlier chunks, two-level: the earlier chunks of my
        # look-back group (their histograms), then the totals of the earlier groups (published by each group's
        # last chunk), so no chunk sums more than group - 1 + ceil(G / group) - 1 rows
        base = _sum_rows(counts_ptr, stride_cr, rank, cols * stride_ce, cmask, CH)
        grp = c // group
        pos = c - grp * group
        ok = wait_all_eq(flag_ptr + 1 + grp * group, pos, mark, timeout, HAS_TIMER, FB)
        earlier = _sum_rows(hist_ptr + grp * group * E_PAD, E_PAD, pos, cols, cmask, CH)
        if (pos == group - 1) & (role < nprog - 1) & (ok != 0):  # a later group exists and reads my total
            tl.store(gtot_ptr + grp * E_PAD + cols, earlier + mine)
            publish_mark(flag_ptr + nprog + grp, mark)
        ok = ok & wait_all_eq(flag_ptr + nprog, grp, mark, timeout, HAS_TIMER, FB)
        earlier += _sum_rows(gtot_ptr, E_PAD, grp, cols, cmask, CH)
        base += earlier
        ok = ok & wait_all_eq(flag_ptr, 1, mark, timeout, HAS_TIMER, 2)
        # (C) after the placement: map global ordinals through segment_ends / expert_slot
        _remap_tile(out_ptr, ic, inb, ev, valid, esafe, tl.gather(base, esafe, 0) + o, ends_ptr, slot_ptr, ok,
                    W, L, W_PAD)
        for start in range(first + CB, last, CB):  # only when a chunk holds more than one pass-(C) tile
            ic = start + tl.arange(0, CB)
            inb, ev, valid, esafe, o = _tile_routes(topk_ptr, stride_tt, stride_tk, out_ptr, ic, last, E, K)
            _remap_tile(out_ptr, ic, inb, ev, valid, esafe, tl.gather(base, esafe, 0) + o, ends_ptr, slot_ptr, ok,
                        W, L, W_PAD)
        status = bad * PLAN_BAD_EXPERT_ID | (1 - ok) * PLAN_WAIT_GAVE_UP
        if last >= num_routes:  # earlier chunks + this one = every route: compare with counts[rank]
            own = tl.load(counts_ptr + rank * stride_cr + cols * stride_ce, mask=cmask, other=0).to(tl.int32)
            differs = tl.max(((own != earlier + mine) & cmask).to(tl.int32), axis=0)
            status = status | (differs * PLAN_HISTOGRAM_MISMATCH)
        tl.store(status_ptr + role, status)
