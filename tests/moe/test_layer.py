"""MoELayer (tritonep.moe): recipe / geometry checks, expert FFN, router, and multi-rank CPU worlds against the dense
fp32 reference (tritonep.reference.moe_dense_reference, autograd through it).

Tolerances (bf16 activations and weights, fp32 accumulation, fp32 reference built from the same bf16 values):
every output and gradient satisfies ``max|got - ref| <= 3e-2 * max|ref|`` (observed ~1e-2 at most; one bf16 ulp is
3.9e-3 relative and the layer rounds h, the SwiGLU, the expert output and y to bf16).
"""

from __future__ import annotations

import pytest
import torch

from tritonep.errors import ConfigError
from tritonep.moe import (MoEGeometry, MoELayer, MoERecipe, TopKRouter, check_config, expert_ffn,
                          topk_softmax_torch)
from tritonep.reference import moe_dense_reference
from tritonep.testing import run_cpu_world

TOL = 3e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    return err / max(scale, 1e-6)


# ------------------------------------------------------------------------------------------------ single process
def test_recipe_geometry_errors_name_the_field():
    bad_recipes = [
        (dict(dispatch_wire="int4"), "dispatch_wire"),
        (dict(combine_wire="fp16", combine="push"), "combine_wire"),
        (dict(combine="broadcast"), "combine"),
        (dict(balance="greedy"), "balance"),
        (dict(expert_alignment=0), "expert_alignment"),
        (dict(combine_wire="fp8", combine="pull"), "combine_wire"),
    ]
    for kw, field in bad_recipes:
        with pytest.raises(ConfigError, match=field):
            MoERecipe(**kw)
    MoERecipe(combine_wire="fp8", combine="push")  # quantized combine is fine with push
    good = dict(hidden=64, intermediate=32, num_experts=8, topk=2, max_tokens_per_rank=16)
    bad_geoms = [
        (dict(hidden=60), "hidden"),
        (dict(intermediate=20), "intermediate"),
        (dict(hidden=0), "hidden"),
        (dict(topk=9), "topk"),
        (dict(num_experts=-8), "num_experts"),
        (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
        (dict(topk=2.0), "topk"),
    ]
    for kw, field in bad_geoms:
        with pytest.raises(ConfigError, match=field):
            MoEGeometry(**{**good, **kw})
    geo = MoEGeometry(**good)
    with pytest.raises(ConfigError, match="num_experts=8 is not divisible by world_size=3"):
        geo.check(3)
    with pytest.raises(ConfigError, match="num_experts"):
        MoELayer.required_bytes(MoERecipe(), geo, 3)
    with pytest.raises(ConfigError, match="dispatch_wire='fp8'.*hidden=64"):  # fp8 needs hidden % 128 == 0
        check_config(MoERecipe(dispatch_wire="fp8"), geo, 2)
    check_config(MoERecipe(dispatch_wire="mxfp4"), geo, 2)
    assert hash(geo) == hash(MoEGeometry(**good)) and hash(MoERecipe()) == hash(MoERecipe())


def test_router_topk_ties_and_grads():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], requires_grad=True)
    idx, w = topk_softmax_torch(logits, 2)
    assert idx.tolist() == [[1, 2], [0, 1]] and idx.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.allclose(w.sum(-1), torch.ones(2))
    _, w_raw = topk_softmax_torch(logits, 2, renormalize=False)
    assert torch.allclose(w_raw[1], torch.full((2,), 0.25))
    r = TopKRouter(16, 8, 3, seed=5)
    x = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    idx, w = r(x)
    (w * torch.arange(3.0)).sum().backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    assert torch.equal(TopKRouter(16, 8, 3, seed=5).weight, r.weight)


def test_expert_ffn_writes_into_out_and_matches_autograd_reference():
    torch.manual_seed(0)
    L, H, inter = 3, 16, 8
    offs = torch.tensor([4, 4, 12], dtype=torch.int32)  # expert 1 empty; rows 10, 11 are alignment padding
    x = torch.randn(12, H).bfloat16()
    x[10:] = 0
    w1 = (torch.randn(L, H, 2 * inter) / 4).bfloat16().requires_grad_()
    w2 = (torch.randn(L, inter, H) / 3).bfloat16().requires_grad_()
    xl = x.clone().requires_grad_()
    region = torch.full((20, H), 7.0, dtype=torch.bfloat16)
    y = expert_ffn(xl, offs, w1, w2, out=region[:12])
    assert y.data_ptr() == region.data_ptr() and not region.requires_grad
    assert torch.equal(region[10:12], torch.zeros(2, H, dtype=torch.bfloat16))
    assert torch.equal(region[12:], torch.full((8, H), 7.0, dtype=torch.bfloat16))  # nothing past R written
    gy = torch.randn(12, H)
    (y.float() * gy).sum().backward()
    xr = x.float().requires_grad_()
    w1r, w2r = w1.detach().float().requires_grad_(), w2.detach().float().requires_grad_()
    seg = torch.tensor([0] * 4 + [2] * 8)
    h = torch.bmm(xr[:, None], w1r[seg])[:, 0]
    yr = torch.bmm((torch.nn.functional.silu(h[:, :inter]) * h[:, inter:])[:, None], w2r[seg])[:, 0]
    (yr * gy).sum().backward()
    for got, ref in ((y, yr), (xl.grad, xr.grad), (w1.grad, w1r.grad), (w2.grad, w2r.grad)):
        assert _rel(got, ref) < TOL
    assert torch.equal(w1.grad[1], torch.zeros_like(w1.grad[1]))  # an expert without rows gets no gradient
    assert torch.equal(xl.grad[10:], torch.zeros(2, H, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------ CPU worlds
def _routing_for(case, rank, world_size, T):
    if case.get("trace") is not None:
        from tritonep.data import load_flame_trace, split_across_ranks

        idx, w = load_flame_trace(case["trace"])
        parts = split_across_ranks(idx, w, world_size, num_tokens=case["tokens"])
        return parts[rank]
    g = torch.Generator().manual_seed(100 + rank)
    E, K = case["geometry"].num_experts, case["geometry"].topk
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    idx = idx.long().reshape(T, K)
    if T > 1:
        idx[1, -1] = -1  # one masked slot
    w = torch.rand(T, K, generator=g)
    return idx, w


def _world_layer_vs_reference(group, case):
    import torch.distributed as dist

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    geo: MoEGeometry = case["geometry"]
    layer = MoELayer(case["recipe"], geo, group, seed=3, record_stats=True)
    dev = layer.device
    T = case["tokens"][rank]
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(T, geo.hidden, generator=g).bfloat16().to(dev).requires_grad_()
    gy = torch.randn(T, geo.hidden, generator=g).to(dev)
    if case["router"]:
        y = layer(x)
    else:
        idx, w = _routing_for(case, rank, W, T)
        idx, w = idx.to(dev), w.float().to(dev).requires_grad_()
        y = layer(x, idx, w)
    (y.float() * gy).sum().backward()
    timings, stats = dict(layer.last_timings), dict(layer.last_stats)
    # dense fp32 reference on this rank's tokens, all E experts (same bf16-rounded values)
    # every expert drawn on the layer's device type (a CUDA draw differs from a CPU draw), as the layers draw theirs
    w1a, w2a = MoELayer.init_expert_weights(geo, seed=3, dtype=torch.bfloat16, device=dev)
    L = geo.num_experts // W
    assert torch.equal(w1a[rank * L:(rank + 1) * L], layer.w1.detach())
    assert torch.equal(w2a[rank * L:(rank + 1) * L], layer.w2.detach())
    w1a, w2a = w1a.float().requires_grad_(), w2a.float().requires_grad_()
    xr = x.detach().float().requires_grad_()
    if case["router"]:
        wg = layer.router.weight.detach().clone().requires_grad_()
        probs = torch.softmax(xr @ wg.t(), dim=-1)
        wr, idx = torch.topk(probs, geo.topk, dim=-1)
        wr = wr / wr.sum(-1, keepdim=True)
    else:
        wr = w.detach().clone().requires_grad_()
    yr = moe_dense_reference(xr, idx, wr, w1a, w2a)
    (yr * gy).sum().backward()
    leaves = (xr, w1a, w2a, wg if case["router"] else wr)
    for t in leaves:  # a rank with 0 tokens leaves the reference graph without a path to them
        if t.grad is None:
            t.grad = torch.zeros_like(t)
    out = dict(y=y.detach(), yr=yr.detach(), gx=x.grad, gxr=xr.grad, gw1=layer.w1.grad, gw2=layer.w2.grad,
               gw1r=w1a.grad, gw2r=w2a.grad, timings=timings, stats=stats, T=T,
               alloc=layer.buffer.allocated_bytes, routes=int((idx >= 0).sum()),
               need=MoELayer.required_bytes(case["recipe"], geo, W, device_type=dev.type))
    if case["router"]:
        out.update(grouter=layer.router.weight.grad, grouterr=wg.grad)
    else:
        out.update(gtw=w.grad, gtwr=wr.grad)
    layer.close()
    return out


def _check_world(res, case):
    geo = case["geometry"]
    W = len(res)
    L = geo.num_experts // W
    gw1r = sum(r["gw1r"] for r in res)  # every rank's tokens contribute to every expert's gradient
    gw2r = sum(r["gw2r"] for r in res)
    for rank, r in enumerate(res):
        assert r["alloc"] == r["need"] > 0
        assert r["y"].shape == (r["T"], geo.hidden) and r["y"].dtype == torch.bfloat16
        assert set(r["timings"]) == {"dispatch_s", "gemm_s", "combine_s"}
        assert len(r["stats"]["num_tokens_per_expert"]) == L
        pairs = [("y", "yr"), ("gx", "gxr"), ("grouter", "grouterr") if case["router"] else ("gtw", "gtwr")]
        for a, b in pairs:
            assert r[a].shape == r[b].shape, (rank, a)
            assert _rel(r[a], r[b]) < TOL, (rank, a, _rel(r[a], r[b]))
        sl = slice(rank * L, (rank + 1) * L)
        assert _rel(r["gw1"], gw1r[sl]) < TOL, (rank, "gw1", _rel(r["gw1"], gw1r[sl]))
        assert _rel(r["gw2"], gw2r[sl]) < TOL, (rank, "gw2", _rel(r["gw2"], gw2r[sl]))
    routed = [sum(r["stats"]["num_tokens_per_expert"]) for r in res]
    assert sum(routed) == sum(r["routes"] for r in res)  # every valid route reached exactly one expert row
    A = case["recipe"].expert_alignment
    for n, r in zip(routed, res):
        assert n <= r["stats"]["recv_rows"] <= n + L * (A - 1)


def _geo(E, K, T):
    return MoEGeometry(hidden=64, intermediate=32, num_experts=E, topk=K, max_tokens_per_rank=T)


def test_world2_router_pull_matches_dense_reference():
    case = dict(recipe=MoERecipe(), geometry=_geo(8, 2, 16), tokens=[16, 11], router=True)
    _check_world(run_cpu_world(2, _world_layer_vs_reference, case), case)


def test_world4_given_routing_push_aligned_with_empty_rank():
    case = dict(recipe=MoERecipe(combine="push", expert_alignment=4), geometry=_geo(16, 4, 12),
                tokens=[9, 0, 12, 5], router=False)
    res = run_cpu_world(4, _world_layer_vs_reference, case)
    _check_world(res, case)
    assert res[1]["y"].shape == (0, 64) and res[1]["gtw"].shape == (0, 4)


def test_world2_flame_trace_matches_dense_reference():
    case = dict(recipe=MoERecipe(), geometry=_geo(64, 6, 16), tokens=[16, 16], router=False, trace=2)
    _check_world(run_cpu_world(2, _world_layer_vs_reference, case), case)


class _TinyModel(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x * 2) + x


def _world_compile(group, T, E=8):
    import torch.distributed as dist

    rank = dist.get_rank(group)
    geo = _geo(E, 2, 16)
    model = _TinyModel(MoELayer(MoERecipe(), geo, group, seed=1))
    dev = model.layer.device
    x = torch.randn(T[rank], 64, generator=torch.Generator().manual_seed(rank)).bfloat16().to(dev)
    gy = torch.randn(T[rank], 64, generator=torch.Generator().manual_seed(50 + rank)).to(dev)

    def run(fn):
        xx = x.clone().requires_grad_()
        model.zero_grad()
        y = fn(xx)
        (y.float() * gy).sum().backward()
        return [y.detach(), xx.grad] + [p.grad.clone() for p in model.parameters()]

    eager = run(model)
    assert not model.layer._stash  # eager calls go through the same op: state consumed by the backward
    compiled = run(torch.compile(model, backend="aot_eager"))
    assert next(model.layer._tickets) == 2 and not model.layer._stash  # two saved op calls (eager, compiled), both consumed
    model.layer.close()
    return eager, compiled


def test_world2_torch_compile_matches_eager():
    res = run_cpu_world(2, _world_compile, [12, 7], timeout_s=240)
    for eager, compiled in res:
        for a, b in zip(eager, compiled):
            assert a.shape == b.shape
            assert _rel(a, b) < 1e-3


# ------------------------------------------------------------------------------------------------ GPU (device machine)
@pytest.mark.gpu
def test_gpu_expert_ffn_grouped_matches_loop():
    import tritonep.moe.experts as ex

    torch.manual_seed(0)
    L, H, inter = 4, 256, 128
    offs = torch.tensor([64, 64, 200, 256], dtype=torch.int32, device="cuda")
    x = torch.randn(256, H, device="cuda").bfloat16()
    for dt in (torch.bfloat16, torch.float32):
        w1 = (torch.randn(L, H, 2 * inter, device="cuda") / 16).to(dt)
        w2 = (torch.randn(L, inter, H, device="cuda") / 11).to(dt)
        gy = torch.randn(256, H, device="cuda").bfloat16()
        o1, h1 = ex.expert_ffn_forward(x, offs, w1, w2)
        b1 = ex.expert_ffn_backward(gy, x, offs, w1, w2, h1)
        grouped = ("cuda", dt) not in ex._GROUPED_REFUSED
        ex._GROUPED_REFUSED.add(("cuda", dt))
        try:
            o2, h2 = ex.expert_ffn_forward(x, offs, w1, w2)
            b2 = ex.expert_ffn_backward(gy, x, offs, w1, w2, h2)
        finally:
            if grouped:
                ex._GROUPED_REFUSED.discard(("cuda", dt))
        if dt == torch.bfloat16:
            assert grouped, "torch._grouped_mm refused bf16 on this GPU"
        for a, b in zip((o1, h1) + b1, (o2, h2) + b2):
            assert _rel(a, b) < 1e-2


@pytest.mark.gpu
def test_gpu_world_layer_and_compile(gpu_world, gpu_world_size):
    from tritonep.bench.cases import experts_for, tokens_for

    W = gpu_world_size
    case = dict(recipe=MoERecipe(expert_alignment=8), geometry=MoEGeometry(256, 128, 8 * W, 4, 128),
                tokens=tokens_for([128, 77], W), router=True)
    _check_world(gpu_world(W, _world_layer_vs_reference, case), case)
    case = dict(recipe=MoERecipe(combine="push"), geometry=_geo(experts_for(64, W), 6, 16),
                tokens=tokens_for([16, 0], W), router=False, trace=2)
    _check_world(gpu_world(W, _world_layer_vs_reference, case), case)
    for eager, compiled in gpu_world(W, _world_compile, tokens_for([12, 7], W), experts_for(8, W)):
        for a, b in zip(eager, compiled):
            assert _rel(a, b) < 1e-3
