"""``tritonep plan``: the virtual-expert plan for a trace or histogram, before/after loads and what moves."""

from __future__ import annotations

import json

import torch

from .help import HelpFormatter

__all__ = ["add_parser", "main", "plan_table"]


def add_parser(sub):
    """Register ``tritonep plan`` and its flags on the ``sub`` subparsers action."""
    from .routing import ROUTING_HELP

    p = sub.add_parser("plan", formatter_class=HelpFormatter,
                       help="virtual-expert placement for a trace or histogram: per-rank load before/after",
                       description="The virtual-expert plan for one layer of a trace or histogram, on the host (no "
                                   "GPU, no ranks started; a second or two): replicas of hot experts (virtual experts) "
                                   "go into other ranks' spare slots until every rank computes the same number of "
                                   "routes. Prints "
                                   "per rank the load before (routes = tokens x top-k), the capacity, the load after "
                                   "and the global expert ids each rank hosts as virtual experts, then balancedness "
                                   "(mean/max load) and moved routes against the total excess. Default: OLMoE arxiv "
                                   "layer 0, 8 ranks, both modes side by side. docs/moe.md, 'Virtual experts'.")
    p.add_argument("--routing", default="olmoe", metavar="flame|olmoe|PATH", help=ROUTING_HELP)
    p.add_argument("--layer", type=int, default=None,
                   help="layer (flame 2..9, olmoe 0/7/15, a file: its layer numbers; default: the first)")
    p.add_argument("--domain", default="arxiv", help="OLMoE domain")
    p.add_argument("--world-size", type=int, default=8, help="EP ranks")
    p.add_argument("--num-experts", type=int, default=None,
                   help="experts (default: the source's experts, 64 for flame/olmoe, for a file its largest expert "
                        "id + 1, rounded up to a multiple of the world size: 66 for 3 ranks; olmoe's histograms are "
                        "tiled to this many); fewer than a file's or the flame trace's largest id + 1 is an error")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per rank (default: a trace's every token, histograms 4096; more than a trace holds "
                        "is an error)")
    p.add_argument("--topk", type=int, default=None,
                   help="top-k of histogram sampling (default: the file's topk, else 8; a trace has its own K)")
    p.add_argument("--mode", choices=["reference", "minimal", "both"], default="both",
                   help="placement mode: reference (the library's default: the placement rule of Megatron-LM's "
                        "virtual experts, after MoonshotAI's MoonEP; always balances exactly, may move more than the "
                        "total excess), minimal (only ranks over capacity send, only ranks "
                        "under it receive: moves the total excess when the virtual slots suffice, else says what it "
                        "could not move and why) or both (side by side; the default)")
    p.add_argument("--json", default="", help="write the plan and metrics to this JSON file")
    p.add_argument("--plot", default="", help="PNG of per-rank load before and after, side by side")
    p.set_defaults(func=main)


def _source(args):
    """``(RoutingSource, layer, num_experts, topk, total_tokens)`` of the flags, every one checked.

    Raises:
        DataError: a bad routing file, layer, domain, --num-experts, --topk or --tokens.
        ConfigError: --world-size below 1.
    """
    from ..errors import ConfigError
    from .routing import check_layers, check_tokens, check_topk, resolve

    W = args.world_size
    if W < 1:
        raise ConfigError(f"--world-size {W} must be >= 1")
    src = resolve(args.routing, args.domain)
    layer = check_layers(src, [args.layer] if args.layer is not None else [src.layers[0]], flag="--layer")[0]
    E = args.num_experts if args.num_experts is not None else src.default_num_experts(W)
    src.check_num_experts(E)
    if E % W:
        raise ConfigError(f"--num-experts {E} is not a multiple of --world-size {W} (every rank owns E / W experts)")
    topk = check_topk(src, args.topk, [layer], E, args.domain)
    if src.kind == "trace":
        have = src.num_tokens([layer])
        total = check_tokens(src, args.tokens, -(-have // W), W, [layer])
    else:
        total = check_tokens(src, args.tokens, 4096, W, [layer])
    return src, layer, E, topk, total


def counts_for(args) -> torch.Tensor:
    """The ``[W, E]`` int32 per-source histogram the planner sees for the flags in ``args`` (``--routing`` etc.).

    Raises:
        DataError, ConfigError: as :func:`_source`.
    """
    from .routing import layer_counts

    src, layer, E, topk, total = _source(args)
    return layer_counts(src.spec, layer, total, args.world_size, E, topk, args.domain)


def plan_table(counts: torch.Tensor, mode: str = "reference") -> dict:
    """Placement + metrics of a ``[W, E]`` histogram (torch planner ``place_torch(counts, mode)``).

    Returns a JSON-able dict: loads before/after, balancedness, maxvio, moved routes, total excess, max load, slots,
    and ``unmoved_routes`` / ``shortfall`` (:func:`tritonep.balance.plan_shortfall`: the routes a minimal-mode plan
    left over capacity, which ranks keep them and which under-capacity ranks had no free slot; 0 / empty lists when
    the plan balances exactly). Raises PlanError on a bad histogram or mode.
    """
    from ..balance import (balancedness, excess_routes, loads_after, maxvio, place_torch, plan_shortfall,
                           rank_loads)

    W, E = counts.shape
    pl = place_torch(counts, mode)
    before = rank_loads(counts, W)
    after = loads_after(pl)
    L = E // W
    native = torch.stack([pl.allocation[d * L:(d + 1) * L, d] for d in range(W)])  # routes kept native
    moved = int(counts.sum()) - int(native.sum())
    slots = (pl.experts_to_copy >= 0).sum(1)
    short = plan_shortfall(pl)
    return dict(before=before.tolist(), after=after.tolist(), balancedness_before=balancedness(before),
                balancedness_after=balancedness(after), maxvio=maxvio(counts.sum(0)), moved_routes=moved,
                slots_used=slots.tolist(), experts_to_copy=pl.experts_to_copy.tolist(),
                capacity=pl.capacity.tolist(), mode=mode, excess_routes=excess_routes(counts, W),
                max_load=int(after.max()), unmoved_routes=short["unmoved_routes"], shortfall=short)


def shortfall_line(mode: str, r: dict) -> str:
    """The sentence saying what a plan (:func:`plan_table`'s dict ``r``) could not move and why; "" when nothing."""
    sf = r["shortfall"]
    if not sf["unmoved_routes"]:
        return ""
    L = sf["slots_per_rank"]
    over = ", ".join(f"rank {o['rank']} at {o['load']} (capacity {o['capacity']})" for o in sf["over_capacity"])
    under = ", ".join(f"rank {u['rank']} at {u['load']}" for u in sf["under_capacity"])
    slots = "its only virtual slot" if L == 1 else f"all {L} of its virtual slots"
    return (f"{mode} mode could not move {sf['unmoved_routes']} of the {r['excess_routes']} routes of total excess: "
            f"{over} stay{'s' if len(sf['over_capacity']) == 1 else ''} over capacity, because every rank under "
            f"capacity ({under}) has {slots} in use (a slot holds one expert; E / W = {L} experts per rank give {L} "
            f"slot{'s' if L != 1 else ''} per rank). More experts per rank give more slots; --mode reference always "
            f"balances exactly, at the price of moving more routes.")


def main(args) -> int:
    """``tritonep plan``: print (and optionally write / plot) the plan; returns 0. Library errors propagate (exit 2).

    Output: one table row per rank (load before, capacity, and for each mode the load after and the virtual experts
    it hosts, one column each, so a list wraps inside its cell and never across the table), then one line per
    mode; a plan that could not move its whole excess (minimal mode out of slots) says how much, where and why."""
    from rich.table import Table

    from .console import make_console

    if args.plot:
        from .run import _need_matplotlib

        _need_matplotlib()
    src, layer, E, _topk, total = _source(args)
    counts = counts_for(args)
    modes = ["reference", "minimal"] if args.mode == "both" else [args.mode]
    per_mode = {m: plan_table(counts, m) for m in modes}
    res = dict(per_mode[modes[0]])
    W = args.world_size
    what = f"{src.name} layer {layer}"
    t = Table(title=f"virtual-expert plan: {what}, {W} ranks, {E} experts, {total} tokens "
                    f"(virtual experts = global ids held in this rank's slots)")
    for c in ["rank", "load before", "capacity"] + [h for m in modes for h in (f"after ({m})",
                                                                               f"virtual experts ({m})")]:
        t.add_column(c, justify="right")
    for d in range(W):
        cells = [str(d), str(res["before"][d]), str(res["capacity"][d])]
        for m in modes:
            r = per_mode[m]
            cells += [str(r["after"][d]), " ".join(str(e) for e in r["experts_to_copy"][d] if e >= 0) or "-"]
        t.add_row(*cells)
    con = make_console()
    con.print(t)
    con.print(f"before: balancedness (mean/max) {res['balancedness_before']:.3f}, expert maxvio (max/mean expert "
              f"load - 1) {res['maxvio']:.2f}, total excess {res['excess_routes']} of {int(counts.sum())} routes")
    for m, r in per_mode.items():
        con.print(f"{m} mode: balancedness {r['balancedness_after']:.3f}, moved routes {r['moved_routes']} (total "
                  f"excess {r['excess_routes']}), max load {r['max_load']} (capacity {max(r['capacity'])})")
        if shortfall_line(m, r):
            con.print(f"[bold yellow]note[/]: {shortfall_line(m, r)}")
    res["modes"] = {m: {k: r[k] for k in ("moved_routes", "excess_routes", "unmoved_routes", "max_load",
                                          "balancedness_after", "after", "experts_to_copy", "shortfall")}
                    for m, r in per_mode.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.plot:
        from .plots import grouped_loads

        grouped_loads([str(d) for d in range(W)],
                      [(f"before: native experts (balancedness {res['balancedness_before']:.3f})",
                        [[v] for v in res["before"]]),
                       (f"after: virtual experts (balancedness {res['balancedness_after']:.3f})",
                        [[v] for v in res["after"]])],
                      ["routes"], args.plot, title=f"tritonep plan: {what}, {W} ranks, {E} experts",
                      xlabel="rank", ylabel="routes computed", mean="panel")
        con.print(f"plot written to {args.plot}")
    return 0
