"""Per-kernel breakdown of dispatch and combine on one GPU (world 1), every wire; prints a table, writes JSON.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=. torchrun --nproc-per-node 1 benchmarks/probes/kernel_breakdown.py --json $OUT/kernel_breakdown.json
    python benchmarks/probes/kernel_breakdown.py --cpu     # 1-rank CPU world, profile cpu-smoke: code and checks only

Shape: ``--profile`` of tritonep/bench/profiles.py (default DeepSeek-V3, 4096 tokens). For each geometry variant (default: ``two-kernel`` =
send / expand dispatch + partial / out push combine, ``fused`` = the one-launch dispatch and combine;
``--variants NAME=GEOMETRY`` with TRITONEP_GEOMETRY strings replaces them) and wire (bf16, fp8, mxfp4), the device
time of each kernel per call from ``torch.profiler`` over ``--iters`` eager calls (:mod:`tritonep.bench.kernels`);
``--extra`` adds the dispatch with rows kept quantized and the combine backward. Under Nsight Compute
(``bash scripts/gpu.sh ncu``) the same calls give each kernel's hardware counters.
Every row is checked after timing; a failed row prints FAILED and the run exits 1.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if "--cpu" in sys.argv[1:]:  # before tritonep's kernels are imported: the CPU world runs them in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritonep.bench.check import exit_code  # noqa: E402
from tritonep.bench.profiles import PROFILES  # noqa: E402
from tritonep.bench.kernels import DEFAULT_VARIANTS, GPU_VARIANTS, breakdown_lines, kernel_breakdown  # noqa: E402


def _rows(group, a):
    return kernel_breakdown(group, a.profile, wires=tuple(a.wires), variants=a.variant_map, num_sms=a.num_sms or None,
                            iters=a.iters, extra=a.extra)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="deepseek-v3", choices=sorted(PROFILES))
    ap.add_argument("--wires", nargs="+", default=["bf16", "fp8", "mxfp4"])
    ap.add_argument("--num-sms", type=int, default=0, help="SM cap (0: all)")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="NAME=GEOMETRY entries (TRITONEP_GEOMETRY strings), e.g. 'wide=fs=0,fe=0,bt=4,warps=8'")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--extra", action="store_true",
                    help="also the dispatch with rows kept quantized (quantized wires) and the combine backward (bf16)")
    ap.add_argument("--json", default="")
    ap.add_argument("--cpu", action="store_true", help="1-rank CPU world (interpreter), profile cpu-smoke, 1 iter")
    a = ap.parse_args(argv)
    a.variant_map = (dict(v.split("=", 1) for v in a.variants) if a.variants
                     else dict(DEFAULT_VARIANTS if a.cpu else GPU_VARIANTS))
    if a.cpu:
        from tritonep.testing import run_cpu_world

        a.profile, a.iters = "cpu-smoke", 1
        rows = run_cpu_world(1, _rows, a, timeout_s=1800)[0]
        return _report(rows, dict(device="cpu", world_size=1, command=" ".join(sys.argv)), a)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    rows = _rows(dist.group.WORLD, a)
    code = 0
    if rank == 0:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, world_size=dist.get_world_size(),
                    triton=__import__("triton").__version__, command=" ".join(sys.argv))
        code = _report(rows, meta, a)
    dist.destroy_process_group()
    return code


def _report(rows, meta, a) -> int:
    meta["checked"] = all(r.get("checked") for r in rows)
    meta["variants"] = a.variant_map
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(meta)
    for line in breakdown_lines(rows):
        print(line)
    return exit_code(rows)


if __name__ == "__main__":
    sys.exit(main())
