"""Minimal placement mode: invariants, Triton == torch, the flame layer 3 regression, slot exhaustion.

The reference mode (the default) is covered by test_planner.py; here it only appears as the contrast.
"""

import itertools
import zlib

import pytest
import torch

from tritonep.balance import (
    PLACEMENT_MODES, Placement, excess_routes, loads_after, moved_routes, place_torch, plan, plan_status, rank_loads,
    remap_torch,
)
from tritonep.data import (
    flame_layers, load_flame_trace, load_olmoe_histogram, sample_routing, scale_histogram_to_experts,
    split_across_ranks,
)
from tritonep.errors import PlanError

from tests.balance.planner_cases import CASES, check_remap, make_topk

NO_ROUTES = torch.empty(0, 1, dtype=torch.int64)  # placement-only kernel runs (status bit 2 is then expected)


def capacity_of(counts):
    world = counts.shape[0]
    n = int(counts.to(torch.int64).sum())
    return torch.tensor([n // world + (1 if d < n % world else 0) for d in range(world)])


def check_minimal(counts, p: Placement):
    """Every invariant of a minimal-mode placement; returns ``(moved, excess)``."""
    world, num_experts = counts.shape
    L = num_experts // world
    total = counts.to(torch.int64).sum(0)
    cap = capacity_of(counts)
    assert torch.equal(p.capacity.to(torch.int64), cap)
    alloc = p.allocation.to(torch.int64)
    assert bool((alloc >= 0).all())
    assert torch.equal(alloc.sum(1), total), "routes conserved per expert"
    assert torch.equal(p.segment_ends.to(torch.int64), alloc.cumsum(1))
    owner = torch.arange(num_experts) // L
    kept = alloc[torch.arange(num_experts), owner]
    sent = torch.zeros(world, dtype=torch.int64).index_add_(0, owner, total - kept)
    after = loads_after(p)
    recv = after - torch.zeros(world, dtype=torch.int64).index_add_(0, owner, kept)
    load = rank_loads(counts, world)
    assert not bool(((sent > 0) & (recv > 0)).any()), "no rank both sends and receives"
    assert bool((load[sent > 0] > cap[sent > 0]).all()), "only ranks over capacity send"
    assert bool((load[recv > 0] < cap[recv > 0]).all()), "only ranks under capacity receive"
    assert bool((after >= torch.minimum(load, cap)).all() and (after <= torch.maximum(load, cap)).all())
    q = p.quota.to(torch.int64)
    assert bool((q.diagonal() == 0).all())
    for s in range(world):
        for d in range(world):
            if s != d:
                assert int(q[s, d]) == int(alloc[s * L:(s + 1) * L, d].sum()), "quota = routes s hands to d"
    moved, excess = moved_routes(p), excess_routes(counts, world)
    assert moved == int(q.sum()) == int(sent.sum()) <= excess
    used = (p.experts_to_copy >= 0).sum(1).to(torch.int64)
    if moved == excess:
        assert torch.equal(after, cap), "exact balance once the whole excess moved"
    else:
        assert bool((used[after < cap] == L).all()), "stops early only when every under-capacity rank is out of slots"
    for d in range(world):
        remote = [e for e in range(num_experts) if e // L != d and alloc[e, d] > 0]
        want = sorted(remote, key=lambda e: (-int(alloc[e, d]), -e))  # allocation desc, ties to the highest id
        row = p.experts_to_copy[d].tolist()
        assert len(want) <= L and row == want + [-1] * (L - len(want)), "slot set == migrated set, ordered"
        for e in range(num_experts):
            s = int(p.expert_slot[e, d])
            assert (s >= 0) == (e in remote) and (s < 0 or row[s] == e)
    return moved, excess


def run_minimal(topks, counts, ranks=None, **plan_kw):
    """place_torch + remap_torch invariants, then the Triton planner on ``ranks`` (default all) == the twins."""
    p = place_torch(counts, "minimal")
    check_minimal(counts, p)
    rids = [remap_torch(topks[r], p, r, counts) for r in range(counts.shape[0])]
    check_remap(topks, counts, p, [x.to(torch.int64) for x in rids])
    for r in (range(counts.shape[0]) if ranks is None else ranks):
        pt, rid = plan(counts, topks[r], r, mode="minimal", **plan_kw)
        assert plan_status(pt) == 0
        assert pt.equal(p), f"Triton minimal placement differs on rank {r}"
        assert torch.equal(rid, rids[r]), f"Triton minimal remap differs on rank {r}"
    return p


def triton_equal(counts, mode="minimal"):
    pt, _ = plan(counts, NO_ROUTES, 0, mode=mode)
    p = place_torch(counts, mode)
    assert pt.equal(p), (mode, counts)
    return p


def trace_topks(layer, world):
    idx, w = load_flame_trace(layer)
    topks = [part[0] for part in split_across_ranks(idx, w, world)]
    counts = torch.stack([torch.bincount(t.reshape(-1), minlength=64) for t in topks]).to(torch.int32)
    return topks, counts


# ----------------------------------------------------------------------------------- the flame layer 3 regression
def test_minimal_mode_flame_layer3_eight_ranks():
    """Ranks 2 and 5 start over capacity (1550, 1658 > 1536): the reference makes them host expert 63 of rank 7 and
    moves 342 routes; the minimal mode moves exactly the total excess, 334, and ranks 2 and 5 only send."""
    topks, counts = trace_topks(3, 8)
    assert rank_loads(counts, 8).tolist() == [1416, 1520, 1550, 1453, 1491, 1658, 1466, 1734]
    assert excess_routes(counts, 8) == 334
    ref = place_torch(counts)
    assert moved_routes(ref) == 342
    assert 63 in ref.experts_to_copy[2].tolist() and 63 in ref.experts_to_copy[5].tolist()
    p = run_minimal(topks, counts, ranks=(2, 5))
    assert check_minimal(counts, p) == (334, 334)
    assert loads_after(p).tolist() == [1536] * 8
    assert p.experts_to_copy[2].tolist() == [-1] * 8 and p.experts_to_copy[5].tolist() == [-1] * 8
    assert p.quota[:, [2, 5, 7]].sum() == 0 and p.quota[[0, 1, 3, 4, 6]].sum() == 0  # 2, 5, 7 send; rest receive
    assert p.quota.tolist() == [[0] * 8, [0] * 8, [0, 14, 0, 0, 0, 0, 0, 0], [0] * 8, [0] * 8,
                                [0, 0, 0, 83, 39, 0, 0, 0], [0] * 8, [120, 2, 0, 0, 6, 0, 70, 0]]


def test_real_traces_minimal_equals_twin():
    """Every FLAME layer at 8 ranks moves exactly its excess; larger worlds (fewer slots) and OLMoE: Triton ==
    torch, invariants hold, and the residual case stays as documented."""
    for layer in flame_layers():
        _, counts = trace_topks(layer, 8)
        p = triton_equal(counts)
        moved, excess = check_minimal(counts, p)
        assert moved == excess <= moved_routes(place_torch(counts))
    for world in (16, 32):
        _, counts = trace_topks(3, world)
        check_minimal(counts, triton_equal(counts))
    for layer, world in ((0, 8), (15, 8), (15, 16)):
        hist = scale_histogram_to_experts(load_olmoe_histogram("arxiv", layer), 64)
        idx, w = sample_routing(hist, 256 * world, 8, generator=0)
        parts = split_across_ranks(idx, w, world)
        counts = torch.stack([torch.bincount(t.reshape(-1), minlength=64) for t, _ in parts]).to(torch.int32)
        moved, excess = check_minimal(counts, triton_equal(counts))
        assert moved == excess or world == 16  # at L=4 this layer may run out of slots (documented)


# --------------------------------------------------------------------------------------------- histogram cases
@pytest.mark.parametrize("name", sorted(CASES))
def test_cases_minimal_triton_equal(name):
    c = CASES[name]
    topks, counts = make_topk(c["world"], c["E"], c["K"], c["tokens"], c.get("probs"), c.get("mask_p", 0.0),
                              seed=zlib.crc32(name.encode()) % 1000)
    run_minimal(topks, counts, ranks=sorted({0, c["world"] - 1}))


def test_multi_program_noncontiguous_minimal():
    topks, counts = make_topk(4, 16, 3, [40, 33, 0, 21], probs=[25.0 if e == 9 else 1.0 for e in range(16)],
                              mask_p=0.1, seed=3, dtype=torch.int32)
    p = place_torch(counts, "minimal")
    counts_nc = counts.to(torch.int64).t().contiguous().t()
    for r in (1, 2):
        pt, rid = plan(counts_nc, topks[r], r, num_programs=3, block=16, validate=True, mode="minimal")
        assert pt.equal(p) and torch.equal(rid, remap_torch(topks[r], p, r, counts))


def test_random_histograms_invariants_and_triton():
    """Heavy-tailed random histograms (exact or slot-limited) through the twin; a spread of them through Triton,
    including tie-heavy ones (few distinct values) and traffic on few ranks (many pieces per receiver)."""
    g = torch.Generator().manual_seed(7)
    short = 0
    for i in range(200):
        world = [2, 4, 5, 8][i % 4]
        L = [1, 2, 3, 4, 8][(i // 4) % 5]
        logits = torch.randn(world, world * L, generator=g) * 2.5
        counts = torch.poisson(torch.exp(logits), generator=g).to(torch.int32)
        moved, excess = check_minimal(counts, place_torch(counts, "minimal"))
        short += moved < excess
        if i % 10 == 0:
            triton_equal(counts)
    assert 0 < short < 100  # both regimes are exercised
    for i in range(16):
        world, L = [2, 3, 4, 8][i % 4], [1, 3, 8, 16][(i // 4) % 4]
        counts = torch.randint(0, 3, (world, world * L), generator=g, dtype=torch.int32) * 4
        counts[:, : world * L // 2] *= torch.randint(1, 4, (1,), generator=g, dtype=torch.int32)
        if i % 3 == 0:
            counts[:, L * (world // 2):] = 0
        check_minimal(counts, triton_equal(counts))


def test_exhaustive_small_histograms():
    """Every per-expert histogram with entries 0..3 for (W, L) in (3, 1), (4, 1), (2, 2): the invariants hold, and
    with at most one rank over capacity the whole excess always moves (the argument in placement.py)."""
    for world, L in ((3, 1), (4, 1), (2, 2)):
        for hist in itertools.product(range(4), repeat=world * L):
            counts = torch.tensor([list(hist)] + [[0] * (world * L)] * (world - 1), dtype=torch.int32)
            moved, excess = check_minimal(counts, place_torch(counts, "minimal"))
            over = int((rank_loads(counts, world) > capacity_of(counts)).sum())
            if over <= 1:
                assert moved == excess, hist


# -------------------------------------------------------------------------------------------- slots run out
def test_slots_run_out_stays_partial_and_never_sends_and_receives():
    # L=1: ranks 0 and 1 are over (+1, +2), rank 2 is under (-3) and can hold one remote expert only
    counts = torch.tensor([[5, 5, 0], [0, 0, 0], [0, 0, 0]], dtype=torch.int32)
    p = triton_equal(counts)
    assert check_minimal(counts, p) == (2, 3)
    assert loads_after(p).tolist() == [5, 3, 2] and p.capacity.tolist() == [4, 3, 3]
    assert p.experts_to_copy.tolist() == [[-1], [-1], [1]]
    assert loads_after(place_torch(counts)).tolist() == [4, 3, 3]  # the reference balances (and over-migrates)
    # L=2: three senders (+3 each) face one receiver (-9) with two slots: two pieces, then it is full
    counts = torch.tensor([[6, 6, 6, 6, 6, 6, 0, 0]] + [[0] * 8] * 3, dtype=torch.int32)
    p = triton_equal(counts)
    assert check_minimal(counts, p) == (6, 9)
    assert loads_after(p).tolist() == [9, 9, 12, 6] and p.experts_to_copy[3].tolist() == [2, 0]
    topks = [torch.tensor([[0], [1], [2], [3], [4], [5]]).repeat(6, 1)] + [torch.empty(0, 1, dtype=torch.int64)] * 3
    run_minimal(topks, counts, ranks=(0,))


# ----------------------------------------------------------------------------------------------- API surface
def test_mode_argument():
    assert PLACEMENT_MODES == ("reference", "minimal")
    counts = torch.tensor([[9, 1, 1, 1], [9, 1, 1, 1]], dtype=torch.int32)
    assert place_torch(counts).equal(place_torch(counts, "reference"))
    pt, _ = plan(counts, NO_ROUTES, 0)
    assert pt.equal(place_torch(counts, mode="reference"))
    assert triton_equal(counts, "reference").equal(pt)
    with pytest.raises(PlanError, match="mode='fast'"):
        place_torch(counts, "fast")
    with pytest.raises(PlanError, match="mode='Minimal'"):
        plan(counts, NO_ROUTES, 0, mode="Minimal")
    assert moved_routes(place_torch(counts, "minimal")) == excess_routes(counts, 2) == 8
    assert excess_routes(counts.sum(0), 2) == 8


@pytest.mark.compile
def test_minimal_planner_compiles_for_sm90():
    """The interpreter accepts code the compiler refuses: compile both modes' launches for sm_90 offline."""
    from tests.support.compile_check import compile_recorded, record_launches

    recs = []
    with record_launches(recs):
        for world, num_experts in ((8, 64), (2, 8)):
            counts = torch.randint(0, 9, (world, num_experts), dtype=torch.int32)
            plan(counts, NO_ROUTES, 0, mode="minimal")
    assert {r.get("name") for r in recs} == {"plan_kernel"}  # one launch per planner step
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_cli_plan_shows_both_modes(tmp_path):
    """``tritonep plan --routing flame --layer 3`` (default ``--mode both``): one summary line per mode."""
    import json
    import os
    import subprocess
    import sys

    out_json = tmp_path / "plan.json"
    p = subprocess.run([sys.executable, "-m", "tritonep.cli.main", "plan", "--routing", "flame", "--layer", "3",
                        "--json", str(out_json)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, COLUMNS="200"))
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 0, out
    assert "reference mode: balancedness 1.000, moved routes 342 (total excess 334), max load 1536" in out
    assert "minimal mode: balancedness 1.000, moved routes 334 (total excess 334), max load 1536" in out
    res = json.loads(out_json.read_text())
    assert res["mode"] == "reference" and res["moved_routes"] == 342
    assert {m: r["moved_routes"] for m, r in res["modes"].items()} == {"reference": 342, "minimal": 334}
