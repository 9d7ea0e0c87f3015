"""Per-kernel time of dispatch and combine: where do the microseconds of each wire go.

:func:`kernel_breakdown` builds one :class:`tritonep.EPBuffer` per (kernel-tile variant, wire), runs ``iters`` eager
dispatch calls and ``iters`` combine calls under ``torch.profiler`` (CUDA activity only) and reports each kernel's
device time per call (the two-kernel dispatch shows ``dispatch_send_kernel`` and ``dispatch_expand_kernel``, the
push combine ``combine_partial_kernel`` and ``combine_out_kernel``, the fused paths their one launch). Every row is
checked after timing (:class:`tritonep.bench.check.PointChecker`: rows and counts bit for bit, combine against the
fixed-order oracle). Without CUDA (CPU world, interpreter) the host time of each bound launch stands in for the
device time: a smoke run of the code and the checks, not a measurement.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from ..wire.formats import get_wire
from .check import PointChecker, compare_close, compare_exact, kept_decoded, mark_checked
from .ep import PROFILES, _device, _routing

__all__ = ["launch_timer", "kernel_breakdown", "breakdown_lines", "DEFAULT_VARIANTS", "GPU_VARIANTS"]

DEFAULT_VARIANTS = {"two-kernel": "fs=0,fe=0,fc=0", "fused": "fs=1,fe=1,fc=1"}
GPU_VARIANTS = {"two-kernel": "fs=0,fe=0,fc=0", "fused": "fs=40,fe=88,fc=1"}
"""On the GPU the fused roles get the table's split (one program per role is the CPU smoke's choice only)."""
"""Variant name -> TRITONEP_GEOMETRY override: the two-kernel dispatch (send / expand) with the two-kernel push
combine (partial / out), and the one-launch dispatch and combine."""


@contextlib.contextmanager
def launch_timer():
    """Wrap every kernel launch of both backends (every one is a bound launch,
    :class:`tritonep.runtime.bound.BoundKernel`); yields a dict kernel name -> accumulated host seconds."""
    from ..runtime.bound import BoundKernel

    acc = defaultdict(float)
    orig = BoundKernel.__call__

    def timed(self, *dyn):
        t0 = time.perf_counter()
        orig(self, *dyn)
        acc[self.name] += time.perf_counter() - t0

    BoundKernel.__call__ = timed
    try:
        yield acc
    finally:
        BoundKernel.__call__ = orig


def _kernel_us(fn, iters: int) -> tuple[dict, str]:
    """``({kernel name: microseconds per call}, mode)`` of ``iters`` calls of ``fn``."""
    if not torch.cuda.is_available():
        with launch_timer() as acc:
            for _ in range(iters):
                fn()
        return {k: v * 1e6 / iters for k, v in acc.items()}, "cpu-host"
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            out[e.key] = e.self_device_time_total / iters
    return out, "profiler"


def _check_combine_backward(row: dict, buf, gy, eo, d, idx, w, rank: int) -> dict:
    """Check ``buf.combine_backward(gy, eo, d.handle)`` and mark ``row``: the row gradient is each route's weight
    times its token's ``gy`` row (one bf16 rounding: bit for bit against a dispatch of ``gy`` by the same routing),
    the weight gradient ``<gy[token], eo[row]>`` (fp32 sums: within 1e-3 of the largest); every row past the
    layout's end zero in both (the expand zeroes the rows no route writes)."""
    ge, gw = buf.combine_backward(gy, eo, d.handle)
    dg = buf.dispatch(gy, idx, w)
    n = int(dg.expert_offsets[-1]) if dg.expert_offsets.numel() else 0
    rows = dg.x[:n].float()
    want = dict(grad_rows=(rows * dg.weights[:n, None]).to(ge.dtype), rows_past_end=torch.zeros_like(ge[n:]),
                weights_past_end=torch.zeros_like(gw[n:]))
    err = compare_exact(dict(grad_rows=ge[:n], rows_past_end=ge[n:], weights_past_end=gw[n:]), want)
    err = err or compare_close("grad_weights", gw[:n], (rows * eo[:n].float()).sum(1), 1e-3)
    return mark_checked(row, err, rank)


def kernel_breakdown(group, profile: str = "deepseek-v3", wires=("bf16", "fp8", "mxfp4"), variants=None,
                     num_sms=None, iters: int = 5, seed: int = 0, extra: bool = False) -> list:
    """Rows (dicts) of per-kernel times on this rank: one per (variant, wire, op in dispatch / combine; with
    ``extra`` also ``dispatch.kept`` for quantized wires and ``combine_backward`` for bf16).

    Args:
        group: the EP group (world 1 on one GPU for the breakdown; any size works). profile: a key of
            :data:`tritonep.bench.ep.PROFILES`. wires: wire names. variants: name -> TRITONEP_GEOMETRY string
            (default :data:`DEFAULT_VARIANTS`), each the buffer's ``tiles`` argument. num_sms: SM cap (None: all). iters: profiled calls per op.
            extra: add the dispatch with rows kept quantized (checked decoded against the wire's oracle) and the
            combine backward (checked against a dispatch of its ``grad_y``).

    Returns:
        dicts with profile, variant, geometry, wire, op, kernels ``{name: us per call}``, us (their sum), mode,
        checked (and check_error when a check failed).
    """
    import tritonep as tep

    p = PROFILES[profile]
    rank = dist.get_rank(group)
    dev = _device()
    H, E, K, T = p["hidden"], p["num_experts"], p["topk"], p["tokens"]
    idx, w, _ = _routing(rank, T, E, K, seed, dev)
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    chk = PointChecker(group, x, idx, w, E)
    rows = []
    for vname, geo in (variants or DEFAULT_VARIANTS).items():
        for wire in wires:  # no host read in a call (the kernels alone): sync checks off
            buf = tep.EPBuffer(group, E, H, T, K, num_sms=num_sms, dispatch_wire=wire, combine_wire=wire, tiles=geo,
                               sync_checks="none")
            g = buf.tiles
            base = dict(profile=profile, variant=vname, wire=wire, tokens=T, hidden=H, num_sms=num_sms or 0,
                        geometry=f"bt={g.bt},bh={g.bh},warps={g.num_warps},grid={g.grid_send},"
                                 f"fs={g.fused_send},fe={g.fused_expand},fc={g.fused_combine},hg={g.grid_hist},"
                                 f"xeb={g.xeb},xw={g.xwarps}")
            d = buf.dispatch(x, idx, w)  # warm-up (kernels are compiled at construction)
            eo = chk.expert_out(buf.expert_out_buffer(), d)
            buf.combine(eo, d.handle)
            kern, mode = _kernel_us(lambda: buf.dispatch(x, idx, w), iters)
            r = dict(base, op="dispatch", kernels=kern, us=sum(kern.values()), mode=mode)
            rows.append(chk.dispatch(r, buf.dispatch(x, idx, w), wire))
            d = buf.dispatch(x, idx, w)
            eo = chk.expert_out(buf.expert_out_buffer(), d)
            kern, mode = _kernel_us(lambda: buf.combine(eo, d.handle), iters)
            r = dict(base, op="combine", kernels=kern, us=sum(kern.values()), mode=mode)
            rows.append(chk.combine(r, buf.combine(eo, d.handle), wire))
            if extra and get_wire(wire).quantized:
                kern, mode = _kernel_us(lambda: buf.dispatch(x, idx, w, keep_quantized=True), iters)
                r = dict(base, op="dispatch.kept", kernels=kern, us=sum(kern.values()), mode=mode)
                rows.append(chk.dispatch(r, kept_decoded(buf.dispatch(x, idx, w, keep_quantized=True), wire), wire))
            if extra and wire == "bf16":
                gy = torch.randn(T, H, device=dev).to(torch.bfloat16)
                kern, mode = _kernel_us(lambda: buf.combine_backward(gy, eo, d.handle), iters)
                r = dict(base, op="combine_backward", kernels=kern, us=sum(kern.values()), mode=mode)
                rows.append(_check_combine_backward(r, buf, gy, eo, d, idx, w, rank))
            buf.close()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def breakdown_lines(rows: list) -> list:
    """A short table: one line per (variant, wire, op) with its kernels' microseconds."""
    out = [f"{'variant':11s} {'wire':6s} {'op':9s} {'total us':>9s}  kernels (us per call)"]
    for r in rows:
        ks = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["kernels"].items(), key=lambda kv: -kv[1]))
        ok = "" if r.get("checked") else "  FAILED"
        out.append(f"{r['variant']:11s} {r['wire']:6s} {r['op']:9s} {r['us']:9.1f}  {ks}{ok}")
    return out
