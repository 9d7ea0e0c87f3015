"""Host cost of one :class:`tritonep.runtime.bound.BoundKernel` call on the direct path, without a GPU.

    PYTHONPATH=. python benchmarks/probes/bound_overhead.py [--iters 20000] [--json out.json]

A kernel shaped like the forward fused dispatch (14 per-call values: 10 tensors, 2 ints, 2 None; 40 static
arguments) is bound to a stand-in compiled kernel whose C launcher does nothing, so the figure is the Python work
of a launch: key, look-up, hook check, stream, argument tuple. The CPU's stream lookup is a stand-in too (the GPU's
``torch._C._cuda_getCurrentRawStream`` costs ~0.1-0.3 us more). Rows: ``bound_call_us`` (the whole
``bk(*dyn)``), ``c_launch_floor_us`` (the stand-in launcher called with a prebuilt tuple: what no Python work
costs). Compare runs on one machine only.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

import torch

N_STATIC, DYN = 40, ("x", "i", "w", "r", "T", "o", "ow", "hm", "hw", "hn", "np_", "of", "q", "s")


def _fake_kernel():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import KernelParam

    params = list(DYN) + [f"s{i}" for i in range(N_STATIC)] + ["BT: tl.constexpr", "WIRE: tl.constexpr"]
    src = f"def fused_like({', '.join(params)}):\n    pass\n"
    ns = {"tl": __import__("triton.language", fromlist=["x"])}
    exec(src, ns)
    kfn = ns["fused_like"]
    kparams = [KernelParam(i, p, p.name == "T", False) for i, p in enumerate(inspect.signature(kfn).parameters.values())]

    class Run:
        launch_cooperative_grid = launch_pdl = False
        global_scratch_size = profile_scratch_size = 0

        @staticmethod
        def launch(*a):
            return None

    class Compiled:
        run = Run()
        function, packed_metadata = 1, 2

    class Kernel:
        fn, params = staticmethod(kfn), kparams
        device_caches = {0: (None, None, None, CUDABackend(GPUTarget("cuda", 90, 32)), None)}

        def __getitem__(self, grid):
            return lambda *a, **k: Compiled()

        def warmup(self, *a, grid, **k):
            return Compiled()

    return Kernel(), Run.launch


def measure(iters: int) -> dict:
    from tritonep.runtime import bound as bound_mod

    bound_mod.bound_launch_enabled = lambda launcher: True
    torch._C._cuda_getCurrentRawStream = lambda dev: 7  # CPU stand-in (no CUDA here)

    class Lau:
        device, _warmup, max_programs = torch.device("cuda:0"), False, 0

    k, launch = _fake_kernel()
    static = {f"s{i}": (torch.zeros(4) if i % 3 == 0 else i) for i in range(N_STATIC)}
    bk = bound_mod.BoundKernel(Lau(), k, (132,), dict(static, BT=32, WIRE=1, num_warps=8), dyn=DYN)
    t = [torch.zeros(64) for _ in range(10)]
    dyn = (t[0], t[1], t[2], t[3], 128, t[4], t[5], t[6], t[7], t[8], t[9], t[0], None, None)
    bk(*dyn)  # Triton's path once: binds the variant

    def loop(fn):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            best.append((time.perf_counter() - t0) / iters * 1e6)
        return statistics.median(best)

    args = tuple(range(70))
    return dict(bound_call_us=loop(lambda: bk(*dyn)), c_launch_floor_us=loop(lambda: launch(*args)), iters=iters)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = measure(a.iters)
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
