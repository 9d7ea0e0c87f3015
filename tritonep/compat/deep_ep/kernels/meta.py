"""Two local kernels of the DeepEP-compatible normal mode, each one launch where the torch twin takes ten ops:

* :func:`layout` (``get_dispatch_layout``): tokens per rank, routes per expert, ``is_token_in_rank``; one program
  walks the token tiles and holds both histograms in registers (no atomics, deterministic), like DeepEP's layout
  kernel one pass over ``topk_idx``. Twin: :func:`tritonep.compat.deep_ep.packing.layout_torch`.
* :func:`unpack_meta` (after the meta lane's dispatch): every received token's local ids (-1 off this rank, for -1
  and for ids outside ``[-1, E)``), its weights (0 where the id is -1) and the per-local-expert histogram (one relaxed
  atomic per received slot into a zeroed ``[L + 1]`` int32). Twin: :func:`tritonep.compat.deep_ep.packing.unpack_meta`.

Both are bit-exact with their twins (integer work and moves only). On CUDA they launch through the cached launcher
(:class:`tritonep.ep.triton.fast_launch.LaunchCache`: a few us of host time instead of Triton's per-call binding),
elsewhere through Triton's own path (the interpreter on a CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["layout", "unpack_meta", "layout_kernel", "unpack_meta_kernel"]


@triton.jit
def layout_kernel(ids_ptr, T, in_rank_ptr, per_rank_ptr, per_expert_ptr, K: tl.constexpr, KB: tl.constexpr,
                  E: tl.constexpr, EB: tl.constexpr, L: tl.constexpr, W: tl.constexpr, WB: tl.constexpr,
                  BT: tl.constexpr):
    """``ids [T, K]`` (int32/int64) -> ``in_rank [T, W]`` bool, ``per_rank [W]`` / ``per_expert [E]`` int32. One
    program (grid 1); an id outside ``[0, E)`` selects nothing."""
    kk = tl.arange(0, KB)
    ww = tl.arange(0, WB)
    per_rank = tl.zeros((WB,), tl.int32)
    per_expert = tl.zeros((EB,), tl.int32)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        tm = t < T
        m2 = tm[:, None] & (kk < K)[None, :]
        ids = tl.load(ids_ptr + t[:, None].to(tl.int64) * K + kk[None, :], mask=m2, other=-1)
        valid = m2 & (ids >= 0) & (ids < E)
        r = tl.where(valid, ids // L, -1)
        hit = tl.max((r[:, :, None] == ww[None, None, :]).to(tl.int32), axis=1)  # [BT, WB]: token t reaches rank w
        tl.store(in_rank_ptr + t[:, None].to(tl.int64) * W + ww[None, :], hit != 0,
                 mask=tm[:, None] & (ww < W)[None, :])
        per_rank += tl.sum(hit, axis=0)
        per_expert += tl.histogram(tl.reshape(tl.where(valid, ids, 0).to(tl.int32), (BT * KB,)), EB,
                                   mask=tl.reshape(valid, (BT * KB,)))
    tl.store(per_rank_ptr + ww, per_rank, mask=ww < W)
    tl.store(per_expert_ptr + tl.arange(0, EB), per_expert, mask=tl.arange(0, EB) < E)


@triton.jit
def unpack_meta_kernel(rows_ptr, RS, w_ptr, R, live_ptr, lo, idx_ptr, wout_ptr, hist_ptr, K: tl.constexpr,
                       KB: tl.constexpr, L: tl.constexpr, BR: tl.constexpr, LIVE: tl.constexpr):
    """Received tokens ``[BR]`` per program: ``rows`` int32 ``[R*K, RS]`` (the token's K ids first in the first of its
    K rows), ``w`` float32 ``[R*K]`` (route weights) -> ``idx [R, K]`` local ids, ``wout [R, K]`` float32, and
    ``hist[1 + j] += slots with local expert j`` (``hist[0]``: slots with -1). ``lo`` = rank * L. ``LIVE``: tokens at
    or past ``*live_ptr`` are not received (ids -1, weight 0, not counted)."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    kk = tl.arange(0, KB)
    rm = i < R
    m2 = rm[:, None] & (kk < K)[None, :]
    if LIVE:
        rm = rm & (i < tl.load(live_ptr))
    live2 = rm[:, None] & (kk < K)[None, :]
    ids = tl.load(rows_ptr + (i * K)[:, None].to(tl.int64) * RS + kk[None, :], mask=live2, other=-1)
    loc = ids - lo
    ok = live2 & (loc >= 0) & (loc < L)
    local = tl.where(ok, loc, -1)
    off = i[:, None].to(tl.int64) * K + kk[None, :]
    w = tl.load(w_ptr + off, mask=ok, other=0.0)
    tl.store(idx_ptr + off, local.to(idx_ptr.dtype.element_ty), mask=m2)
    tl.store(wout_ptr + off, tl.where(ok, w, 0.0), mask=m2)
    # one atomic per slot: tl.histogram of this reshaped, partly masked tile undercounted on an H100 under
    # triton 3.6 (half of every bin); element-wise atomics are exact on every layout
    tl.atomic_add(hist_ptr + (local + 1), tl.full((BR, KB), 1, tl.int32), mask=live2, sem="relaxed")


_CACHE = {}


def _launch(kernel, grid, args, kwargs, device):
    """``kernel[grid](*args, **kwargs)``, through the cached launcher on CUDA (one per device)."""
    if device.type == "cuda":
        from ....ep.triton.fast_launch import LaunchCache

        cache = _CACHE.get(device)
        if cache is None:
            cache = _CACHE[device] = LaunchCache()
        cache.launch(kernel, grid, args, kwargs)
    else:
        kernel[grid](*args, **kwargs)


def _p2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """``(num_tokens_per_rank int32 [W], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, W])`` of
    ``topk_idx [T, K]`` (contiguous int32/int64), by :func:`layout_kernel`; same values as
    :func:`tritonep.compat.deep_ep.packing.layout_torch`."""
    T, K = topk_idx.shape
    dev = topk_idx.device
    in_rank = torch.empty(T, num_ranks, dtype=torch.bool, device=dev)
    per_rank = torch.empty(num_ranks, dtype=torch.int32, device=dev)
    per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
    bt = 64 if dev.type == "cuda" else 32
    _launch(layout_kernel, (1,), (topk_idx, T, in_rank, per_rank, per_expert),
            dict(K=K, KB=_p2(K), E=num_experts, EB=_p2(num_experts), L=num_experts // num_ranks, W=num_ranks,
                 WB=_p2(num_ranks), BT=bt, num_warps=8 if dev.type == "cuda" else 4), dev)
    return per_rank, per_expert, in_rank


def unpack_meta(rows: torch.Tensor, weights: torch.Tensor, num_tokens: int, topk: int, rank: int,
                num_local_experts: int, idx_dtype: torch.dtype, live: torch.Tensor | None = None):
    """The meta lane's received rows -> ``(recv_topk_idx [R, K] idx_dtype, recv_topk_weights [R, K] float32,
    hist int32 [L + 1])`` for its first ``R = num_tokens`` tokens (``rows``: bf16 ``[>= R*K, width]``, contiguous
    rows; ``weights``: float32 ``[>= R*K]``); ``live``: a device int32 scalar, the tokens actually received (rows
    past it read as not received). Same values as :func:`tritonep.compat.deep_ep.packing.unpack_meta`."""
    R, K, L = num_tokens, topk, num_local_experts
    dev = rows.device
    idx = torch.empty(R, K, dtype=idx_dtype, device=dev)
    wout = torch.empty(R, K, dtype=torch.float32, device=dev)
    hist = torch.zeros(L + 1, dtype=torch.int32, device=dev)
    if R:
        br = 128 if dev.type == "cuda" else 64
        r32 = rows.view(torch.int32)
        _launch(unpack_meta_kernel, (triton.cdiv(R, br),),
                (r32, r32.stride(0), weights, R, live if live is not None else hist, rank * L, idx, wout, hist),
                dict(K=K, KB=_p2(K), L=L, BR=br, LIVE=live is not None), dev)
    return idx, wout, hist
