"""MoE layer fwd+bwd: tritonep.MoELayer vs a torch + NCCL reference layer with the same shapes, same run.

The reference layer is what a user writes without tritonep: sort routes by expert, ``all_to_all_single`` one row
per route (differentiable, ``torch.distributed.nn.functional``), the same expert FFN (``torch._grouped_mm`` on GPU,
a loop on CPU), ``all_to_all_single`` back, weighted sum over k. Both layers run forward + backward on the same
routing (uniform or OLMoE-skewed) and the median step time is reported, plus the speedup.

Every layer checks itself after timing (:mod:`tritonep.bench.check`): the last step's output of each
layer (tritonep per balance mode, and the torch + NCCL reference layer) is compared with the dense fp32 oracle
:func:`tritonep.reference.moe_dense_reference` of this rank's tokens, within its tolerance ``max|y - ref| <= 3e-2
* max|ref|`` (:data:`tritonep.bench.moe_soak.TOL`, the MoE layer tests' bound). The oracle is built once per run
on the device, a chunk of experts at a time with their weights redrawn as the layer draws them
(:meth:`tritonep.MoELayer.init_expert_weights`), so no rank ever holds every expert's weights.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

__all__ = ["reference_layer_step", "moe_bench_world", "moe_oracle"]

_ORACLE_CHUNK_BYTES = 2 << 30  # expert weights (bf16) redrawn per oracle step


def _ffn(x, offs, w1, w2):
    from ..moe.experts import expert_ffn

    out = torch.empty(x.shape[0], w2.shape[-1], dtype=x.dtype, device=x.device)
    return expert_ffn(x, offs, w1, w2, out=out)


def _a2a_autograd(out, inp, out_splits, in_splits, group):
    """``torch.distributed.nn.functional.all_to_all_single`` (differentiable; what a user writes), without the
    FutureWarning torch >= 2.13 prints on every call for it."""
    import warnings

    from torch.distributed.nn.functional import all_to_all_single

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*all_to_all_single is deprecated", category=FutureWarning)
        return all_to_all_single(out, inp, out_splits, in_splits, group)


def reference_layer_step(group, x, topk_idx, topk_weights, w1, w2, num_experts):
    """One forward of the torch + all_to_all_single reference layer (autograd through everything)."""
    all_to_all_single = _a2a_autograd

    W = dist.get_world_size(group)
    L = num_experts // W
    T, K = topk_idx.shape
    flat = topk_idx.reshape(-1)
    valid = flat >= 0
    order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)
    order = order[: int(valid.sum())]
    e_sorted = flat[order]
    send_counts = torch.bincount(e_sorted // L, minlength=W)
    per_expert = torch.bincount(e_sorted, minlength=num_experts)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_pe = torch.empty(W * L, dtype=per_expert.dtype, device=per_expert.device)
    dist.all_to_all_single(recv_pe, per_expert, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    rows = x[order // K]
    recv = all_to_all_single(torch.empty(sum(rc), x.shape[1], dtype=x.dtype, device=x.device), rows, rc, sc, group)
    # received rows are grouped by source rank, then expert: regroup by local expert (source order kept)
    pe = recv_pe.view(W, L)
    src_rows = torch.arange(sum(rc), device=x.device)
    starts = torch.cumsum(pe.reshape(-1), 0) - pe.reshape(-1)
    j_of = torch.repeat_interleave(torch.arange(L, device=x.device).repeat(W), pe.reshape(-1))
    perm = torch.argsort(j_of, stable=True)
    grouped = recv[perm]
    offs = torch.cumsum(pe.sum(0), 0).to(torch.int32)
    y_rows = _ffn(grouped, offs, w1, w2)
    back_rows = torch.empty_like(y_rows)
    back_rows[perm] = y_rows
    del starts, src_rows
    back = all_to_all_single(torch.empty(sum(sc), x.shape[1], dtype=x.dtype, device=x.device), back_rows, sc, rc,
                             group)
    contrib = back.float() * topk_weights.reshape(-1)[order][:, None]
    y = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add(0, order // K, contrib)
    return y.to(x.dtype)


def _profile_step(step, sync, rows=14):
    """One fwd+bwd step under torch.profiler: the top kernels/ops by device time, as a text table."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=acts) as prof:
        step()
        sync()
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def moe_oracle(x, topk_idx, topk_weights, geometry, seed, dtype=torch.bfloat16):
    """Dense fp32 MoE output ``[T, H]`` of these tokens under the layer's initial weights (seed, dtype), summed over
    chunks of experts (each chunk through :func:`tritonep.reference.moe_dense_reference`), on x's device."""
    from ..moe.layer_parts import expert_weights
    from ..reference import moe_dense_reference

    E, H, inter = geometry.num_experts, geometry.hidden, geometry.intermediate
    step = max(1, _ORACLE_CHUNK_BYTES // (3 * H * inter * torch.finfo(dtype).bits // 8))
    xf = x.detach().float()
    y = torch.zeros(x.shape[0], H, dtype=torch.float32, device=x.device)
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        sel = (topk_idx >= e0) & (topk_idx < e1)
        if not bool(sel.any()):
            continue
        w1, w2 = expert_weights(geometry, seed, dtype, range(e0, e1), x.device)
        y += moe_dense_reference(xf, torch.where(sel, topk_idx - e0, -1), topk_weights, w1, w2)
    return y


def moe_bench_world(group, cfg, steps=10, warmup=2):
    """Rank body: median fwd+bwd seconds of tritonep vs the reference layer (and their max relative difference),
    plus ``checks``: one row per layer ``{op, checked[, check_error]}`` from the oracle check after timing."""
    from ..moe import MoEGeometry, MoELayer, MoERecipe
    from .cases import random_routing
    from .check import compare_close, mark_checked
    from .moe_soak import TOL

    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    H, I, E, K, T = cfg["hidden"], cfg["intermediate"], cfg["num_experts"], cfg["topk"], cfg["tokens"]
    geo = MoEGeometry(hidden=H, intermediate=I, num_experts=E, topk=K, max_tokens_per_rank=T)
    out = {"checks": []}
    seed = 1

    def check(op, y, x, idx, w):
        ref = moe_oracle(x, idx, w, geo, seed)
        row = dict(op=op, tokens=T, hidden=H, world_size=dist.get_world_size(group), tolerance=TOL)
        out["checks"].append(mark_checked(row, compare_close(op, y.float(), ref, TOL), rank))

    for bal in cfg.get("balance", ["none"]):
        layer = MoELayer(MoERecipe(balance=bal, combine="push"), geo, group, device=dev, seed=seed)
        if cfg.get("skew"):
            from ..data import load_olmoe_histogram, sample_routing, scale_histogram_to_experts

            hist = scale_histogram_to_experts(load_olmoe_histogram("arxiv", 0), E)
            idx, w = sample_routing(hist, T, K, generator=rank)
        else:
            idx, w = random_routing(T, E, K, seed=rank)
        idx, w = idx.to(dev), w.to(dev)
        x = torch.randn(T, H, device=dev).to(torch.bfloat16).requires_grad_(True)

        def sync():
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier(group=group)

        times = []
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            y = layer(x, topk_idx=idx, topk_weights=w)
            y.float().sum().backward()
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out[f"tritonep.{bal}"] = statistics.median(times)
        if cfg.get("profile"):
            out[f"profile.tritonep.{bal}"] = _profile_step(
                lambda: layer(x, topk_idx=idx, topk_weights=w).float().sum().backward(), sync)
        y_tep = y.detach()
        check(f"tritonep.{bal}", y_tep, x, idx, w)
        if bal == "none":
            w1 = layer.w1.detach().clone().requires_grad_(True)
            w2 = layer.w2.detach().clone().requires_grad_(True)
            times = []
            for i in range(warmup + steps):
                sync()
                t0 = time.perf_counter()
                yr = reference_layer_step(group, x, idx, w, w1, w2, E)
                yr.float().sum().backward()
                sync()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            out["reference"] = statistics.median(times)
            check("reference", yr.detach(), x, idx, w)
            if cfg.get("profile"):
                out["profile.reference"] = _profile_step(
                    lambda: reference_layer_step(group, x, idx, w, w1, w2, E).float().sum().backward(), sync)
            out["max_rel_diff"] = float((y_tep.float() - yr.detach().float()).abs().max()
                                        / yr.detach().float().abs().max().clamp_min(1e-6))
        out[f"load.{bal}"] = layer.last_stats["recv_rows"]  # alignment 1: rows = routes received
        layer.close()
    return out
