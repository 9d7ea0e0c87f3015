"""Where a bound launch's host microseconds go, per kernel of one eager dispatch + combine (world 1, one GPU).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    PYTHONPATH=. torchrun --nproc-per-node 1 benchmarks/probes/launch_probe.py --tokens 128 [--geometry dec=128]

For every BoundKernel a dispatch + combine launches (their per-call values captured from one real call): host us of
the whole ``bk(*dyn)`` (synchronised before every launch: only whole-call kernels, the decode
geometry's, may be launched alone) and of its variant key alone (``benchmarks/probes/host_cost.py`` times the bare C
launcher); then the host cost of the pieces around the launches (the
status read's copy + event + synchronize, torch.empty, a view) and whether a Triton kernel can store straight into a
pinned host tensor (zero-copy status, DeepEP's mapped counter) and how long the host then waits for it.
"""

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import triton
import triton.language as tl


@triton.jit
def _poke(dst_ptr, val):
    tl.store(dst_ptr, val)


def _us(fn, n=200, sync=True):
    ts = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    ts.sort()
    return round(ts[len(ts) // 2] * 1e6, 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--geometry", default="")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.geometry:
        os.environ["TRITONEP_GEOMETRY"] = a.geometry
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    import tritonep as tep
    from tritonep.bench.profiles import profile_shape
    from tritonep.runtime.bound import BoundKernel

    H, E, K, _ = profile_shape("decode")
    T = a.tokens
    dev = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    buf = tep.EPBuffer(dist.group.WORLD, E, H, T, K)
    for _ in range(3):
        d = buf.dispatch(x, idx, w)
        buf.combine(buf.expert_out_buffer(d.x.shape[0]), d.handle)
    torch.cuda.synchronize()
    seen = []
    orig = BoundKernel.__call__

    def spy(self, *dyn):
        seen.append((self, dyn))
        return orig(self, *dyn)

    BoundKernel.__call__ = spy
    d = buf.dispatch(x, idx, w)
    eo = buf.expert_out_buffer(d.x.shape[0])
    buf.combine(eo, d.handle)
    BoundKernel.__call__ = orig
    torch.cuda.synchronize()
    out = {"tokens": T, "geometry": a.geometry, "kernels": []}
    for bk, dyn in seen:
        if "decode" not in bk.name:  # a kernel of a multi-launch call waits for its partners: never alone
            continue
        row = {"name": bk.name, "n_args": len(bk._tmpl), "n_dyn": len(dyn), "grid": bk.grid}
        key = bk.key_of(dyn)
        row["direct"] = key is not None and key in bk._variants
        row["call_idle_us"] = _us(lambda: bk(*dyn))
        row["key_us"] = _us(lambda: bk.key_of(dyn), sync=False)
        print(json.dumps(row), flush=True)
        out["kernels"].append(row)
    # pieces around the launches
    st = torch.zeros(8, dtype=torch.int64, device=dev)
    host = torch.empty(8, dtype=torch.int64, pin_memory=True)
    ev = torch.cuda.Event()

    def read():
        host.copy_(st, non_blocking=True)
        ev.record()
        ev.synchronize()
        return host.tolist()
    out["status_read_us"] = _us(read)
    out["empty_us"] = _us(lambda: torch.empty(T * K, H, dtype=torch.bfloat16, device=dev), sync=False)
    out["view_us"] = _us(lambda: d.x[:5], sync=False)
    # the host pieces of one eager decode dispatch, each alone: the entry's input checks + sync mode,
    # the three allocations (handle block, rows, row weights), the returned handle and Dispatched
    from tritonep import envs
    from tritonep.ep.handle import Dispatched
    from tritonep.ep.validate import check_dispatch_inputs

    impl, cfg = buf._backend, buf.config

    def front():
        check_dispatch_inputs(x, idx, w, *buf._din)
        envs.sync_checks()
    out["front_us"] = _us(front, sync=False)
    out["allocs_us"] = _us(lambda: (impl.hl.new(dev), impl.outputs.alloc_rows(cfg.max_recv_tokens, False)),
                           sync=False)
    # what replaces them (one output-pool take per call): the decode pool's take (a set found free by its reference
    # counts; the set of the held ``d`` is checked first and skipped)
    pool = impl.outputs.decode_pool if impl.decode is not None else impl.outputs.pool  # the pool its dispatch takes from
    out["pool_take_us"] = _us(lambda: pool.take(), sync=False)

    def objects():
        h = impl.outputs.new_handle()
        h._fill(d.handle.store, impl.hl, T, 1, 5, d.weights, None)
        return Dispatched(d.x, d.num_tokens_per_expert, d.expert_offsets, h, d.weights, None)
    out["objects_us"] = _us(objects, sync=False)
    out["dispatch_idle_us"] = _us(lambda: buf.dispatch(x, idx, w))
    out["dispatch_sync_free_idle_us"] = _us(lambda: buf.dispatch(x, idx, w, sync_free=True))
    out["combine_idle_us"] = _us(lambda: buf.combine(eo, d.handle))
    # zero-copy: a kernel stores into pinned host memory; the host spins on a numpy view
    pin = torch.zeros(16, dtype=torch.int64, pin_memory=True)
    view = pin.numpy()
    ok = True
    try:
        _poke[(1,)](pin, 7)
        torch.cuda.synchronize()
        out["mapped_store_seen"] = int(view[0])
        waits = []
        for i in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _poke[(1,)](pin, 100 + i)
            while view[0] != 100 + i:
                if time.perf_counter() - t0 > 1.0:
                    ok = False
                    break
            waits.append(time.perf_counter() - t0)
        waits.sort()
        out["mapped_launch_to_seen_us"] = round(waits[100] * 1e6, 2)
        out["mapped_ok"] = ok
    except Exception as e:  # noqa: BLE001 - report, do not fail the probe
        out["mapped_error"] = repr(e)[:300]
    print(json.dumps({k: v for k, v in out.items() if k != "kernels"}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    buf.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
