"""An overflowing sync-free step with backward on one GPU, made to run under ``compute-sanitizer --tool memcheck``.

Every rank runs, for each triton path (two-kernel, fused, decode: forced by the buffer's ``tiles=``), a sync-free dispatch
whose routes exceed ``max_recv_tokens`` (every route to expert 0), the combine, the backward of both, and both
backward halves called directly on the refused handle with capacity-sized inputs; then the same through
``MoELayer(MoERecipe(sync_free=True))`` with its backward. Every one must raise CapacityError at ``check()`` and leave
the empty layout (offsets 0, outputs and gradients 0); a synced call afterwards must succeed. Under memcheck any
access past the rows a kernel was given is an error the sanitizer reports (before the empty layout, the combine
backward's expand wrote every route to its layout row in a gradient buffer of ``max_recv_tokens`` rows).

    compute-sanitizer --tool memcheck --target-processes all --error-exitcode 3 \\
        python benchmarks/probes/overflow_memcheck.py --world-size 1 2 --mps on

World 1: one process (one rank, its own experts). W = 2: two ranks on the one GPU (``run_gpu_world(2, ..., mps=...)``:
under MPS by default; ``--mps off`` time-slices them, for a sanitizer build that refuses MPS clients). Exit code 0:
every check held; 1: a check failed (printed); the sanitizer's own ``--error-exitcode`` for memory errors.
"""

from __future__ import annotations

import argparse

import torch

PATHS = {"two_kernel": "dec=0,fs=0,fe=0,fc=0", "fused": "dec=0,fs=8,fe=8,fc=1", "decode": "bt=2,dec=2"}
H, TM, K, MAX_RECV = 128, 16, 2, 10


def _overflow_step(buf, rank, W):
    """One refused sync-free step on ``buf``; a list of failed checks (empty: every check held)."""
    from tritonep.errors import CapacityError

    dev, bad = buf.device, []
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TM, H, generator=g).to(torch.bfloat16).to(dev).requires_grad_(True)
    idx = torch.zeros(TM, K, dtype=torch.int64)
    idx[:, 1] = torch.arange(TM) % (2 * W - 1) + 1
    idx = idx.to(dev)
    w = (torch.rand(TM, K, generator=g) + 0.1).to(dev).requires_grad_(True)
    d = buf.dispatch(x, idx, w, sync_free=True)
    if d.expert_offsets.any() or d.num_tokens_per_expert.any() or d.weights.detach().any():
        bad.append("the refused layout is not empty")
    eo = (d.x.float() * 0.5 + 1.0).to(torch.bfloat16)
    y = buf.combine(eo, d.handle)
    y.float().sum().backward()
    if y.any() or x.grad.any() or w.grad.any():
        bad.append("a refused call's output or gradient is not 0")
    M = buf.max_recv_tokens
    gx, gw = buf.dispatch_backward(torch.ones(M, H, dtype=torch.bfloat16, device=dev), torch.ones(M, device=dev),
                                   d.handle)
    ge, gr = buf.combine_backward(torch.ones(TM, H, dtype=torch.bfloat16, device=dev),
                                  torch.ones(M, H, dtype=torch.bfloat16, device=dev), d.handle)
    if gx.any() or gw.any() or ge.any() or gr.any():
        bad.append("a backward half on the refused handle is not 0")
    try:
        buf.check()
        bad.append("check() raised nothing")
    except CapacityError:
        pass
    ok = buf.dispatch(x.detach()[:2], idx[:2] * 0 + torch.tensor([[0, 1]], device=dev), w.detach()[:2])
    buf.combine(ok.x.clone(), ok.handle)
    buf.check()  # the buffer is usable afterwards
    return bad


def _moe_step(group, rank, W):
    import tritonep as tep
    from tritonep.errors import CapacityError

    geo = tep.MoEGeometry(hidden=H, intermediate=64, num_experts=2 * W, topk=K, max_tokens_per_rank=TM,
                          max_recv_tokens=MAX_RECV)
    layer = tep.MoELayer(tep.MoERecipe(sync_free=True), geo, group, seed=1)
    dev = layer.device
    x = torch.randn(TM, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(dev)
    x.requires_grad_(True)
    idx = torch.zeros(TM, K, dtype=torch.int64, device=dev)
    idx[:, 1] = 1
    y = layer(x, idx, torch.full((TM, K), 0.5, device=dev))
    y.float().sum().backward()
    bad = [] if not (y.any() or x.grad.any()) else ["the MoE layer's refused step is not 0"]
    try:
        layer.buffer.check()
        bad.append("the MoE layer's check() raised nothing")
    except CapacityError:
        pass
    layer.close()
    return bad


def rank_fn(group):
    import torch.distributed as dist

    import tritonep as tep

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    failed = {}
    for name, tiles in PATHS.items():
        buf = tep.EPBuffer(group, 2 * W, H, TM, K, max_recv_tokens=MAX_RECV, tiles=tiles)
        failed[name] = _overflow_step(buf, rank, W)
        buf.close()
    failed["moe_layer"] = _moe_step(group, rank, W)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return failed


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--mps", choices=["on", "off"], default="on", help="ranks that share the GPU (W = 2)")
    a = p.parse_args()
    from tritonep.testing import run_gpu_world

    import overflow_memcheck  # the ranks unpickle the rank function by module name (this folder is on their path)

    ok = True
    for W in a.world_size:
        res = run_gpu_world(W, overflow_memcheck.rank_fn, mps=a.mps == "on" and W > 1, timeout_s=540)
        for r, failed in enumerate(res):
            bad = {k: v for k, v in failed.items() if v}
            ok &= not bad
            print(f"world {W} rank {r}: " + ("every check held: CapacityError at check(), empty layout, usable after"
                                             f" ({', '.join(failed)})" if not bad else f"FAILED {bad}"), flush=True)
    print("verdict:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
