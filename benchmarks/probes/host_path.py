"""Host path of dispatch / combine / backwards, counted (torch calls, allocations, launches, host reads) and timed
with launches stubbed (:mod:`tritonep.bench.host_path`), in a CPU world (no GPU needed).

    PYTHONPATH=. python benchmarks/probes/host_path.py --tokens 128 --json out.json
    PYTHONPATH=. python benchmarks/probes/host_path.py --tokens 128 --backends nccl --gpu-path
    PYTHONPATH=. python benchmarks/probes/host_path.py --tokens 128 --compat --geometry bt=2,dec=3

Shape: ``--profile`` of tritonep/bench/profiles.py (default DeepSeek-V3) at world 1 (``--world-size`` for more CPU ranks); both
backends. The counts are machine independent; ``host_us`` is this machine's Python time per call without launches.
``--gpu-path``: the nccl backend takes its GPU path (``use_triton``: the Triton kernels, here interpreted, run
outside the counts and the times) instead of its CPU twins; use few ``--iters``, the interpreter is slow.
``--compat``: the DeepEP-compatible Buffer's round trip as benchmarks/deep_ep_compat.py times it (layout, dispatch,
combine; ``num_worst_tokens`` too) next to the EPBuffer of the same routing (``tep``) and the EPBuffer its rows travel
in (``rows``: one pseudo-expert per rank), launches run for real outside the counts (later steps read their outputs);
``tkern``: aten ops that run a device kernel or copy (torch's own launches on a GPU). ``--geometry`` sets
TRITONEP_GEOMETRY (``bt=2,dec=3``: the one-launch decode tiles a GPU picks up to 256 tokens; the
CPU's own tiles are the two-kernel path a GPU takes at 4096 tokens).
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


def compat_setup(group, T, H, E, K):
    """One rank's inputs and buffers of the compat probes: ``(W, topk_idx [T, K] int64 (distinct experts), topk_weights
    [T, K] float32, x [T, H] bf16, a compat ``deep_ep.Buffer``, an EPBuffer of the same tokens)``, seeded by rank."""
    import torch.distributed as dist

    import tritonep as tep
    import tritonep.compat.deep_ep as deep_ep

    W = dist.get_world_size(group)
    g = torch.Generator().manual_seed(dist.get_rank(group))
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    buf = deep_ep.Buffer(group, 0, 0, max_tokens_per_rank=T)
    ebuf = tep.EPBuffer(group, E, H, T, K, max_recv_tokens=W * T * min(K, E // W))
    return W, idx, w, x, buf, ebuf


def _compat_rank(group, T, H, E, K, iters, geometry):
    import torch.distributed as dist

    if geometry:
        os.environ["TRITONEP_GEOMETRY"] = geometry
    import tritonep as tep
    import tritonep.compat.deep_ep as deep_ep
    from tritonep.bench.host_path import measure_calls

    W, idx, w, x, buf, ebuf = compat_setup(group, T, H, E, K)
    rows = tep.EPBuffer(group, W, H, T, W, max_recv_tokens=W * T)
    ranks = torch.arange(W, dtype=torch.int32)
    ones = torch.ones(T, W)
    st = {}

    def layout():
        st["layout"] = buf.get_dispatch_layout(idx, E)

    def dispatch(worst=0):
        n, _, ne, itr, _ = st["layout"]
        st["d"] = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr, num_tokens_per_expert=ne,
                               topk_idx=idx, topk_weights=w, num_worst_tokens=worst)

    def combine():
        buf.combine(st["d"][0], st["d"][4])

    def tep_dispatch():
        st["t"] = ebuf.dispatch(x, idx, w)

    def rows_dispatch():  # the lane alone (its routing made once, as benchmarks/deep_ep_compat.py times it)
        if "slots" not in st:
            st["slots"] = torch.where(st["layout"][3], ranks, -1)
        st["r"] = rows.dispatch(x, st["slots"], ones)

    calls = {"compat_layout": layout, "compat_dispatch": dispatch, "compat_combine": combine,
             "compat_worst_dispatch": lambda: dispatch(W * T), "compat_worst_combine": combine,
             "tep_dispatch": tep_dispatch, "tep_combine": lambda: ebuf.combine(st["t"].x, st["t"].handle),
             "rows_dispatch": rows_dispatch, "rows_combine": lambda: rows.combine(st["r"].x, st["r"].handle)}

    def status_reads():
        meta = sum(ops.host_reads for ops in buf._normal._meta_ops.values())  # the compat's own (histogram) reads
        return sum(lane.host_reads for _, lane in buf.lanes) + meta + ebuf.host_reads + rows.host_reads

    try:
        res = measure_calls(calls, status_reads, iters=iters, run_kernels=True)
    finally:
        buf.destroy()
        ebuf.close()
        rows.close()
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
    ap.add_argument("--compat", action="store_true", help="the DeepEP-compatible Buffer's round trip (module doc)")
    ap.add_argument("--geometry", default="", help="--compat: TRITONEP_GEOMETRY of the buffers")
    ap.add_argument("--names", action="store_true", help="print the torch / aten names of every call")
    ap.add_argument("--hidden", type=int, default=None, help="override the profile's hidden size (the interpreter "
                    "runs the kernels: a small hidden keeps --compat fast; the host path hardly depends on it)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from tritonep.bench.profiles import profile_shape
    from tritonep.testing import run_cpu_world

    hidden, a.experts, a.topk, _ = profile_shape(a.profile)
    a.hidden = a.hidden or hidden

    rows = []
    for T in a.tokens:
        if a.compat:
            heap = 64 * 2**20 + 8 * a.world_size * T * a.topk * a.hidden * 2
            res = run_cpu_world(a.world_size, _compat_rank, T, a.hidden, a.experts, a.topk, a.iters, a.geometry,
                                heap_bytes=heap, check_protocol=False, timeout_s=1800)[0]
            for kind, r in res.items():
                rows.append(dict(tokens=T, backend="triton", call=kind, **r))
            continue
        for backend in a.backends:
            heap = 64 * 2**20 + 3 * a.world_size * T * a.topk * a.hidden * 2
            res = run_cpu_world(a.world_size, _rank, T, a.hidden, a.experts, a.topk, backend, a.iters, a.gpu_path,
                                heap_bytes=heap, check_protocol=False, timeout_s=900)[0]
            for kind, r in res.items():
                rows.append(dict(tokens=T, backend=backend, call=kind, **r))
    print(f"{'T':>5} {'backend':>7} {'call':>21} {'torch':>6} {'aten':>5} {'alloc':>5} {'tkern':>5} {'launch':>6} "
          f"{'reads':>5} {'host us':>8}")
    for r in rows:
        print(f"{r['tokens']:>5} {r['backend']:>7} {r['call']:>21} {r['torch_calls']:>6} {r['aten_ops']:>5} "
              f"{r['allocs']:>5} {r['torch_kernels']:>5} {r['launches']:>6} {r['host_reads']:>5} {r['host_us']:>8.1f}")
        if a.names:
            print("      torch:", r["torch_names"])
            print("      aten: ", r["aten_names"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(world_size=a.world_size, hidden=a.hidden, experts=a.experts, topk=a.topk,
                           torch=torch.__version__, gpu_path=a.gpu_path, compat=a.compat, geometry=a.geometry,
                           note="launches stubbed; counts exact, host_us this machine",
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
