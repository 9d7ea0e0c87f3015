"""Host cost of the torch.distributed collectives a dispatch can use, next to a Triton launch and torch ops, eager.

Run (one GPU, one rank: NCCL's host path, not the wire)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
    torchrun --nproc-per-node 1 benchmarks/probes/collective_cost.py --json out.json

Per op: ``host_us`` = host time per call of ``iters`` back-to-back calls (no sync inside), ``call_us`` = the same
including the final synchronize / iters (what an eager loop of that op costs). Shapes are the nccl backend's at
decode (the ``decode`` profile of tritonep/bench/profiles.py: bf16 rows of H + 96 meta bytes; a counts row of
E + W + 2 int32). Why: to choose between one and two collectives per sync-free nccl dispatch; ``*_bound``: the nccl backend's bound paths
(:class:`tritonep.backends.nccl.collectives.BoundCollective`: the process group's backend called directly;
:class:`tritonep.runtime.bound.BoundKernel`: the compiled kernel's C launcher; ``*_wide_*``: a 57-argument kernel through
Triton's ``kernel[grid]``, the bound launch through Triton's C launcher and the bound packed launch,
:mod:`tritonep.runtime.packed_launch`). Checks: every op's output is compared with
its expected value once after timing. The JSON has host_cost.py's format (``{info, rows: {name: us}}``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl


@triton.jit
def _empty_kernel(a_ptr, b_ptr, n, m):
    pass


@triton.jit
def _wide_kernel(out_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19,
                 a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37, a38, a39,
                 C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                 C5: tl.constexpr, C6: tl.constexpr, C7: tl.constexpr, C8: tl.constexpr, C9: tl.constexpr,
                 C10: tl.constexpr, C11: tl.constexpr, C12: tl.constexpr, C13: tl.constexpr, C14: tl.constexpr,
                 C15: tl.constexpr):
    # 41 runtime arguments and 16 constexprs (the decode dispatch has 47 and 21): stores their sum (the check)
    s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11 + a12 + a13 + a14 + a15 + a16 + a17 + a18 + a19
    s += a20 + a21 + a22 + a23 + a24 + a25 + a26 + a27 + a28 + a29 + a30 + a31 + a32 + a33 + a34 + a35 + a36 + a37
    tl.store(out_ptr, s + a38 + a39 + C0 + C15)


def timed(fn, iters=200, rounds=5):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    host, call = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / iters * 1e6)
        call.append((t2 - t0) / iters * 1e6)
    return dict(host_us=sorted(host)[rounds // 2], call_us=sorted(call)[rounds // 2])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, W = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    from tritonep.bench.profiles import profile_shape

    H, E, _, _ = profile_shape("decode")
    T, width, ncols = a.tokens, H * 2 + 96, E + W + 2
    row = torch.arange(ncols, dtype=torch.int32, device=dev)
    gathered = torch.empty(W * ncols, dtype=torch.int32, device=dev)
    send = torch.randint(0, 255, (W * T, width), dtype=torch.uint8, device=dev)
    recv = torch.empty_like(send)
    splits = [T] * W
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    order = torch.randperm(T, device=dev)
    out = torch.empty_like(x)
    res = {}
    res["all_gather_into_tensor"] = timed(lambda: dist.all_gather_into_tensor(gathered, row))
    res["all_to_all_single_even"] = timed(lambda: dist.all_to_all_single(recv, send))
    res["all_to_all_single_splits"] = timed(lambda: dist.all_to_all_single(recv, send, splits, splits))
    from tritonep.backends.nccl.collectives import BoundCollective
    from tritonep.runtime.launch import Launch

    recv_b = torch.empty_like(send)
    bound_a2a = BoundCollective(recv_b, send, None)  # the nccl backend's even all_to_all: the backend called directly
    res["all_to_all_single_even_bound"] = timed(bound_a2a)
    res["triton_launch_4args"] = timed(lambda: _empty_kernel[(1,)](row, gathered, 1, 2))
    bk = Launch(dev, record=False, max_programs=0).bind(_empty_kernel, {}, ("a_ptr", "b_ptr", "n", "m"))  # the backends' bound direct launch
    res["bound_launch_4args"] = timed(lambda: bk((1,), row, gathered, 1, 2))
    # a wide launch (41 + 16 arguments) three ways: Triton's kernel[grid], the bound launch through Triton's C
    # launcher (every argument each launch), the bound packed launch (tritonep.runtime.packed_launch: the per-call values)
    wide_out = torch.zeros(3, dtype=torch.int64, device=dev)
    wo = [wide_out[i:i + 1] for i in range(3)]
    vals = list(range(2, 42))
    consts = {f"C{i}": i for i in range(16)}
    res["triton_launch_wide"] = timed(lambda: _wide_kernel[(1,)](wo[0], *vals, **consts))
    # bound: the constexprs and 37 of the ints static (as a buffer binds its regions and tiles), 4 per-call values
    static = dict(consts, **{f"a{i}": vals[i] for i in range(3, 40)})
    for j, (name, mode) in enumerate((("bound_launch_wide_triton_launcher", "direct"),
                                      ("bound_launch_wide_packed", "packed"))):
        bw = Launch(dev, record=False, max_programs=0, mode=mode).bind(_wide_kernel, static,
                                                                      ("out_ptr", "a0", "a1", "a2"))
        res[name] = timed(lambda: bw((1,), wo[1 + j], *vals[:3]))
    res["index_select_rows"] = timed(lambda: x.index_select(0, order))
    res["index_copy_rows"] = timed(lambda: out.index_copy_(0, order, x))
    res["empty_rows"] = timed(lambda: torch.empty(T, H, dtype=torch.bfloat16, device=dev))
    torch.cuda.synchronize()
    ok = bool(torch.equal(gathered.view(W, ncols)[rank], row) and torch.equal(recv, send)
              and torch.equal(recv_b, send) if W == 1 else True)
    ok = ok and wide_out.tolist() == [sum(vals) + 15] * 3
    info = dict(command="torchrun --nproc-per-node 1 benchmarks/probes/collective_cost.py", checked=ok, tokens=T,
                world_size=W, gpu=torch.cuda.get_device_name(dev), torch=torch.__version__)
    # host_cost's file format ({info, rows: {name: us}}): scripts/results_index.py indexes it as a host_cost run
    rows = {f"{k}.{m}": v[m] for k, v in res.items() for m in ("host_us", "call_us")}
    if rank == 0:
        for k, v in res.items():
            print(k, v, flush=True)
        print(info, flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(info=info, rows=rows), f, indent=1)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit("collective_cost: an output did not match")


if __name__ == "__main__":
    main()
