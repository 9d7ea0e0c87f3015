"""Peers: tritonep's dispatch + combine vs torchtitan 0.3.0 MinimalAsyncEP's (the nearest public peer: Triton over
torch symmetric memory, no CPU sync), same inputs, outputs cross-checked, eager and CUDA graph; JSON.

    torchrun --nproc-per-node 1 benchmarks/peer_bench.py --json $OUT/peer_bench.json

Shape: ``--profile`` of tritonep/bench/profiles.py (default DeepSeek-V3), 128 and 4096 tokens per rank
(``--tokens``). Per point, each side
runs its round trip (dispatch, then combine of the received rows as the expert output): tritonep synced (one host
read per dispatch), tritonep ``sync_free=True`` and MinimalAsyncEP (its ``dispatch_op`` / ``combine_op``, as its
token dispatcher calls them), eager (median of 3 rounds of ``--iters`` calls, CUDA events) and replayed from a CUDA
graph. Check: every side's ``y`` against the fp32 oracle ``y[t] = x[t] * sum_k w[t, k]`` (relative max error; bf16
rows, so <= 2e-2 passes), and against each other. Exit code 1 if a check fails.

Needs torchtitan (and its import-time dependency spmd_types) importable; a GPU machine without internet gets them as
wheels: ``bash scripts/gpu.sh wheels`` here, then ``bash scripts/gpu.sh peers`` there (docs/gpu.md).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tritonep as tep  # noqa: E402
from tritonep.bench.ep import time_graph, time_rounds  # noqa: E402


def _inputs(rank, T, H, E, K, dev, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(T, H, generator=g).bfloat16().to(dev)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    return x, idx, w


def _err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def bench_point(group, T, H, E, K, iters):
    from torchtitan.distributed.minimal_async_ep import api as mae

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = _inputs(rank, T, H, E, K, dev)
    oracle = x.float() * w.sum(1, keepdim=True)
    L = E // W
    buf = tep.EPBuffer(group, E, H, T, K, max_recv_tokens=W * T * min(K, L))
    if mae._buffer_key is None:
        mae.init_buffer(group, H, T, L, K, torch.bfloat16, dev)
    cap = W * T * min(K, L)

    def tep_round(sync_free):
        d = buf.dispatch(x, idx, w, sync_free=sync_free)
        return buf.combine(d.x, d.handle)

    def mae_round():
        counts = torch.bincount(idx.reshape(-1), minlength=E)  # what torchtitan's router hands the dispatcher
        o = mae.dispatch_op(x, idx, counts, cap, W)
        y, _ = mae.combine_op(o[0], o[1], o[2], o[3], o[4], o[5], o[7], o[6], w.reshape(-1), T, K)
        return y

    sides = {"tep": lambda: tep_round(False), "tep_sync_free": lambda: tep_round(True), "mae": mae_round}
    row = dict(T=T, H=H, E=E, K=K, world_size=W)
    ys = {}
    for name, fn in sides.items():
        ys[name] = fn()
        torch.cuda.synchronize()
        row[f"{name}_err_vs_oracle"] = _err(ys[name], oracle)
    row["mae_vs_tep_err"] = _err(ys["mae"], ys["tep"])
    row["tep_sync_free_equals_tep"] = bool(torch.equal(ys["tep_sync_free"], ys["tep"]))
    for name, fn in sides.items():
        fn()
        row[f"{name}_round_eager_us"] = time_rounds(fn, group, iters)
        try:
            row[f"{name}_round_graph_us"] = time_graph(fn, group, iters)[0]
        except Exception as e:  # noqa: BLE001 - a side that cannot be captured is a result, not a crash
            row[f"{name}_round_graph_us"] = f"capture failed: {type(e).__name__}: {str(e)[:160]}"
            torch.cuda.synchronize()
    row["eager_tep_over_mae"] = row["tep_round_eager_us"] / row["mae_round_eager_us"]
    row["eager_tep_sync_free_over_mae"] = row["tep_sync_free_round_eager_us"] / row["mae_round_eager_us"]
    row["checked"] = all(row[f"{n}_err_vs_oracle"] <= 2e-2 for n in sides) and row["mae_vs_tep_err"] <= 2e-2 and \
        row["tep_sync_free_equals_tep"]
    buf.close()
    mae._buffer_key = None  # the next point sizes MinimalAsyncEP's process-global buffer anew
    mae._buffer_state = None
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--profile", default="deepseek-v3", help="shape: a profile of tritonep/bench/profiles.py")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group("nccl")
    group = dist.group.WORLD
    import torchtitan

    rows = []
    for T in args.tokens:
        from tritonep.bench.profiles import profile_shape

        H, E, K, _ = profile_shape(args.profile)
        row = bench_point(group, T, H, E, K, args.iters)
        row.update(profile=args.profile, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   torchtitan=getattr(torchtitan, "__version__", "0.3.0"), tritonep=tep.__version__)
        rows.append(row)
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    if args.json and dist.get_rank() == 0:
        from tritonep.bench.meta import run_meta

        with open(args.json, "w") as f:
            json.dump(dict(meta=run_meta(world_size=dist.get_world_size()), rows=rows), f, indent=1)
    dist.destroy_process_group()
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
