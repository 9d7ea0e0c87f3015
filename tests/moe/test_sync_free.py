"""MoERecipe(sync_free=True): the MoE layer with no host read in forward or backward.

CPU worlds: the sync-free layer equals the synced one bit for bit (output, every gradient) and its buffer makes no
host read; the recipe refuses combinations that need one. GPU (one device, world 1): torch's sync debug mode raises on
any host sync during a whole forward + backward, and the same step captured in ONE CUDA graph replays bit-equal to
eager.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import ConfigError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs

H, I, E, K, TM = 64, 32, 8, 2, 12


def _geo(max_recv=None):
    return tep.MoEGeometry(hidden=H, intermediate=I, num_experts=E, topk=K, max_tokens_per_rank=TM,
                           max_recv_tokens=max_recv)


def _steps(group, sync_free, routed, backend="auto"):
    rank = dist.get_rank(group)
    layer = tep.MoELayer(tep.MoERecipe(sync_free=sync_free, combine="push"), _geo(max_recv=48), group, seed=4,
                         backend=backend)
    out = []
    for step in range(2):
        x, idx, w = make_rank_inputs(rank, [11, 5][rank], H, E, K, seed=step + 1, mask_frac=0.1)
        x.requires_grad_(True)
        w = w.contiguous().requires_grad_(True)
        reads = layer.buffer.host_reads
        y = layer(x) if routed else layer(x, idx, w)
        y.float().pow(2).sum().backward()
        out.append(dict(y=y.detach().clone(), gx=x.grad.clone(), gw=None if routed else w.grad.clone(),
                        g1=layer.w1.grad.clone(), g2=layer.w2.grad.clone(), reads=layer.buffer.host_reads - reads,
                        gr=layer.router.weight.grad.clone() if routed else None))
        layer.zero_grad(set_to_none=True)
    layer.buffer.check()
    layer.close()
    return out


@pytest.mark.parametrize("routed,backend", [(False, "auto"), (True, "auto"), (False, "nccl")])
def test_sync_free_layer_equals_synced_and_reads_nothing(routed, backend):
    synced = run_cpu_world(2, _steps, False, routed, backend)
    free = run_cpu_world(2, _steps, True, routed, backend)
    for rs, rf in zip(synced, free):
        for a, b in zip(rs, rf):
            assert b["reads"] == 0 and a["reads"] >= 1
            for f in ("y", "gx", "gw", "g1", "g2", "gr"):
                if a[f] is not None:
                    assert torch.equal(a[f], b[f]), f


def test_sync_free_recipe_refuses_what_needs_a_host_read():
    with pytest.raises(ConfigError, match="balance='none'"):
        tep.MoERecipe(sync_free=True, balance="virtual")
    with pytest.raises(ConfigError, match="bool"):
        tep.MoERecipe(sync_free=1)


# ------------------------------------------------------------------------------------------------ GPU
def _gpu_step(layer, x, idx, w):
    y = layer(x, idx, w)
    y.float().pow(2).sum().backward()
    return y


@pytest.mark.gpu
def test_gpu_sync_free_step_has_no_host_sync_and_replays_bit_equal_in_one_graph(gpu_world):
    gpu_world(1, _gpu_graph_body)


def _gpu_graph_body(group):
    dev = torch.device("cuda", torch.cuda.current_device())
    layer = tep.MoELayer(tep.MoERecipe(sync_free=True, combine="push"),
                         tep.MoEGeometry(hidden=1024, intermediate=512, num_experts=16, topk=4,
                                         max_tokens_per_rank=256, max_recv_tokens=1024), group, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(256, 1024, device=dev, generator=g).to(torch.bfloat16).requires_grad_(True)
    idx = torch.argsort(torch.rand(256, 16, device=dev, generator=g), dim=1)[:, :4].contiguous()
    w = torch.rand(256, 4, device=dev, generator=g).requires_grad_(True)
    params = (x, w, layer.w1, layer.w2)
    # PyTorch's whole-network capture recipe: warm-up, the eager step and the capture on ONE side stream, gradients
    # None before each step (backward ops run on their forward op's stream; gradients made on the legacy default
    # stream fail the capture with cudaErrorStreamCaptureImplicit, as seen on an H200)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up: compiles, allocator pools
            for p in params:
                p.grad = None
            _gpu_step(layer, x, idx, w)
        torch.cuda.synchronize()
        for p in params:
            p.grad = None
        torch.cuda.set_sync_debug_mode("error")  # any host sync in the step raises
        try:
            y_eager = _gpu_step(layer, x, idx, w)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ref = [t.detach().clone() for t in (y_eager,) + tuple(p.grad for p in params)]
        for p in params:
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            y_g = _gpu_step(layer, x, idx, w)
        graph.replay()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    got = [t.detach().clone() for t in (y_g,) + tuple(p.grad for p in params)]
    layer.buffer.check()
    layer.close()
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    return True
