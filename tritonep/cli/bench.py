"""``tritonep bench``: GPU benchmarks against NCCL in the same run, and checked soaks (CPU or GPU)."""

from __future__ import annotations

import json

import torch

from ..bench.check import exit_code
from ..bench.meta import run_meta
from ..bench.profiles import DEFAULT_INTERMEDIATE
from .help import EpilogTableFormatter

__all__ = ["add_parser", "main", "bench_rank", "profiles_epilog"]

OPS = ("dispatch", "combine", "moe", "planner")
CPU_PROFILE = "cpu-smoke"
"""The one profile that runs without a GPU: a CPU world of Triton-interpreted ranks runs every point and its
check (interpreter times, no performance meaning)."""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--world-size 0`` is refused by the parser: one line, exit 2)."""
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


BENCH_DESCRIPTION = """\
Times tritonep's dispatch / combine (or the MoE layer, or the planner) on GPUs against NCCL in the same
run, one rank per GPU, and checks every point after timing it. Without a GPU: --profile cpu-smoke runs
every point and its check in a CPU world (interpreter times), --soak N runs N checked steps.

dispatch / combine table, a row per point: op = tritonep.<call>.<wire> (EPBuffer, triton backend;
.kept = dispatch with keep_quantized=True), tritonep[nccl].* (the nccl backend), nccl.* (plain NCCL:
a2a = all_to_all_single alone, pipeline = the pack + all_to_all + unpack a user writes); sms = the SM
cap (0: the kernel-tile table's grids); mode = graph (CUDA-graph replays) or eager (an op measured both
ways has a row per mode; on a CPU both rows say cpu); us r0 / us max = median microseconds per call on
rank 0 / on the slowest rank; logical GB/s = received rows x hidden x 2 bytes per second, NVLink GB/s =
the bytes that cross to other ranks; checked = every rank's output equals the reference.
More: benchmarks/README.md, docs/performance.md."""


def add_parser(sub):
    """Register ``tritonep bench`` and its flags on the ``sub`` subparsers action."""
    from ..bench.profiles import PROFILES

    p = sub.add_parser("bench", formatter_class=EpilogTableFormatter, epilog=profiles_epilog(PROFILES),
                       help="benchmarks vs NCCL all_to_all_single (GPU) and --soak checks",
                       description=BENCH_DESCRIPTION)
    p.add_argument("op", choices=OPS, help="what to measure: dispatch/combine (one run measures both rows), moe (the "
                                            "MoE layer fwd+bwd vs the torch + NCCL reference at the profile's shape "
                                            "and expert width), planner (virtual-expert planner, one GPU)")
    p.add_argument("--profile", default="deepseek-v3",
                   help=f"one of: {', '.join(sorted(PROFILES))} (their shapes: the table below)")
    p.add_argument("--tokens", type=positive_int, nargs="*", default=None,
                   help="tokens per rank instead of the profile's (several values: a sweep, see --plot)")
    p.add_argument("--num-sms", type=int, nargs="*", default=[0], help="SM caps to measure (0 = kernel-tile table)")
    p.add_argument("--iters", type=positive_int, default=30, help="timed iterations (median reported)")
    p.add_argument("--world-size", type=positive_int, default=None,
                   help="ranks, >= 1 (default: every GPU; on a CPU: 2); more ranks than GPUs share GPUs round-robin "
                        "(time-sliced, or --mps): they run and check, but timings then measure nothing about NVLink")
    p.add_argument("--mps", choices=["off", "on", "auto"], default="off",
                   help="ranks that share a GPU: off = time-sliced; on = a private MPS daemon (refused if it cannot "
                        "start); auto = MPS if it starts")
    p.add_argument("--soak", type=int, default=0,
                   help="instead of timing, N checked steps with fresh random routing and token counts (CPU too; "
                        "--profile does not apply). dispatch/combine: N dispatch+combine calls, each equal bit for "
                        "bit to the reference (CPU E8 H64 T<=12 K3, GPU E64 H1024 T<=256 K6); moe: N MoE layer "
                        "forward+backward steps, output and every gradient within 3e-2 of the dense fp32 reference "
                        "(CPU E8 H64 I32 T<=8 K2, GPU E64 H1024 I512 T<=256 K6); E is rounded up to a multiple of "
                        "the world size")
    p.add_argument("--json", default="", help="write the rows to this JSON file")
    p.add_argument("--plot", default="", help="write a PNG of NVLink GB/s vs tokens per rank (use with a --tokens sweep)")
    p.set_defaults(func=main)


def profiles_epilog(profiles: dict) -> str:
    """The ``--help`` epilog of ``tritonep bench``: one line per profile of ``profiles`` (:data:`tritonep.bench.ep.
    PROFILES`) with its hidden size, experts, top-k and tokens per rank, and what else it sets."""
    head = ("profile", "hidden", "experts", "top-k", "tokens/rank", "interm.")
    rows = []
    for name, p in profiles.items():
        tokens = str(p["tokens"]) if p["tokens"] else "trace/W"
        inter = str(p.get("intermediate", DEFAULT_INTERMEDIATE))
        notes = []
        if "trace_layer" in p:
            notes.append(f"FLAME-MoE-290M trace layer {p['trace_layer']}, its tokens split over W ranks")
        if "geometry" in p:
            notes.append(f"TRITONEP_GEOMETRY={p['geometry']}")
        if "note" in p:  # what the shape alone does not say (help text only)
            notes.append(p["note"])
        rows.append((name, str(p["hidden"]), str(p["num_experts"]), str(p["topk"]), tokens, inter,
                     "; ".join(notes)))
    width = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = "  {:<%d}  {:>%d}  {:>%d}  {:>%d}  {:>%d}  {:>%d}" % tuple(width)
    lines = ["profiles (tritonep/bench/profiles.py; --profile; --tokens replaces the tokens per rank; interm. = the "
             "expert width of `moe`):", fmt.format(*head)]
    lines += [(fmt.format(*r[:6]) + (f"  {r[6]}" if r[6] else "")) for r in rows]
    return "\n".join(lines)


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


def _soak(con, args, ngpu) -> int:
    """``tritonep bench OP --soak N``: N checked steps (dispatch/combine: bitwise; moe: fwd+bwd vs the dense
    reference). Returns 0 when every step passed, 1 otherwise.

    Raises:
        ConfigError: ``--soak`` for ``planner``, N < 1, or a world size that is not 1..64 (CPU) / 1..#GPUs.
    """
    from ..errors import ConfigError

    if args.op == "planner":
        raise ConfigError("--soak is for dispatch, combine and moe; the planner is checked by `tritonep bench planner` "
                          "(on a GPU: equal to its pure-torch version) and shown by `tritonep plan` (CPU too)")
    if args.soak < 1:
        raise ConfigError(f"--soak {args.soak} must be >= 1 (steps)")
    W = args.world_size if args.world_size is not None else (min(ngpu, 8) if ngpu else 2)
    if W < 1 or W > 64:
        raise ConfigError(f"--world-size {W} must be in 1..64 ({f'{ngpu} CUDA GPUs' if ngpu else 'CPU world'})")
    if ngpu:
        world = _gpu_world(con, args, W, ngpu)
    else:
        from ..testing import run_cpu_world as world
    if args.op == "moe":
        from ..bench.moe_soak import TOL, moe_soak_world
        from ..moe import MoEGeometry, MoERecipe
        from ..moe.recipe import check_config

        cfg = dict(E=8, H=64, I=32, Tmax=8, K=2) if not ngpu else dict(E=64, H=1024, I=512, Tmax=256, K=6)
        cfg["E"] = -(-cfg["E"] // W) * W
        check_config(MoERecipe(), MoEGeometry(hidden=cfg["H"], intermediate=cfg["I"], num_experts=cfg["E"],
                                              topk=cfg["K"], max_tokens_per_rank=cfg["Tmax"]), W)
        res = world(W, moe_soak_world, args.soak, cfg, timeout_s=max(600, 60 * args.soak))
        bad = sorted({i for _, b, _ in res for i in b})
        worst = max(r[2] for r in res)
        con.print(f"MoE soak: {args.soak} forward+backward steps x {W} ranks, {cfg}: worst relative error "
                  f"{worst:.2e} (tolerance {TOL:g}): "
                  + ("[green]all within tolerance of the dense reference[/]" if not bad
                     else f"[red]failing steps {bad}[/]"))
        return 1 if bad else 0
    from ..bench.soak import soak_world

    cfg = dict(E=8, H=64, Tmax=12, K=3) if not ngpu else dict(E=64, H=1024, Tmax=256, K=6)
    cfg["E"] = -(-cfg["E"] // W) * W
    res = world(W, soak_world, args.soak, cfg, timeout_s=max(600, 3 * args.soak))
    bad = sorted({i for _, b in res for i in b})
    con.print(f"soak: {args.soak} calls x {W} ranks, {cfg}: "
              + ("[green]all equal to the reference[/]" if not bad else f"[red]failing calls {bad}[/]"))
    return 1 if bad else 0


def main(args) -> int:
    """``tritonep bench``: 0 when measured (or every soak step passed), 1 when a check failed; refusals raise
    :class:`tritonep.errors.ConfigError` (one line, exit 2)."""
    from ..bench.ep import PROFILES
    from ..errors import ConfigError
    from .console import make_console

    con = make_console()
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.soak:
        return _soak(con, args, ngpu)
    if args.profile not in PROFILES:
        raise ConfigError(f"unknown profile {args.profile!r}; valid profiles: {', '.join(sorted(PROFILES))}")
    if args.plot:
        from .run import _need_matplotlib

        _need_matplotlib()
    if args.op == "planner":
        return _planner(con, args, ngpu)
    if ngpu < 1:
        if args.profile == CPU_PROFILE:
            return _cpu_smoke(con, args)
        raise ConfigError(f"timing {args.op} needs CUDA GPUs (found none); on a CPU run `tritonep bench {args.op} "
                          f"--profile {CPU_PROFILE}` (every point and its check, in a CPU world; interpreter times) or "
                          f"`tritonep bench {args.op} --soak N` (N checked steps)")
    W = args.world_size if args.world_size is not None else ngpu
    if not 2 <= W <= 64:
        raise ConfigError(f"--world-size {W} must be in 2..64 (timing needs at least 2 ranks; {ngpu} CUDA GPU(s) "
                          f"here: --world-size 2 puts 2 ranks on one GPU, whose timings measure nothing about NVLink)")
    run_gpu_world = _gpu_world(con, args, W, ngpu)
    if args.op == "moe":
        return _moe(con, args, W, run_gpu_world)
    res = run_gpu_world(W, bench_rank, args.op, args.profile, args.num_sms, args.iters, args.tokens,
                        timeout_s=900)
    _ep_table(con, res, f"tritonep bench {args.profile} (world {W}); peer copy {res[0][0]['peer_copy_gbps']:.0f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=run_meta(world_size=W), world_size=W, world=res.info.as_dict(),
                           timing_note=res.info.timing_note(), rows=res), f, indent=1)
    if args.plot:
        from ..bench.plot import plot_gbps_vs_tokens

        plot_gbps_vs_tokens(res[0], args.plot)
        con.print(f"wrote {args.plot}")
    return exit_code([r for rs in res for r in rs])


def _ep_table(con, res, title: str) -> None:
    """Print the dispatch / combine rows of every rank of ``res`` (one row per point: rank 0's time, the slowest
    rank's, bandwidths and whether every rank's check passed)."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(title))
    for c in ("op", "sms", "mode", "us r0", "us max", "logical GB/s", "NVLink GB/s", "checked"):
        t.add_column(c)
    for i, r in enumerate(res[0]):
        us_max = max(rs[i]["us"] for rs in res)
        ok = all(rs[i].get("checked") for rs in res)
        cpu = r["mode"] == "cpu"  # interpreter times: no bandwidth is measured
        t.add_row(escape(r["op"]), str(r["num_sms"]), r["mode"], f"{r['us']:.1f}", f"{us_max:.1f}",
                  "-" if cpu else f"{r['logical_gbps']:.0f}", "-" if cpu else f"{r['nvlink_gbps']:.0f}",
                  "ok" if ok else "FAILED")
    con.print(t)


def cpu_smoke_rank(group, op, tokens):
    """Rank body of ``tritonep bench dispatch|combine|moe --profile cpu-smoke`` in a CPU world: dispatch / combine
    rows of the profile (every wire, both backends, the NCCL baselines; one timed call each) or the MoE layer at the
    profile's shape (intermediate 32), each checked."""
    from ..bench.ep import PROFILES, bench_ep

    if op == "moe":
        from ..bench.moe import moe_bench_world

        p = PROFILES[CPU_PROFILE]
        cfg = dict(tokens=(tokens or [p["tokens"]])[0], hidden=p["hidden"], intermediate=p["intermediate"],
                   num_experts=p["num_experts"], topk=p["topk"], skew=False, balance=["none"])
        return moe_bench_world(group, cfg, 1, 1)
    rows = []
    for t in (tokens or [None]):
        for r in bench_ep(group, CPU_PROFILE, iters=1, tokens=t):
            r.update(num_sms=0, peer_copy_gbps=None, op_group=op)
            rows.append(r)
    return rows


def _cpu_smoke(con, args) -> int:
    """``tritonep bench dispatch|combine|moe --profile cpu-smoke`` without a GPU: the profile's points in a CPU world
    (default 2 ranks), each checked; the times are interpreter times."""
    from ..errors import ConfigError
    from ..testing import run_cpu_world

    W = args.world_size if args.world_size is not None else 2
    if not 2 <= W <= 8:
        raise ConfigError(f"--world-size {W}: --profile {CPU_PROFILE} runs 2..8 CPU ranks (its 8 experts are split "
                          f"over them)")
    if args.plot:
        raise ConfigError(f"--plot draws NVLink GB/s of a GPU run; --profile {CPU_PROFILE} measures no bandwidth")
    con.print(f"tritonep bench: no GPU -> CPU world of {W} ranks (Triton interpreter), profile {CPU_PROFILE}: every "
              f"point checked; the times are interpreter times, not a measurement", soft_wrap=True)
    res = run_cpu_world(W, cpu_smoke_rank, args.op, args.tokens, timeout_s=1800)
    if args.op == "moe":
        checks = [c for o in res for c in o["checks"]]
        layers = ", ".join(dict.fromkeys(c["op"] for c in checks))
        con.print(f"MoE layer fwd+bwd ({CPU_PROFILE}, CPU world of {W}): {sum(c['checked'] for c in checks)} of "
                  f"{len(checks)} layer outputs ({W} ranks x {layers}) within tolerance of the dense fp32 reference")
        rows = checks
    else:
        _ep_table(con, res, f"tritonep bench {CPU_PROFILE} (CPU world of {W}; interpreter times)")
        rows = [r for rs in res for r in rs]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=run_meta(world_size=W), world_size=W, device="cpu", rows=list(res)), f, indent=1)
    return exit_code(rows)


def _planner(con, args, ngpu) -> int:
    """``tritonep bench planner``: planner time at the profile's tokens / experts / top-k (one GPU)."""
    from rich.table import Table

    from ..bench.ep import PROFILES
    from ..bench.planner import bench_planner

    if ngpu < 1:
        from ..errors import ConfigError

        raise ConfigError("tritonep bench planner needs a CUDA GPU (found none); `tritonep plan` shows the plan on "
                          "a CPU")
    p = PROFILES[args.profile]
    rows = bench_planner(worlds=(args.world_size,) if args.world_size is not None else (2, 4, 8),
                         tokens=(args.tokens or [p["tokens"] or 4096])[0], topk=p["topk"], num_experts=p["num_experts"],
                         iters=args.iters)
    t = Table(title=f"tritonep bench planner ({args.profile})")
    for c in ("world", "experts", "tokens", "top-k", "graph us", "eager us", "checked (== torch reference)"):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["world_size"]), str(r["num_experts"]), str(r["tokens"]), str(r["topk"]),
                  f"{r['graph_us']:.1f}", f"{r['eager_us']:.1f}", "ok" if r["checked"] else "FAILED")
    con.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=run_meta(world_size=1), rows=rows), f, indent=1)
    return exit_code(rows)


def _gpu_world(con, args, W: int, ngpu: int):
    """``run_gpu_world`` with the ``--mps`` choice, after one line saying how the ranks are placed (and, when they
    share a GPU, that timings then measure nothing about NVLink); the results' ``.info`` says how they ran.

    Raises:
        ConfigError: more than 8 ranks on one GPU.
    """
    from ..testing import run_gpu_world
    from ..testing.placement import plan_world

    mps = {"off": False, "on": True, "auto": "auto"}[args.mps]
    planned = plan_world(W, [f"cuda:{i}" for i in range(ngpu)], mps=bool(mps))
    con.print(f"tritonep bench: {planned.describe()}", soft_wrap=True)
    if planned.timing_note():
        con.print(f"[bold yellow]note[/]: {planned.timing_note()}", soft_wrap=True)

    def world(world_size, fn, *fargs, **kw):
        return run_gpu_world(world_size, fn, *fargs, mps=mps, **kw)

    return world


def _moe(con, args, W, run_gpu_world) -> int:
    """``tritonep bench moe``: the MoE layer fwd+bwd vs the torch + NCCL reference layer (every GPU)."""
    from ..bench.ep import PROFILES
    from ..bench.moe import moe_bench_world

    p = PROFILES[args.profile]
    cfg = dict(tokens=(args.tokens or [p["tokens"] or 4096])[0], hidden=p["hidden"],
               intermediate=p.get("intermediate", DEFAULT_INTERMEDIATE),
               num_experts=p["num_experts"], topk=p["topk"], skew=False, balance=["none"])
    res = run_gpu_world(W, moe_bench_world, cfg, args.iters, timeout_s=1800)
    tep = max(o["tritonep.none"] for o in res)
    ref = max(o["reference"] for o in res)
    con.print(f"MoE layer fwd+bwd ({args.profile}, world {W}, {cfg['tokens']} tokens/rank): tritonep "
              f"{tep * 1e3:.2f} ms, torch + NCCL reference {ref * 1e3:.2f} ms, speedup {ref / tep:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=run_meta(world_size=W), cfg=cfg, world=res.info.as_dict(),
                           timing_note=res.info.timing_note(), ranks=res), f, indent=1)
    return exit_code([c for o in res for c in o["checks"]])
