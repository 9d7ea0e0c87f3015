"""The host path: what does an EAGER dispatch / combine cost next to its CUDA-graph replay, and where do the host's
microseconds go?

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 1 benchmarks/eager_profile.py --tokens 128 1024 4096 --json $OUT/eager_profile.json

Per token count (``--profile`` of tritonep/bench/profiles.py, default DeepSeek-V3): graph-replay time, eager time
(CUDA events over back-to-back calls, the default deferred sync checks), host (CPU) time per eager call, and the host
time split by kernel launch (by kernel name; measured in a second loop, so the timer's own wrapper stays out of the
host time) and the rest (allocation, host read, autograd), and of it the time the host waited in the dispatch's one
host read for the device's verdict (``*_host_wait_us``; the rest is ``*_host_work_us``, the host's own work; it
still holds any time a launch or allocation itself blocks). Rank 0 prints the top CPU ops of one call from
``torch.profiler``. Every token count's row also holds this host's speed
(:func:`tritonep.bench.host_path.host_calibration`): the GPU machines' hosts differ by up to 2x in CPU speed, so
host times of two runs compare only next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch.distributed as dist

ROUNDS = 5  # eager timings: median of 5 rounds (3 gave +-20 % between calls of one process at 1024 tokens)


def profile_tokens(group, T, profile="deepseek-v3", iters=30, backend="triton"):
    import tritonep as tep
    from tritonep.bench.profiles import profile_shape
    from tritonep.bench.ep import time_graph, time_rounds

    H, E, K, _ = profile_shape(profile)
    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(rank)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    buf = tep.EPBuffer(group, E, H, T, K, backend=backend)
    out = dict(tokens=T, backend=backend, profile=profile)
    from tritonep.bench.host_path import host_calibration

    out.update(host_calibration(dev))  # this host's speed: read every host time below next to it
    if backend == "triton":  # the tiles and grids behind the numbers (TRITONEP_GEOMETRY overrides show here)
        g = buf.tiles
        out["geometry"] = (f"bt={g.bt},bh={g.bh},warps={g.num_warps},grid_send={g.grid_send},"
                           f"grid_expand={g.grid_expand},fs={g.fused_send},fe={g.fused_expand},dec={g.decode},"
                           f"cbt={g.cbt},cwarps={g.cwarps},bbt={g.bbt},bwarps={g.bwarps},bgrid={g.bgrid}")
    eo = buf.expert_out_buffer()
    eo.normal_()
    if backend == "triton":  # the nccl backend's eager path is what users run (its host read sizes the rows)
        out["dispatch_graph_us"], _ = time_graph(lambda: buf.dispatch(x, idx, w), group, iters=iters)
        d = buf.dispatch(x, idx, w, sync_free=True)  # (no read; a captured dispatch reads nothing either)
        out["combine_graph_us"], _ = time_graph(lambda: buf.combine(eo, d.handle), group, iters=iters)
        gx = torch.randn(buf.max_recv_tokens, H, device=dev).to(torch.bfloat16)
        gw = torch.rand(buf.max_recv_tokens, device=dev)
        gy = torch.randn(T, H, device=dev).to(torch.bfloat16)
        out["dispatch_bwd_graph_us"], _ = time_graph(lambda: buf.dispatch_backward(gx, gw, d.handle), group,
                                                     iters=iters)
        out["combine_bwd_graph_us"], _ = time_graph(lambda: buf.combine_backward(gy, eo, d.handle), group,
                                                    iters=iters)
        for _ in range(3):  # warm the eager path after the captures (allocator, pools) before timing it
            buf.dispatch(x, idx, w, sync_free=True)
        torch.cuda.synchronize()
        out["dispatch_sync_free_eager_us"] = time_rounds(lambda: buf.dispatch(x, idx, w, sync_free=True), group,
                                                         iters, rounds=ROUNDS)
        out["dispatch_bwd_eager_us"] = time_rounds(lambda: buf.dispatch_backward(gx, gw, d.handle), group, iters,
                                                   rounds=ROUNDS)
        out["combine_bwd_eager_us"] = time_rounds(lambda: buf.combine_backward(gy, eo, d.handle), group, iters,
                                                  rounds=ROUNDS)
    else:
        out["dispatch_graph_us"] = out["combine_graph_us"] = float("nan")
    for _ in range(3):
        d = buf.dispatch(x, idx, w)
        buf.combine(eo, d.handle)
    torch.cuda.synchronize()
    out["dispatch_eager_us"] = time_rounds(lambda: buf.dispatch(x, idx, w), group, iters, rounds=ROUNDS)
    d = buf.dispatch(x, idx, w)
    eo_r = buf.expert_out_buffer(d.x.shape[0])
    out["combine_eager_us"] = time_rounds(lambda: buf.combine(eo_r, d.handle), group, iters, rounds=ROUNDS)
    # host time per call and its split
    from tritonep.bench.kernels import launch_timer
    from tritonep.memory import group_barrier

    # the host read's own time (a spin until the device published the call's verdict): waiting for the GPU, not
    # host work; host_work_us = host_us - host_wait_us
    status = getattr(getattr(buf, "_backend", None), "call_status", None)  # the triton backend's (nccl: none)
    read0 = getattr(status, "read", None)
    waited = [0.0]
    if read0 is not None:
        def read(ticket):
            t = time.perf_counter()
            try:
                return read0(ticket)
            finally:
                waited[0] += time.perf_counter() - t
        status.read = read
    # the host time per call without the launch timer (its wrapper's own Python would count): ROUNDS loops of
    # ``iters`` calls, the round of median host work reported (one loop varied by +-15 % between processes on one
    # host); then the launches' split in one more loop with the timer
    for name, fn in (("dispatch", lambda: buf.dispatch(x, idx, w)),
                     ("combine", lambda: buf.combine(eo_r, d.handle))):
        rounds = []
        for timer in [False] * ROUNDS + [True]:
            with launch_timer() if timer else contextlib.nullcontext({}) as acc:
                waited[0] = 0.0
                group_barrier(group, dev)  # tritonep.memory: NCCL, or gloo when ranks share a GPU
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                host = (time.perf_counter() - t0) / iters * 1e6
                torch.cuda.synchronize()
            if timer:
                out[f"{name}_launch_host_us"] = {k: v / iters * 1e6 for k, v in acc.items()}
            else:
                rounds.append((host - waited[0] / iters * 1e6, host, waited[0] / iters * 1e6))
        work, host, wait = sorted(rounds)[len(rounds) // 2]
        out[f"{name}_host_us"] = host
        out[f"{name}_host_rounds_us"] = [round(r[1], 2) for r in rounds]
        if read0 is not None:
            out[f"{name}_host_wait_us"] = wait
            out[f"{name}_host_work_us"] = work
    if read0 is not None:
        del status.read  # the class's method again
    if rank == 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                dd = buf.dispatch(x, idx, w)
                buf.combine(buf.expert_out_buffer(dd.x.shape[0]), dd.handle)
            torch.cuda.synchronize()
        out["profile_table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        out["profile_table_cuda"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
    else:
        for _ in range(5):
            dd = buf.dispatch(x, idx, w)
            buf.combine(buf.expert_out_buffer(dd.x.shape[0]), dd.handle)
        torch.cuda.synchronize()
    buf.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--profile", default="deepseek-v3", help="shape: a profile of tritonep/bench/profiles.py")
    ap.add_argument("--json", default=None)
    ap.add_argument("--backend", default="triton", choices=["triton", "nccl"])
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    res = []
    for T in a.tokens:
        r = profile_tokens(dist.group.WORLD, T, profile=a.profile, backend=a.backend)
        res.append(r)
        if rank == 0:
            print(r.pop("profile_table", ""), flush=True)
            print(r.pop("profile_table_cuda", ""), flush=True)
            print(json.dumps(r, indent=1), flush=True)
    if rank == 0:
        print(f"{'tokens':>7} {'disp graph':>10} {'disp eager':>10} {'disp host':>10} {'disp work':>10} "
              f"{'comb graph':>10} {'comb eager':>10} {'comb host':>10}")
        for r in res:
            print(f"{r['tokens']:>7} {r['dispatch_graph_us']:>10.1f} {r['dispatch_eager_us']:>10.1f} "
                  f"{r['dispatch_host_us']:>10.1f} {r.get('dispatch_host_work_us', float('nan')):>10.1f} "
                  f"{r['combine_graph_us']:>10.1f} {r['combine_eager_us']:>10.1f} {r['combine_host_us']:>10.1f}")
        if a.json:
            from tritonep.bench.meta import run_meta

            with open(a.json, "w") as f:
                json.dump(dict(meta=run_meta(world_size=dist.get_world_size()), rows=res), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
