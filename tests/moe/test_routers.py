"""Routers, load-balancing losses, the aux-loss-free bias update, shared experts and expert activations
(tritonep.moe.router / router_deepseek / losses / shared / activations), against transformers' own modules where they
exist, and inside the layer in CPU worlds.

Tolerances: routers and aux losses run in float32 on both sides with the same ops: values and gradients within 1e-6
relative (the chosen experts identical). Layer outputs against the dense fp32 oracle: ``3e-2 * max|ref|`` as in
tests/moe/test_layer.py (bf16 activations and weights).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

if torch.cuda.is_available():  # the device machine may lack transformers; CI (CPU) installs it (scripts/setup.sh)
    pytest.importorskip("transformers")
from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter, load_balancing_loss_func
from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP, Qwen2MoeTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from tritonep.errors import ConfigError
from tritonep.moe import (ACTIVATIONS, DeepSeekV3Router, MoEGeometry, MoELayer, MoERecipe, RouterConfig,
                          SharedExperts, TopKRouter, attach_aux_loss, deepseek_v3_topk_torch, expert_ffn,
                          get_activation, register_activation, switch_aux_loss, update_router_biases)
from tritonep.testing import run_cpu_world

_SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=32)


def _close(a, b, tol=1e-6):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max()) <= tol * max(float(b.abs().max()), 1e-12)


def _route_and_grad(router, x, idx_of, w_of, gw):
    """(sorted idx, weights in id order, d(sum w * gw)/d weight, d/dx) of any router call."""
    xx = x.clone().requires_grad_()
    idx, w = idx_of(router, xx), w_of(router, xx)
    order = idx.argsort(-1)
    idx, w = idx.gather(1, order), w.gather(1, order)
    (w.float() * gw).sum().backward()
    return idx, w, router.weight.grad, xx.grad


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_routers_equal_transformers_routers(name):
    E, K = 16, 4
    cfgs = {"mixtral": (MixtralTopKRouter, MixtralConfig(num_local_experts=E, num_experts_per_tok=K, **_SMALL)),
            "qwen2_moe": (Qwen2MoeTopKRouter, Qwen2MoeConfig(num_experts=E, num_experts_per_tok=K,
                                                             norm_topk_prob=False, **_SMALL)),
            "qwen3_moe": (Qwen3MoeTopKRouter, Qwen3MoeConfig(num_experts=E, num_experts_per_tok=K,
                                                             norm_topk_prob=True, **_SMALL)),
            "olmoe": (OlmoeTopKRouter, OlmoeConfig(num_experts=E, num_experts_per_tok=K, norm_topk_prob=False,
                                                   **_SMALL)),
            "deepseek_v3": (DeepseekV3TopkRouter, DeepseekV3Config(n_routed_experts=E, num_experts_per_tok=K,
                                                                   n_group=4, topk_group=2, norm_topk_prob=True,
                                                                   routed_scaling_factor=2.5, **_SMALL))}
    cls, cfg = cfgs[name]
    theirs = cls(cfg).float()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(E, 32, generator=g) * 3 / math.sqrt(32))
    if name == "deepseek_v3":
        with torch.no_grad():
            theirs.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.1)
        ours = DeepSeekV3Router(32, E, K, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
        ours.load_state_dict(theirs.state_dict())
    else:
        ours = TopKRouter(32, E, K, renormalize=bool(getattr(cfg, "norm_topk_prob", True)))
        ours.load_state_dict(theirs.state_dict())
    x = torch.randn(40, 32, generator=g)
    gw = torch.randn(40, K, generator=g)
    a = _route_and_grad(ours, x, lambda r, xx: r(xx)[0], lambda r, xx: r(xx)[1], gw)
    b = _route_and_grad(theirs, x, lambda r, xx: r(xx)[2], lambda r, xx: r(xx)[1], gw)
    assert torch.equal(a[0], b[0].long())
    for u, v in zip(a[1:], b[1:]):
        assert _close(u, v), name


def test_deepseek_group_limit_and_bias_select_only():
    E, K, G, TG = 16, 3, 4, 2
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, E, generator=g, requires_grad=True)
    bias = torch.randn(E, generator=g) * 0.2
    idx, w, scores = deepseek_v3_topk_torch(logits, bias, K, G, TG, norm_topk_prob=False, routed_scaling_factor=1.0)
    choice = scores.detach() + bias
    gs = choice.view(64, G, E // G).topk(2, -1).values.sum(-1)
    kept = gs.topk(TG, -1).indices
    assert all(set((idx[t] // (E // G)).tolist()) <= set(kept[t].tolist()) for t in range(64))
    assert torch.equal(w, torch.sigmoid(logits).gather(1, idx))  # the weights are the unbiased scores
    big = torch.zeros(E)
    big[5] = 10.0  # the bias alone makes expert 5 win everywhere (its group too), without touching its weight
    idx2, w2, _ = deepseek_v3_topk_torch(logits, big, K, G, TG, False, 1.0)
    assert (idx2 == 5).any(-1).all() and torch.equal(w2[idx2 == 5], torch.sigmoid(logits)[:, 5].detach())
    with pytest.raises(ConfigError):
        deepseek_v3_topk_torch(logits, bias, 9, G, TG)  # 9 > 2 groups x 4 experts


def test_switch_aux_loss_equals_transformers_load_balancing_loss():
    E, K = 8, 2
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(50, E, generator=g, requires_grad=True)
    ref = load_balancing_loss_func((logits,), E, K)
    ref.backward()
    g_ref = logits.grad.clone()
    logits.grad = None
    probs = torch.softmax(logits, -1)
    ours = switch_aux_loss(probs, probs.topk(K, -1).indices, E)
    ours.backward()
    assert _close(ours, ref) and _close(logits.grad, g_ref)
    assert float(switch_aux_loss(torch.full((6, E), 1 / E), torch.arange(12).view(6, 2) % E, E)) == pytest.approx(K)
    assert float(switch_aux_loss(torch.zeros(0, E), torch.zeros(0, K, dtype=torch.long), E)) == 0.0


def test_attach_aux_loss_adds_its_gradient():
    w = torch.randn(5, requires_grad=True)
    y = w * 2
    aux = (w ** 2).sum()
    attach_aux_loss(y, aux, 0.3).sum().backward()
    assert _close(w.grad, 2 + 0.3 * 2 * w.detach())


def test_bias_update_counts_routes_and_follows_the_sign_rule():
    r = DeepSeekV3Router(16, 8, 2, bias_update_rate=0.01, seed=2)
    x = torch.randn(30, 16)
    r.eval()
    r(x)
    assert float(r.tokens_per_expert.sum()) == 0  # evaluation counts nothing
    r.train()
    idx, _ = r(x)
    assert torch.equal(r.tokens_per_expert, torch.bincount(idx.reshape(-1), minlength=8).float())
    load = r.tokens_per_expert.clone()
    assert update_router_biases(torch.nn.Sequential(r)) == 1  # no process group: this rank's counts
    assert torch.equal(r.e_score_correction_bias, 0.01 * torch.sign(load.mean() - load))
    assert float(r.tokens_per_expert.abs().sum()) == 0 and "tokens_per_expert" not in r.state_dict()
    assert "e_score_correction_bias" in r.state_dict()


def _bias_world(group):
    rank = dist.get_rank(group)
    r = DeepSeekV3Router(16, 8, 2, bias_update_rate=0.01, seed=2).train()
    idx, _ = r(torch.randn(20 + 7 * rank, 16, generator=torch.Generator().manual_seed(rank)))
    local = r.tokens_per_expert.clone()
    update_router_biases(r, group)
    return local, r.e_score_correction_bias.clone()


def test_bias_update_sums_counts_over_the_group():
    res = run_cpu_world(2, _bias_world)
    total = res[0][0] + res[1][0]
    expect = 0.01 * torch.sign(total.mean() - total)
    assert torch.equal(res[0][1], expect) and torch.equal(res[1][1], expect)


def test_router_config_errors_name_the_field():
    for kw, field in ((dict(kind="topk"), "kind"), (dict(n_group=2), "n_group"),
                      (dict(kind="deepseek_v3", n_group=2, topk_group=3), "topk_group"),
                      (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
                      (dict(aux_loss_coef=-1.0), "aux_loss_coef"), (dict(bias_update_rate=0.1), "bias_update_rate"),
                      (dict(norm_topk_prob=1), "norm_topk_prob")):
        with pytest.raises(ConfigError, match=field):
            RouterConfig(**kw)
    with pytest.raises(ConfigError, match="n_group"):
        RouterConfig(kind="deepseek_v3", n_group=3).check(num_experts=8, topk=2)
    with pytest.raises(ConfigError, match="activation"):
        MoEGeometry(64, 32, 8, 2, 16, activation="tanh")
    with pytest.raises(ConfigError, match="shared_gate"):
        MoEGeometry(64, 32, 8, 2, 16, shared_gate=True)
    with pytest.raises(ConfigError, match="router"):
        MoERecipe(router="deepseek_v3")
    with pytest.raises(ConfigError, match="n_group"):
        MoERecipe(router=RouterConfig(kind="deepseek_v3", n_group=16)).check(MoEGeometry(64, 32, 8, 2, 16))


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_expert_activations_forward_backward_match_autograd(act):
    a = get_activation(act)
    L, H, inter = 2, 16, 8
    g = torch.Generator().manual_seed(5)
    offs = torch.tensor([5, 9], dtype=torch.int32)
    x = torch.randn(9, H, generator=g)
    w1 = (torch.randn(L, H, a.width(inter), generator=g) / 4).requires_grad_()
    w2 = (torch.randn(L, inter, H, generator=g) / 3).requires_grad_()
    xl = x.clone().requires_grad_()
    y = expert_ffn(xl, offs, w1, w2, act=act)
    gy = torch.randn(9, H, generator=g)
    (y * gy).sum().backward()
    seg = torch.tensor([0] * 5 + [1] * 4)
    xr, w1r, w2r = x.clone().requires_grad_(), w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    h = torch.bmm(xr[:, None], w1r[seg])[:, 0]
    yr = torch.bmm(a._apply(h)[:, None], w2r[seg])[:, 0]
    (yr * gy).sum().backward()
    for u, v in ((y, yr), (xl.grad, xr.grad), (w1.grad, w1r.grad), (w2.grad, w2r.grad)):
        assert _close(u, v, 1e-5), act
    with pytest.raises(ConfigError, match="swiglu"):
        register_activation("swiglu", F.silu, gated=True)


def test_shared_experts_equal_transformers_mlps():
    cfg = Qwen2MoeConfig(shared_expert_intermediate_size=24, **_SMALL)
    for hf, gated in ((DeepseekV3MLP(DeepseekV3Config(**_SMALL), intermediate_size=24), False),
                      (Qwen2MoeMLP(cfg, intermediate_size=24), True)):
        ours = SharedExperts(32, 24, gated_output=gated, dtype=torch.float32)
        hf = hf.float()
        hf_gate = torch.nn.Linear(32, 1, bias=False)
        with torch.no_grad():
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(hf, n).weight.copy_(getattr(ours, n).weight)
            if gated:
                hf_gate.weight.copy_(ours.gate.weight)
        x = torch.randn(10, 32)
        ref = hf(x) * (torch.sigmoid(hf_gate(x)) if gated else 1.0)
        gy = torch.randn(10, 32)
        (ours(x) * gy).sum().backward()
        (ref * gy).sum().backward()
        assert _close(ours(x), ref)
        for n in ("gate_proj", "up_proj", "down_proj"):
            assert _close(getattr(ours, n).weight.grad, getattr(hf, n).weight.grad)


# ------------------------------------------------------------------------------------------------ in the layer
def _dense(x, idx, w, w1, w2, act):
    """fp32 dense MoE with any registered activation (the oracle of the non-SwiGLU layer)."""
    y = torch.zeros(x.shape[0], x.shape[1])
    for k in range(idx.shape[1]):
        e = idx[:, k]
        h = torch.bmm(x.float()[:, None], w1[e].float())[:, 0]
        y = y + w[:, k:k + 1] * torch.bmm(get_activation(act)._apply(h)[:, None], w2[e].float())[:, 0]
    return y


def _plain_act_virtual_world(group):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    geo = MoEGeometry(64, 32, 8, 2, 16, activation="relu2", shared_intermediate=24, shared_gate=True)
    layer = MoELayer(MoERecipe(balance="virtual"), geo, group, seed=4, dtype=torch.float32)
    g = torch.Generator().manual_seed(20 + rank)
    T = 16
    x = torch.randn(T, 64, generator=g).bfloat16().requires_grad_()
    idx = torch.stack([torch.tensor([0, 1 + (t % 7)]) for t in range(T)])  # expert 0 hot: replicas are needed
    w = torch.rand(T, 2, generator=g).requires_grad_()
    y = layer(x, idx, w)
    gy = torch.randn(T, 64, generator=g)
    (y.float() * gy).sum().backward()
    w1a, w2a = MoELayer.init_expert_weights(geo, seed=4, dtype=torch.float32)
    w1a.requires_grad_()
    w2a.requires_grad_()
    xr, wr = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    yr = _dense(xr, idx, wr, w1a, w2a, "relu2") + layer.shared(xr.bfloat16()).float()
    (yr * gy).sum().backward()
    L = 8 // W
    out = dict(y=(y, yr), gx=(x.grad, xr.grad), gw=(w.grad, wr.grad), slots=layer.last_stats["slots_used"],
               w1=(layer.w1.grad, w1a.grad), w2=(layer.w2.grad, w2a.grad), L=L)
    layer.close()
    return out


def test_plain_activation_virtual_experts_and_gated_shared_experts_in_a_world():
    res = run_cpu_world(2, _plain_act_virtual_world, timeout_s=300)
    assert sum(r["slots"] for r in res) > 0  # the hot expert was replicated
    for rank, r in enumerate(res):
        for k in ("y", "gx", "gw"):
            assert _close(*r[k], 3e-2), (rank, k)
        L = r["L"]
        for k in ("w1", "w2"):
            ref = sum(rr[k][1] for rr in res)[rank * L:(rank + 1) * L]
            assert _close(r[k][0], ref, 3e-2), (rank, k)


def _aux_and_bias_world(group):
    rank = dist.get_rank(group)
    rc = dict(kind="deepseek_v3", n_group=2, topk_group=1, bias_update_rate=0.05)
    geo = MoEGeometry(64, 32, 8, 2, 16, activation="geglu")
    with_aux = MoELayer(MoERecipe(router=RouterConfig(aux_loss_coef=0.5, **rc)), geo, group, seed=9, backend="nccl")
    plain = MoELayer(MoERecipe(router=RouterConfig(**rc)), geo, group, seed=9, backend="nccl")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank)).bfloat16()
    for layer in (with_aux, plain):
        layer(x).float().sum().backward()
    counts = with_aux.router.tokens_per_expert.clone()
    route = with_aux.router.route(x)  # what the forward computed
    aux = switch_aux_loss(route.probs, route.topk_idx, 8)
    (g_aux,) = torch.autograd.grad(aux, with_aux.router.weight)
    with_aux.router.tokens_per_expert.copy_(counts)  # (the extra route() above counted its routes again)
    update_router_biases(with_aux, group)
    out = dict(grad=(with_aux.router.weight.grad, plain.router.weight.grad + 0.5 * g_aux),
               logged=(with_aux.last_aux_loss, aux.detach()), counts=counts,
               bias=with_aux.router.e_score_correction_bias.clone(), plain_none=plain.last_aux_loss is None)
    for layer in (with_aux, plain):
        layer.close()
    return out


def test_aux_loss_gradient_and_bias_update_inside_the_layer():
    res = run_cpu_world(2, _aux_and_bias_world)
    total = res[0]["counts"] + res[1]["counts"]
    assert float(total.sum()) == 2 * 16 * 2  # every route counted once
    for r in res:
        assert _close(*r["grad"], 1e-5) and _close(*r["logged"], 1e-6) and r["plain_none"]
        assert torch.equal(r["bias"], 0.05 * torch.sign(total.mean() - total))


def _capacity_world(group):
    from tritonep.errors import CapacityError

    geo = MoEGeometry(64, 32, 8, 2, 16, max_recv_tokens=12)
    layer = MoELayer(MoERecipe(), geo, group, seed=1, backend="nccl")
    x = torch.randn(16, 64).bfloat16()
    idx = torch.tensor([[0, 1]] * 16)  # 2 ranks x 16 tokens x 2 routes all land on rank 0: 64 rows > 12
    try:
        layer(x, idx, torch.rand(16, 2))
        err = "no error"
    except CapacityError as e:
        err = str(e)
    ok = layer(x[:3], idx[:3], torch.rand(3, 2)).shape  # 12 rows fit; the layer stays usable
    layer.close()
    return err, tuple(ok)


def test_max_recv_tokens_bounds_memory_and_refuses_on_every_rank():
    small = MoELayer.required_bytes(MoERecipe(), MoEGeometry(64, 32, 8, 2, 16, max_recv_tokens=12), 2, "cpu")
    assert small < MoELayer.required_bytes(MoERecipe(), MoEGeometry(64, 32, 8, 2, 16), 2, "cpu")
    for err, shape in run_cpu_world(2, _capacity_world):
        assert "12" in err and shape == (3, 64), err


def _compile_world(group):
    rank = dist.get_rank(group)
    rc = RouterConfig(kind="deepseek_v3", n_group=2, topk_group=1, aux_loss_coef=0.1, bias_update_rate=0.01)
    layer = MoELayer(MoERecipe(router=rc), MoEGeometry(64, 32, 8, 2, 16, shared_intermediate=16, shared_gate=True),
                     group, seed=3, backend="nccl")
    x = torch.randn(12 - 5 * rank, 64, generator=torch.Generator().manual_seed(rank)).bfloat16()

    def run(fn):
        xx = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = fn(xx)
        y.float().square().sum().backward()
        return [y.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()]

    eager = run(layer)
    counts = layer.router.tokens_per_expert.clone()
    compiled = run(torch.compile(layer, backend="aot_eager"))
    both = layer.router.tokens_per_expert.clone()
    layer.close()
    return eager, compiled, counts, both


def test_torch_compile_with_deepseek_router_aux_loss_and_shared_experts():
    for eager, compiled, counts, both in run_cpu_world(2, _compile_world, timeout_s=300):
        for a, b in zip(eager, compiled):
            assert a.shape == b.shape and _close(a, b, 1e-3)
        assert torch.equal(both, 2 * counts)  # the compiled forward counted its routes too
