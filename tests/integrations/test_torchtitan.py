"""torchtitan's own MoE module with tritonep's token dispatcher equals the same module on one rank.

The module is torchtitan 0.3.0's ``MoE`` with the configuration of its DeepSeek-V3 ``debugmodel`` MoE layer (dim 256,
8 routed experts of hidden 256, top-3 softmax router, 2 shared experts, load-balancing bias). In a CPU world of W
ranks each rank runs it with :class:`TritonEPTokenDispatcher` on its own T tokens, holding experts
``[r*L, (r+1)*L)``; the reference is the same weights on one rank with torchtitan's ``LocalTokenDispatcher`` over all
W*T tokens. Compared: every rank's output and input gradient, every expert's weight gradients (on its owner), and
the router / shared-expert gradients summed over ranks (each rank sees only its tokens' share).

Tolerances (``max|ep - ref| <= tol * max|ref|`` per tensor), from where the two paths round differently (the
routing, the expert GEMM inputs and the expert outputs are the same bf16 values on both):
- forward 2^-8: our combine sums the K weighted expert rows in fp32 and rounds once to bf16; torchtitan's local
  combine keeps the fp32 sum (the model here is fp32). One bf16 rounding is <= 2^-9 of the value.
- gradients 2^-5: the combine's backward receives the bf16-rounded output gradient and rounds ``w * g`` to bf16 again
  (torchtitan: one rounding of ``w * g``), the dispatch backward rounds the K-row sum of ``grad_x`` to bf16; these
  1-ulp differences pass through bf16 grouped GEMMs with ~10-row reductions per expert (measured 1e-3 .. 8e-3).
- fp8 dispatch wire: forward and gradients 2^-3 (e4m3 keeps 3 mantissa bits: <= 2^-4 of each element's block
  scale, the experts then see those rows); the bf16-wire result must differ from it (the wire is really used).

CI installs torchtitan (scripts/setup.sh), so there these tests never skip; elsewhere they skip without torchtitan.
"""

import os

import pytest
import torch
import torch.distributed as dist

if os.environ.get("CI"):
    import torchtitan  # noqa: F401  (CI must run these tests: a missing torchtitan is a failure there)
else:
    pytest.importorskip("torchtitan")

from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher  # noqa: E402

from tritonep.integrations import torchtitan as tt  # noqa: E402
from tritonep.testing import run_cpu_world  # noqa: E402

FWD_TOL, GRAD_TOL, FP8_TOL = 2.0 ** -8, 2.0 ** -5, 2.0 ** -3
DEAD, SKEWED = 7, (0, 1, 2)  # an expert nobody picks; the experts every token of the last rank picks


def moe_config():
    """torchtitan's DeepSeek-V3 debugmodel MoE layer config (the first MoE layer; standard dispatcher)."""
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    return deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard").layers[1].moe


def _inputs(W, T, D, n_layers, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(W, T, D, generator=g), torch.randn(W, T, D, generator=g)


def _build(n_layers, seed, crafted, fields):
    """``(reference layers, ep layers)``: the same weights; ``crafted``: the DEAD expert is never chosen."""
    torch.manual_seed(seed)
    ref, ep = [], []
    for _ in range(n_layers):
        r = moe_config().build()
        r.init_states()
        if crafted:
            r.expert_bias_E[DEAD] = -100.0  # softmax scores are in (0, 1): nobody picks DEAD
        e = tt.use_tritonep(moe_config(), **fields).build()
        e.load_state_dict(r.state_dict())
        ref.append(r)
        ep.append(e)
    return ref, ep


def _skew(x_rank, gate_weight):
    """Tokens whose top-3 are SKEWED: x = 10 * sum_e w_e / |w_e|^2 + noise (every other score stays ~0)."""
    w = gate_weight.detach()
    target = sum(w[e] / w[e].square().sum() for e in SKEWED) * 10.0
    return target + 0.01 * x_rank


def _world(group, T, n_layers, crafted, fields, compile_ac=False, seed=0):
    rank, W = dist.get_rank(), dist.get_world_size()
    ref, ep = _build(n_layers, seed, crafted, fields)
    mesh = DeviceMesh("cpu", list(range(W)))
    for layer in ep:
        tt.shard_routed_experts(layer, mesh)
    D = ep[0].router.gate.weight.shape[1]
    xs, gys = _inputs(W, T, D, n_layers, seed + 1)
    if crafted:
        xs[W - 1] = _skew(xs[W - 1], ref[0].router.gate.weight)

    def stack(layers, x):
        for layer in layers:
            x = layer(x)
        return x

    run = stack
    if compile_ac:
        from torch.utils.checkpoint import checkpoint

        def run(layers, x):  # activation checkpointing around a compiled block
            body = torch.compile(lambda y: stack(layers, y), backend="aot_eager", fullgraph=True)
            return checkpoint(body, x, use_reentrant=False)

    x = xs[rank:rank + 1].clone().requires_grad_()
    from torch._dynamo.utils import counters

    from tritonep.ep import ops

    first_ticket = next(ops._TICKETS)
    y = run(ep, x)
    (y * gys[rank:rank + 1]).sum().backward()
    dispatches = next(ops._TICKETS) - first_ticket - 1  # dispatch ops run (each takes one ticket)
    disp = ep[0].routed_experts.token_dispatcher
    disp.check()
    buffers = {id(layer.routed_experts.token_dispatcher.buffer) for layer in ep}
    out = dict(y=y.detach()[0], gx=x.grad[0], shared_buffers=len(buffers), dispatches=dispatches,
               graphs=counters["stats"]["unique_graphs"],
               grads=[{n: p.grad.clone() for n, p in layer.named_parameters()} for layer in ep])
    tt.close_buffers()
    if rank == 0:  # the reference after the world's collectives: it needs no peer
        xr = xs.clone().requires_grad_()
        yr = stack(ref, xr)
        (yr * gys).sum().backward()
        out["ref"] = dict(y=yr.detach(), gx=xr.grad, grads=[{n: p.grad.clone() for n, p in layer.named_parameters()}
                                                            for layer in ref],
                          counts=[layer.tokens_per_expert_E.clone() for layer in ref],
                          last_rank_ids=ref[0].router(xs[W - 1:W], ref[0].expert_bias_E)[1].sort(-1).values)
    return out


def _err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _compare(res, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL):
    ref, W = res[0]["ref"], len(res)
    errs = {}
    for r, out in enumerate(res):
        assert out["shared_buffers"] == 1, "dispatchers of one configuration share one buffer"
        errs[f"y{r}"] = _err(out["y"], ref["y"][r])
        errs[f"gx{r}"] = _err(out["gx"], ref["gx"][r])
    for i, ref_grads in enumerate(ref["grads"]):
        for name, g_ref in ref_grads.items():
            if name.startswith("routed_experts.inner_experts."):
                L = g_ref.shape[0] // W
                for r, out in enumerate(res):
                    errs[f"{i}.{name}[{r}]"] = _err(out["grads"][i][name], g_ref[r * L:(r + 1) * L])
            else:  # router / shared experts: each rank's share of the tokens
                errs[f"{i}.{name}"] = _err(sum(out["grads"][i][name] for out in res), g_ref)
    if os.environ.get("TRITONEP_PRINT_ERRS"):
        print(sorted(errs.items(), key=lambda kv: -kv[1])[:6])
    bad = {k: v for k, v in errs.items() if v > (fwd_tol if k[0] == "y" else grad_tol)}
    assert not bad, f"over tolerance: {bad}"
    return errs


def _check_crafted(ref):
    assert ref["counts"][0][DEAD] == 0, "the dead expert was picked"
    assert (ref["last_rank_ids"] == torch.tensor(SKEWED)).all(), "the last rank's tokens do not all pick SKEWED"


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_world2_two_layers_share_a_buffer_sync_free():
    """Natural routing, two stacked MoE layers on one shared buffer (layer 1 fwd, layer 2 fwd, layer 2 bwd, layer 1
    bwd), sync-free dispatch (max_recv_tokens rows, device counts)."""
    res = run_cpu_world(2, _world, 16, 2, False, {}, timeout_s=300)
    assert all(r["dispatches"] == 2 and r["graphs"] == 0 for r in res)
    _compare(res)


def test_world2_dead_expert_and_skewed_rank_synced():
    """An expert nobody picks, a rank whose every token goes to the same three experts (all on rank 0); the synced
    dispatch (exact row count)."""
    res = run_cpu_world(2, _world, 16, 1, True, {"sync_free": False}, timeout_s=300)
    _check_crafted(res[0]["ref"])
    _compare(res)


def test_world4_dead_expert_and_skewed_rank_sync_free():
    res = run_cpu_world(4, _world, 8, 1, True, {}, timeout_s=400)
    _check_crafted(res[0]["ref"])
    _compare(res)


def test_world2_compiled_fullgraph_with_activation_checkpointing():
    """torch.compile(fullgraph=True, backend="aot_eager") of the MoE block under non-reentrant activation
    checkpointing (the backward recomputes the forward, dispatch and combine included)."""
    fields = {"hidden_dim": 256, "num_max_tokens_per_rank": 16}  # compiled: the buffer is sized when wired
    res = run_cpu_world(2, _world, 16, 1, False, fields, True, timeout_s=400)
    assert all(r["graphs"] >= 1 and r["dispatches"] == 2 for r in res), "not compiled, or not recomputed"
    _compare(res)


def test_world2_fp8_dispatch_wire_with_padded_segments():
    res = run_cpu_world(2, _world, 16, 1, False, {"dispatch_wire": "fp8", "pad_multiple": 8}, timeout_s=300)
    errs = _compare(res, FP8_TOL, FP8_TOL)
    assert max(v for k, v in errs.items() if k[0] == "y") > FWD_TOL  # the rows really went through e4m3


def test_override_replaces_every_dispatcher():
    """torchtitan's --override.imports path: every MoE layer (and MTP layer) of the DeepSeek-V3 debugmodel gets our
    Config with the kwargs; sizes torchtitan filled into a HybridEP config are kept."""
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.deepseek_v3 import deepseekv3_configs

    model = deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="hybridep", num_mtp_layers=1)
    for layer in list(model.layers) + list(model.mtp_layers):
        if layer.moe is not None:
            layer.moe.routed_experts.token_dispatcher.hidden_dim = 256
            layer.moe.routed_experts.token_dispatcher.num_max_tokens_per_rank = 512
    target = "tritonep.integrations.torchtitan.tritonep_token_dispatcher"
    lines = apply_overrides(OverrideConfig(imports=[(target, {"dispatch_wire": "fp8", "pad_multiple": 16})]), model)
    cfgs = [layer.moe.routed_experts.token_dispatcher for layer in list(model.layers) + list(model.mtp_layers)
            if layer.moe is not None]
    assert len(lines) == len(cfgs) == 6
    for c in cfgs:
        assert isinstance(c, tt.TritonEPTokenDispatcher.Config)
        assert (c.num_experts, c.top_k, c.hidden_dim, c.num_max_tokens_per_rank) == (8, 3, 256, 512)
        assert (c.dispatch_wire, c.pad_multiple, c.sync_free) == ("fp8", 16, True)
        assert isinstance(c.build(), tt.TritonEPTokenDispatcher)
    with pytest.raises(TypeError):
        tt.tritonep_token_dispatcher(LocalTokenDispatcher.Config(num_experts=8, top_k=2), no_such_field=1)
