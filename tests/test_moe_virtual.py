"""MoE layer with virtual experts (balance="virtual") equals balance="none" on real and skewed routing.

Same weights, same routing: outputs and every gradient (x, topk_weights, every native w1 / w2) of the balanced layer
match the plain layer within bf16 tolerance (max |a-b| <= 3e-2 * max |b|; the GEMMs of moved routes run on another
rank, so summation order differs). The balanced layer's per-rank work is exactly equal (the plan's capacity), and
the gradient of every native expert includes the replicas' contributions pulled back from the peers.
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.testing import run_cpu_world

H, I, E = 64, 32, 16


def _routing(kind, W, T, K, layer=0):
    from tritonep.data import (load_flame_trace, load_olmoe_histogram, sample_routing, scale_histogram_to_experts,
                               split_across_ranks)

    if kind == "flame":
        idx, w = load_flame_trace(3, renormalize=True)
        idx = idx[: T * W] % E
        return split_across_ranks(idx, w[: T * W], W, uneven=True)
    hist = scale_histogram_to_experts(load_olmoe_histogram("github", layer), E)
    idx, w = sample_routing(hist, T * W, K, generator=5)
    return split_across_ranks(idx, w, W)


def _world(group, kind, T, K, steps):
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    rank, W = dist.get_rank(), dist.get_world_size()
    parts = _routing(kind, W, T, K)
    idx, w = parts[rank]
    tmax = max(p[0].shape[0] for p in parts)
    geo = MoEGeometry(hidden=H, intermediate=I, num_experts=E, topk=K, max_tokens_per_rank=tmax)
    out = {}
    for bal in ("none", "virtual"):
        layer = MoELayer(MoERecipe(balance=bal, combine="push"), geo, group, seed=7)
        assert layer.allocated_bytes == MoELayer.required_bytes(MoERecipe(balance=bal, combine="push"), geo, W)
        res = []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(idx.shape[0], H, generator=g).bfloat16().requires_grad_(True)
            tw = w.clone().requires_grad_(True)
            gy = torch.randn(idx.shape[0], H, generator=g)
            for p in layer.parameters():
                p.grad = None
            y = layer(x, topk_idx=idx, topk_weights=tw)
            (y.float() * gy).sum().backward()
            res.append(dict(y=y.detach(), gx=x.grad, gw=tw.grad, gw1=layer.w1.grad.float(),
                            gw2=layer.w2.grad.float(), load=sum(layer.last_stats["num_tokens_per_expert"])))
        layer.close()
        out[bal] = res
    return out


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("kind,K", [("flame", 6), ("olmoe", 8)])
def test_virtual_equals_none(kind, K):
    W, T = 4, 16
    res = run_cpu_world(W, _world, kind, T, K, 2, timeout_s=600)
    for r in range(W):
        for step in range(2):
            a, b = res[r]["virtual"][step], res[r]["none"][step]
            for key in ("y", "gx", "gw", "gw1", "gw2"):
                assert _rel(a[key], b[key]) <= 3e-2, (r, step, key, _rel(a[key], b[key]))
    for step in range(2):
        loads = [res[r]["virtual"][step]["load"] for r in range(W)]
        total = sum(loads)
        assert max(loads) - min(loads) <= 1 and total == sum(res[r]["none"][step]["load"] for r in range(W))
