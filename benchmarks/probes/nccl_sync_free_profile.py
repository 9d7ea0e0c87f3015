"""Where a sync-free nccl dispatch's time goes, per mode (one-hop / gather), at the decode shape, world 1.

Run (one GPU)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 1 benchmarks/probes/nccl_sync_free_profile.py --tokens 128 --json out.json

Per mode: ``host_us`` (host time per call of back-to-back calls, no sync inside), ``call_us`` (the same with the
final synchronize, per call) and the device time per kernel from ``torch.profiler`` (one table each). Why: the
one-hop mode (2 launches, 1 collective) measured no faster than the gather mode (4 launches, 2 collectives) at 128
tokens in ep_bench, so the time is not the host's launches. Checks: every mode's real rows equal the
synced dispatch's.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--modes", nargs="+", default=["onehop", "gather"], choices=["onehop", "gather"],
                    help="the modes to run, in order (one per process keeps each mode's host timing clean of the "
                         "other's torch.profiler section)")
    a = ap.parse_args()
    from tritonep.bench.ep import one_gpu_inputs
    from tritonep.bench.profiles import profile_shape

    H, E, K, _ = profile_shape("decode")
    T = a.tokens
    dev, x, idx, w = one_gpu_inputs(T, H, E, K)
    import tritonep as tep
    from torch.profiler import ProfilerActivity, profile

    res = {}
    for mode in a.modes:
        buf = tep.EPBuffer(dist.group.WORLD, E, H, T, K, backend="nccl", sync_free_mode=mode)
        ref = buf.dispatch(x, idx, w)
        for _ in range(10):
            d = buf.dispatch(x, idx, w, sync_free=True)
        torch.cuda.synchronize()
        end = int(d.expert_offsets[-1])
        ok = torch.equal(d.x[:end], ref.x) and torch.equal(d.weights[:end], ref.weights)
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            buf.dispatch(x, idx, w, sync_free=True)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                buf.dispatch(x, idx, w, sync_free=True)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14)
        res[mode] = dict(host_us=(t1 - t0) / n * 1e6, call_us=(t2 - t0) / n * 1e6, checked=bool(ok))
        print(f"== {mode}: {res[mode]}\n{table}", flush=True)
        buf.close()
    if a.json and dist.get_rank() == 0:
        with open(a.json, "w") as f:
            json.dump(dict(command="torchrun --nproc-per-node 1 benchmarks/probes/nccl_sync_free_profile.py --tokens "
                           f"{T} --modes {' '.join(a.modes)}", tokens=T, **res), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
