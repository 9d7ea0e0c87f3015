"""The MoE layer's forward + backward step eager vs the same step captured in ONE CUDA graph (issue 24, sync-free).

Run on one GPU (world 1: the HBM / compute side; several ranks sharing a GPU measure nothing about NVLink)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=. torchrun --nproc-per-node 1 benchmarks/moe_graph_bench.py --tokens 128 4096 --json out.json

Per token count: the layer (``MoERecipe(sync_free=True)``; hidden / intermediate / experts / top-k of
``--shape``) runs forward + backward on fixed inputs: eager (CUDA events over back-to-back steps) and replayed from one
captured graph; the replayed step's output and every gradient must equal the eager step's bit for bit (``checked``),
else the row says FAILED and the run exits 1. Target: eager <= 1.2x graph.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

SHAPES = {"deepseek-v3": dict(hidden=7168, intermediate=2048, num_experts=256, topk=8),
          "small": dict(hidden=2048, intermediate=1024, num_experts=64, topk=6)}


def _step(layer, x, idx, w):
    y = layer(x, idx, w)
    y.float().pow(2).sum().backward()
    return y


def bench(group, T, shape, iters):
    import tritonep as tep
    from tritonep.bench.ep import time_rounds

    dev = torch.device("cuda", torch.cuda.current_device())
    s = SHAPES[shape]
    W = dist.get_world_size(group)
    geo = tep.MoEGeometry(max_tokens_per_rank=T, **s)  # worst-case receive rows (every route on one rank)
    layer = tep.MoELayer(tep.MoERecipe(sync_free=True, combine="push"), geo, group, device=dev)
    g = torch.Generator(device=dev).manual_seed(dist.get_rank(group))
    x = torch.randn(T, s["hidden"], device=dev, generator=g).to(torch.bfloat16).requires_grad_(True)
    idx = torch.argsort(torch.rand(T, s["num_experts"], device=dev, generator=g), dim=1)[:, :s["topk"]].contiguous()
    w = torch.rand(T, s["topk"], device=dev, generator=g).requires_grad_(True)
    params = (x, w, layer.w1, layer.w2)

    def eager():
        for p in params:
            p.grad = None  # each step's gradients are new tensors, as in the captured step
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
        ref = [t.detach().clone() for t in (y_e,) + tuple(p.grad for p in params)]
        for p in params:
            p.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=st):
            y_g = _step(layer, x, idx, w)
        graph_us = time_rounds(graph.replay, group, iters)
        graph.replay()
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    got = [t.detach().clone() for t in (y_g,) + tuple(p.grad for p in params)]
    checked = all(torch.equal(a, b) for a, b in zip(ref, got))
    layer.buffer.check()
    layer.close()
    return dict(tokens=T, shape=shape, world_size=W, eager_us=eager_us, graph_us=graph_us,
                eager_over_graph=eager_us / graph_us, checked=checked)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--shape", default="deepseek-v3", choices=sorted(SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    rows = [bench(dist.group.WORLD, T, a.shape, a.iters) for T in a.tokens]
    ok = all(r["checked"] for r in rows)
    if dist.get_rank() == 0:
        for r in rows:
            print(f"T={r['tokens']:>5} eager {r['eager_us']:9.1f} us  graph {r['graph_us']:9.1f} us  "
                  f"eager/graph {r['eager_over_graph']:.2f}  {'ok' if r['checked'] else 'FAILED'}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
