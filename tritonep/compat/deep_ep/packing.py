"""Torch ops of the DeepEP-compatible normal mode: the layout, the per-rank slots, and how rows travel as bits.

Every EPBuffer row is bfloat16 and its raw (``bf16``) wire moves rows as they are, bit for bit (loads and stores
only, on both backends; ``tests/compat/test_packing.py`` sends every 16-bit pattern, NaN payloads included). The
compat Buffer uses that to carry what DeepEP carries besides bf16 rows:

* a caller-quantized dispatch ``(x_fp8, scales)``: the row's bytes (``H`` one-byte elements, then the scales' bytes,
  any 4-byte dtype) packed into a ``[T, H]`` bf16 row (:func:`pack_quantized`; ``H`` bf16 = ``2H`` bytes hold
  ``H + 4S``) and taken apart on the receiver (:func:`unpack_quantized`): the caller's bits, unchanged;
* the top-k ids and weights of every row (:func:`pack_meta` / :func:`unpack_meta`): int32 ids and float32 weights as
  bf16 pairs, in a second, narrow lane.

The combine direction adds rows (fp32 sums, one bf16 rounding), so bits cannot travel there; the reduced
``topk_weights`` of DeepEP's combine travel as three bf16 numbers per weight whose sum is the weight exactly
(:func:`split_weights` / :func:`merge_weights`): a weight that comes from one rank only (the case of every DeepEP
caller: a rank's received weights are zero off its experts) is summed exactly.

Idea: DeepEP's intranode layout and row order (``csrc/kernels/layout.cu``, ``intranode.cu`` of its V1 API), written
anew on tritonep's EPBuffer.
"""

from __future__ import annotations

import torch

__all__ = ["layout_torch", "rank_slots", "meta_width", "pack_meta", "unpack_meta", "local_id_table",
           "pack_quantized", "unpack_quantized", "split_weights", "merge_weights"]

_HI = -65536  # int32 mask keeping a float32's top 16 bits: its bf16 truncation


def layout_torch(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """DeepEP's dispatch layout of this rank's routing.

    Args:
        topk_idx: ``[T, K]`` int32/int64 expert ids; -1 (and any id outside ``[0, E)``) selects nothing.
        num_experts: E, a multiple of ``num_ranks``; expert e lives on rank ``e // (E / num_ranks)``.
        num_ranks: W.

    Returns:
        ``(num_tokens_per_rank int32 [W], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, W])``: tokens
        sent to each rank (a token counts once per rank), routes to each expert (a repeated id counts twice), and
        whether token t goes to rank r. Device ops only (no host read).
    """
    T = topk_idx.shape[0]
    L = num_experts // num_ranks
    ids = topk_idx.long()
    valid = (ids >= 0) & (ids < num_experts)
    ids = torch.where(valid, ids, num_experts)  # every invalid slot -> the spare bin E
    in_rank = torch.zeros(T, num_ranks + 1, dtype=torch.bool, device=ids.device)
    in_rank.scatter_(1, ids // L, True)  # the spare bin E lands in the spare column W
    is_token_in_rank = in_rank[:, :num_ranks].contiguous()
    per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    per_expert = torch.bincount(ids.reshape(-1), minlength=num_experts + 1)[:num_experts].to(torch.int32)
    return per_rank, per_expert, is_token_in_rank


def rank_slots(is_token_in_rank: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """The routing of the per-rank composition: ``[T, W]`` int32, slot r = r where token t goes to rank r, else -1.

    An EPBuffer with ``num_experts = W`` (one pseudo-expert per rank), ``topk = W`` and these ids, weight 1, receives
    exactly DeepEP's rows: one per (token, receiving rank), in (source rank, source token) order, and its combine
    is the unweighted sum over ranks. ``ranks``: ``arange(W)`` int32 on the device (cached by the caller)."""
    return torch.where(is_token_in_rank, ranks, -1)


def meta_width(topk: int) -> int:
    """bf16 elements of a meta row: ``2K`` (int32 ids) + ``2K`` (float32 weights), rounded up to a multiple of 8
    (16-byte rows)."""
    return (4 * topk + 7) // 8 * 8


def pack_meta(topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``[T, meta_width(K)]`` bf16 rows holding each token's int32 ids, then its float32 weights (bit patterns).

    Ids are narrowed to int32 (DeepEP's ids fit: experts < 2^31)."""
    T, K = topk_idx.shape
    parts = [topk_idx.to(torch.int32).view(torch.bfloat16), topk_weights.to(torch.float32).view(torch.bfloat16)]
    pad = meta_width(K) - 4 * K
    if pad:
        parts.append(torch.zeros(T, pad, dtype=torch.bfloat16, device=topk_idx.device))
    return torch.cat(parts, 1)


def local_id_table(rank: int, num_local_experts: int, num_experts: int, dtype, device) -> torch.Tensor:
    """``[E + 1]`` table: entry g = g - rank*L for this rank's experts, -1 for the others; the last entry (index -1)
    is -1. ``table[ids]`` turns global ids (-1 included) into DeepEP's local ids without ever wrapping."""
    t = torch.full((num_experts + 1,), -1, dtype=dtype)
    lo = rank * num_local_experts
    t[lo:lo + num_local_experts] = torch.arange(num_local_experts, dtype=dtype)
    return t.to(device)


def unpack_meta(rows: torch.Tensor, topk: int, table: torch.Tensor, num_experts: int, num_local_experts: int):
    """Received meta rows -> ``(recv_topk_idx [R, K] table.dtype, recv_topk_weights [R, K] float32, hist [L + 1])``.

    ``recv_topk_idx``: local expert ids, -1 where the expert lives elsewhere (or the id was -1 / outside
    ``[-1, E)``); ``recv_topk_weights``: the weight, 0 where the id is -1 (DeepEP's rule); ``hist[0]``: slots with
    -1, ``hist[1 + j]``: slots with local expert j (DeepEP's per-expert receive count, before alignment)."""
    K = topk
    ids = rows[:, :2 * K].view(torch.int32).clamp(-1, num_experts)  # an id outside [-1, E) reads the -1 entry
    local = table[ids]
    w = rows[:, 2 * K:4 * K].view(torch.float32)
    weights = torch.where(local >= 0, w, 0.0)
    hist = torch.bincount((local + 1).reshape(-1), minlength=num_local_experts + 1)
    return local, weights, hist


def pack_quantized(xq: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(xq [T, H] one-byte dtype, scales [T, S] four-byte dtype, any strides)`` -> ``[T, H]`` bf16 rows whose bytes
    are xq's row, then the scales' bytes, then 2H - H - 4S bytes left unset. The caller checks 4S <= H."""
    T, H = xq.shape
    S = scales.shape[1]
    out = torch.empty(T, 2 * H, dtype=torch.uint8, device=xq.device)
    out[:, :H].copy_(xq.view(torch.uint8))
    out[:, H:H + 4 * S].view(scales.dtype).copy_(scales)
    return out.view(torch.bfloat16)


def unpack_quantized(rows: torch.Tensor, x_dtype: torch.dtype, scale_dtype: torch.dtype, num_scales: int):
    """Received ``[R, H]`` bf16 rows of :func:`pack_quantized` -> ``(xq [R, H] x_dtype, scales [R, S] scale_dtype)``,
    both contiguous, bit for bit what the sender packed."""
    R, H = rows.shape
    b = rows.view(torch.uint8)
    xq = b[:, :H].contiguous().view(x_dtype)
    scales = b[:, H:H + 4 * num_scales].contiguous().view(scale_dtype)
    return xq, scales


def split_weights(w: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, K]`` -> bf16 ``[N, 3K]``: three numbers (hi | mid | lo) whose float32 sum is ``w`` exactly.

    ``hi`` = w with its low 16 bits cleared (a bf16 value), ``mid`` the same of ``w - hi``, ``lo`` the rest (at most 8
    significant bits: a bf16 value). Exact for finite |w| >= 2^-110 and 0; +-inf and NaN come back as themselves.
    """
    hi = (w.view(torch.int32) & _HI).view(torch.float32)
    r = torch.where(torch.isfinite(w), w - hi, 0.0)
    mid = (r.view(torch.int32) & _HI).view(torch.float32)
    return torch.cat([hi, mid, r - mid], 1).to(torch.bfloat16)


def merge_weights(parts: torch.Tensor, topk: int) -> torch.Tensor:
    """bf16 ``[N, >= 3K]`` (the hi | mid | lo columns first) -> float32 ``[N, K]`` = hi + mid + lo (in that order)."""
    K = topk
    p = parts[:, :3 * K].float()
    return p[:, :K] + p[:, K:2 * K] + p[:, 2 * K:]
