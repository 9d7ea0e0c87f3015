"""``tritonep run``: the main job — an MoE layer forward+backward per traced layer, on real routing, checked.

Every rank (one per local GPU, or ``--world-size`` ranks placed round-robin on the GPUs, sharing them when there are
fewer GPUs than ranks; a CPU world of ``--world-size`` forked ranks when there is no GPU) builds one
:class:`tritonep.MoELayer` per layer of the trace, routes its share of the trace's tokens through it (the real
FLAME-MoE-290M router decisions by default, tokens drawn from an OLMoE load histogram, or your own router's routing
file: ``--routing PATH``, see :mod:`tritonep.data.routing_file`), runs forward and backward,
and returns outputs, gradients and timings. The parent checks everything against the single-process dense reference
(:func:`tritonep.reference.moe_dense_reference` + autograd) with the same weights and routing, prints one table row
per layer and exits 1 if any check fails.

Tolerance: relative max error ``max|got - ref| / max|ref| <= 3e-2`` for the output and every gradient (bf16 inputs,
weights and wires; fp32 accumulation). Quantized wires use their record's tolerance
(:attr:`tritonep.wire.WireFormat.tolerance`: fp8 0.15, mxfp4 0.5, fp8_e5m2 0.3; quantization error, see docs/wire-formats.md).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ..wire.formats import WIRE_FORMATS, WIRES
from .help import HelpFormatter
from .progress import ProgressLines, report

__all__ = ["add_parser", "main", "run_rank"]

TOL = {name: f.tolerance for name, f in WIRE_FORMATS.items()}
"""Relative tolerance of the check per wire (the wire records' own)."""


def add_parser(sub):
    """Register ``tritonep run`` and its flags on the ``sub`` subparsers action."""
    p = sub.add_parser("run", formatter_class=HelpFormatter,
                       help="MoE layer fwd+bwd per traced layer on real routing, checked against a dense "
                                   "reference (the main job)",
                       description="The main job: an MoE layer (router decisions from a trace or histogram, SwiGLU "
                                   "experts) forward and backward per traced layer, on every local GPU or, without "
                                   "one, a CPU world of 4 ranks (kernels in Triton's interpreter; about 1 min on 2 "
                                   "cores). Prints a progress line per layer on stderr, then a table on stdout with a "
                                   "row per layer: tokens over all ranks, balancedness (mean/max routes per rank, 1.0 "
                                   "= even), dispatch / GEMM / combine milliseconds of the forward (interpreter times "
                                   "on a CPU), step = forward + backward, and the largest relative error of the output "
                                   "and every gradient against a dense single-process reference. Exit 0 when every "
                                   "check passed. Routing files and exit codes: docs/cli.md.")
    from .routing import ROUTING_HELP

    p.add_argument("--routing", default="flame", metavar="flame|olmoe|PATH", help=ROUTING_HELP)
    p.add_argument("--layers", type=int, nargs="*", default=None,
                   help="layers to run (flame: 2..9, olmoe: 0 7 15, a file: its layer numbers); default: all")
    p.add_argument("--domain", default="arxiv",
                   help="OLMoE domain for --routing olmoe: arxiv, book, c4, github, wikipedia, tulu")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per rank (default: 64 on CPU, 1024 on GPU, capped at what a trace holds: flame has "
                        "2048 tokens per layer in all; asking a trace for more is an error)")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks (default: one per GPU; 4 in the CPU world when there is no GPU). More ranks than GPUs "
                        "share GPUs round-robin (gloo group; time-sliced, or --mps): checked the same, but the "
                        "timings then measure nothing about NVLink")
    p.add_argument("--mps", choices=["off", "on", "auto"], default="off",
                   help="ranks that share a GPU: off = time-sliced; on = a private MPS daemon for this run, so they "
                        "run at once (refused if it cannot start); auto = MPS if it starts, else time-sliced")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: 2048 on a GPU; on a CPU 64, or the "
                   "wires' block if larger: 128 with fp8 / fp8_e5m2)")
    p.add_argument("--intermediate", type=int, default=None, help="expert FFN width (default 32 CPU / 1024 GPU)")
    p.add_argument("--num-experts", type=int, default=None,
                   help="experts (default: the source's experts, 64 for flame/olmoe, for a file its largest expert id "
                        "+ 1, rounded up to a multiple of the world size: 66 for 3 ranks); fewer than a trace's largest "
                        "id + 1 is an error, more is fine")
    p.add_argument("--topk", type=int, default=None,
                   help="top-k (default: a trace's own K, flame 6; histograms: the file's topk, else 8)")
    p.add_argument("--steps", type=int, default=1, help="forward+backward steps per layer")
    p.add_argument("--balance", choices=["none", "virtual"], default="none", help="virtual experts on/off")
    blocks = ", ".join(f"{n} {f.block}" for n, f in WIRE_FORMATS.items() if f.quantized)
    p.add_argument("--dispatch-wire", choices=list(WIRES), default="bf16",
                   help=f"wire format of dispatch (hidden must be a multiple of the wire's block: {blocks})")
    p.add_argument("--combine-wire", choices=list(WIRES), default="bf16",
                   help="wire format of the push combine (same hidden rules)")
    p.add_argument("--combine", choices=["push", "pull"], default="push",
                   help="combine kind (push: a quantized --combine-wire needs it; MoERecipe's own default is pull)")
    p.add_argument("--expert-alignment", type=int, default=1, help="row alignment of expert segments")
    p.add_argument("--no-check", action="store_true", help="skip the dense reference check (timing only)")
    p.add_argument("--json", default="", help="write per-layer results to this JSON file")
    p.add_argument("--plot", default="", help="write a PNG of per-rank load per layer (matplotlib)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before the whole world is killed")
    p.set_defaults(func=main)


def _settings(args, on_gpu, world_size):
    """The run's settings (JSON-serialisable, sent to every rank), every flag and the routing checked first.

    Raises:
        DataError: a bad routing file, layer, domain, --num-experts, --topk or --tokens (one line each).
        ConfigError: --world-size or --steps below 1, --timeout not positive.
    """
    from ..errors import ConfigError
    from .routing import check_layers, check_tokens, check_topk, resolve, token_split

    if world_size < 1:
        raise ConfigError(f"--world-size {world_size} must be >= 1")
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be >= 1")
    if not args.timeout > 0:
        raise ConfigError(f"--timeout {args.timeout:g} must be a positive number of seconds")
    src = resolve(args.routing, args.domain)
    layers = check_layers(src, args.layers)
    E = args.num_experts if args.num_experts is not None else src.default_num_experts(world_size)
    src.check_num_experts(E)
    topk = check_topk(src, args.topk, layers, E, args.domain)
    total = check_tokens(src, args.tokens, 1024 if on_gpu else 64, world_size, layers)
    s = dict(
        routing=args.routing, routing_name=src.name, domain=args.domain, layers=layers, topk=topk,
        total_tokens=total, tokens=max(token_split(total, world_size)),
        hidden=args.hidden if args.hidden is not None else (2048 if on_gpu else max(64, *(WIRE_FORMATS[w].block
                                                            for w in (args.dispatch_wire, args.combine_wire)))),
        intermediate=args.intermediate if args.intermediate is not None else (1024 if on_gpu else 32),
        num_experts=E, steps=args.steps, balance=args.balance,
        dispatch_wire=args.dispatch_wire, combine_wire=args.combine_wire, combine=args.combine,
        expert_alignment=args.expert_alignment, check=not args.no_check,
    )
    if args.routing != "olmoe":
        s.pop("domain")
    _check_widths(args, s)
    return s


def _check_widths(args, s) -> None:
    """``--hidden`` / ``--intermediate`` against the rules that apply to them, each named by its flag: a positive
    multiple of 8 (rows of 16 bytes), and for hidden the block of every quantized wire it travels on (fp8 128,
    mxfp4 32: one scale per block, no padding), so fp8 with ``--hidden 100`` names fp8's block, not the row rule.

    Raises:
        ConfigError: naming the flag, the value and a value that works.
    """
    from ..errors import ConfigError
    from ..moe.recipe import ROW_MULTIPLE

    for flag, v in (("--hidden", args.hidden), ("--intermediate", args.intermediate)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} {v} must be a positive integer")
    H = s["hidden"]
    for flag in ("--dispatch-wire", "--combine-wire"):
        wire = WIRE_FORMATS[s[flag[2:].replace("-", "_")]]
        if wire.quantized and H % wire.block:
            raise ConfigError(f"--hidden {H}: {flag} {wire.name} quantizes hidden in blocks of {wire.block} elements "
                              f"(one scale per block, no padding): use a multiple of {wire.block}, e.g. "
                              f"{-(-H // wire.block) * wire.block}")
    for flag, v in (("--hidden", H), ("--intermediate", s["intermediate"])):
        if v % ROW_MULTIPLE:
            raise ConfigError(f"{flag} {v} is not a multiple of {ROW_MULTIPLE} (rows must be multiples of 16 bytes "
                              f"for vectorised copies and torch._grouped_mm), e.g. "
                              f"{-(-v // ROW_MULTIPLE) * ROW_MULTIPLE}")


def layer_routing(s, layer, world_size):
    """Per-rank ``(topk_idx, topk_weights)`` for one layer (identical on every rank and in the parent)."""
    from .routing import layer_routing as _lr

    return _lr(s["routing"], layer, s["total_tokens"], world_size, s["num_experts"], s["topk"],
               s.get("domain", "arxiv"))


def run_rank(group, s):
    """Rank body: every layer, every step; returns per-layer dicts of CPU tensors and timings."""
    import torch.distributed as dist

    from ..moe import MoEGeometry, MoELayer, MoERecipe

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    recipe = MoERecipe(dispatch_wire=s["dispatch_wire"], combine_wire=s["combine_wire"], combine=s["combine"],
                       balance=s["balance"], expert_alignment=s["expert_alignment"])
    out = []
    if dev.type == "cuda":
        _check_rank_memory(s, W, rank, dev)
    progress = s.get("progress") if rank == 0 else None
    n = len(s["layers"])
    report(progress, f"{W} ranks started; running {n} layer{'s' if n != 1 else ''} (forward + backward"
                     + (f", {s['steps']} steps each" if s["steps"] > 1 else "") + ")")
    t_start = time.perf_counter()
    for li, layer in enumerate(s["layers"]):
        t_layer = time.perf_counter()
        parts = layer_routing(s, layer, W)
        idx, w = parts[rank]
        T = idx.shape[0]
        tmax = max(p[0].shape[0] for p in parts)
        geo = MoEGeometry(hidden=s["hidden"], intermediate=s["intermediate"], num_experts=s["num_experts"],
                          topk=s["topk"], max_tokens_per_rank=max(tmax, 1))
        moe = MoELayer(recipe, geo, group, device=dev, seed=1000 + layer, record_stats=True)
        g = torch.Generator().manual_seed(layer * 100 + rank)
        x0 = torch.randn(T, s["hidden"], generator=g).to(torch.bfloat16)
        gy = torch.randn(T, s["hidden"], generator=g).to(torch.bfloat16)
        rec = {"layer": layer, "tokens": T, "timings": []}
        for step in range(s["steps"]):
            x = x0.to(dev).clone().requires_grad_(True)
            wt = w.to(dev).clone().requires_grad_(True)
            for p in moe.parameters():
                p.grad = None
            t0 = time.perf_counter()
            y = moe(x, topk_idx=idx.to(dev), topk_weights=wt)
            (y.float() * gy.to(dev).float()).sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            tim = dict(getattr(moe, "last_timings", {}))
            tim["step_s"] = time.perf_counter() - t0
            rec["timings"].append(tim)
        rec["recv_per_expert"] = list(getattr(moe, "last_stats", {}).get("num_tokens_per_expert", []))
        if s["check"]:
            rec.update(x=x0, gy=gy, y=y.detach().cpu(), gx=x.grad.cpu(), gw=wt.grad.cpu(),
                       gw1=moe.w1.grad.detach().float().cpu(), gw2=moe.w2.grad.detach().float().cpu())
        moe.close()
        out.append(rec)
        report(progress, f"layer {layer} done ({li + 1} of {len(s['layers'])}) in "
                         f"{time.perf_counter() - t_layer:.1f} s, {time.perf_counter() - t_start:.0f} s so far")
    return out


def _check_rank_memory(s, world_size, rank, dev) -> None:
    """On a GPU rank, before the first allocation: the run's sizes against the free memory of its device (shared with
    the other ranks placed there) and, on rank 0, the reference check's against cuda:0's total memory.

    Raises:
        ConfigError: the sizes cannot fit (one line, see :mod:`tritonep.cli.memory`).
    """
    from ..testing import gpu_world_info
    from .memory import check_device_memory, run_memory

    info = gpu_world_info()
    here = str(dev)
    sharing = sum(1 for d in info.devices if str(d) == here) if info is not None else 1
    free, total = torch.cuda.mem_get_info(dev)
    check_device_memory(run_memory(s, world_size, "cuda"), free, sharing,
                        total if rank == 0 and s["check"] else None)


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def check_layer(s, li, layer, results, world_size):
    """Dense reference for one layer; returns dict of max relative errors.

    Runs on the GPU when there is one (cuda:0, after the ranks finished), else on the CPU;
    :meth:`MoELayer.init_expert_weights` rebuilds the ranks' expert weights bit for bit on any GPU, whatever SM share
    the ranks saw (MPS).
    """
    from ..moe import MoEGeometry, MoELayer
    from ..reference import moe_dense_reference

    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    parts = layer_routing(s, layer, world_size)
    tmax = max(p[0].shape[0] for p in parts)
    geo = MoEGeometry(hidden=s["hidden"], intermediate=s["intermediate"], num_experts=s["num_experts"],
                      topk=s["topk"], max_tokens_per_rank=max(tmax, 1))
    w1, w2 = MoELayer.init_expert_weights(geo, seed=1000 + layer, dtype=torch.bfloat16, device=dev)
    w1 = w1.float().requires_grad_(True)
    w2 = w2.float().requires_grad_(True)
    recs = [results[r][li] for r in range(world_size)]

    def cat(key):
        return torch.cat([r[key] for r in recs]).to(dev)

    x = cat("x").detach().float().requires_grad_(True)
    idx = torch.cat([p[0] for p in parts]).to(dev)
    w = torch.cat([p[1] for p in parts]).to(dev).detach().clone().requires_grad_(True)
    y = moe_dense_reference(x, idx, w, w1, w2)
    gy = cat("gy").float()
    (y * gy).sum().backward()
    L = s["num_experts"] // world_size
    errs = {
        "y": _rel(cat("y"), y.detach()),
        "grad_x": _rel(cat("gx"), x.grad),
        "grad_w": _rel(cat("gw"), w.grad),
        "grad_w1": _rel(cat("gw1"), w1.grad),
        "grad_w2": _rel(cat("gw2"), w2.grad),
    }
    assert L * world_size == s["num_experts"]
    return errs


def _check_settings(s, world_size: int) -> None:
    """Every static check of the layers this run builds, before any rank starts (ConfigError -> exit 2)."""
    from ..moe import MoEGeometry, MoERecipe
    from ..moe.recipe import check_config

    recipe = MoERecipe(dispatch_wire=s["dispatch_wire"], combine_wire=s["combine_wire"], combine=s["combine"],
                       balance=s["balance"], expert_alignment=s["expert_alignment"])
    geo = MoEGeometry(hidden=s["hidden"], intermediate=s["intermediate"], num_experts=s["num_experts"],
                      topk=s["topk"], max_tokens_per_rank=max(1, s["tokens"]))
    check_config(recipe, geo, world_size)


def main(args) -> int:
    """``tritonep run``: returns 0 when every check passed, 1 when one failed; library errors propagate (exit 2)."""
    from rich.table import Table

    from ..balance.metrics import balancedness

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    on_gpu = ngpu >= 1
    W = args.world_size if args.world_size is not None else (ngpu if on_gpu else 4)
    s = _settings(args, on_gpu, W)
    if args.plot:
        _need_matplotlib()
    from .console import make_console
    from .routing import token_split

    con = make_console()
    _check_settings(s, W)
    from .memory import check_host_memory, run_memory

    mem = run_memory(s, W, "cuda" if on_gpu else "cpu")
    check_host_memory(mem, W, cpu_world=not on_gpu)
    sizes = token_split(s["total_tokens"], W)
    per_rank = str(sizes[0]) if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
    what = (f"routing={s['routing_name']}, layers={s['layers']}, {s['total_tokens']} tokens per layer "
            f"({per_rank} per rank), E={s['num_experts']}, top-{s['topk']}, H={s['hidden']}")
    world = None
    if on_gpu:
        from ..testing import run_gpu_world
        from ..testing.placement import plan_world

        mps = {"off": False, "on": True, "auto": "auto"}[args.mps]
        planned = plan_world(W, [f"cuda:{i}" for i in range(ngpu)], mps=bool(mps))  # ConfigError: > 8 per GPU
        con.print(f"[bold]tritonep run[/]: {planned.describe()}, {what}", soft_wrap=True)
        t0 = time.time()
        with ProgressLines("tritonep run: ") as progress:
            results = run_gpu_world(W, run_rank, dict(s, progress=progress.path), timeout_s=args.timeout, mps=mps,
                                    on_wait=progress.poll)
        world = results.info
        if world.timing_note():
            con.print(f"[bold yellow]note[/]: {world.timing_note()}", soft_wrap=True)
    else:
        from .. import envs
        from ..testing import run_cpu_world

        con.print(f"[bold]tritonep run[/]: no GPU -> CPU world of {W} ranks (Triton interpreter), {what}", soft_wrap=True)
        t0 = time.time()
        heap = max(envs.cpu_heap_bytes(), mem.symmetric + (1 << 20))  # one layer's buffers at a time
        with ProgressLines("tritonep run: ") as progress:
            results = run_cpu_world(W, run_rank, dict(s, progress=progress.path), timeout_s=args.timeout,
                                    heap_bytes=heap, on_wait=progress.poll)
    wall = time.time() - t0
    tol = max(TOL[s["dispatch_wire"]], TOL[s["combine_wire"]])
    table = Table(title=f"tritonep run — {s['routing_name']}, world {W}, balance={s['balance']}, "
                        f"wires {s['dispatch_wire']}/{s['combine_wire']}")
    cols = ["layer", "tokens", "balancedness"] + (["before balancing"] if s["balance"] == "virtual" else []) + [
        "dispatch ms", "gemm ms", "combine ms", "step ms", "max rel err", "check"]
    for c in cols:
        table.add_column(c, justify="right")
    rows, ok_all = [], True
    if s["check"]:
        n = len(s["layers"])
        print(f"tritonep run: checking {n} layer{'s' if n != 1 else ''} against the dense single-process reference",
              file=sys.stderr, flush=True)
    for li, layer in enumerate(s["layers"]):
        loads = [sum(results[r][li]["recv_per_expert"]) for r in range(W)]
        bal = balancedness(torch.tensor(loads, dtype=torch.float64)) if sum(loads) else 1.0
        tim = [results[r][li]["timings"][-1] for r in range(W)]
        def mx(k):
            return max(t.get(k, 0.0) for t in tim) * 1e3
        errs = check_layer(s, li, layer, results, W) if s["check"] else {}
        worst = max(errs.values()) if errs else float("nan")
        ok = (worst <= tol) if errs else None  # None: not checked (--no-check)
        ok_all &= ok is not False
        rows.append(dict(layer=layer, tokens=sum(results[r][li]["tokens"] for r in range(W)), rank_loads=loads,
                         balancedness=float(bal), dispatch_ms=mx("dispatch_s"), gemm_ms=mx("gemm_s"),
                         combine_ms=mx("combine_s"), step_ms=mx("step_s"), errors=errs, ok=ok))
        extra = []
        if s["balance"] == "virtual":
            from ..balance.metrics import rank_loads
            from ..backends.layout import counts_torch

            parts = layer_routing(s, layer, W)
            native = rank_loads(torch.stack([counts_torch(q[0], s["num_experts"]) for q in parts]), W)
            rows[-1]["rank_loads_before"] = [int(v) for v in native.tolist()]
            rows[-1]["balancedness_before"] = float(balancedness(native.double()))
            extra = [f"{rows[-1]['balancedness_before']:.3f}"]
        table.add_row(str(layer), str(rows[-1]["tokens"]), f"{bal:.3f}", *extra, f"{mx('dispatch_s'):.2f}",
                      f"{mx('gemm_s'):.2f}", f"{mx('combine_s'):.2f}", f"{mx('step_s'):.1f}",
                      f"{worst:.2e}" if errs else "-",
                      "not checked" if ok is None else "[green]pass[/]" if ok else "[red]FAIL[/]")
    con.print(table)
    con.print(f"tolerance {tol:g} (max |got-ref| / max |ref| over output and every gradient); wall {wall:.1f} s")
    if args.json:
        from ..bench.meta import run_meta

        with open(args.json, "w") as f:
            json.dump(dict(meta=run_meta(world_size=W), settings=s, world_size=W, device="cuda" if on_gpu else "cpu", wall_s=wall,
                           world=world.as_dict() if world else None,
                           timing_note=world.timing_note() if world else "CPU world: interpreter times",
                           layers=rows), f, indent=1)
    if args.plot:
        _plot(rows, W, args.plot, title=f"tritonep run: {s['routing_name']}, {W} ranks, balance={s['balance']}")
        con.print(f"plot written to {args.plot}")
    con.print("outputs not checked (--no-check)" if not s["check"] else
              "[bold green]all checks passed[/]" if ok_all else "[bold red]some checks FAILED[/]")
    return 0 if ok_all else 1


def _need_matplotlib() -> None:
    """--plot needs matplotlib: refuse before the run starts (ConfigError, exit 2) rather than after it."""
    from ..errors import ConfigError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib (pip install 'tritonep[plot]' or pip install matplotlib)") from None


def _plot(rows, W, path, title=""):
    """PNG of routes received per rank for every layer; with virtual experts 'before' and 'after' side by side.

    Args:
        rows: the run's per-layer rows (``layer``, ``rank_loads`` and, with balancing, ``rank_loads_before``).
        W: ranks. path: PNG file. title: the figure title.
    """
    from .plots import grouped_loads

    panels = []
    if all("rank_loads_before" in r for r in rows):
        panels.append(("before balancing (native experts)", [r["rank_loads_before"] for r in rows]))
        panels.append(("after balancing (virtual experts)", [r["rank_loads"] for r in rows]))
    else:
        panels.append(("routes received per rank", [r["rank_loads"] for r in rows]))
    grouped_loads([str(r["layer"]) for r in rows], panels, [f"rank {r}" for r in range(W)], path,
                  title=title or "per-rank expert load per layer", xlabel="layer", ylabel="routes received")
