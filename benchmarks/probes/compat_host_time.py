"""Host time of the DeepEP-compatible Buffer's round trip (layout + dispatch + combine; ``compat_w``: the combine of
``topk_weights``, Megatron's fused-dispatch backward, a fresh handle each time; ``num_worst_tokens`` too) vs
EPBuffer's dispatch + combine on the same routing, with every launch a no-op, in a CPU world of one rank.

    PYTHONPATH=. python benchmarks/probes/compat_host_time.py --tokens 128 --hidden 512 --iters 300 [--split] [--cprofile 40]

Each side first runs twice with its kernels for real (interpreted), then every bound launch is replaced by a no-op
that only publishes the call's ticket into the pinned word the host spins on (the status words and histogram stay as
the last real run left them: the same inputs every call). So the times hold the Python and torch host work and the
host reads' spins, and none of the interpreter's after-effects (an interpreted kernel leaves the CPU's caches cold:
timing host steps between real interpreted launches, as ``benchmarks/probes/host_path.py --compat`` does, inflates
every host step 2-10x on a loaded 2-core machine). Reported: per side the minimum over 3 rounds of the median of
``--iters`` round trips (us); ``--split``: inclusive time of the main host functions (a wrapper each, ~0.5 us added);
``--cprofile N``: cProfile's top N by own time. Decode tiles (``TRITONEP_GEOMETRY=bt=2,dec=3``, what a GPU takes up to
256 tokens) unless ``--geometry``. ``--meta-rows-max-tokens 0``: the compat Buffer's top-k in the meta lane (the way
larger token counts take: a second EPBuffer dispatch, no row copies; default: the Buffer's default, meta rows at
these sizes). This machine's time only: compare sides and commits in one run.
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

def _rank(group, T, H, E, K, geometry, n, split, cprofile, mrm):
    import gc

    import torch.distributed as dist

    if geometry:
        os.environ["TRITONEP_GEOMETRY"] = geometry
    import tritonep as tep
    import tritonep.compat.deep_ep as deep_ep
    if mrm is not None:
        deep_ep.DEFAULTS["meta_rows_max_tokens"] = mrm  # the Buffer compat_setup makes passes none
    from tritonep.runtime.bound import BoundKernel
    from host_path import compat_setup  # this folder's compat probe: the same inputs and buffers

    W, idx, w, x, buf, ebuf = compat_setup(group, T, H, E, K)
    orig = BoundKernel.__call__
    plans = {}
    def plan(self, dyn):
        if "ticket" not in self._dyn:
            return None
        pos = self._dyn.index("ticket") + (0 if self.grid is not None else 1)
        try:
            words = self.arg("HOST_ST")
        except ValueError:
            words = None
        if words:
            return self.arg("host_st_ptr").numpy(), words, pos
        h = self.arg("host_ptr")
        return h.numpy(), h.numel() - 1, pos
    def stub(self, *dyn):
        p = plans.get(id(self), 0)
        if p == 0:
            p = plans[id(self)] = plan(self, dyn)
        if p is not None:
            p[0][p[1]] = dyn[p[2]]
    def compat():
        n_, _, ne, itr, _ = buf.get_dispatch_layout(idx, E)
        d = buf.dispatch(x, num_tokens_per_rank=n_, is_token_in_rank=itr, num_tokens_per_expert=ne, topk_idx=idx, topk_weights=w)
        buf.combine(d[0], d[4])
    def compat_w():  # Megatron's fused dispatch then its backward: combine(grad, handle, topk_weights=grad_probs)
        n_, _, ne, itr, _ = buf.get_dispatch_layout(idx, E)
        d = buf.dispatch(x, num_tokens_per_rank=n_, is_token_in_rank=itr, num_tokens_per_expert=ne, topk_idx=idx, topk_weights=w)
        buf.combine(d[0], d[4], topk_weights=d[2])
    def compat_worst():
        n_, _, ne, itr, _ = buf.get_dispatch_layout(idx, E)
        d = buf.dispatch(x, num_tokens_per_rank=n_, is_token_in_rank=itr, num_tokens_per_expert=ne, topk_idx=idx, topk_weights=w, num_worst_tokens=W*T)
        buf.combine(d[0], d[4])
    def tepf():
        d = ebuf.dispatch(x, idx, w)
        ebuf.combine(d.x, d.handle)
    fns = (("compat", compat), ("compat_w", compat_w), ("compat_worst", compat_worst), ("tep", tepf))
    for _, fn in fns:
        fn(); fn()
    BoundKernel.__call__ = stub
    res = {}
    acc = {}
    if split:
        from tritonep.compat.deep_ep import meta, normal, buffer as cbuf
        from tritonep.ep import buffer as ebufm
        from tritonep.runtime import host_status
        def wrap(obj, name, label):
            f = getattr(obj, name)
            def g_(*a, **k):
                t0 = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    acc[label] = acc.get(label, 0.0) + time.perf_counter() - t0
            setattr(obj, name, g_)
        for o, nme in [(cbuf.Buffer, "get_dispatch_layout"), (cbuf.Buffer, "dispatch"), (cbuf.Buffer, "combine"),
                       (normal.NormalMode, "_send"), (normal.NormalMode, "combine"),
                       (meta.MetaOps, "pack_rows"), (meta.MetaOps, "unpack_rows"), (meta.MetaOps, "layout"),
                       (normal.NormalMode, "_meta2_dispatch"), (ebufm.EPBuffer, "dispatch_backward"),
                       (ebufm.EPBuffer, "dispatch"), (ebufm.EPBuffer, "combine"), (host_status.HostStatus, "read"),
                       (BoundKernel, "__call__")]:
            wrap(o, nme, f"{o.__name__}.{nme}")
    gc.disable()
    for rep in range(3):
        for name, fn in fns:
            for _ in range(20):
                fn()
            per = {}
            for _ in range(n):
                acc.clear()
                t0 = time.perf_counter()
                fn()
                acc["TOTAL"] = time.perf_counter() - t0
                for k, v in acc.items():
                    per.setdefault(k, []).append(v * 1e6)
            for k, v in per.items():
                res.setdefault(name, {}).setdefault(k, []).append(statistics.median(v))
    gc.enable()
    if cprofile:
        import cProfile, pstats, io
        for name, fn in fns[:2] + fns[3:]:
            pr = cProfile.Profile(); pr.enable()
            for _ in range(n):
                fn()
            pr.disable()
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(cprofile)
            print("#####", name, s.getvalue())
    BoundKernel.__call__ = orig
    buf.destroy(); ebuf.close()
    return {n_: {k: round(min(v), 1) for k, v in d.items()} for n_, d in res.items()}

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512, help="row width (the host path hardly depends on it; the "
                    "warm-up runs are interpreted)")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--geometry", default="bt=2,dec=3")
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--cprofile", type=int, default=0)
    ap.add_argument("--meta-rows-max-tokens", type=int, default=None, help="the compat Buffer's meta_rows_max_tokens "
                    "(0: the meta lane's way)")
    a = ap.parse_args()
    from tritonep.testing import run_cpu_world

    T, H = a.tokens, a.hidden
    res = run_cpu_world(1, _rank, T, H, a.experts, a.topk, a.geometry, a.iters, a.split, a.cprofile,
                        a.meta_rows_max_tokens, heap_bytes=64 * 2**20 + 8 * T * a.topk * H * 2,
                        check_protocol=False, timeout_s=1800)[0]
    for k, d in res.items():
        print("=====", k, "(us: min over 3 rounds of the median of --iters)")
        for f, v in sorted(d.items(), key=lambda kv: -kv[1]):
            print(f"  {f:40s} {v}")


if __name__ == "__main__":
    main()
