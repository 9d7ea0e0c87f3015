"""Virtual-expert planner timing on one GPU (one launch; the goal: <= 15 us at 4096 tokens x top-8, 256 experts).

Times :func:`tritonep.balance.plan` (one Triton launch) as a CUDA-graph replay (median over rounds of 20
back-to-back replays, CUDA events) and eagerly, on OLMoE-skewed routing for the given world sizes (the planner's
input is the gathered ``[W, E]`` histogram; this rank's ``topk_idx`` is sampled from the same histogram), for each
placement mode, chunk count and tile size asked for. Every point checks itself after timing
(:mod:`tritonep.bench.check`): the captured call's outputs (every replay rewrites them) and the last eager call's
outputs must equal the torch twins (:func:`tritonep.balance.place_torch`, :func:`tritonep.balance.remap_torch`,
built once per (world size, mode)) bit for bit, with a zero status word; the row records ``checked``.
Without CUDA the same code runs eagerly with ``time.perf_counter`` (a smoke test of the checks, no measurement).
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from .check import mark_checked

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
        out = fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(ts), out


def _time_eager(fn, iters: int) -> float:
    ts = []
    for _ in range(iters):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            out = fn()
            ts.append((time.perf_counter() - t0) * 1e6)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts), out


def _count_launches(call) -> int:
    """Kernel launches of one ``call()``: CUDA kernels seen by torch.profiler, or interpreted Triton launches."""
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    from triton.runtime.interpreter import InterpretedFunction

    n, orig = [0], InterpretedFunction.run

    def counting(self, *a, **k):
        n[0] += 1
        return orig(self, *a, **k)

    InterpretedFunction.run = counting
    try:
        call()
    finally:
        InterpretedFunction.run = orig
    return n[0]


def _check(out, want_p, want_r) -> str:
    """'' when a plan() output equals the twins bit for bit with a zero status, else what differs."""
    from ..balance import plan_status

    p, r = out
    bad = [] if p.equal(want_p) else ["placement"]
    if not torch.equal(r.cpu(), want_r):
        bad.append(f"runtime ids ({int((r.cpu() != want_r).sum())} of {r.numel()} differ)")
    if plan_status(p):
        bad.append(f"status {plan_status(p)}")
    return ", ".join(bad)


def bench_planner(worlds=(2, 4, 8), tokens: int = 4096, topk: int = 8, num_experts: int = 256,
                  num_programs=(0,), iters: int = 50, blocks=(0,), modes=("reference",), warps=(0,),
                  lookback_groups=(0,)) -> list[dict]:
    """Rows ``{world_size, num_experts, tokens, topk, mode, num_programs, block, num_warps, lookback_group,
    launches, graph_us, eager_us, checked[, check_error]}``; ``graph_us`` is None without CUDA; ``launches`` =
    kernels one eager call ran (torch.profiler on CUDA, interpreted launches on CPU).

    ``num_programs`` / ``blocks`` / ``warps`` / ``lookback_groups`` 0 = :func:`tritonep.balance.plan`'s default
    (every combination is one row). A failed check prints FAILED.
    """
    from ..balance import place_torch, plan, remap_torch
    from ..data import load_olmoe_histogram, sample_routing, scale_histogram_to_experts

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    E, K, T = num_experts, topk, tokens
    hist = scale_histogram_to_experts(load_olmoe_histogram("arxiv", 0), E)
    rows = []
    for W in worlds:
        idxs = [sample_routing(hist, T, K, generator=r)[0] for r in range(W)]
        counts = torch.stack([torch.bincount(i[i >= 0].reshape(-1), minlength=E) for i in idxs]).to(torch.int32)
        counts_d, idx_d = counts.to(dev), idxs[0].to(dev).to(torch.int32)
        for mode in modes:
            ref_p = place_torch(counts, mode)  # the oracle, once per (world size, mode)
            ref_r = remap_torch(idxs[0], ref_p, 0, counts).to(torch.int32)
            for npg, blk, nw, grp in itertools.product(num_programs, blocks, warps, lookback_groups):
                kw = dict(mode=mode)
                kw.update({k: v for k, v in (("num_programs", npg), ("block", blk), ("num_warps", nw),
                                             ("lookback_group", grp)) if v})

                def call():
                    return plan(counts_d, idx_d, 0, **kw)

                graph_us, g_out = _time_graph(call, iters) if cuda else (None, None)
                eager_us, e_out = _time_eager(call, iters if cuda else 1)
                row = dict(world_size=W, num_experts=E, tokens=T, topk=K, mode=mode,
                           num_programs=npg or "default", block=blk or "default", num_warps=nw or "default",
                           lookback_group=grp or "default", launches=_count_launches(call),
                           graph_us=graph_us, eager_us=eager_us)
                if cuda:
                    torch.cuda.synchronize()
                errs = [f"{name}: {e}" for name, out in (("graph", g_out), ("eager", e_out))
                        if out is not None and (e := _check(out, ref_p, ref_r))]
                rows.append(mark_checked(row, "; ".join(errs)))
    return rows
