"""``tritonep bench``: GPU benchmarks against NCCL in the same run, and checked soaks (CPU or GPU)."""

from __future__ import annotations

import argparse

import json

import torch

__all__ = ["add_parser", "main", "bench_rank"]

OPS = ("dispatch", "combine")


def add_parser(sub):
    from ..bench.ep import PROFILES

    p = sub.add_parser("bench", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="benchmarks vs NCCL all_to_all_single (GPU) and --soak checks")
    p.add_argument("op", choices=OPS, help="what to measure (one run measures both dispatch and combine rows; the "
                                            "MoE layer: benchmarks/moe_bench.py)")
    p.add_argument("--profile", default="deepseek-v3",
                   help=f"one of: {', '.join(sorted(PROFILES))} (hidden/experts/top-k/tokens per rank)")
    p.add_argument("--tokens", type=int, default=None, help="override tokens per rank of the profile")
    p.add_argument("--num-sms", type=int, nargs="*", default=[0], help="SM caps to measure (0 = geometry table)")
    p.add_argument("--iters", type=int, default=30, help="timed iterations (median reported)")
    p.add_argument("--world-size", type=int, default=0, help="ranks (default: every GPU; CPU soak: 2)")
    p.add_argument("--soak", type=int, default=0,
                   help="instead of timing: N dispatch+combine calls with fresh random routing and token counts, each "
                        "checked bit for bit against the reference (fixed small shape: CPU E8 H64 T<=12 K3, GPU E64 "
                        "H1024 T<=256 K6; --profile does not apply)")
    p.add_argument("--json", default="", help="write the rows to this JSON file")
    p.set_defaults(func=main)


def bench_rank(group, op, profile, sms_list, iters, tokens):
    from ..bench.ep import bench_ep, peer_copy_gbps

    rows = []
    pc = peer_copy_gbps(group)
    for sms in sms_list:
        for r in bench_ep(group, profile, num_sms=sms or None, iters=iters, tokens=tokens):
            r.update(num_sms=sms, peer_copy_gbps=pc, op_group=op)
            rows.append(r)
    return rows


def main(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..bench.ep import PROFILES

    con = Console()
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.soak:
        from ..bench.soak import soak_world

        cfg = dict(E=8, H=64, Tmax=12, K=3) if not ngpu else dict(E=64, H=1024, Tmax=256, K=6)
        W = args.world_size or (min(ngpu, 8) if ngpu else 2)
        if ngpu:
            from ..testing import run_gpu_world as world
        else:
            from ..testing import run_cpu_world as world
        res = world(W, soak_world, args.soak, cfg, timeout_s=max(600, 3 * args.soak))
        bad = sorted({i for _, b in res for i in b})
        con.print(f"soak: {args.soak} calls x {W} ranks, {cfg}: "
                  + ("[green]all equal to the reference[/]" if not bad else f"[red]failing calls {bad}[/]"))
        return 1 if bad else 0
    if args.profile not in PROFILES:
        con.print(f"[red]unknown profile {args.profile!r}[/]; valid profiles: {', '.join(sorted(PROFILES))}")
        return 2
    if ngpu < 2:
        con.print(f"[red]tritonep bench {args.op} needs at least 2 CUDA GPUs (found {ngpu})[/]; on a CPU run "
                  f"`tritonep bench dispatch --soak N` for checked calls")
        return 2
    from ..testing import run_gpu_world

    W = args.world_size or ngpu
    res = run_gpu_world(W, bench_rank, args.op, args.profile, args.num_sms, args.iters, args.tokens,
                        timeout_s=900)
    t = Table(title=f"tritonep bench {args.profile} (world {W}); peer copy {res[0][0]['peer_copy_gbps']:.0f} GB/s")
    for c in ("op", "sms", "mode", "us r0", "us max", "logical GB/s", "NVLink GB/s"):
        t.add_column(c)
    for i, r in enumerate(res[0]):
        us_max = max(res[k][i]["us"] for k in range(W))
        t.add_row(r["op"], str(r["num_sms"]), r["mode"], f"{r['us']:.1f}", f"{us_max:.1f}",
                  f"{r['logical_gbps']:.0f}", f"{r['nvlink_gbps']:.0f}")
    con.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(world_size=W, rows=res), f, indent=1)
    return 0
