"""What each host-side piece of an eager decode dispatch costs on THIS host.

The GPU machines' hosts differ by up to 2x in CPU speed and drift within a call, so a call's host time alone says little.
This prints, in one process, a calibration (a fixed pure-Python loop and a fixed torch slice) next to every piece of
the 128-token decode dispatch's host path (the dispatch's input checks, the pool take, the stream / capture queries, the
views cut after the host read, the bound launch) and the whole call, so runs on different hosts can be compared
piece by piece. With ``--cpp`` it also builds (``torch.utils.cpp_extension.load_inline``, needs ninja and a C++
compiler) and times those input checks and the two views done in C++ (a candidate C host path), to decide whether such a path
is worth its build.

Run (one GPU, world 1; on a CPU, ``python benchmarks/probes/host_primitives.py``, one rank of the CPU world, the pieces
only: an interpreted launch is not a host cost; `TRITONEP_GEOMETRY=dec=1` for the decode geometry there)::

    PYTHONPATH=. torchrun --nproc-per-node 1 benchmarks/probes/host_primitives.py --json out.json [--cpp]

Every figure is the minimum over ``--rounds`` rounds of the mean of ``--iters`` calls, microseconds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

_CPP = r"""
#include <torch/extension.h>
// the front door's checks of (x, topk_idx, topk_weights) and the two views a synced decode dispatch cuts after its
// host read, as one call (measurement only)
py::tuple front_and_views(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& w, const at::Tensor& rows,
                          const at::Tensor& rw, int64_t hidden, int64_t topk, int64_t tmax, int64_t R) {
  auto dev = rows.device();
  if (x.device() != dev || idx.device() != dev || w.device() != dev) throw std::invalid_argument("device");
  if (x.dim() != 2 || x.size(1) != hidden || x.scalar_type() != at::kBFloat16) throw std::invalid_argument("x");
  int64_t T = x.size(0);
  if (T > tmax) throw std::invalid_argument("T");
  auto it = idx.scalar_type();
  if ((it != at::kInt && it != at::kLong) || idx.dim() != 2 || idx.size(0) != T || idx.size(1) != topk)
    throw std::invalid_argument("idx");
  if (w.dim() != 2 || w.size(0) != T || w.size(1) != topk || w.scalar_type() != at::kFloat)
    throw std::invalid_argument("w");
  if (!x.is_contiguous() || !idx.is_contiguous() || !w.is_contiguous()) throw std::invalid_argument("contig");
  return py::make_tuple(rows.narrow(0, 0, R), rw.narrow(0, 0, R), (int64_t)x.data_ptr(), (int64_t)idx.data_ptr(),
                        (int64_t)w.data_ptr(), T);
}
"""


def _call_values(bk, dyn) -> tuple:
    """The values the generated direct launch of ``bk`` hands the packed C launcher for per-call values ``dyn`` (in
    its ``_cpos`` order: the storage block's fields as addresses, tensors as addresses, the rest as they are)."""
    by_pos = {}
    for p, v in zip(bk._pos, dyn):
        if p < 0:
            base = v.data_ptr()
            for fpos, start, _, _ in bk._fields:
                by_pos[fpos] = base + 4 * start
        else:
            by_pos[p] = v.data_ptr() if isinstance(v, torch.Tensor) else v
    return tuple(by_pos[p] for p in bk._cpos)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--cpp", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if torch.cuda.is_available():
        dist.init_process_group("nccl")
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        measure(dist.group.WORLD, a)
        dist.destroy_process_group()
    else:  # Triton's interpreter: one rank of the CPU world (its symmetric heap)
        from tritonep.testing import run_cpu_world

        run_cpu_world(1, measure, a)


def measure(group, a):
    import tritonep as tep
    from tritonep.bench.host_path import best_time_us as timed, host_calibration
    from tritonep.ep.validate import check_dispatch_inputs

    from tritonep.bench.profiles import profile_shape

    H, E, K, _ = profile_shape("decode")
    T = a.tokens
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    idx = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K].contiguous().to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    cuda = dev.type == "cuda"
    buf = tep.EPBuffer(group, E, H, T, K)
    impl = buf._backend
    d = buf.dispatch(x, idx, w)
    R = d.x.shape[0]
    eo = buf.expert_out_buffer(R)
    rows = torch.empty(buf.max_recv_tokens, H, dtype=torch.bfloat16, device=dev)
    rw = torch.empty(buf.max_recv_tokens, dtype=torch.float32, device=dev)
    it, rd = a.iters, a.rounds
    res = dict(device=torch.cuda.get_device_name() if cuda else "cpu", tokens=T, rows=R,
               geometry_decode=int(buf.tiles.decode), torch=torch.__version__)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    res.update(host_calibration(dev, it, rd))  # the host's interpreter and torch-binding speed
    pieces = {
        "two_views": lambda: (rows[:R], rw[:R]),
        "front_door_checks": lambda: check_dispatch_inputs(x, idx, w, *buf._din),
        "x_device": lambda: x.device,
        "x_shape_dtype_contig": lambda: (x.shape, x.dtype, x.is_contiguous()),
        "data_ptr_x3": lambda: (x.data_ptr(), idx.data_ptr(), w.data_ptr()),
        "grad_enabled": torch.is_grad_enabled,
    }
    if cuda:
        pieces["is_capturing"] = torch._C._cuda_isCurrentStreamCapturing
        pieces["raw_stream"] = lambda: torch._C._cuda_getCurrentRawStream(0)
    pool = impl.outputs.decode_pool
    pieces["pool_take"] = pool.take
    for name, fn in pieces.items():
        res[name + "_us"] = timed(fn, it, rd)
    # whole calls on the GPU: host time per call (a synced dispatch's includes its wait for the device's verdict), in
    # batches of 50 calls with the GPU drained between batches, untimed
    n = 50
    whole = [("dispatch_synced", lambda: buf.dispatch(x, idx, w)),
             ("dispatch_sync_free", lambda: buf.dispatch(x, idx, w, sync_free=True)),
             ("combine", lambda: buf.combine(eo, d.handle))]
    if buf.tiles.decode:  # the bound launch alone, as a sync-free call makes it (ticket 0: nobody reads)
        bk = impl.k.decode(False)
        dyn = (x, idx, w, impl.hl.new(dev), T, 0, buf.max_recv_tokens, rows, None, None, 0)
        bk(*dyn)
        res["decode_launch_direct_bound"] = bk._direct is not None and bool(bk._direct(dyn))
        whole += [("decode_launch", lambda: bk(*dyn)),
                  ("decode_launch_direct", lambda: bk._direct(dyn))]  # without BoundKernel.__call__'s prelude
        ent = bk._variants.get(bk.key_of(dyn))
        if ent is not None and ent.__class__ is not tuple:  # packed: the C call alone, its values made beforehand
            from tritonep.runtime import packed_launch

            run_c, stream = packed_launch.module().run, torch._C._cuda_getCurrentRawStream(dev.index or 0)
            cvals = _call_values(bk, dyn)
            whole.append(("decode_launch_c_only", lambda: run_c(ent, stream, *cvals)))

    def host_of(fn, reps):  # host time per call, the GPU drained between batches (not timed)
        best = float("inf")
        for _ in range(rd):
            tot = 0.0
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                tot += time.perf_counter() - t0
            best = min(best, tot / (reps * n) * 1e6)
        sync()
        return best

    for name, fn in whole if cuda else ():
        res[name + "_us"] = host_of(fn, max(1, it // (10 * n)))
    if a.cpp:
        from torch.utils.cpp_extension import load_inline

        t0 = time.perf_counter()
        try:
            m = load_inline("tritonep_host_probe", _CPP, functions=["front_and_views"], extra_cflags=["-O2"])
            res["cpp_build_s"] = time.perf_counter() - t0
            args = (x, idx, w, rows, rw, H, K, buf.max_tokens_per_rank, R)
            res["cpp_front_and_views_us"] = timed(lambda: m.front_and_views(*args), it, rd)
            res["py_front_and_views_us"] = timed(
                lambda: (check_dispatch_inputs(x, idx, w, *buf._din), rows[:R], rw[:R]), it, rd)
        except Exception as e:  # noqa: BLE001 - reported, the Python figures stand
            res["cpp_error"] = f"{type(e).__name__}: {e}"[:500]
    buf.close()
    if dist.get_rank(group) == 0:
        meta = {k: res.pop(k) for k in [k for k in res if not k.endswith(("_us", "_s"))]}
        out = dict(meta=meta, rows=res)  # rows {name: us} (scripts/results_index.py, as host_cost's)
        print(json.dumps(out, indent=1), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
