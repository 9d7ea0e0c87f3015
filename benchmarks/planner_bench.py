"""Virtual-expert planner time on one GPU (issue 5: target <= 15 us at 4096 tokens x top-8, 256 experts).

    PYTHONPATH=. python benchmarks/planner_bench.py --json $OUT/planner.json

Method: :mod:`tritonep.bench.planner` (CUDA-graph replay and eager, OLMoE-skewed routing, checked against the twins).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tritonep.bench.planner import bench_planner  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--num-experts", type=int, default=256)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--num-programs", type=int, nargs="*", default=[0], help="0 = plan()'s default")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    rows = bench_planner(a.worlds, a.tokens, a.topk, a.num_experts, a.num_programs, a.iters)
    print(f"{'W':>3s} {'programs':>9s} {'graph us':>9s} {'eager us':>9s} equal")
    for r in rows:
        print(f"{r['world_size']:3d} {str(r['num_programs']):>9s} {r['graph_us']:9.1f} {r['eager_us']:9.1f} "
              f"{r['equal_to_torch']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, command=" ".join(sys.argv),
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
