"""MoE layer forward + backward: how fast is tritonep's layer against what a user writes with torch + NCCL, what do
virtual experts do under skewed routing, and what does an eager step cost against the same step in one CUDA graph?

    python benchmarks/moe_bench.py --json $OUT/moe.json                      # every local GPU, DeepSeek-V3 layer
    python benchmarks/moe_bench.py --skew --json $OUT/moe_skew.json          # OLMoE-skewed routing, none vs virtual
    torchrun --nproc-per-node 1 benchmarks/moe_bench.py --graph --tokens 128 4096 --json $OUT/moe_graph.json
    python benchmarks/moe_bench.py --cpu --tokens 32 --profile cpu-smoke     # 4-rank CPU world: the checks only

Default mode (:mod:`tritonep.bench.moe`): tritonep's ``MoELayer`` and the torch + NCCL reference layer (sort routes,
``all_to_all_single``, the same grouped GEMMs, back) run forward + backward on the same routing; median step time
and speedup. Every layer's output is checked against the dense fp32 oracle after timing; a layer outside the
tolerance prints FAILED and the run exits 1. ``--graph`` (:mod:`tritonep.bench.moe_graph`, world 1 under torchrun):
the sync-free layer's step eager vs replayed from one captured graph, replayed output and gradients bit-equal to
eager. Shapes: ``--profile`` of tritonep/bench/profiles.py (hidden, experts, top-k, expert width).
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
from tritonep.bench.meta import run_meta  # noqa: E402
from tritonep.bench.moe import moe_bench_world  # noqa: E402
from tritonep.bench.profiles import DEFAULT_INTERMEDIATE, PROFILES  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="deepseek-v3", choices=sorted(PROFILES),
                    help="shape (hidden, experts, top-k, expert width; `tritonep bench --help` lists them)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="tokens per rank (default: the profile's; --graph: 128 4096; the default mode takes one)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    ap.add_argument("--skew", action="store_true", help="OLMoE-skewed routing and balance none vs virtual")
    ap.add_argument("--torch-profile", action="store_true", help="also print rank 0's top device kernels of one "
                                                                 "step (torch.profiler) for each layer")
    ap.add_argument("--graph", action="store_true", help="eager step vs one captured CUDA graph (run under torchrun, "
                                                         "one GPU)")
    ap.add_argument("--cpu", action="store_true", help="4-rank CPU world (the checks only; times mean nothing)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if a.graph:
        return _graph(a)
    p = PROFILES[a.profile]
    tokens = (a.tokens or [p["tokens"] or 4096])[0]
    cfg = dict(tokens=tokens, hidden=p["hidden"], intermediate=p.get("intermediate", DEFAULT_INTERMEDIATE),
               num_experts=p["num_experts"], topk=p["topk"], skew=a.skew, profile=a.torch_profile,
               balance=["none", "virtual"] if a.skew else ["none"])
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
            json.dump(dict(meta=run_meta(world_size=len(res)), cfg=cfg, ranks=list(res)), f, indent=1)
    checks = [c for o in res for c in o["checks"]]
    print(f"checks: {sum(c['checked'] for c in checks)} of {len(checks)} layer outputs within {checks[0]['tolerance']:g} "
          f"of the dense fp32 oracle" if checks else "checks: none ran")
    return exit_code(checks)


def _graph(a) -> int:
    """``--graph``: one row per token count (:func:`tritonep.bench.moe_graph.moe_graph_point`); exit 1 unless every
    replayed step equals its eager step bit for bit."""
    import torch.distributed as dist

    from tritonep.bench.moe_graph import moe_graph_point

    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    rows = [moe_graph_point(dist.group.WORLD, T, a.profile, a.steps) for T in (a.tokens or [128, 4096])]
    ok = all(r["checked"] for r in rows)
    if dist.get_rank() == 0:
        for r in rows:
            print(f"T={r['tokens']:>5} eager {r['eager_us']:9.1f} us  graph {r['graph_us']:9.1f} us  "
                  f"eager/graph {r['eager_over_graph']:.2f}  {'ok' if r['checked'] else 'FAILED'}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(meta=run_meta(world_size=dist.get_world_size()), rows=rows), f, indent=1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
