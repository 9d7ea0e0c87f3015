"""Our MoELayer equals the MoE blocks of transformers' own models, forward and gradients, on one rank and with EP.

Tiny random-weight configs of Mixtral, Qwen2-MoE (shared expert + gate), Qwen3-MoE (``norm_topk_prob``), OLMoE
(no renormalisation) and DeepSeek-V3 (sigmoid + correction bias, 4 groups keep 2, scaling 2.5, shared expert) are
built with transformers' modeling code (the pinned version, scripts/setup.sh), their weights are copied into our layer
with :func:`tritonep.moe.hf_import.load_hf_moe_block`, and every rank compares our layer on its own tokens with the
transformers block on the same tokens: the chosen experts (exactly), the routing weights, the output, and the
gradients of the input, the router, the experts (ours summed over the EP group: dispatch brings every rank's tokens
to the expert; theirs summed over the ranks' blocks) and the shared experts.

Precision and tolerance. The transformers block runs in float32 with the same weights (float32 here) on the same
input values (bf16 tokens widened). Our routing runs in float32 too; our tokens, expert output rows, layer output and
the incoming gradient travel as bf16 (the layer's activation dtype: one rounding each, relative 2^-9 = 2e-3), GEMMs
accumulate in float32. The output passes two roundings (expert rows, output), the input gradient up to four (incoming
gradient, weighted rows, the expert backward's rows, their sum back to the token): at most ~8e-3 relative. So every
compared tensor must satisfy ``max|ours - theirs| <= TOL * max|theirs|`` with ``TOL = 2e-2`` (observed at most
7.6e-3, the input gradient of a rank with 5 tokens; the output at most 5.3e-3); the expert choice must be identical,
and the routing weights (float32 on both sides, the same ops) agree to 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

if torch.cuda.is_available():  # the device machine may lack transformers; CI (CPU) installs it (scripts/setup.sh)
    pytest.importorskip("transformers")
import transformers  # noqa: E402
from transformers import DeepseekV3Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from tritonep.moe import MoELayer
from tritonep.moe.hf_import import config_from_hf, load_hf_moe_block, load_hf_moe_state_dict, to_hf_experts
from tritonep.testing import run_cpu_world

transformers.logging.set_verbosity_error()  # tiny configs trip transformers' vocabulary / standalone-experts notes

TOL = 2e-2
TRANSFORMERS_PIN = "5.24.0"  # scripts/setup.sh installs exactly this
_SMALL = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=32)


def _configs():
    return {
        "mixtral": (MixtralSparseMoeBlock, MixtralConfig(intermediate_size=32, num_local_experts=8,
                                                         num_experts_per_tok=2, **_SMALL)),
        "qwen2_moe": (Qwen2MoeSparseMoeBlock, Qwen2MoeConfig(moe_intermediate_size=32, num_experts=8,
                                                             num_experts_per_tok=2, norm_topk_prob=False,
                                                             shared_expert_intermediate_size=48, **_SMALL)),
        "qwen3_moe": (Qwen3MoeSparseMoeBlock, Qwen3MoeConfig(moe_intermediate_size=32, num_experts=8,
                                                             num_experts_per_tok=2, norm_topk_prob=True, **_SMALL)),
        "olmoe": (OlmoeSparseMoeBlock, OlmoeConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                                   norm_topk_prob=False, **_SMALL)),
        "deepseek_v3": (DeepseekV3MoE, DeepseekV3Config(moe_intermediate_size=32, n_routed_experts=16,
                                                        num_experts_per_tok=4, n_group=4, topk_group=2,
                                                        n_shared_experts=1, routed_scaling_factor=2.5,
                                                        norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=16,
                                                        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8,
                                                        **_SMALL)),
    }


def _hf_block(name: str):
    """The transformers block of ``name`` with seeded random float32 weights (the same on every rank)."""
    cls, cfg = _configs()[name]
    block = cls(cfg).float()
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for pname, p in sorted(block.named_parameters()):
            fan_in = p.shape[-1]
            scale = 3.0 if pname.startswith("gate.") else 1.0  # spread router logits: no near-ties in the top-k
            p.copy_(torch.randn(p.shape, generator=g) * scale / math.sqrt(fan_in))
        for bname, b in block.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # selection-only bias: large enough to change choices
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return block, cfg


def _rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12)


def _grad(p):
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _compare_world(group, models, tokens, backend):
    rank = dist.get_rank(group)
    T = tokens[rank]
    out = {}
    for name in models:
        block, cfg = _hf_block(name)
        recipe, geo = config_from_hf(cfg, max_tokens_per_rank=max(tokens))
        layer = MoELayer(recipe, geo, group, dtype=torch.float32, backend=backend)
        dev = layer.device
        block = block.to(dev)
        used = load_hf_moe_block(layer, block)
        gen = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(T, geo.hidden, generator=gen).bfloat16().to(dev)
        gy = torch.randn(T, geo.hidden, generator=gen).to(dev)
        # ours
        xo = x.clone().requires_grad_()
        y = layer(xo)
        (y.float() * gy).sum().backward()
        with torch.no_grad():
            ours_route = layer.router.route(x)
        # theirs, on the same tokens (float32)
        xt = x.float().requires_grad_()
        with torch.no_grad():
            _, w_ref, idx_ref = block.gate(xt)
        y_ref = block(xt[None])[0]
        if y_ref.requires_grad:  # a rank without tokens: their block builds no graph (every gradient is zero)
            (y_ref * gy).sum().backward()
        gu_grad, down_grad = (t.cpu() for t in to_hf_experts(_grad(layer.w1), _grad(layer.w2)))
        r = dict(used=len(used), T=T,
                 same_experts=torch.equal(ours_route.topk_idx.sort(-1).values, idx_ref.long().sort(-1).values),
                 weights=float((ours_route.topk_weights.sort(-1).values -
                                w_ref.float().sort(-1).values).abs().max()) if T else 0.0,
                 y=_rel(y, y_ref), gx=_rel(_grad(xo), _grad(xt)),
                 grouter=_rel(_grad(layer.router.weight), _grad(block.gate.weight)),
                 # expert gradients: ours cover the whole EP group's tokens; theirs this rank's only (summed below)
                 gexp_ours=(gu_grad.detach().clone(), down_grad.detach().clone()),
                 gexp_ref_all=(_grad(block.experts.gate_up_proj).cpu(), _grad(block.experts.down_proj).cpu()))
        if layer.shared is not None:
            hf_shared = getattr(block, "shared_experts", None) or block.shared_expert
            r["gshared"] = max(_rel(_grad(getattr(layer.shared, n).weight), _grad(getattr(hf_shared, n).weight))
                               for n in ("gate_proj", "up_proj", "down_proj"))
            if layer.shared.gate is not None:
                r["gshared"] = max(r["gshared"], _rel(_grad(layer.shared.gate.weight),
                                                      _grad(block.shared_expert_gate.weight)))
        out[name] = r
        layer.close()
    return out


def _check(res, models):
    W = len(res)
    for name in models:
        ref_all = [sum(r[name]["gexp_ref_all"][i] for r in res) for i in (0, 1)]  # every rank's tokens
        for rank, rr in enumerate(res):
            r = rr[name]
            assert r["used"] >= 3, (name, r["used"])
            assert r["same_experts"], (name, rank, "expert choice differs")
            assert r["weights"] < 1e-5, (name, rank, r["weights"])
            errs = {k: r[k] for k in ("y", "gx", "grouter", "gshared") if k in r}
            L = r["gexp_ours"][0].shape[0]
            for i, k in ((0, "gw1"), (1, "gw2")):
                errs[k] = _rel(r["gexp_ours"][i], ref_all[i][rank * L:(rank + 1) * L])
            bad = {k: v for k, v in errs.items() if not v < TOL}
            assert not bad, (name, f"W={W}", f"rank {rank}", bad, errs)


ALL = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


def test_transformers_is_the_pinned_version():
    assert transformers.__version__ == TRANSFORMERS_PIN


def test_one_rank_equals_transformers_blocks():
    _check(run_cpu_world(1, _compare_world, ALL, [16], "triton"), ALL)


def test_ep2_equals_transformers_blocks():
    _check(run_cpu_world(2, _compare_world, ALL, [16, 9], "triton", timeout_s=300), ALL)


def test_ep4_equals_transformers_blocks():
    models = ("mixtral", "deepseek_v3")  # the two router families (all five: EP 4 on the nccl backend, below)
    _check(run_cpu_world(4, _compare_world, models, [12, 0, 16, 7], "triton", timeout_s=400), models)


def test_ep2_and_ep4_nccl_backend_equal_transformers_blocks():
    _check(run_cpu_world(2, _compare_world, ALL, [16, 5], "nccl", timeout_s=300), ALL)
    _check(run_cpu_world(4, _compare_world, ALL, [3, 16, 0, 11], "nccl", timeout_s=300), ALL)


def _import_layouts_world(group):
    from tritonep.errors import ConfigError

    out = {}
    for name, names in (("mixtral", ("w1", "w3", "w2")), ("deepseek_v3", ("gate_proj", "up_proj", "down_proj"))):
        block, cfg = _hf_block(name)
        recipe, geo = config_from_hf(cfg, max_tokens_per_rank=4)
        layer = MoELayer(recipe, geo, group, dtype=torch.float32, backend="nccl")
        load_hf_moe_block(layer, block)
        fused = (layer.w1.detach().clone(), layer.w2.detach().clone())
        # the checkpoint-file layout: one nn.Linear weight per expert and projection, under a model prefix
        sd = {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items() if not k.startswith("experts.")}
        gu, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
        inter = geo.intermediate
        for e in range(geo.num_experts):
            for n, t in zip(names, (gu[e, :inter], gu[e, inter:], down[e])):
                sd[f"model.layers.0.mlp.experts.{e}.{n}.weight"] = t.clone()
        with torch.no_grad():
            layer.w1.zero_()
            layer.w2.zero_()
        used = load_hf_moe_state_dict(layer, sd, prefix="model.layers.0.mlp.")
        out[name] = (torch.equal(layer.w1, fused[0]) and torch.equal(layer.w2, fused[1]),
                     all(f"experts.{e}." in " ".join(used) for e in layer.expert_ids))
        sd.pop(f"model.layers.0.mlp.experts.{layer.expert_ids[-1]}.{names[2]}.weight")
        try:
            load_hf_moe_state_dict(layer, sd, prefix="model.layers.0.mlp.")
            out[name + "_missing"] = "no error"
        except ConfigError as e:
            out[name + "_missing"] = str(e)
        layer.close()
    return out


def test_import_from_checkpoint_file_layout_equals_module_layout():
    for rank, r in enumerate(run_cpu_world(2, _import_layouts_world)):
        for name, names in (("mixtral", "w2"), ("deepseek_v3", "down_proj")):
            assert r[name] == (True, True), (rank, name)
            e = 4 * rank + 3 if name == "mixtral" else 8 * rank + 7
            assert f"experts.{e}.{names}.weight" in r[name + "_missing"], r[name + "_missing"]


@pytest.mark.world1
@pytest.mark.gpu
def test_gpu_ep_equals_transformers_blocks(gpu_world):  # world1: on the one-GPU machine n = 1
    n = min(2, torch.cuda.device_count())  # EP over the GPUs present (one GPU: EP 1)
    _check(gpu_world(n, _compare_world, ALL, [16, 9][:n], "auto", timeout_s=300), ALL)
