"""Planner: how long does the virtual-expert planner take per step (one launch; one GPU, the histograms of W ranks)?

    python benchmarks/planner_bench.py --json $OUT/planner.json
    python benchmarks/planner_bench.py --modes reference minimal --num-programs 0 32 128 \\
        --blocks 0 32 128 --json $OUT/planner_sweep.json                     # chunk / tile sweep
    python benchmarks/planner_bench.py --modes reference minimal --warps 0 2 4 \\
        --lookback-groups 0 1 128 --json $OUT/planner_knobs.json              # warps / look-back sweep
    python benchmarks/planner_bench.py --cpu                                 # CPU smoke run of the checks

Shape: ``--profile`` of tritonep/bench/profiles.py (default DeepSeek-V3: 4096 tokens x top-8 over 256 experts).

Method: :mod:`tritonep.bench.planner` (one launch timed as CUDA-graph replays and eagerly, OLMoE-skewed routing);
every point checks itself against the torch twins after timing; a failed point prints FAILED and the run exits 1.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--cpu" in sys.argv[1:]:  # before tritonep's kernels are imported: the CPU world runs them in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from tritonep.bench.check import exit_code  # noqa: E402
from tritonep.bench.planner import bench_planner  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="deepseek-v3", help="shape: a profile of tritonep/bench/profiles.py")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--modes", nargs="+", default=["reference"], choices=["reference", "minimal"])
    ap.add_argument("--num-programs", type=int, nargs="*", default=[0], help="route chunks; 0 = plan()'s default")
    ap.add_argument("--blocks", type=int, nargs="*", default=[0], help="routes per tile; 0 = plan()'s default")
    ap.add_argument("--warps", type=int, nargs="*", default=[0], help="num_warps of the launch; 0 = plan()'s default")
    ap.add_argument("--lookback-groups", type=int, nargs="*", default=[0],
                    help="chunks per look-back group; 0 = plan()'s default (ceil(sqrt(num_programs)))")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--cpu", action="store_true", help="small CPU smoke run (interpreter): 16 tokens of the cpu-smoke "
                                                       "profile (top-2, 8 experts)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    from tritonep.bench.profiles import profile_shape

    if a.cpu:
        a.profile, a.worlds, a.iters = "cpu-smoke", [2, 4], 1
    _, a.num_experts, a.topk, a.tokens = profile_shape(a.profile)
    if a.cpu:
        a.tokens = 16
    a.tokens = a.tokens or 4096  # a trace profile: the histogram of 4096 tokens
    rows = bench_planner(a.worlds, a.tokens, a.topk, a.num_experts, a.num_programs, a.iters, a.blocks, a.modes,
                         a.warps, a.lookback_groups)
    print(f"{'W':>3s} {'mode':>9s} {'programs':>9s} {'block':>7s} {'warps':>7s} {'group':>7s} {'launches':>8s} "
          f"{'graph us':>9s} {'eager us':>9s} checked")
    for r in rows:
        g = f"{r['graph_us']:9.1f}" if r["graph_us"] is not None else f"{'-':>9s}"
        print(f"{r['world_size']:3d} {r['mode']:>9s} {str(r['num_programs']):>9s} {str(r['block']):>7s} "
              f"{str(r['num_warps']):>7s} {str(r['lookback_group']):>7s} "
              f"{r['launches']:8d} {g} "
              f"{r['eager_us']:9.1f} {'ok' if r['checked'] else 'FAILED'}")
    if a.json:
        from tritonep.bench.meta import run_meta

        with open(a.json, "w") as f:
            json.dump(dict(meta=run_meta(world_size=1), rows=rows), f, indent=1)
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
