"""Host path of dispatch / combine / backwards, counted (torch calls, allocations, launches, host reads) and timed
with launches stubbed (:mod:`tritonep.bench.host_path`), in a CPU world (no GPU needed).

    PYTHONPATH=. python benchmarks/probes/host_path.py --tokens 128 --json out.json
    PYTHONPATH=. python benchmarks/probes/host_path.py --tokens 128 --backends nccl --gpu-path

Shape: ``--profile`` of tritonep/bench/profiles.py (default DeepSeek-V3) at world 1 (``--world-size`` for more CPU ranks); both
backends. The counts are machine independent; ``host_us`` is this machine's Python time per call without launches.
``--gpu-path``: the nccl backend takes its GPU path (``use_triton``: the Triton kernels, here interpreted, run
outside the counts and the times) instead of its CPU twins; use few ``--iters``, the interpreter is slow.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


def _rank(group, T, H, E, K, backend, iters, gpu_path=False):
    import torch.distributed as dist

    import tritonep as tep
    from tritonep.bench.host_path import measure_host_path

    g = torch.Generator().manual_seed(dist.get_rank(group))
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    buf = tep.EPBuffer(group, E, H, T, K, backend=backend)
    run = gpu_path and backend == "nccl"
    if run:
        buf._backend.use_triton = True
    try:
        res = measure_host_path(buf, x, idx, w, iters=iters, run_kernels=run)
    finally:
        buf.close()
    for r in res.values():
        r["torch_names"] = dict(sorted(r["torch_names"].items(), key=lambda kv: -kv[1]))
        r["aten_names"] = dict(sorted(r["aten_names"].items(), key=lambda kv: -kv[1]))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128])
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--profile", default="deepseek-v3", help="shape: a profile of tritonep/bench/profiles.py")
    ap.add_argument("--backends", nargs="+", default=["triton", "nccl"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--gpu-path", action="store_true", help="nccl backend: its GPU path (kernels interpreted)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tritonep.bench.profiles import profile_shape
    from tritonep.testing import run_cpu_world

    a.hidden, a.experts, a.topk, _ = profile_shape(a.profile)

    rows = []
    for T in a.tokens:
        for backend in a.backends:
            heap = 64 * 2**20 + 3 * a.world_size * T * a.topk * a.hidden * 2
            res = run_cpu_world(a.world_size, _rank, T, a.hidden, a.experts, a.topk, backend, a.iters, a.gpu_path,
                                heap_bytes=heap, check_protocol=False, timeout_s=900)[0]
            for kind, r in res.items():
                rows.append(dict(tokens=T, backend=backend, call=kind, **r))
    print(f"{'T':>5} {'backend':>7} {'call':>19} {'torch':>6} {'aten':>5} {'alloc':>5} {'launch':>6} {'reads':>5} "
          f"{'host us':>8}")
    for r in rows:
        print(f"{r['tokens']:>5} {r['backend']:>7} {r['call']:>19} {r['torch_calls']:>6} {r['aten_ops']:>5} "
              f"{r['allocs']:>5} {r['launches']:>6} {r['host_reads']:>5} {r['host_us']:>8.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(world_size=a.world_size, hidden=a.hidden, experts=a.experts, topk=a.topk,
                           torch=torch.__version__, gpu_path=a.gpu_path,
                           note="launches stubbed; counts exact, host_us this machine",
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
