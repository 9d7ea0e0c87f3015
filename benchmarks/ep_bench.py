"""EP benchmark driver (run under torchrun on the GPU machine); prints a table, writes JSON.

    torchrun --nproc-per-node 2 benchmarks/ep_bench.py --profiles deepseek-v3 decode --json $OUT/ep.json
    python benchmarks/ep_bench.py --cpu        # 2-rank CPU world, profile cpu-smoke: the checks only, no timing

How fast are dispatch and combine, against what a user would otherwise write? Per profile (the shapes of
tritonep/bench/profiles.py), wire and SM cap: tritonep's dispatch / combine replayed from a CUDA graph and eager, its
nccl backend, NCCL's bare ``all_to_all_single`` and the NCCL pipeline a user writes for the same expert-grouped
output (:mod:`tritonep.bench.ep` says how each is timed and counted).

Every point checks itself after timing (:mod:`tritonep.bench.check`); a point that fails prints FAILED, its row
holds ``checked: false`` and ``check_error``, and the run exits 1 (also when a geometry variant crashed).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--cpu" in sys.argv[1:]:  # before tritonep's kernels are imported: the CPU world runs them in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritonep.bench.check import exit_code, failed_rows  # noqa: E402
from tritonep.bench.ep import PROFILES, bench_ep, peer_copy_gbps, ratio_lines  # noqa: E402
from tritonep.bench.meta import run_meta  # noqa: E402
from tritonep.wire.formats import WIRES  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", nargs="+", default=["deepseek-v3", "decode"], choices=sorted(PROFILES),
                    help="shapes to measure (default: deepseek-v3 decode; `tritonep bench --help` gives their shapes)")
    ap.add_argument("--num-sms", type=int, nargs="*", default=[0], help="SM caps to measure (default 0 = the geometry table)")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per point, median reported (default 30)")
    ap.add_argument("--json", default="", help="write the rows (each with its check) to this JSON file")
    ap.add_argument("--overlap", type=int, nargs="*", default=None,
                    help="also run the overlap benchmark (dispatch+combine beside a GEMM on another stream) for "
                         "these SM caps, e.g. --overlap 24 0 (tritonep/bench/overlap.py)")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="geometry sweep after the main rows: entries PROFILE:SMS:WIRES:GEOMETRY, e.g. "
                         "'decode:0:bf16:bt=2,grid=128' (GEOMETRY = a TRITONEP_GEOMETRY string, '' = the table)")
    ap.add_argument("--wires", nargs="+", default=["bf16", "fp8", "mxfp4"], choices=list(WIRES),
                    help="dispatch / combine wire formats to measure (default: bf16 fp8 mxfp4)")
    ap.add_argument("--cpu", action="store_true", help="2-rank CPU world (interpreter), profile cpu-smoke, 1 iter: "
                                                       "runs every point and its check; times are not meaningful")
    a = ap.parse_args(argv)
    if a.cpu:
        from tritonep.testing import run_cpu_world

        a.profiles, a.num_sms, a.iters, a.overlap = ["cpu-smoke"], [0], 1, None
        a.variants = [v.replace(v.split(":", 1)[0], "cpu-smoke", 1) for v in a.variants]
        res = run_cpu_world(2, _rank_rows, a, timeout_s=1800)
        return _report(res, run_meta(world_size=2), a, None)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    print('peer copy...', flush=True) if rank == 0 else None
    pc = peer_copy_gbps(group)
    rows = _rank_rows(group, a, pc)
    allrows = [None] * dist.get_world_size()
    dist.all_gather_object(allrows, rows)
    code = 0
    if rank == 0:
        meta = run_meta(world_size=dist.get_world_size())
        code = _report(allrows, meta, a, pc)
    dist.destroy_process_group()
    return code


def _rank_rows(group, a, pc=None):
    """Every row of this rank (main profiles x SM caps, then the variants, then the overlap rows)."""
    rank = dist.get_rank(group)
    rows = []
    for prof in a.profiles:
        for sms in a.num_sms:
            for r in bench_ep(group, prof, num_sms=sms or None, iters=a.iters, wires=tuple(a.wires)):
                r["num_sms"] = sms
                r["peer_copy_gbps"] = pc
                rows.append(r)
    priced = {(r["profile"], r.get("wire")) for r in rows if r.get("op", "").startswith("torch.same_bytes.")}
    for v in a.variants:
        prof, sms, wires, geo = v.split(":", 3)
        fresh = any((prof, wire) not in priced for wire in wires.split("+"))  # world 1: torch's same-bytes rows once
        priced |= {(prof, wire) for wire in wires.split("+")}
        try:
            for r in bench_ep(group, prof, combine_kinds=("push",), num_sms=int(sms) or None, iters=a.iters,
                              wires=tuple(wires.split("+")), baselines=False, eager=False, tiles=geo,
                              same_bytes=fresh):
                r.update(num_sms=int(sms), peer_copy_gbps=pc, variant=geo or "table")
                rows.append(r)
        except Exception as e:  # one bad variant must not lose the rest of the sweep (but fails the run)
            print(f"FAILED variant {v!r}: {e!r}", flush=True)
            rows.append(dict(profile=prof, op="variant", variant=geo or "table", num_sms=int(sms), us=0.0,
                             logical_gbps=0.0, nvlink_gbps=0.0, mode="crashed", checked=False, check_error=repr(e)))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    if a.overlap is not None:
        from tritonep.bench.overlap import bench_overlap

        for r in bench_overlap(group, "deepseek-v3", num_sms_list=a.overlap or [24, 0], iters=a.iters):
            r.update(op="overlap", peer_copy_gbps=pc, us=r["both_us"], logical_gbps=0.0, nvlink_gbps=0.0,
                     mode="graph+stream", checked=bool(r.get("checked", False)))
            rows.append(r)
            if rank == 0:
                print(f"  overlap sms={r['num_sms']}: gemm {r['gemm_us']:.1f} us, comm {r['comm_us']:.1f} us, both "
                      f"{r['both_us']:.1f} us, hidden {r['hidden']:.2f}", flush=True)
    return rows


def _report(allrows, meta, a, pc) -> int:
    """Write the JSON, print the table (rank 0's rows beside rank 1's times) and the ratios; exit code from every
    rank's checks (1 if any point FAILED)."""
    flat = [r for rs in allrows for r in rs]
    meta["checked"] = not failed_rows(flat)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=allrows), f, indent=1)
    print(f"peer copy {pc or 0:.0f} GB/s  {meta}")
    print(f"{'profile':12s} {'op':38s} {'sms':>4s} {'us(r0)':>9s} {'us(r1)':>9s} {'log GB/s':>9s} "
          f"{'nvl GB/s':>9s} mode")
    for i, r in enumerate(allrows[0]):
        r1 = allrows[1][i] if len(allrows) > 1 and i < len(allrows[1]) else r
        ok = "ok" if r.get("checked") and r1.get("checked") else "FAILED"
        print(f"{r['profile']:12s} {r['op']:38s} {r['num_sms']:4d} {r['us']:9.1f} {r1['us']:9.1f} "
              f"{r['logical_gbps']:9.1f} {r['nvlink_gbps']:9.1f} {r['mode']} {ok} {r.get('variant', '')}")
    for line in ratio_lines([r for r in allrows[0] if r.get("num_sms", 0) == 0]):
        print(line)
    return exit_code(flat)


if __name__ == "__main__":
    sys.exit(main())
