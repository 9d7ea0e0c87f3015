"""Expert-parallel vs replicated parameters and their gradients across data parallel x expert parallel groups
(tritonep.moe.params), by hand, with DDP and with FSDP2 (docs/moe.md recipes), against a dense single-process
computation of the same objective.

World of 4 = DP 2 x EP 2 (EP groups {0, 1}, {2, 3}; expert-DP groups {0, 2}, {1, 3}); every rank has its own tokens and
loss ``sum(y * gy) / T``; the objective is the mean of the 4 losses. After backward the router and shared-expert
gradients differ per rank (each rank routed its own tokens); after :func:`tritonep.moe.reduce_gradients` they are
bit-equal on all ranks and equal the dense objective's, and every rank's expert gradients equal the dense ones of its
experts (bit-equal between the two DP replicas). Tolerance ``2e-2 * max|ref|`` (bf16 activations, as in
tests/moe/test_hf_equality.py). The nccl backend serves the EP subgroups (the CPU world's symmetric heap spans the
whole world only).
"""

from __future__ import annotations

import torch
import torch._dynamo  # noqa: F401  (imported before the CPU world forks: DDP / optimizers import it lazily)
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tritonep.moe import (MoEGeometry, MoELayer, MoERecipe, expert_parameter_names, expert_parameters,
                          reduce_gradients, replicated_parameters)
from tritonep.testing import run_cpu_world

GEO = MoEGeometry(64, 32, 8, 2, 16, shared_intermediate=24)
TOKENS = [16, 7, 12, 10]
TOL = 2e-2


def _data(rank):
    g = torch.Generator().manual_seed(40 + rank)
    return torch.randn(TOKENS[rank], 64, generator=g).bfloat16(), torch.randn(TOKENS[rank], 64, generator=g)


def _groups(rank):
    ep = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    edp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return ep[rank // 2], edp[rank % 2]


def _dense_objective_grads(layer):
    """Gradients of mean_r sum(y_r * gy_r) / T_r computed densely in fp32 over every rank's tokens."""
    w1, w2 = (t.float().requires_grad_() for t in MoELayer.init_expert_weights(GEO, seed=5, dtype=torch.float32))
    wg = layer.router.weight.detach().clone().requires_grad_()
    shared = [p.detach().clone().requires_grad_() for p in layer.shared.parameters()]
    total = 0.0
    for r in range(4):
        x, gy = _data(r)
        xf = x.float()
        probs = torch.softmax(xf @ wg.t(), -1)
        wt, idx = probs.topk(2, -1)
        wt = wt / wt.sum(-1, keepdim=True)
        y = torch.zeros_like(xf)
        for k in range(2):
            h = torch.bmm(xf[:, None], w1[idx[:, k]])[:, 0]
            a = torch.nn.functional.silu(h[:, :32]) * h[:, 32:]
            y = y + wt[:, k:k + 1] * torch.bmm(a[:, None], w2[idx[:, k]])[:, 0]
        gp, up, dn = shared
        y = y + torch.nn.functional.linear(torch.nn.functional.silu(xf @ gp.t()) * (xf @ up.t()), dn)
        total = total + (y * gy).sum() / len(x) / 4
    total.backward()
    return wg.grad, [p.grad for p in shared], w1.grad, w2.grad


def _world(group, use_ddp):
    rank = dist.get_rank(group)
    ep_group, edp_group = _groups(rank)
    layer = MoELayer(MoERecipe(), GEO, ep_group, seed=5, dtype=torch.float32, backend="nccl")
    model = torch.nn.Sequential(layer)
    if use_ddp:  # DDP averages the replicated parameters only; experts differ per EP rank and stay out of it
        DDP._set_params_and_buffers_to_ignore_for_model(model, expert_parameter_names(model))
        run = DDP(model, process_group=group)
    else:
        run = model
    x, gy = _data(rank)
    y = run(x)
    ((y.float() * gy).sum() / len(x)).backward()
    before = layer.router.weight.grad.clone()
    reduce_gradients(model, group, edp_group, replicated=not use_ddp)
    ref_router, ref_shared, ref_w1, ref_w2 = _dense_objective_grads(layer)
    lo = layer.expert_ids[0]
    L = layer.num_local_experts
    out = dict(before=before, router=layer.router.weight.grad.clone(),
               shared=[p.grad.clone() for p in layer.shared.parameters()],
               w1=layer.w1.grad.clone(), w2=layer.w2.grad.clone(),
               ref=(ref_router, ref_shared, ref_w1[lo:lo + L], ref_w2[lo:lo + L]),
               n_expert=len(expert_parameters(model)), n_repl=len(replicated_parameters(model)),
               layer_split=(len(list(layer.expert_parameters())), len(list(layer.replicated_parameters()))))
    layer.close()
    return out


def _rel(a, b):
    return float((a.float() - b.float()).abs().max()) / float(b.float().abs().max())


def _check(res, ddp):
    # by hand: each rank routed its own tokens, so its router gradient differs until reduced (DDP reduced it already)
    assert torch.equal(res[0]["before"], res[1]["before"]) == ddp
    for rank, r in enumerate(res):
        assert (r["n_expert"], r["n_repl"], r["layer_split"]) == (2, 4, (2, 4))
        assert torch.equal(r["router"], res[0]["router"]), rank  # reduced: one value everywhere
        for u, v in zip(r["shared"], res[0]["shared"]):
            assert torch.equal(u, v), rank
        twin = res[(rank + 2) % 4]  # the other DP replica of the same experts
        assert torch.equal(r["w1"], twin["w1"]) and torch.equal(r["w2"], twin["w2"]), rank
        ref_router, ref_shared, ref_w1, ref_w2 = r["ref"]
        errs = [_rel(r["router"], ref_router), _rel(r["w1"], ref_w1), _rel(r["w2"], ref_w2)]
        errs += [_rel(u, v) for u, v in zip(r["shared"], ref_shared)]
        assert max(errs) < TOL, (rank, errs)


def test_reduce_gradients_dp2_x_ep2_equals_the_dense_objective():
    _check(run_cpu_world(4, _world, False), False)


def test_ddp_for_replicated_and_reduce_for_experts_equals_the_dense_objective():
    _check(run_cpu_world(4, _world, True), True)


def _fsdp_world(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank(group)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))  # EP groups {0, 1}, {2, 3}
    world = init_device_mesh("cpu", (4,))
    layer = MoELayer(MoERecipe(), GEO, mesh["ep"].get_group(), seed=5, dtype=torch.float32, backend="nccl")
    ref_router, ref_shared, ref_w1, ref_w2 = _dense_objective_grads(layer)
    lo, L = layer.expert_ids[0], layer.num_local_experts
    fully_shard(layer.router, mesh=world)  # replicated parameters: sharded over all 4 ranks, averaged over 4
    fully_shard(layer.shared, mesh=world)
    fully_shard(layer, mesh=mesh["dp"])  # what is left: w1, w2, sharded over the 2 ranks holding the same experts
    layer.set_gradient_divide_factor(4.0)  # experts: sum over the DP replicas / N (docs/moe.md)
    for m in (layer, layer.router, layer.shared):
        m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM: reduce with SUM, divide after
    x, gy = _data(rank)
    y = layer(x)
    ((y.float() * gy).sum() / len(x)).backward()

    def full(p):
        return p.grad.full_tensor()

    out = dict(router=_rel(full(layer.router.weight), ref_router),
               shared=max(_rel(full(p), r) for p, r in zip(layer.shared.parameters(), ref_shared)),
               w1=_rel(full(layer.w1), ref_w1[lo:lo + L]), w2=_rel(full(layer.w2), ref_w2[lo:lo + L]))
    return out


def test_fsdp2_recipe_equals_the_dense_objective():
    for rank, r in enumerate(run_cpu_world(4, _fsdp_world)):
        assert max(r.values()) < TOL, (rank, r)
