"""cProfile of eager dispatch + combine (+ both backwards) at world 1: where a call's HOST time goes, by function.

Run on one GPU::

    PYTHONPATH=. torchrun --nproc-per-node 1 benchmarks/probes/host_profile.py --tokens 128 --calls 200

Prints the top functions by own time (tottime) over ``--calls`` eager dispatch+combine pairs (and, with
``--backward``, their backward passes through autograd), after a warm-up; host time only (cProfile), the GPU is not
timed here (benchmarks/eager_profile.py and tritonep/bench/ep.py time it).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--backend", default="triton", choices=["triton", "nccl"])
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    import tritonep as tep
    from tritonep.bench.profiles import profile_shape

    H, E, K, _ = profile_shape("deepseek-v3")
    T = a.tokens
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(dist.get_rank())
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    buf = tep.EPBuffer(dist.group.WORLD, E, H, T, K, backend=a.backend)
    if a.backward:
        x.requires_grad_(True)
        w.requires_grad_(True)

    def pair():
        d = buf.dispatch(x, idx, w)
        y = buf.combine(d.x, d.handle) if a.backward else buf.combine(buf.expert_out_buffer(d.x.shape[0]), d.handle)
        if a.backward:
            y.float().sum().backward()
        return y

    for _ in range(10):
        pair()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.calls):
        pair()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
    if dist.get_rank() == 0:
        print(f"tokens={T} backend={a.backend} backward={a.backward} calls={a.calls}")
        print(s.getvalue())
    buf.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
