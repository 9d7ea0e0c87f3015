"""Checkpoints of MoE layers with torch.distributed.checkpoint: saved at EP = 4, loaded at EP = 2 and EP = 1, every
expert weight and every optimizer state bit-equal (tritonep.moe.params keys, tritonep.moe.checkpoint).

The layers are a DeepSeek-V3-style layer (sigmoid router with a correction bias, shared experts) with weights set
from the global expert id (the same expert gets the same values at any EP size) and an AdamW step taken on gradients
that are functions of the global expert id too, so the optimizer state is known per expert. The nccl backend builds
the layers (no kernel runs here; the keys are backend-independent).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once before the CPU world forks: optimizers import it lazily, seconds
import torch.distributed as dist  # in every rank)
import torch.distributed.checkpoint  # noqa: F401  (likewise)

from tritonep.errors import ConfigError
from tritonep.moe import MoEGeometry, MoELayer, MoERecipe, RouterConfig
from tritonep.moe import checkpoint as ckpt
from tritonep.testing import run_cpu_world

E = 8
GEO = MoEGeometry(64, 32, E, 2, 8, shared_intermediate=16)
RECIPE = MoERecipe(router=RouterConfig(kind="deepseek_v3", n_group=2, topk_group=1))


def _expert_values(e: int, shape, salt: int):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * salt + e))


def _model(group):
    model = torch.nn.ModuleDict({"moe": MoELayer(RECIPE, GEO, group, seed=1, dtype=torch.float32, backend="nccl"),
                                 "head": torch.nn.Linear(64, 4)})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _local(model, opt):
    moe = model["moe"]
    st = opt.state.get(moe.w1, {})
    return dict(ids=list(moe.expert_ids), w1=moe.w1.detach().clone(), w2=moe.w2.detach().clone(),
                m1=st.get("exp_avg", torch.zeros(0)).clone(), v2=opt.state.get(moe.w2, {}).get("exp_avg_sq"),
                router=moe.router.weight.detach().clone(), bias=moe.router.e_score_correction_bias.clone(),
                shared=moe.shared.down_proj.weight.detach().clone(), head=model["head"].weight.detach().clone(),
                head_m=opt.state.get(model["head"].weight, {}).get("exp_avg"))


def _save_world(group, path):
    model, opt = _model(group)
    moe = model["moe"]
    with torch.no_grad():
        for j, e in enumerate(moe.expert_ids):
            moe.w1[j] = _expert_values(e, moe.w1.shape[1:], 1)
            moe.w2[j] = _expert_values(e, moe.w2.shape[1:], 2)
            moe.w1.grad = torch.stack([_expert_values(e, moe.w1.shape[1:], 3) for e in moe.expert_ids])
            moe.w2.grad = torch.stack([_expert_values(e, moe.w2.shape[1:], 4) for e in moe.expert_ids])
        moe.router.e_score_correction_bias.copy_(torch.arange(E) * 0.01)
    for p in model.parameters():  # replicated parameters: the same gradient everywhere (as after the reduction)
        if p.grad is None:
            p.grad = torch.full_like(p, 0.5)
    opt.step()
    keys = sorted(k for k in model.state_dict() if "experts." in k)
    ckpt.save(path, model, opt, extra={"step": 7}, group=group)
    return _local(model, opt), keys


def _load_world(group, path):
    model, opt = _model(group)  # fresh weights (seeded init), no optimizer state yet
    extra = ckpt.load(path, model, opt, extra={"step": 0}, group=group)
    out = _local(model, opt)
    out["extra"] = extra
    # a missing expert entry of the optimizer is named
    sd = ckpt.optimizer_state_dict(model, opt)
    sd["state"].pop(f"moe.experts.{out['ids'][0]}.w1")
    try:
        ckpt.load_optimizer_state_dict(model, opt, sd)
        out["missing"] = "no error"
    except ConfigError as e:
        out["missing"] = str(e)
    model["moe"].close()
    return out


def _full(res, key):
    return torch.cat([r[key] for r in res])


def test_save_at_ep4_load_at_ep2_and_ep1_bit_equal(tmp_path):
    saved = run_cpu_world(4, _save_world, str(tmp_path / "ck"))
    keys = [k for _, ks in saved for k in ks]
    assert sorted(keys) == sorted(f"moe.experts.{e}.{n}" for e in range(E) for n in ("w1", "w2"))  # once each
    saved = [s for s, _ in saved]
    full = {k: _full(saved, k) for k in ("w1", "w2", "m1", "v2")}
    for W in (2, 1):
        for rank, r in enumerate(run_cpu_world(W, _load_world, str(tmp_path / "ck"))):
            lo, hi = r["ids"][0], r["ids"][-1] + 1
            assert r["ids"] == list(range(rank * E // W, (rank + 1) * E // W))
            for k in ("w1", "w2", "m1", "v2"):
                assert torch.equal(r[k], full[k][lo:hi]), (W, rank, k)
            for k in ("router", "bias", "shared", "head", "head_m"):
                assert torch.equal(r[k], saved[0][k]), (W, rank, k)
            assert r["extra"] == {"step": 7}
            assert f"moe.experts.{lo}.w1" in r["missing"]


def _state_dict_keys_world(group):
    rank = dist.get_rank(group)
    layer = MoELayer(MoERecipe(), MoEGeometry(64, 32, E, 2, 8), group, seed=1, backend="nccl")
    sd = layer.state_dict()
    full = {f"experts.{e}.{n}": torch.full((64, 64) if n == "w1" else (32, 64), float(e), dtype=torch.bfloat16)
            for e in range(E) for n in ("w1", "w2")}
    full["router.weight"] = layer.router.weight.detach().clone()
    layer.load_state_dict(full)  # a full single-file state dict: this rank takes its experts, ignores the rest
    took = layer.w1[:, 0, 0].tolist()
    partial = dict(full)
    partial.pop(f"experts.{layer.expert_ids[1]}.w2")
    with pytest.raises(RuntimeError, match=f"experts.{layer.expert_ids[1]}.w2"):
        layer.load_state_dict(partial)
    views = sd[f"experts.{layer.expert_ids[0]}.w1"].data_ptr() == layer.w1.data_ptr()
    layer.close()
    return sorted(sd), took, views, rank


def test_state_dict_keys_are_global_expert_ids():
    for keys, took, views, rank in run_cpu_world(2, _state_dict_keys_world):
        ids = range(rank * 4, rank * 4 + 4)
        assert keys == sorted([f"experts.{e}.{n}" for e in ids for n in ("w1", "w2")] + ["router.weight"])
        assert took == [float(e) for e in ids] and views
