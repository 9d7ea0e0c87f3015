"""Virtual-expert planner timing on one GPU (issue: planner <= 15 us at 4096 tokens x top-8, 256 experts).

Times :func:`tritonep.balance.plan` (both launches) as a CUDA-graph replay (median over rounds of 20 back-to-back
replays, CUDA events) and eagerly, on OLMoE-skewed routing for the given world sizes (the planner's input is the
gathered ``[W, E]`` histogram; this rank's ``topk_idx`` is sampled from the same histogram). Each shape's result is
checked against the torch twins before timing.
"""

from __future__ import annotations

import statistics

import torch

__all__ = ["bench_planner"]


def _time_graph(fn, iters: int, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
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


def _time_eager(fn, iters: int) -> float:
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def bench_planner(worlds=(2, 4, 8), tokens: int = 4096, topk: int = 8, num_experts: int = 256,
                  num_programs=(0,), iters: int = 50) -> list[dict]:
    """Rows ``{world_size, num_experts, tokens, topk, num_programs, graph_us, eager_us, equal_to_torch}``.

    Needs CUDA (raises RuntimeError otherwise). ``num_programs`` 0 = :func:`tritonep.balance.plan`'s default.
    """
    from ..balance import place_torch, plan, remap_torch
    from ..data import load_olmoe_histogram, sample_routing, scale_histogram_to_experts

    if not torch.cuda.is_available():
        raise RuntimeError("the planner benchmark needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    E, K, T = num_experts, topk, tokens
    hist = scale_histogram_to_experts(load_olmoe_histogram("arxiv", 0), E)
    rows = []
    for W in worlds:
        idxs = [sample_routing(hist, T, K, generator=r)[0] for r in range(W)]
        counts = torch.stack([torch.bincount(i[i >= 0].reshape(-1), minlength=E) for i in idxs]).to(torch.int32)
        counts_d, idx_d = counts.to(dev), idxs[0].to(dev).to(torch.int32)
        ref_p = place_torch(counts)
        ref_r = remap_torch(idxs[0], ref_p, 0, counts)
        for npg in num_programs:
            kw = dict(num_programs=npg) if npg else {}
            p, r = plan(counts_d, idx_d, 0, validate=True, **kw)
            ok = bool(torch.equal(r.cpu(), ref_r.to(torch.int32))
                      and torch.equal(p.allocation.cpu(), ref_p.allocation.to(torch.int32)))
            rows.append(dict(world_size=W, num_experts=E, tokens=T, topk=K, num_programs=npg or "default",
                             graph_us=_time_graph(lambda: plan(counts_d, idx_d, 0, **kw), iters),
                             eager_us=_time_eager(lambda: plan(counts_d, idx_d, 0, **kw), iters),
                             equal_to_torch=ok))
    return rows
