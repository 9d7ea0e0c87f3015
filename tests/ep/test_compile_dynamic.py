"""The custom ops under ``torch.compile(dynamic=True)``: the token count varies from call to call and every int the
compiled function closes over is symbolic, including the buffer id its fakes look the buffer up with (an
unhashable SymInt made them fail with ``TypeError: unhashable type: non-nested SymInt``).

Checked against the same body run eagerly (bit for bit: rows, combine, gradients), with one graph for the varying T
(no recompile per T), on both backends, synced (unbacked row count) and sync-free; the MoE layer compiled the same
way against its eager self.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.ep import ops
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs

E, H, TM, K = 8, 64, 12, 3


def _body(bid, sync_free):
    def body(x, idx, w):
        d = ops.dispatch(bid, x, idx, w, sync_free=sync_free)
        eo = (d.x.float() * 0.5 - 0.25).to(torch.bfloat16)
        return ops.combine(eo, d), d.expert_offsets
    return body


def _run(fn, x, idx, w):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y, offs = fn(x, idx, w)
    (y.float() * 1.5).sum().backward()
    return y.detach().clone(), offs.clone(), x.grad.clone(), w.grad.clone()


def _ops_world(group, backend, sync_free, tokens):
    from torch._dynamo.utils import counters

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    Ew = 3 * W  # a multiple of W
    buf = tep.EPBuffer(group, Ew, H, TM, K, backend=backend)
    body = _body(ops.buffer_id(buf), sync_free)
    comp = torch.compile(body, backend="aot_eager", dynamic=True, fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    same = []
    for i, T in enumerate(tokens):
        x, idx, w = make_rank_inputs(rank, T, H, Ew, K, seed=i + 1, mask_frac=0.2)
        got, ref = _run(comp, x, idx, w), _run(body, x, idx, w)
        same.append(all(torch.equal(a, b) for a, b in zip(got, ref)))
    graphs = counters["stats"]["unique_graphs"] - before
    buf.check()
    buf.close()
    return same, graphs


@pytest.mark.parametrize("W,backend,sync_free", [(3, "nccl", True)])  # the fakes are backend-independent
def test_ops_compile_dynamic(W, backend, sync_free):
    for same, graphs in run_cpu_world(W, _ops_world, backend, sync_free, [5, 7, 9], timeout_s=300):
        assert all(same), same
        assert graphs == 1, f"{graphs} graphs for 3 token counts (a recompile per T)"


@pytest.mark.slow
@pytest.mark.parametrize("W,backend,sync_free", [(2, "triton", False), (2, "triton", True), (3, "triton", False),
                                                 (2, "nccl", False)])
def test_ops_compile_dynamic_every_backend(W, backend, sync_free):
    for same, graphs in run_cpu_world(W, _ops_world, backend, sync_free, [5, 7, 9], timeout_s=300):
        assert all(same), same
        assert graphs == 1, graphs


def _moe_world(group):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    geo = tep.MoEGeometry(hidden=H, intermediate=32, num_experts=E, topk=2, max_tokens_per_rank=TM)
    layer = tep.MoELayer(tep.MoERecipe(), geo, group, seed=2)
    comp = torch.compile(layer, backend="aot_eager", dynamic=True)
    same = []
    for T in (6, 9):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T + rank)).to(torch.bfloat16)
        outs = []
        for fn in (comp, layer):
            xr = x.clone().requires_grad_(True)
            y = fn(xr)
            y.float().sum().backward()
            outs.append((y.detach().clone(), xr.grad.clone(), layer.w1.grad.clone()))
            layer.zero_grad(set_to_none=True)
        same.append(all(torch.equal(a, b) for a, b in zip(*outs)))
    layer.close()
    return same


@pytest.mark.slow
def test_moe_layer_compile_dynamic():
    for same in run_cpu_world(2, _moe_world, timeout_s=300):
        assert all(same), same
