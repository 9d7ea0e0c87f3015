"""``tritonep bench``: GPU benchmarks against NCCL in the same run, and checked soaks (CPU or GPU)."""

from __future__ import annotations

import json

import torch

from .help import HelpFormatter

__all__ = ["add_parser", "main", "bench_rank"]

OPS = ("dispatch", "combine", "moe", "planner")


def add_parser(sub):
    from ..bench.ep import PROFILES

    p = sub.add_parser("bench", formatter_class=HelpFormatter,
                       help="benchmarks vs NCCL all_to_all_single (GPU) and --soak checks")
    p.add_argument("op", choices=OPS, help="what to measure: dispatch/combine (one run measures both rows), moe (the "
                                            "MoE layer fwd+bwd vs the torch + NCCL reference; --profile deepseek-v3 "
                                            "shapes, intermediate 2048), planner (virtual-expert planner, one GPU)")
    p.add_argument("--profile", default="deepseek-v3",
                   help=f"one of: {', '.join(sorted(PROFILES))} (hidden/experts/top-k/tokens per rank)")
    p.add_argument("--tokens", type=int, nargs="*", default=None,
                   help="tokens per rank instead of the profile's (several values: a sweep, see --plot)")
    p.add_argument("--num-sms", type=int, nargs="*", default=[0], help="SM caps to measure (0 = geometry table)")
    p.add_argument("--iters", type=int, default=30, help="timed iterations (median reported)")
    p.add_argument("--world-size", type=int, default=0, help="ranks (default: every GPU; CPU soak: 2)")
    p.add_argument("--soak", type=int, default=0,
                   help="instead of timing: N dispatch+combine calls with fresh random routing and token counts, each "
                        "checked bit for bit against the reference (fixed small shape: CPU E8 H64 T<=12 K3, GPU E64 "
                        "H1024 T<=256 K6; --profile does not apply)")
    p.add_argument("--json", default="", help="write the rows to this JSON file")
    p.add_argument("--plot", default="", help="write a PNG of NVLink GB/s vs tokens per rank (use with a --tokens sweep)")
    p.set_defaults(func=main)


def bench_rank(group, op, profile, sms_list, iters, tokens):
    """Rank body: every row of ``profile`` for each SM cap and each token count (``tokens``: list or None)."""
    from ..bench.ep import bench_ep, peer_copy_gbps

    rows = []
    pc = peer_copy_gbps(group)
    for t in (tokens or [None]):
        for sms in sms_list:
            for r in bench_ep(group, profile, num_sms=sms or None, iters=iters, tokens=t):
                r.update(num_sms=sms, peer_copy_gbps=pc, op_group=op)
                rows.append(r)
    return rows


def main(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..bench.ep import PROFILES

    import shutil

    con = Console(width=max(shutil.get_terminal_size((140, 24)).columns, 120))  # no mid-line wraps in logs
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
    if args.op == "planner":
        return _planner(con, args, ngpu)
    if ngpu < 2:
        con.print(f"[red]tritonep bench {args.op} needs at least 2 CUDA GPUs (found {ngpu})[/]; on a CPU run "
                  f"`tritonep bench dispatch --soak N` for checked calls")
        return 2
    from ..testing import run_gpu_world

    W = args.world_size or ngpu
    if args.op == "moe":
        return _moe(con, args, W)
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
    if args.plot:
        from ..bench.plot import plot_gbps_vs_tokens

        plot_gbps_vs_tokens(res[0], args.plot)
        con.print(f"wrote {args.plot}")
    return 0


def _planner(con, args, ngpu) -> int:
    """``tritonep bench planner``: planner time at the profile's tokens / experts / top-k (one GPU)."""
    from rich.table import Table

    from ..bench.ep import PROFILES
    from ..bench.planner import bench_planner

    if ngpu < 1:
        con.print("[red]tritonep bench planner needs a CUDA GPU (found none)[/]; `tritonep plan` shows the plan on a CPU")
        return 2
    p = PROFILES[args.profile]
    rows = bench_planner(worlds=(args.world_size,) if args.world_size else (2, 4, 8),
                         tokens=(args.tokens or [p["tokens"] or 4096])[0], topk=p["topk"], num_experts=p["num_experts"],
                         iters=args.iters)
    t = Table(title=f"tritonep bench planner ({args.profile})")
    for c in ("world", "experts", "tokens", "top-k", "graph us", "eager us", "equal to twins"):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["world_size"]), str(r["num_experts"]), str(r["tokens"]), str(r["topk"]),
                  f"{r['graph_us']:.1f}", f"{r['eager_us']:.1f}", str(r["equal_to_torch"]))
    con.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows), f, indent=1)
    return 0 if all(r["equal_to_torch"] for r in rows) else 1


def _moe(con, args, W) -> int:
    """``tritonep bench moe``: the MoE layer fwd+bwd vs the torch + NCCL reference layer (every GPU)."""
    from ..bench.ep import PROFILES
    from ..bench.moe import moe_bench_world
    from ..testing import run_gpu_world

    p = PROFILES[args.profile]
    cfg = dict(tokens=(args.tokens or [p["tokens"] or 4096])[0], hidden=p["hidden"], intermediate=2048,
               num_experts=p["num_experts"], topk=p["topk"], skew=False, balance=["none"])
    res = run_gpu_world(W, moe_bench_world, cfg, args.iters, timeout_s=1800)
    tep = max(o["tritonep.none"] for o in res)
    ref = max(o["reference"] for o in res)
    con.print(f"MoE layer fwd+bwd ({args.profile}, world {W}, {cfg['tokens']} tokens/rank): tritonep "
              f"{tep * 1e3:.2f} ms, torch + NCCL reference {ref * 1e3:.2f} ms, speedup {ref / tep:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cfg=cfg, ranks=res), f, indent=1)
    return 0
