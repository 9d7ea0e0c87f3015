"""How many compiled kernel variants a world of W ranks needs, per rank and all ranks together (no GPU needed).

Runs a CPU world (forked ranks, Triton's interpreter) through the code paths a GPU run compiles -- the MoE layer of
``tritonep run`` (forward + backward, pull combine), an EPBuffer's two-kernel, fused and one-launch decode paths on
every wire with both backwards, the virtual-expert layer (planner, weight transport) and the nccl backend's
sync-free paths -- and keys every launch exactly as Triton's JIT cache does (:mod:`tests.support.variant_keys`).
Prints the variants each rank compiles, their sum over ranks and the distinct variants the ranks need together
(what a cache shared by the ranks holds). ``--compile`` also compiles every distinct variant for sm_90 in a fresh
process with an empty Triton cache and prints the seconds (one rank's variants, and all ranks' distinct ones):
what a cold start costs in compile time on one CPU core.

    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/probes/variant_count.py --world-size 4 [--paths ep,layer] \\
        [--compile]

When every kernel takes the rank as a runtime value (``do_not_specialize``), every rank compiles the same variants:
``distinct`` equals one rank's count, and ``tests/backends/test_rank_variants.py`` keeps it so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--paths", default="layer,ep,virtual,nccl", help="comma-separated, of layer, ep, virtual, nccl")
    ap.add_argument("--compile", action="store_true", help="compile the variants for sm_90 and time it")
    ap.add_argument("--json", help="write the counts (and compile seconds) here")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from tests.support.variant_keys import compile_keys, count, variants_by_rank
    from tests.support.variant_paths import record

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
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    sys.exit(main())
