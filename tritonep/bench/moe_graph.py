"""The MoE layer's forward + backward step eager vs the same step captured in ONE CUDA graph (sync-free recipe).

Per token count the layer (``MoERecipe(sync_free=True)`` at a profile's hidden / experts / top-k / expert width of
:data:`tritonep.bench.profiles.PROFILES`) runs forward + backward on fixed inputs: eager (CUDA events over
back-to-back steps) and replayed from one captured graph; the replayed step's output and every gradient must equal
the eager step's bit for bit (``checked``). ``benchmarks/moe_bench.py --graph`` runs it (one GPU, world 1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["moe_graph_point"]


def _step(layer, x, idx, w):
    y = layer(x, idx, w)
    y.float().pow(2).sum().backward()
    return y


def moe_graph_point(group, T: int, profile: str = "deepseek-v3", iters: int = 10) -> dict:
    """One row: ``{tokens, shape, num_experts, world_size, eager_us, graph_us, eager_over_graph, checked}`` (microseconds per
    forward + backward step; ``checked``: the replayed output and gradients equal the eager ones bit for bit).

    Needs CUDA (a captured graph); ``T`` tokens on this rank, the worst-case receive capacity; the profile's routed
    experts sized to the card (:func:`tritonep.bench.sizing.experts_for_card`).
    """
    import tritonep as tep

    from .ep import time_rounds
    from .profiles import DEFAULT_INTERMEDIATE, PROFILES
    from .sizing import experts_for_card

    dev = torch.device("cuda", torch.cuda.current_device())
    p = PROFILES[profile]
    H, K, F = p["hidden"], p["topk"], p.get("intermediate", DEFAULT_INTERMEDIATE)
    W = dist.get_world_size(group)
    # weights, the eager step's gradients, their reference copies and the graph's gradients: 4 copies of 3 H x F
    # matrices per expert, within 70 % of the card (an 80 GB H100: 128 of DeepSeek-V3's 256 experts, an H200: 256)
    E = experts_for_card(p["num_experts"], 4 * 3 * H * F * 2, W, torch.cuda.get_device_properties(dev).total_memory,
                         min_experts=K, share=0.7)
    geo = tep.MoEGeometry(hidden=H, intermediate=F, num_experts=E, topk=K,
                          max_tokens_per_rank=T)  # worst-case receive rows (every route on one rank)
    layer = tep.MoELayer(tep.MoERecipe(sync_free=True, combine="push"), geo, group, device=dev)
    g = torch.Generator(device=dev).manual_seed(dist.get_rank(group))
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16).requires_grad_(True)
    idx = torch.argsort(torch.rand(T, E, device=dev, generator=g), dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, device=dev, generator=g).requires_grad_(True)
    params = (x, w, layer.w1, layer.w2)

    def eager():
        for q in params:
            q.grad = None  # each step's gradients are new tensors, as in the captured step
        return _step(layer, x, idx, w)

    # PyTorch's whole-network capture recipe: warm-up, eager steps and capture on ONE side stream, gradients set to
    # None before capture (backward ops run on their forward op's stream; gradients created on the legacy default
    # stream make the capture fail with cudaErrorStreamCaptureImplicit)
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            eager()
        eager_us = time_rounds(eager, group, iters)
        y_e = eager()
        ref = [t.detach().clone() for t in (y_e,) + tuple(q.grad for q in params)]
        for q in params:
            q.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=st):
            y_g = _step(layer, x, idx, w)
        graph_us = time_rounds(graph.replay, group, iters)
        graph.replay()
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    got = [t.detach().clone() for t in (y_g,) + tuple(q.grad for q in params)]
    checked = all(torch.equal(a, b) for a, b in zip(ref, got))
    layer.buffer.check()
    layer.close()
    return dict(tokens=T, shape=profile, num_experts=E, world_size=W, eager_us=eager_us, graph_us=graph_us,
                eager_over_graph=eager_us / graph_us, checked=checked)
