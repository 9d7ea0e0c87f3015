"""Routing cases and invariant checks shared by the planner tests (test_planner, test_planner_minimal,
test_planner_one_launch)."""

import torch

from tritonep.balance import Placement


def make_topk(world, num_experts, topk, tokens, probs=None, mask_p=0.0, seed=0, dtype=torch.int64):
    """Per-rank topk_idx (distinct experts per token, -1 masked with prob mask_p) and the gathered counts."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.ones(num_experts) if probs is None else torch.as_tensor(probs, dtype=torch.float64)
    out = []
    for r in range(world):
        t = tokens[r]
        if t == 0:
            out.append(torch.empty(0, topk, dtype=dtype))
            continue
        idx = torch.multinomial(probs.float().expand(t, -1), topk, replacement=False, generator=g)
        idx = torch.where(torch.rand(t, topk, generator=g) < mask_p, torch.full_like(idx, -1), idx)
        out.append(idx.to(dtype))
    counts = torch.stack([torch.bincount(x[x >= 0].reshape(-1), minlength=num_experts) for x in out]).to(torch.int32)
    return out, counts


def decode(rid, p: Placement):
    """Runtime ids -> the global expert whose weights run them (native or via experts_to_copy)."""
    L = p.num_local_experts
    d, j = rid // (2 * L), rid % (2 * L)
    etc = p.experts_to_copy.to(torch.int64)
    virt = etc[d.clamp(min=0), (j - L).clamp(min=0)]
    return torch.where(rid < 0, -1, torch.where(j < L, d * L + j, virt))


def check_remap(topks, counts, p: Placement, rids):
    """Remap invariants over all ranks' runtime ids (rids[r] = remap of rank r's topk)."""
    world, num_experts = counts.shape
    L = num_experts // world
    alloc = p.allocation.to(torch.int64)
    observed = torch.zeros(num_experts, world, dtype=torch.int64)
    seq = [[] for _ in range(num_experts)]  # destinations in global stable order, per expert
    for r in range(world):
        e = topks[r].reshape(-1).to(torch.int64)
        rid = rids[r].reshape(-1).to(torch.int64)
        assert rid.dtype == torch.int64 and torch.equal(rid < 0, e < 0), "-1 stays -1, valid stays valid"
        assert torch.equal(decode(rid, p), e), "never a slot whose experts_to_copy entry is another expert"
        for ee, rr in zip(e.tolist(), rid.tolist()):
            if ee >= 0:
                observed[ee, rr // (2 * L)] += 1
                seq[ee].append(rr // (2 * L))
    assert torch.equal(observed, alloc), "each runtime expert receives exactly allocation-many routes"
    for e in range(num_experts):
        want = [d for d in range(world) for _ in range(int(alloc[e, d]))]
        assert seq[e] == want, "contiguous runs per destination in rank order over the global stable order"
        if alloc[e, e // L] == alloc[e].sum():
            assert all(d == e // L for d in seq[e]), "not migrated -> stays native"


W4, E16 = 4, 16


def hot(e_hot, weight, n=E16):
    p = torch.ones(n)
    p[e_hot] = weight
    return p


CASES = {
    "uniform": dict(world=4, E=16, K=2, tokens=[24, 24, 24, 24]),
    "hot_expert": dict(world=4, E=16, K=2, tokens=[20, 20, 20, 20], probs=hot(5, 200.0)),
    "hot_rank": dict(world=4, E=16, K=3, tokens=[16, 16, 16, 16], probs=[50.0] * 4 + [1.0] * 12),
    "two_ranks_own_everything": dict(world=4, E=16, K=2, tokens=[16, 16, 16, 16], probs=[1.0] * 8 + [0.0] * 8),
    "empty_experts": dict(world=4, E=16, K=1, tokens=[10, 10, 10, 10], probs=[1.0, 0.0] * 8),
    "uneven_tokens": dict(world=4, E=16, K=2, tokens=[0, 5, 40, 13], probs=hot(12, 20.0)),
    "masked_routes": dict(world=4, E=16, K=4, tokens=[12, 30, 7, 20], mask_p=0.35, probs=hot(2, 30.0)),
    "all_masked": dict(world=4, E=16, K=2, tokens=[5, 0, 3, 2], mask_p=1.0),
    "world8_L1": dict(world=8, E=8, K=2, tokens=[6, 9, 0, 4, 12, 3, 7, 5], probs=[30.0] + [1.0] * 7),
    "world3_L4": dict(world=3, E=12, K=2, tokens=[11, 4, 9], probs=hot(0, 40.0, 12)),
    "world2_L3": dict(world=2, E=6, K=3, tokens=[13, 2], mask_p=0.2),
    "world1": dict(world=1, E=4, K=2, tokens=[9]),
}
