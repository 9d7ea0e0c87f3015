"""Virtual-expert planner: place_torch / remap_torch invariants, the reference worked example, Triton == torch."""

import itertools
import zlib

import pytest
import torch

from tritonep.balance import (
    Placement, balancedness, check_plan_status, loads_after, maxvio, place_torch, plan, plan_status, rank_loads,
    remap_torch, straggler_factor,
)
from tritonep.errors import PlanError

from tests.balance.planner_cases import CASES, check_remap, hot, make_topk


# ----------------------------------------------------------------------------------------------------- helpers


def check_placement(counts, p: Placement):
    """Every invariant of a placement built from counts [W, E]."""
    world, num_experts = counts.shape
    L = num_experts // world
    total = counts.to(torch.int64).sum(0)
    n = int(total.sum())
    cap = torch.tensor([n // world + (1 if d < n % world else 0) for d in range(world)])
    assert torch.equal(p.capacity.to(torch.int64), cap)
    alloc = p.allocation.to(torch.int64)
    assert bool((alloc >= 0).all())
    assert torch.equal(alloc.sum(1), total), "routes conserved per expert"
    assert torch.equal(loads_after(p), cap), "every rank's load equals its capacity"
    assert torch.equal(p.segment_ends.to(torch.int64), alloc.cumsum(1))
    q = p.quota.to(torch.int64)
    assert bool(((q > 0).sum(0) <= 1).all()), "single-sender rule"
    assert bool((q.diagonal() == 0).all())
    for d in range(world):
        remote = [e for e in range(num_experts) if e // L != d and alloc[e, d] > 0]
        want = sorted(remote, key=lambda e: (-int(alloc[e, d]), -e))  # allocation desc, ties to highest id
        row = p.experts_to_copy[d].tolist()
        assert len(want) <= L
        assert row == want + [-1] * (L - len(want)), "slot set == migrated set, ordered, no duplicates"
        for e in range(num_experts):
            s = int(p.expert_slot[e, d])
            assert (s >= 0) == (e in remote) and (s < 0 or row[s] == e)
        # every route that migrates to d comes from its single sender
        senders = {e // L for e in remote}
        assert len(senders) <= 1 and all(q[s, d] > 0 for s in senders)


def run_case(topks, counts, triton=True, **plan_kw):
    p = place_torch(counts)
    check_placement(counts, p)
    rids = [remap_torch(topks[r], p, r, counts) for r in range(counts.shape[0])]
    check_remap(topks, counts, p, [x.to(torch.int64) for x in rids])
    if triton:
        for r in range(counts.shape[0]):
            pt, rid = plan(counts, topks[r], r, **plan_kw)
            assert plan_status(pt) == 0
            assert pt.equal(p), f"Triton placement differs on rank {r}"
            assert rid.dtype == torch.int32 and torch.equal(rid, rids[r]), f"Triton remap differs on rank {r}"
    return p


# ------------------------------------------------------------------------------------------ the worked example
def test_reference_worked_example_exact():
    """balance_anchors.md §1.4: R=4, E=12, L=3, T=9, K=1; experts 0-8 get 4 routes each, 9-11 none."""
    flat = torch.tensor([e for e in range(9) for _ in range(4)])
    topks = list(flat.reshape(4, 9, 1))
    counts = torch.stack([torch.bincount(t.reshape(-1), minlength=12) for t in topks]).to(torch.int32)
    p = run_case(topks, counts)
    assert rank_loads(counts, 4).tolist() == [12, 12, 12, 0]  # balances +3, +3, +3, -9 against C=9
    assert p.capacity.tolist() == [9, 9, 9, 9]
    # rank 0 -> rank 3: 9; rank 1 -> rank 0: 6; rank 2 -> rank 1: 3
    assert p.quota.tolist() == [[0, 0, 0, 9], [6, 0, 0, 0], [0, 3, 0, 0], [0, 0, 0, 0]]
    assert p.allocation[:9].tolist() == [
        [0, 0, 0, 4], [0, 0, 0, 4], [3, 0, 0, 1],
        [4, 0, 0, 0], [2, 2, 0, 0], [0, 4, 0, 0],
        [0, 3, 1, 0], [0, 0, 4, 0], [0, 0, 4, 0]]
    assert p.allocation[9:].tolist() == [[0, 0, 0, 0]] * 3
    assert p.experts_to_copy.tolist() == [[3, 4, -1], [6, -1, -1], [-1, -1, -1], [1, 0, 2]]
    # Over-migration: rank 0 gives away all of e0 and e1, then hosts rank 1's e3, e4.
    # Runtime ids (2L=6): e.g. rank 1's three e2 routes have global ordinals 1,2,3 -> native 2,2 then slot 2 of
    # rank 3 = 3*6+3+2 = 23; e4's first two routes (rank 1) -> slot 1 of rank 0 = 4.
    want = [[22, 22, 22, 22, 21, 21, 21, 21, 2], [2, 2, 23, 3, 3, 3, 3, 4, 4],
            [7, 7, 8, 8, 8, 8, 9, 9, 9], [12, 13, 13, 13, 13, 14, 14, 14, 14]]
    for r in range(4):
        assert remap_torch(topks[r], p, r, counts).reshape(-1).tolist() == want[r]


# --------------------------------------------------------------------------------------- histogram invariants


@pytest.mark.parametrize("name", sorted(CASES))
def test_invariants_and_triton_equal(name):
    c = CASES[name]
    topks, counts = make_topk(c["world"], c["E"], c["K"], c["tokens"], c.get("probs"), c.get("mask_p", 0.0),
                              seed=zlib.crc32(name.encode()) % 1000)
    run_case(topks, counts)


def test_ties_and_single_expert_holds_everything():
    """Equal hot experts (expert and rank ties) and one expert whose routes exceed any capacity."""
    topks = [torch.tensor([[0], [1], [4], [5]]).repeat(3, 1) for _ in range(4)]
    counts = torch.stack([torch.bincount(t.reshape(-1), minlength=8) for t in topks]).to(torch.int32)
    run_case(topks, counts)
    # all 20 routes to expert 3 (owner rank 1): split over all ranks, 5 each, exact balance
    topks = [torch.full((5, 1), 3) for _ in range(4)]
    counts = torch.stack([torch.bincount(t.reshape(-1), minlength=8) for t in topks]).to(torch.int32)
    p = run_case(topks, counts)
    assert p.allocation[3].tolist() == [5, 5, 5, 5] and p.capacity.tolist() == [5] * 4
    # fewer routes than ranks: remainder to the lowest ranks
    topks = [torch.tensor([[7]]), torch.empty(0, 1, dtype=torch.int64), torch.tensor([[7]]),
             torch.empty(0, 1, dtype=torch.int64)]
    counts = torch.stack([torch.bincount(t.reshape(-1), minlength=8) for t in topks]).to(torch.int32)
    p = run_case(topks, counts)
    assert p.capacity.tolist() == [1, 1, 0, 0] and p.allocation[7].tolist() == [1, 1, 0, 0]


def test_exhaustive_small_histograms_always_balance_exactly():
    """Every per-expert histogram with entries 0..3 for (W=3, L=1) and (W=2, L=2): exact balance, slots fit."""
    for world, L in ((3, 1), (2, 2)):
        for hist in itertools.product(range(4), repeat=world * L):
            counts = torch.tensor([list(hist)] + [[0] * (world * L)] * (world - 1), dtype=torch.int32)
            check_placement(counts, place_torch(counts))


def test_random_heavy_tail_histograms():
    g = torch.Generator().manual_seed(7)
    for i in range(150):
        world = [2, 4, 5, 8][i % 4]
        L = [1, 2, 3, 4][(i // 4) % 4]
        logits = torch.randn(world, world * L, generator=g) * 2.5
        counts = torch.poisson(torch.exp(logits), generator=g).to(torch.int32)
        check_placement(counts, place_torch(counts))
        if i % 25 == 0:  # a few through the kernel, placement only (an empty topk_idx disagrees with counts[0])
            pt, _ = plan(counts, torch.empty(0, 1, dtype=torch.int64), 0)
            assert pt.equal(place_torch(counts)) and plan_status(pt) == (2 if counts[0].any() else 0)


def test_triton_many_pieces_and_slot_ties():
    """Many step-3 rounds per sender and equal allocations on one receiver (slot ties: highest id first)."""
    counts = torch.zeros(2, 32, dtype=torch.int32)
    counts[0, :16] = 5  # rank 0 owns all 80 routes: hands 40 = eight whole experts of 5 to rank 1
    pt, _ = plan(counts, torch.empty(0, 1, dtype=torch.int64), 1)
    assert pt.equal(place_torch(counts))
    assert pt.experts_to_copy[1].tolist() == [7, 6, 5, 4, 3, 2, 1, 0] + [-1] * 8
    g = torch.Generator().manual_seed(11)
    for i in range(32):  # few distinct values (ties), traffic concentrated on a few ranks (many pieces)
        world, L = [2, 3, 4, 8][i % 4], [1, 3, 8, 16][(i // 4) % 4]
        counts = torch.randint(0, 3, (world, world * L), generator=g, dtype=torch.int32) * 4
        counts[:, : world * L // 2] *= torch.randint(1, 4, (1,), generator=g, dtype=torch.int32)
        if i % 3 == 0:
            counts[:, L * (world // 2):] = 0
        pt, _ = plan(counts, torch.empty(0, 1, dtype=torch.int64), 0)
        assert pt.equal(place_torch(counts)), (i, counts)


def test_triton_multi_program_noncontiguous_int32():
    topks, counts = make_topk(4, 16, 3, [40, 33, 0, 21], probs=hot(9, 25.0), mask_p=0.1, seed=3,
                              dtype=torch.int32)
    p = place_torch(counts)
    counts_nc = counts.to(torch.int64).t().contiguous().t()  # int64, non-contiguous
    for r in (0, 1, 2, 3):
        wide = torch.full((topks[r].shape[0], 5), 99, dtype=torch.int32)
        wide[:, 1:4] = topks[r]
        view = wide[:, 1:4]  # non-contiguous rows
        pt, rid = plan(counts_nc, view, r, num_programs=3, block=16, validate=True)
        assert pt.equal(p) and torch.equal(rid, remap_torch(topks[r], p, r, counts))


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_triton_two_launch_chunks_and_status():
    """More chunks than tiles (empty chunks), many chunks over a larger shape, status bits from a middle chunk."""
    topks, counts = make_topk(8, 64, 4, [30, 0, 17, 25, 9, 40, 3, 12], probs=hot(11, 40.0, 64), mask_p=0.1, seed=5)
    p = place_torch(counts)
    for r in (0, 5, 7):
        want = remap_torch(topks[r], p, r, counts)
        for G, blk in ((1, 16), (7, 16), (40, 32)):
            pt, rid = plan(counts, topks[r], r, num_programs=G, block=blk, validate=True)
            assert pt.equal(p) and torch.equal(rid, want), (r, G, blk)
            assert pt.status.shape == (G + 1,)
    bad = topks[5].clone()
    bad[20, 1] = 64  # an id outside [0, E) in chunk 1 of 4 (and the histogram no longer matches counts[5])
    pt, rid = plan(counts, bad, 5, num_programs=4, block=16)
    assert plan_status(pt) == 6 and rid[20, 1] == 2 * 64  # out of the runtime range: the dispatch refuses it
    assert torch.equal(rid[:20], remap_torch(topks[5], p, 5, counts)[:20])  # earlier routes: ordinals unchanged


# ------------------------------------------------------------------------------------------------- bad inputs
def test_bad_counts_raise_plan_error():
    with pytest.raises(PlanError, match=r"counts\[1, 3\]=-2"):
        c = torch.zeros(2, 4, dtype=torch.int32)
        c[1, 3] = -2
        place_torch(c)
    with pytest.raises(PlanError, match="shape"):
        place_torch(torch.zeros(8, dtype=torch.int32))
    with pytest.raises(PlanError, match="num_experts=10 is not divisible by world_size=4"):
        place_torch(torch.zeros(4, 10, dtype=torch.int32))
    with pytest.raises(PlanError, match="dtype"):
        place_torch(torch.zeros(2, 4))
    with pytest.raises(PlanError, match="world_size=65"):
        plan(torch.zeros(65, 65, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int64), 0)
    assert place_torch(torch.zeros(65, 65, dtype=torch.int32)).capacity.sum() == 0  # the reference has no limit
    with pytest.raises(PlanError, match="num_experts=2048"):
        plan(torch.zeros(2, 2048, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int64), 0)
    c = torch.tensor([[1, 0, 0, 0], [0, -1, 0, 0]], dtype=torch.int32)
    pt, _ = plan(c, torch.tensor([[0]]), 0)
    assert plan_status(pt) & 1
    with pytest.raises(PlanError, match="negative"):
        check_plan_status(pt)


def test_bad_topk_raise_plan_error():
    counts = torch.tensor([[2, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.int32)
    p = place_torch(counts)
    good = torch.tensor([[0, 3], [0, -1]])
    assert remap_torch(good, p, 0, counts).shape == (2, 2)
    with pytest.raises(PlanError, match=r"expert 3, counts\[0, 3\]=1"):
        remap_torch(torch.tensor([[0, -1], [0, -1]]), p, 0, counts)
    with pytest.raises(PlanError, match="expert id 4"):
        remap_torch(torch.tensor([[0, 4], [0, 3]]), p, 0, counts)
    with pytest.raises(PlanError, match="rank=2"):
        remap_torch(good, p, 2, counts)
    with pytest.raises(PlanError, match="rank=-1"):
        plan(counts, good, -1)
    with pytest.raises(PlanError, match="differs from counts"):
        plan(counts, torch.tensor([[0, -1], [0, -1]]), 0, validate=True)
    _, rid = plan(counts, torch.tensor([[0, 4], [0, 3]]), 0)
    assert rid[0, 1] == 2 * 4  # outside the runtime range [0, 2E): the dispatch of the runtime ids refuses it
    with pytest.raises(PlanError, match="outside"):
        plan(counts, torch.tensor([[0, 4], [0, 3]]), 0, validate=True)
    with pytest.raises(PlanError, match="topk_idx must be"):
        plan(counts, torch.tensor([0, 3]), 0)


# ---------------------------------------------------------------------------------------------------- metrics
def test_metrics():
    assert balancedness(torch.tensor([4, 4, 4, 4])) == 1.0
    assert balancedness(torch.tensor([8, 0, 0, 0])) == 0.25
    assert balancedness(torch.tensor([0, 0])) == 1.0
    assert straggler_factor(torch.tensor([6, 2])) == 1.5
    assert maxvio(torch.tensor([1, 1, 1, 5])) == pytest.approx(1.5)
    assert maxvio(torch.zeros(4)) == 0.0
    with pytest.raises(PlanError, match="negative"):
        balancedness(torch.tensor([1, -1]))
    with pytest.raises(PlanError):
        rank_loads(torch.zeros(10), 4)
    topks, counts = make_topk(4, 16, 2, [30, 10, 0, 17], probs=hot(1, 50.0), seed=11)
    loads = rank_loads(counts, 4)
    assert torch.equal(loads, rank_loads(counts.sum(0), 4)) and int(loads.sum()) == int(counts.sum())
    before = balancedness(loads)
    after = loads_after(place_torch(counts))
    n = int(counts.sum())
    assert before < 0.6 and balancedness(after) == pytest.approx((n / 4) / -(-n // 4))


# -------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("world,num_experts,topk,tokens", [(4, 16, 2, 100), (8, 256, 8, 4096), (64, 512, 8, 2048),
                                                         (16, 1024, 6, 3000)])
def test_gpu_plan_matches_torch(world, num_experts, topk, tokens):
    """Compiled kernel on CUDA (multi-program) == torch twins; uneven tokens, masked routes, a hot expert."""
    probs = hot(3, 50.0, num_experts)
    toks = [tokens - 37 * (r % 3) for r in range(world)]
    topks, counts = make_topk(world, num_experts, topk, toks, probs=probs, mask_p=0.05, seed=world)
    p = place_torch(counts)
    check_placement(counts, p)
    dev_counts = counts.cuda()
    for r in sorted({0, 1, world - 1}):
        pt, rid = plan(dev_counts, topks[r].cuda(), r, validate=True)
        assert pt.equal(p) and torch.equal(rid.cpu(), remap_torch(topks[r], p, r, counts))
        pt, rid = plan(dev_counts, topks[r].cuda(), r, num_programs=1, block=128, validate=True)
        assert pt.equal(p) and torch.equal(rid.cpu(), remap_torch(topks[r], p, r, counts))


@pytest.mark.gpu
@pytest.mark.parametrize("world,num_experts", [(2, 256), (8, 256), (16, 1024), (64, 256)])
def test_gpu_placement_many_pieces_and_ties(world, num_experts):
    """Compiled placement (1, 4 and 8 warps) on long step-3 runs and equal allocations: == place_torch."""
    g = torch.Generator().manual_seed(world)
    L = num_experts // world
    for i in range(6):
        counts = torch.randint(0, 3, (world, num_experts), generator=g, dtype=torch.int32) * (4 + i)
        if i % 2 == 0:  # traffic on the first ranks only: long runs of whole experts handed over
            counts[:, L * max(1, world // 4):] = 0
        if i == 5:  # one rank, all experts tied: slot order is pure tie-break (highest id first)
            counts.zero_()
            counts[0, :L] = 7
        pt, _ = plan(counts.cuda(), torch.empty(0, 1, dtype=torch.int64, device="cuda"), 0)
        assert pt.equal(place_torch(counts)), (world, num_experts, i)
