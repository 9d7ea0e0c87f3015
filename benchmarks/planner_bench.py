"""Virtual-expert planner time on one GPU (issue 5: target <= 15 us at 4096 tokens x top-8, 256 experts).

    PYTHONPATH=. python benchmarks/planner_bench.py --json $OUT/planner.json

Times ``tritonep.balance.plan`` (both launches: placement + chunk histograms, then the route remap) as a CUDA-graph
replay (median over ``--iters`` back-to-back replays, CUDA events) and eagerly, on OLMoE-skewed routing for world
sizes 2/4/8 (the planner's input is the gathered ``[W, E]`` histogram; this rank's ``topk_idx`` is sampled from the
same histogram). The result is checked against the torch twins once per shape before timing.
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tritonep.balance import place_torch, plan, remap_torch  # noqa: E402
from tritonep.data import load_olmoe_histogram, sample_routing, scale_histogram_to_experts  # noqa: E402


def _time_graph(fn, iters):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    reps = 20
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(ts)


def _time_eager(fn, iters):
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


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
    dev = torch.device("cuda")
    E, K, T = a.num_experts, a.topk, a.tokens
    hist = scale_histogram_to_experts(load_olmoe_histogram("arxiv", 0), E)
    rows = []
    for W in a.worlds:
        idxs = [sample_routing(hist, T, K, generator=r)[0] for r in range(W)]
        counts = torch.stack([torch.bincount(i[i >= 0].reshape(-1), minlength=E) for i in idxs]).to(torch.int32)
        counts_d, idx_d = counts.to(dev), idxs[0].to(dev).to(torch.int32)
        ref_p = place_torch(counts)
        ref_r = remap_torch(idxs[0], ref_p, 0, counts)
        for npg in a.num_programs:
            kw = dict(num_programs=npg) if npg else {}
            p, r = plan(counts_d, idx_d, 0, validate=True, **kw)
            ok = bool(torch.equal(r.cpu(), ref_r.to(torch.int32))
                      and torch.equal(p.allocation.cpu(), ref_p.allocation.to(torch.int32)))
            g_us = _time_graph(lambda: plan(counts_d, idx_d, 0, **kw), a.iters)
            e_us = _time_eager(lambda: plan(counts_d, idx_d, 0, **kw), a.iters)
            row = dict(world_size=W, num_experts=E, tokens=T, topk=K, num_programs=npg or "default",
                       graph_us=g_us, eager_us=e_us, equal_to_torch=ok)
            rows.append(row)
            print(row, flush=True)
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
