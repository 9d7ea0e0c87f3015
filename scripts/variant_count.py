"""How many compiled kernel variants a world of W ranks needs, per rank and all ranks together (no GPU needed).

Runs a CPU world (forked ranks, Triton's interpreter) through the code paths a GPU run compiles -- the MoE layer of
``tritonep run`` (forward + backward, pull combine), an EPBuffer's two-kernel, fused and one-launch decode paths on
every wire with both backwards, the virtual-expert layer (planner, weight transport) and the nccl backend's
sync-free paths -- and keys every launch exactly as Triton's JIT cache does (:mod:`tests.support.variant_keys`).
Prints the variants each rank compiles, their sum over ranks and the distinct variants the ranks need together
(what a cache shared by the ranks holds). ``--compile`` also compiles every distinct variant for sm_90 in a fresh
process with an empty Triton cache and prints the seconds (one rank's variants, and all ranks' distinct ones):
what a cold start costs in compile time on one CPU core.

    PYTHONPATH=. TRITON_INTERPRET=1 python scripts/variant_count.py --world-size 4 [--paths ep,layer] [--compile]

When every kernel takes the rank as a runtime value (``do_not_specialize``), every rank compiles the same variants:
``distinct`` equals one rank's count, and ``tests/backends/test_rank_variants.py`` keeps it so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

PATHS = ("layer", "ep", "virtual", "nccl")


def _layer(group):
    """The MoE layer ``tritonep run`` builds (default recipe: bf16 wires, pull combine), forward + backward."""
    import torch
    import torch.distributed as dist

    from tritonep.bench.cases import make_rank_inputs
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    rank = dist.get_rank()
    layer = MoELayer(MoERecipe(), MoEGeometry(hidden=64, intermediate=32, num_experts=8, topk=2,
                                              max_tokens_per_rank=8), group)
    x, idx, w = make_rank_inputs(rank, 8, 64, 8, 2, seed=3)
    x.requires_grad_(True)
    w.requires_grad_(True)
    layer(x, topk_idx=idx, topk_weights=w).float().sum().backward()
    layer.close()
    del torch


def _ep(group):
    """An EPBuffer's paths: two-kernel push / pull combine, both backwards, every wire (kept quantized rows too),
    the fused one-launch path and the one-launch decode path."""
    import torch.distributed as dist

    import tritonep as tep
    from tritonep.bench.cases import make_rank_inputs

    rank = dist.get_rank()
    for geo in ("", "fs=1,fe=1,fc=1", "bt=2,dec=3"):
        os.environ["TRITONEP_GEOMETRY"] = geo
        try:
            for wire in ("bf16", "fp8", "mxfp4"):
                b = tep.EPBuffer(group, 8, 128, 16, 2, dispatch_wire=wire, combine_wire=wire, expert_alignment=4)
                x, i, w = make_rank_inputs(rank, 9, 128, 8, 2, seed=5)
                x.requires_grad_(True)
                w.requires_grad_(True)
                d = b.dispatch(x, i, w)
                kinds = ("push", "pull") if wire == "bf16" and not geo else ("push",)
                ys = [b.combine(d.x * 1, d.handle, kind=k) for k in kinds]
                sum(y.float().sum() for y in ys).backward()
                if wire != "bf16":
                    b.dispatch(x.detach(), i, w.detach(), keep_quantized=True)
                b.close()
        finally:
            os.environ.pop("TRITONEP_GEOMETRY", None)


def _virtual(group):
    """The virtual-expert layer (planner, counts exchange, weight push and gradient pull), push combine."""
    import torch.distributed as dist

    from tritonep.bench.cases import make_rank_inputs
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    rank = dist.get_rank()
    layer = MoELayer(MoERecipe(balance="virtual", combine="push"),
                     MoEGeometry(hidden=64, intermediate=32, num_experts=8, topk=2, max_tokens_per_rank=8), group)
    x, idx, w = make_rank_inputs(rank, 8, 64, 8, 2, seed=3)
    x.requires_grad_(True)
    layer(x, topk_idx=idx, topk_weights=w).float().sum().backward()
    layer.close()


def _nccl(group):
    """The nccl backend's Triton paths (``use_triton``): the synced and both sync-free modes, with the backward."""
    import torch.distributed as dist

    import tritonep as tep
    from tritonep.bench.cases import make_rank_inputs
    from tests.support.hooks import backend_of

    rank = dist.get_rank()
    for mode in ("gather", "onehop"):
        os.environ["TRITONEP_NCCL_SYNC_FREE"] = mode
        try:
            b = tep.EPBuffer(group, 8, 64, 32, 2, backend="nccl", expert_alignment=4)
        finally:
            os.environ.pop("TRITONEP_NCCL_SYNC_FREE", None)
        backend_of(b).use_triton = True
        x, i, w = make_rank_inputs(rank, 9, 64, 8, 2, seed=7)
        x.requires_grad_(True)
        w.requires_grad_(True)
        d = b.dispatch(x, i, w)
        b.combine(d.x * 1, d.handle).float().sum().backward()
        f = b.dispatch(x.detach(), i, w.detach(), sync_free=True)
        b.combine(f.x * 1, f.handle)
        b.check()
        b.close()


_FNS = dict(layer=_layer, ep=_ep, virtual=_virtual, nccl=_nccl)


def _world(group, paths, out):
    from tests.support.variant_keys import record_keys_to

    with record_keys_to(out):
        for p in paths:
            _FNS[p](group)
    return True


def record(world_size: int, paths=PATHS, timeout_s: float = 1800.0) -> list:
    """Run the ``paths`` in a CPU world of ``world_size`` ranks; returns the key records
    (:func:`tests.support.variant_keys.read_keys`)."""
    from tests.support.variant_keys import read_keys
    from tritonep.testing import run_cpu_world

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "keys.jsonl")
        run_cpu_world(world_size, _world, list(paths), out, timeout_s=timeout_s)
        return read_keys(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--compile", action="store_true", help="compile the variants for sm_90 and time it")
    ap.add_argument("--json", help="write the counts (and compile seconds) here")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.support.variant_keys import compile_keys, count, variants_by_rank

    paths = [p for p in args.paths.split(",") if p]
    t0 = time.perf_counter()
    recs = record(args.world_size, paths)
    res = dict(world_size=args.world_size, paths=paths, **count(recs))
    res["record_s"] = round(time.perf_counter() - t0, 1)
    by = variants_by_rank(recs)
    r0 = by[min(by)]
    res["only_in_some_ranks"] = sorted({json.loads(k)["name"] for v in by.values() for k in v if k not in r0}
                                       | {json.loads(k)["name"] for v in by.values() for k in r0 if k not in v})
    print(f"W = {args.world_size}, paths {paths}: variants per rank {res['per_rank']}, sum over ranks {res['sum']}, "
          f"distinct over ranks {res['distinct']}")
    print(f"kernels whose variants differ between ranks: {res['only_in_some_ranks'] or 'none'}")
    if args.compile:
        union = {}
        for v in by.values():
            union.update(v)
        one = compile_keys(list(r0.values()))
        rest = [k for t, k in union.items() if t not in r0]
        more = compile_keys(rest) if rest else dict(seconds=[], failures=[])
        res["compile_s_one_rank"] = round(sum(one["seconds"]), 1)
        res["compile_s_all_ranks_distinct"] = round(sum(one["seconds"]) + sum(more["seconds"]), 1)
        res["compile_failures"] = one["failures"] + more["failures"]
        print(f"sm_90 compile, empty cache, one process: rank {min(by)}'s {len(r0)} variants "
              f"{res['compile_s_one_rank']} s; all ranks' {res['distinct']} distinct variants "
              f"{res['compile_s_all_ranks_distinct']} s; failures {len(res['compile_failures'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res.get("compile_failures") else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
