"""Host cost of the ways a call can reach the GPU (to choose the launch path by measurement).

Run on the GPU machine (one GPU)::

    PYTHONPATH=. python benchmarks/probes/host_cost.py --json out.json

Measures host (CPU) microseconds per operation, median of ``--reps`` timed loops of ``--iters`` operations each, the
GPU never the bottleneck (every kernel is empty, every loop is followed by one synchronize outside the timing of the
per-op figure's numerator... the loop is long enough that queue back-pressure would show; it does not at these
sizes). Rows:

* ``launch.<path>.<n>args``: one launch of an empty Triton kernel with ``n`` runtime arguments (half pointers, half
  ints) through (a) ``kernel[grid](...)`` (Triton's JIT path), (b) ``CompiledKernel[grid](...)`` (what
  a cache of compiled variants does on a hit), (c) the compiled kernel's C launcher called directly with tensors, (d) the same with
  every pointer passed as a Python int (the pre-bound launch: static arguments precomputed at construction).
* ``graph.replay.<k>kernels``: ``CUDAGraph.replay()`` of a graph of k such launches (the whole call replayed from a graph), and
  ``h2d.pinned_64B``: the per-call argument block written before a replay (a 64-byte pinned -> device copy).
* ``torch.*``: the small torch operations a call's host path is made of (allocation, views, autograd, events,
  stream lookup).

Every row is host time; nothing is checked because nothing is computed (the kernels are empty by design).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
import triton
import triton.language as tl


def _make_kernel(n_ptr: int, n_int: int):
    params = [f"p{i}" for i in range(n_ptr)] + [f"i{i}" for i in range(n_int)]
    src = (f"def empty_{n_ptr}_{n_int}({', '.join(params)}, C: tl.constexpr):\n"
           f"    pid = tl.program_id(0)\n"
           f"    if pid < 0:\n"
           f"        tl.store(p0, i0)\n")
    ns = {"tl": tl, "triton": triton}
    fname = f"/tmp/_host_cost_k_{n_ptr}_{n_int}.py"
    with open(fname, "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n@triton.jit\n" + src)
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_hc_{n_ptr}_{n_int}", fname)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, f"empty_{n_ptr}_{n_int}")


def _time(fn, iters: int, reps: int) -> float:
    """Median host microseconds per call of ``fn`` over ``reps`` loops of ``iters`` calls."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0) / iters * 1e6)
    return statistics.median(out)


def measure(iters: int, reps: int) -> dict:
    dev = torch.device("cuda", 0)
    rows: dict = {}
    stream = torch.cuda.current_stream().cuda_stream
    for n in (4, 20, 40, 60):
        n_ptr, n_int = n // 2, n - n // 2
        k = _make_kernel(n_ptr, n_int)
        ts = [torch.empty(64, dtype=torch.int32, device=dev) for _ in range(n_ptr)]
        ints = [3 + 2 * i for i in range(n_int)]
        args = ts + ints
        compiled = k[(1,)](*args, C=1)
        rows[f"launch.jit.{n}args"] = _time(lambda: k[(1,)](*args, C=1), iters, reps)
        runner = compiled[(1, 1, 1)]
        rows[f"launch.compiled.{n}args"] = _time(lambda: runner(*args, 1), iters, reps)
        run = compiled.run  # CudaLauncher
        fn_h, meta = compiled.function, compiled.packed_metadata
        rows[f"launch.c_tensors.{n}args"] = _time(
            lambda: run(1, 1, 1, stream, fn_h, meta, None, None, None, *args, 1), iters, reps)
        iargs = [t.data_ptr() for t in ts] + ints
        raw = run.launch
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        assert run.global_scratch_size == 0 and run.profile_scratch_size == 0
        rows[f"launch.c_ints.{n}args"] = _time(
            lambda: raw(1, 1, 1, stream, fn_h, coop, pdl, None, None, meta, None, None, None, *iargs, 1), iters,
            reps)
        if n == 40:
            for nk in (1, 4):
                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    with torch.cuda.graph(g, stream=s):
                        for _ in range(nk):
                            runner(*args, 1)
                torch.cuda.current_stream().wait_stream(s)
                rows[f"graph.replay.{nk}kernels"] = _time(g.replay, iters, reps)
    pinned = torch.empty(16, dtype=torch.int32, pin_memory=True)
    blk = torch.empty(16, dtype=torch.int32, device=dev)
    rows["h2d.pinned_64B"] = _time(lambda: blk.copy_(pinned, non_blocking=True), iters, reps)
    rows["torch.empty_cuda"] = _time(lambda: torch.empty(1024, dtype=torch.int32, device=dev), iters, reps)
    from tritonep.bench.profiles import profile_shape

    H, _, _, T = profile_shape("decode")
    rows["torch.empty_cuda_2d"] = _time(lambda: torch.empty(T, H, dtype=torch.bfloat16, device=dev), iters, reps)
    flat = torch.empty(1 << 20, dtype=torch.int32, device=dev)
    sizes = [1024] * 9
    rows["torch.split_9"] = _time(lambda: flat[:9216].split(sizes), iters, reps)
    rows["torch.split_with_sizes_9"] = _time(lambda: flat[:9216].split_with_sizes(sizes), iters, reps)  # outputs.py
    rows["torch.slice"] = _time(lambda: flat[:100], iters, reps)
    rows["torch.view_2d"] = _time(lambda: flat[:1024].view(32, 32), iters, reps)
    x = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    rows["torch.contiguous_noop"] = _time(lambda: x.contiguous(), iters, reps)
    rows["torch.shape_checks"] = _time(
        lambda: (x.dim() == 2 and x.shape[1] == H and x.dtype == torch.bfloat16 and x.device == dev
                 and x.is_contiguous()), iters, reps)
    rows["torch.data_ptr"] = _time(x.data_ptr, iters, reps)
    rows["torch.current_stream"] = _time(lambda: torch.cuda.current_stream().cuda_stream, iters, reps)
    rows["torch.raw_stream"] = _time(lambda: torch._C._cuda_getCurrentRawStream(0), iters, reps)
    rows["torch.is_capturing"] = _time(torch.cuda.is_current_stream_capturing, iters, reps)
    ev = torch.cuda.Event()
    rows["torch.event_record"] = _time(ev.record, iters, reps)
    small = torch.zeros(4, dtype=torch.int64, device=dev)
    host = torch.empty(4, dtype=torch.int64, pin_memory=True)

    def roundtrip():
        host.copy_(small, non_blocking=True)
        ev.record()
        ev.synchronize()

    rows["torch.d2h_sync_idle"] = _time(roundtrip, iters, reps)
    rows["torch.add_1"] = _time(lambda: small[:1].add_(1), iters, reps)

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a

        @staticmethod
        def backward(ctx, g):
            return g

    xa = torch.empty(4, device=dev, requires_grad=True)
    rows["torch.autograd_apply"] = _time(lambda: Fn.apply(xa), iters, reps)
    with torch.no_grad():
        rows["torch.autograd_apply_nograd"] = _time(lambda: Fn.apply(xa), iters, reps)

    @dataclasses.dataclass(frozen=True)
    class H:
        a: object
        b: object
        c: int = 0

    h = H(1, 2)
    rows["py.dataclass_replace"] = _time(lambda: dataclasses.replace(h, c=3), iters, reps)
    rows["py.dataclass_new"] = _time(lambda: H(1, 2, 3), iters, reps)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = measure(a.iters, a.reps)
    info = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                iters=a.iters, reps=a.reps, unit="host us per op (median of reps)")
    for k, v in rows.items():
        print(f"{k:34s} {v:8.2f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
