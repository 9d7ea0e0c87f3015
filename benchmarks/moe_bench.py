"""MoE layer fwd+bwd: tritonep vs the torch + NCCL reference layer (issue 4), and balance none vs virtual (issue 5).

GPU machine:   PYTHONPATH=. python benchmarks/moe_bench.py --json $OUT/moe.json            (every local GPU)
CPU smoke run: python benchmarks/moe_bench.py --cpu --tokens 32 --hidden 64 --intermediate 32 --num-experts 16

Every layer's output is checked against the dense fp32 oracle after timing (:mod:`tritonep.bench.moe`); a layer
outside the tolerance prints FAILED and the run exits 1.
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
from tritonep.bench.moe import moe_bench_world  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="4-rank CPU world (smoke run; times are not meaningful)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--num-experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skew", action="store_true", help="OLMoE-skewed routing and balance none vs virtual")
    ap.add_argument("--profile", action="store_true", help="also print rank 0's top device kernels of one step "
                                                            "(torch.profiler) for each layer")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    cfg = dict(tokens=a.tokens, hidden=a.hidden, intermediate=a.intermediate, num_experts=a.num_experts,
               topk=a.topk, skew=a.skew, profile=a.profile, balance=["none", "virtual"] if a.skew else ["none"])
    if a.cpu:
        from tritonep.testing import run_cpu_world

        res = run_cpu_world(4, moe_bench_world, cfg, a.steps, 1, timeout_s=1800)
    else:
        from tritonep.testing import run_gpu_world

        res = run_gpu_world(torch.cuda.device_count(), moe_bench_world, cfg, a.steps, timeout_s=1800)
    for r, o in enumerate(res):
        print(f"rank {r}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in o.items()
                                        if not k.startswith("profile.") and k != "checks"))
    for k, v in res[0].items():
        if k.startswith("profile."):
            print(f"--- rank 0, {k[8:]}: one fwd+bwd step\n{v}")
    tep = max(o["tritonep.none"] for o in res)
    ref = max(o["reference"] for o in res)
    print(f"fwd+bwd step: tritonep {tep * 1e3:.2f} ms, torch+NCCL reference {ref * 1e3:.2f} ms, speedup {ref / tep:.2f}x")
    if a.skew:
        v = max(o["tritonep.virtual"] for o in res)
        loads = [o["load.none"] for o in res]
        print(f"virtual experts: {v * 1e3:.2f} ms ({tep / v:.2f}x vs none); ideal max/mean load "
              f"{max(loads) / (sum(loads) / len(loads)):.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(cfg=cfg, ranks=res, command=" ".join(sys.argv)), f, indent=1)
    checks = [c for o in res for c in o["checks"]]
    print(f"checks: {sum(c['checked'] for c in checks)} of {len(checks)} layer outputs within {checks[0]['tolerance']:g} "
          f"of the dense fp32 oracle" if checks else "checks: none ran")
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
