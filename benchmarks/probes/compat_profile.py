"""Where the DeepEP-compatible Buffer's eager round trip spends its time, at world 1 on one GPU.

    PYTHONPATH=. torchrun --nproc-per-node 1 benchmarks/probes/compat_profile.py --tokens 128 4096
    PYTHONPATH=. torchrun --nproc-per-node 1 benchmarks/probes/compat_profile.py --tokens 128 --meta-rows-max-tokens 0

``--meta-rows-max-tokens``: the Buffer's (default: its own, 256: the top-k as meta rows of the rows lane at 128
tokens; 0: in the meta lane, a second EPBuffer dispatch).

For each token count (the ``deepseek-v3`` profile's hidden size, experts and top-k; uniform random routing) and each
mode (``host``: counts read on the host; ``worst``: ``num_worst_tokens``, no host read), what Megatron calls
(``get_dispatch_layout`` + ``dispatch`` + ``combine``) is measured three ways:

* phases: each call alone, synchronized before and after (wall us, median of ``--calls``): which call is slow;
* torch.profiler over 5 round trips: every CUDA kernel (name, count, GPU us) and the host-synchronizing CUDA API calls
  (cudaStreamSynchronize, cudaMemcpy*, cudaEventSynchronize): how many kernels and host waits a round trip holds;
* cProfile over ``--calls`` round trips: the top functions by own host time.

A diagnostic (nothing here is a result to commit); ``benchmarks/deep_ep_compat.py`` is the benchmark.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _phases(buf, x, idx, w, E, worst, calls):
    """Median synchronized wall time (us) of each call of one round trip."""
    times = {"layout": [], "dispatch": [], "combine": []}
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n, _, ne, itr, _ = buf.get_dispatch_layout(idx, E)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        rx, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr, num_tokens_per_expert=ne,
                                         topk_idx=idx, topk_weights=w, num_worst_tokens=worst)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        buf.combine(rx, h)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
            times[k].append(v * 1e6)
    return {k: round(statistics.median(v), 1) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--meta-rows-max-tokens", type=int, default=None)
    a = ap.parse_args()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group("nccl")
    import tritonep.compat.deep_ep as deep_ep
    from tritonep.bench.profiles import PROFILES

    p = PROFILES["deepseek-v3"]
    H, E, K = p["hidden"], p["num_experts"], p["topk"]
    dev = torch.device("cuda", torch.cuda.current_device())
    W = dist.get_world_size()
    for T in a.tokens:
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, generator=g).bfloat16().to(dev)
        idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(dev)
        w = torch.rand(T, K, generator=g).to(dev)
        opt = {} if a.meta_rows_max_tokens is None else {"meta_rows_max_tokens": a.meta_rows_max_tokens}
        buf = deep_ep.Buffer(dist.group.WORLD, 0, 0, max_tokens_per_rank=T, **opt)
        for mode, worst in (("host", 0), ("worst", W * T)):
            def round_trip():
                n, _, ne, itr, _ = buf.get_dispatch_layout(idx, E)
                rx, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr,
                                                 num_tokens_per_expert=ne, topk_idx=idx, topk_weights=w,
                                                 num_worst_tokens=worst)
                return buf.combine(rx, h)[0]

            for _ in range(3):
                round_trip()
            torch.cuda.synchronize()
            kinds = sorted({key[0] for key, _ in buf.lanes})
            print(f"\n##### T={T} mode={mode} lanes={kinds}: phases (us, synchronized each) "
                  f"{_phases(buf, x, idx, w, E, worst, a.calls)}", flush=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    round_trip()
                torch.cuda.synchronize()
            kern, api = {}, {}
            for e in prof.events():
                name = e.name
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    c, t = kern.get(name, (0, 0.0))
                    kern[name] = (c + 1, t + e.device_time)
                elif name.startswith("cuda") and any(s in name for s in ("Synchronize", "Memcpy", "LaunchKernel")):
                    c, t = api.get(name, (0, 0.0))
                    api[name] = (c + 1, t + e.cpu_time)
            print(f"##### T={T} mode={mode}: CUDA kernels over 5 round trips (count, GPU us total):", flush=True)
            for name, (c, t) in sorted(kern.items(), key=lambda kv: -kv[1][1]):
                print(f"  {c:4d} {t:10.1f}  {name[:110]}")
            print(f"##### T={T} mode={mode}: CUDA API calls over 5 round trips (count, host us total):")
            for name, (c, t) in sorted(api.items(), key=lambda kv: -kv[1][1]):
                print(f"  {c:4d} {t:10.1f}  {name}")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.calls):
                round_trip()
            torch.cuda.synchronize()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(a.top)
            print(f"##### T={T} mode={mode}: cProfile over {a.calls} round trips, by own time:")
            print("\n".join(s.getvalue().splitlines()[:a.top + 12]), flush=True)
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(a.top)
            print(f"##### T={T} mode={mode}: cProfile by cumulative time:")
            print("\n".join(s.getvalue().splitlines()[:a.top + 12]), flush=True)
        buf.destroy()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
