"""MoE layer with virtual experts (balance="virtual") equals balance="none" on real and skewed routing.

Same weights, same routing: outputs and every gradient (x, topk_weights, every native w1 / w2) of the balanced layer
match the plain layer within bf16 tolerance (max |a-b| <= 3e-2 * max |b|; the GEMMs of moved routes run on another
rank, so summation order differs). The balanced layer's per-rank work is exactly equal (the plan's capacity), and
the gradient of every native expert includes the replicas' contributions pulled back from the peers.

The split run (native experts from the parameters, then only the used virtual slots, no weight concatenation) is
checked on its own (bit-equal to one run over concatenated weights) and in a hand-made 3-rank world where one rank
uses two slots and has no native rows, one uses two slots after native rows, and the sender uses none (zero slot
rows) while all its experts also run elsewhere; then a balanced step (no slot used anywhere) and the torch.compile
path (plan, push and split run inside the custom op) against eager.
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.errors import InputError
from tritonep.moe.experts import expert_ffn, expert_ffn_parts
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
        layer = MoELayer(MoERecipe(balance=bal, combine="push"), geo, group, seed=7, record_stats=True)
        assert layer.allocated_bytes == MoELayer.required_bytes(MoERecipe(balance=bal, combine="push"), geo, W)
        res, dev = [], layer.device
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(idx.shape[0], H, generator=g).bfloat16().to(dev).requires_grad_(True)
            tw = w.clone().to(dev).requires_grad_(True)
            gy = torch.randn(idx.shape[0], H, generator=g).to(dev)
            for p in layer.parameters():
                p.grad = None
            y = layer(x, topk_idx=idx.to(dev), topk_weights=tw)
            (y.float() * gy).sum().backward()
            res.append(dict(y=y.detach(), gx=x.grad, gw=tw.grad, gw1=layer.w1.grad.float(),
                            gw2=layer.w2.grad.float(), load=sum(layer.last_stats["num_tokens_per_expert"]),
                            used=layer.last_stats.get("slots_used")))
        layer.close()
        out[bal] = res
    return out


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _check_virtual_equals_none(res, W):
    for r in range(W):
        for step in range(2):
            a, b = res[r]["virtual"][step], res[r]["none"][step]
            for key in ("y", "gx", "gw", "gw1", "gw2"):
                assert _rel(a[key], b[key]) <= 3e-2, (r, step, key, _rel(a[key], b[key]))
    for step in range(2):
        loads = [res[r]["virtual"][step]["load"] for r in range(W)]
        total = sum(loads)
        assert max(loads) - min(loads) <= 1 and total == sum(res[r]["none"][step]["load"] for r in range(W))


@pytest.mark.parametrize("kind,K", [("flame", 6), ("olmoe", 8)])
def test_virtual_equals_none(kind, K):
    res = run_cpu_world(4, _world, kind, 16, K, 2, timeout_s=600)
    _check_virtual_equals_none(res, 4)
    assert any(res[r]["virtual"][0]["used"] for r in range(4))  # some routes ran in virtual slots


@pytest.mark.gpu
def test_gpu_virtual_equals_none_grouped_gemm():
    from tritonep.testing import run_gpu_world

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    res = run_gpu_world(2, _world, "olmoe", 64, 8, 2, timeout_s=600)
    _check_virtual_equals_none(res, 2)
    assert any(res[r]["virtual"][0]["used"] for r in range(2))


@pytest.mark.gpu
def test_gpu_split_run_matches_one_grouped_run():
    g = torch.Generator().manual_seed(4)
    w1 = (torch.randn(6, 256, 256, generator=g) / 16).bfloat16().cuda()
    w2 = (torch.randn(6, 128, 256, generator=g) / 11).bfloat16().cuda()
    offs = torch.tensor([40, 40, 104, 160, 232, 256], dtype=torch.int32, device="cuda")
    x = torch.randn(256, 256, generator=g).bfloat16().cuda()
    gy = torch.randn(256, 256, generator=g).bfloat16().cuda()
    ref_w1, ref_w2, xr = w1.clone().requires_grad_(), w2.clone().requires_grad_(), x.clone().requires_grad_()
    ref = expert_ffn(xr, offs, ref_w1, ref_w2)
    (ref.float() * gy.float()).sum().backward()
    ws1, ws2 = [w1[:4].clone().requires_grad_(), w1[4:].clone().requires_grad_()], \
        [w2[:4].clone().requires_grad_(), w2[4:].clone().requires_grad_()]
    xs = x.clone().requires_grad_()
    y = expert_ffn_parts(xs, [0, 160, 256], (offs[:4], offs[4:] - 160), ws1, ws2)
    (y.float() * gy.float()).sum().backward()
    import tritonep.moe.experts as ex

    assert ("cuda", torch.bfloat16) not in ex._GROUPED_REFUSED, "torch._grouped_mm refused bf16"
    assert _rel(y, ref) < 1e-2 and _rel(xs.grad, xr.grad) < 1e-2
    assert _rel(torch.cat([w.grad for w in ws1]), ref_w1.grad) < 1e-2
    assert _rel(torch.cat([w.grad for w in ws2]), ref_w2.grad) < 1e-2


# ------------------------------------------------------------------------------------------------ split run
def test_split_run_equals_one_run_over_concatenated_weights():
    from tritonep.balance.transport import used_slot_count

    g = torch.Generator().manual_seed(3)
    w1 = (torch.randn(6, H, 2 * I, generator=g) / 8).bfloat16()
    w2 = (torch.randn(6, I, H, generator=g) / 6).bfloat16()
    # 4 "native" experts (the second empty), then 2 "slots"; 3 rows past the last segment end
    offs = torch.tensor([5, 5, 12, 17, 25, 30], dtype=torch.int32)
    R = 33
    x = torch.randn(R, H, generator=g).bfloat16()
    x[30:] = 0
    gy = torch.randn(R, H, generator=g).bfloat16()
    cases = [  # (bounds, offsets per part, experts per part)
        ([0, 17, R], (offs[:4], offs[4:] - 17), ((0, 4), (4, 6))),
        ([0, 17, 25, R], (offs[:4], offs[4:5] - 17, offs[5:] - 25), ((0, 4), (4, 5), (5, 6))),
        ([0, 0, R], (offs[:0], offs), ((0, 0), (0, 6))),  # a part with no rows and no experts first
    ]
    ref_w1, ref_w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    ref = expert_ffn(xr, offs, ref_w1, ref_w2)
    (ref.float() * gy.float()).sum().backward()
    for bounds, po, ranges in cases:
        ws1 = [w1[a:b].clone().requires_grad_() for a, b in ranges]
        ws2 = [w2[a:b].clone().requires_grad_() for a, b in ranges]
        xs = x.clone().requires_grad_()
        out = torch.full((R, H), 7.0, dtype=torch.bfloat16)
        y = expert_ffn_parts(xs, bounds, po, ws1, ws2, out=out)
        assert y.data_ptr() == out.data_ptr() and torch.equal(y, ref) and not y[30:].any()
        (y.float() * gy.float()).sum().backward()
        assert torch.equal(xs.grad, xr.grad)
        assert torch.equal(torch.cat([w.grad for w in ws1]), ref_w1.grad)
        assert torch.equal(torch.cat([w.grad for w in ws2]), ref_w2.grad)
    with pytest.raises(InputError, match="bounds"):
        expert_ffn_parts(x, [0, 40, R], cases[0][1], [w1[:4], w1[4:]], [w2[:4], w2[4:]])
    with pytest.raises(InputError, match="per part"):
        expert_ffn_parts(x, [0, 17, R], cases[0][1], [w1[:4]], [w2[:4], w2[4:]])
    assert used_slot_count([-1, -1]) == 0 and used_slot_count([3, 5, -1]) == 2 and used_slot_count([-1, 4]) == 2


# per-expert route totals of the skewed step (E=12, W=3, L=4, capacity 26): rank 0's experts are hot, rank 1's idle.
# The plan (tritonep.balance.place_torch) runs experts 0 and 2 on rank 1 (slots 0, 1; no native rows there), experts
# 1 and 3 on rank 2 (slots 0, 1, after 6 native rows: the slot offsets must be shifted), and rank 0 uses no slot
# (zero slot rows) while all four of its experts also run elsewhere. The balanced step moves nothing.
_SKEW = [18, 18, 18, 18, 0, 0, 0, 0, 6, 0, 0, 0]
_EVEN = [5, 5, 0, 0, 10, 0, 0, 0, 2, 2, 2, 4]


def _hand_routing(totals, sizes, seed):
    """Tokens with 2 distinct experts each realising ``totals``, split over ranks by ``sizes`` (+ one masked token
    on rank 0)."""
    flat = torch.repeat_interleave(torch.arange(len(totals)), torch.tensor(totals))
    n = flat.numel() // 2
    idx = torch.stack([flat[:n], flat[n:]], 1)  # no expert has more than n routes: the two ids differ
    g = torch.Generator().manual_seed(seed)
    idx = idx[torch.randperm(n, generator=g)]
    w = torch.rand(n, 2, generator=g) + 0.1
    parts, lo = [], 0
    for r, t in enumerate(sizes):
        i, ww = idx[lo:lo + t], w[lo:lo + t]
        if r == 0:
            i, ww = torch.cat([i, torch.full((1, 2), -1)]), torch.cat([ww, torch.ones(1, 2)])
        parts.append((i, ww))
        lo += t
    return parts


def _split_world(group):
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    rank = dist.get_rank()
    steps = [_hand_routing(_SKEW, [20, 12, 7], 1)[rank], _hand_routing(_EVEN, [3, 7, 5], 2)[rank]]
    geo = MoEGeometry(hidden=H, intermediate=I, num_experts=12, topk=2, max_tokens_per_rank=21)
    out = {}
    for bal in ("none", "virtual"):
        recipe = MoERecipe(balance=bal, combine="push", expert_alignment=4)
        layer = MoELayer(recipe, geo, group, seed=11, record_stats=True)
        res = []
        for step, (idx, w) in enumerate(steps):
            g = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(idx.shape[0], H, generator=g).bfloat16().requires_grad_(True)
            tw = w.clone().requires_grad_(True)
            gy = torch.randn(idx.shape[0], H, generator=g)
            layer.zero_grad(set_to_none=True)
            y = layer(x, topk_idx=idx, topk_weights=tw)
            (y.float() * gy).sum().backward()
            st = layer.last_stats
            res.append(dict(y=y.detach(), gx=x.grad, gw=tw.grad, gw1=layer.w1.grad.float(), gw2=layer.w2.grad.float(),
                            used=st.get("slots_used"), native=sum(st["num_tokens_per_expert"][:4]),
                            load=sum(st["num_tokens_per_expert"])))
        if bal == "virtual":  # the custom-op path (plan, push and split run inside the op) equals eager
            idx, w = steps[0]
            x = torch.randn(idx.shape[0], H, generator=torch.Generator().manual_seed(rank)).bfloat16()

            def run(fn):
                xx = x.clone().requires_grad_()
                layer.zero_grad(set_to_none=True)
                (fn(xx, topk_idx=idx, topk_weights=w).float() * x.float()).sum().backward()
                return [xx.grad, layer.w1.grad.clone(), layer.w2.grad.clone()]

            eager = run(layer)
            compiled = run(torch.compile(layer, backend="aot_eager"))
            res.append(dict(compile=[_rel(a, b) for a, b in zip(compiled, eager)], tickets=next(layer._tickets)))
        layer.close()
        out[bal] = res
    return out


def test_virtual_split_hand_made_world():
    res = run_cpu_world(3, _split_world, timeout_s=300)
    for r in range(3):
        for step in range(2):
            a, b = res[r]["virtual"][step], res[r]["none"][step]
            for key in ("y", "gx", "gw", "gw1", "gw2"):
                assert _rel(a[key], b[key]) <= 3e-2, (r, step, key, _rel(a[key], b[key]))
        assert max(res[r]["virtual"][2]["compile"]) <= 1e-3 and res[r]["virtual"][2]["tickets"] == 1
    assert [res[r]["virtual"][0]["used"] for r in range(3)] == [0, 2, 2]
    assert [res[r]["virtual"][0]["native"] for r in range(3)] == [26, 0, 6]
    assert [res[r]["virtual"][0]["load"] for r in range(3)] == [26, 26, 26]
    assert [res[r]["virtual"][1]["used"] for r in range(3)] == [0, 0, 0]
    assert [res[r]["none"][0]["used"] for r in range(3)] == [None] * 3
