"""``tritonep plan``: the virtual-expert plan for a trace or histogram, before/after loads and what moves."""

from __future__ import annotations

import json

import torch

from .help import HelpFormatter

__all__ = ["add_parser", "main", "plan_table"]


def add_parser(sub):
    p = sub.add_parser("plan", formatter_class=HelpFormatter,
                       help="virtual-expert placement for a trace or histogram: per-rank load before/after")
    p.add_argument("--routing", choices=["flame", "olmoe"], default="olmoe",
                   help="flame: the FLAME-MoE-290M trace; olmoe: an OLMoE expert-load histogram (strong skew)")
    p.add_argument("--layer", type=int, default=None, help="trace layer (flame 2..9, olmoe 0/7/15)")
    p.add_argument("--domain", default="arxiv", help="OLMoE domain")
    p.add_argument("--world-size", type=int, default=8, help="EP ranks")
    p.add_argument("--num-experts", type=int, default=64, help="experts (histograms are tiled to this many)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank (olmoe sampling)")
    p.add_argument("--topk", type=int, default=8, help="top-k (olmoe sampling)")
    p.add_argument("--mode", choices=["reference", "minimal", "both"], default="both",
                   help="placement mode: reference (MoonEP, the default of the library), minimal (only ranks over "
                        "capacity send; moves the total excess) or both (table of the first, a summary line each)")
    p.add_argument("--json", default="", help="write the plan and metrics to this JSON file")
    p.add_argument("--plot", default="", help="PNG of per-rank load before and after")
    p.set_defaults(func=main)


def counts_for(args) -> torch.Tensor:
    """The ``[W, E]`` per-source histogram the planner sees for the chosen input."""
    from ..data import (load_flame_trace, load_olmoe_histogram, sample_routing, scale_histogram_to_experts,
                        split_across_ranks)
    from ..kernels.layout import counts_torch

    W, E = args.world_size, args.num_experts
    if args.routing == "flame":
        idx, w = load_flame_trace(args.layer if args.layer is not None else 2)
        if E != 64:
            idx = idx % E
        parts = split_across_ranks(idx, w, W)
    else:
        hist = scale_histogram_to_experts(load_olmoe_histogram(args.domain, args.layer or 0), E)
        idx, w = sample_routing(hist, args.tokens * W, args.topk, generator=0)
        parts = split_across_ranks(idx, w, W)
    return torch.stack([counts_torch(p[0], E) for p in parts])


def plan_table(counts: torch.Tensor, mode: str = "reference") -> dict:
    """Placement + metrics of a ``[W, E]`` histogram (torch planner ``place_torch(counts, mode)``).

    Returns a JSON-able dict: loads before/after, balancedness, maxvio, moved routes, total excess, max load, slots.
    Raises PlanError on a bad histogram or mode.
    """
    from ..balance import balancedness, excess_routes, loads_after, maxvio, place_torch, rank_loads

    W, E = counts.shape
    pl = place_torch(counts, mode)
    before = rank_loads(counts, W)
    after = loads_after(pl)
    L = E // W
    native = torch.stack([pl.allocation[d * L:(d + 1) * L, d] for d in range(W)])  # routes kept native
    moved = int(counts.sum()) - int(native.sum())
    slots = (pl.experts_to_copy >= 0).sum(1)
    return dict(before=before.tolist(), after=after.tolist(), balancedness_before=balancedness(before),
                balancedness_after=balancedness(after), maxvio=maxvio(counts.sum(0)), moved_routes=moved,
                slots_used=slots.tolist(), experts_to_copy=pl.experts_to_copy.tolist(),
                capacity=pl.capacity.tolist(), mode=mode, excess_routes=excess_routes(counts, W),
                max_load=int(after.max()))


def main(args) -> int:
    from rich.console import Console
    from rich.table import Table

    counts = counts_for(args)
    modes = ["reference", "minimal"] if args.mode == "both" else [args.mode]
    res = plan_table(counts, modes[0])
    W = args.world_size
    src = (f"flame layer {args.layer if args.layer is not None else 2}" if args.routing == "flame"
           else f"olmoe {args.domain} layer {args.layer or 0}")
    t = Table(title=f"virtual-expert plan: {src}, {W} ranks, {args.num_experts} experts "
                    f"(virtual experts = global ids held in this rank's slots)")
    for c in ("rank", "load before", f"load after ({modes[0]})", "slots used", "virtual experts"):
        t.add_column(c, justify="right")
    for d in range(W):
        t.add_row(str(d), str(res["before"][d]), str(res["after"][d]), str(res["slots_used"][d]),
                  " ".join(str(e) for e in res["experts_to_copy"][d] if e >= 0) or "-")
    import shutil

    con = Console(width=max(shutil.get_terminal_size((140, 24)).columns, 120))
    con.print(t)
    con.print(f"balancedness (mean/max) {res['balancedness_before']:.3f} -> {res['balancedness_after']:.3f}; "
              f"expert maxvio (max/mean expert load - 1) {res['maxvio']:.2f}; moved routes {res['moved_routes']} of {int(counts.sum())}")
    per_mode = {m: res if m == modes[0] else plan_table(counts, m) for m in modes}
    for m, r in per_mode.items():
        hosts = ", ".join(f"{d}: " + " ".join(str(e) for e in row if e >= 0)
                          for d, row in enumerate(r["experts_to_copy"]) if max(row) >= 0) or "-"
        con.print(f"{m} mode: moved routes {r['moved_routes']} (total excess {r['excess_routes']}), max load "
                  f"{r['max_load']} (capacity {max(r['capacity'])}); virtual experts by rank {hosts}")
    res["modes"] = {m: {k: r[k] for k in ("moved_routes", "excess_routes", "max_load", "after", "experts_to_copy")}
                    for m, r in per_mode.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(1.5 + 0.5 * W, 3.4))
        xs = list(range(W))
        ax.bar([x - 0.2 for x in xs], res["before"], 0.4, label="before")
        ax.bar([x + 0.2 for x in xs], res["after"], 0.4, label="after (virtual experts)")
        ax.set_xlabel("rank")
        ax.set_ylabel("routes")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        con.print(f"plot written to {args.plot}")
    return 0
