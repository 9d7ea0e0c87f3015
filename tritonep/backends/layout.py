"""Torch twins of the dispatch layout: per-expert counts, segment layout, every route's destination row.

These are the specification of the counts exchange and layout that :class:`tritonep.backends.triton.counts.CountsExchange` and
the triton backend run with the kernels of :mod:`tritonep.backends.triton.kernels.layout` (whose docstring derives the row
formula), and of the nccl backend's host plan; tests compare both against them bit for bit.

Names: W = world_size, E = num_experts, L = E // W local experts, K = topk, A = expert_alignment.
"""

from __future__ import annotations

import torch

__all__ = ["counts_torch", "layout_torch", "route_rows_torch"]


def counts_torch(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes of this rank per expert: int32 ``[E]`` (``-1`` slots skipped)."""
    ids = topk_idx.reshape(-1).long()
    ids = ids[ids >= 0]
    return torch.bincount(ids, minlength=num_experts).to(torch.int32)


def layout_torch(counts: torch.Tensor, rank: int, expert_alignment: int = 1):
    """Segment layout from the full counts matrix, as seen by ``rank``.

    Args:
        counts: int ``[W, E]``, ``counts[s, e]`` = routes of source rank s to expert e.
        rank: the rank whose view is computed.
        expert_alignment: A >= 1.

    Returns:
        dict with ``send_base`` int32 ``[E]`` (row of this rank's first route to e on e's rank),
        ``num_tokens_per_expert`` int32 ``[L]`` and ``expert_offsets`` int32 ``[L]`` (cumulative aligned segment
        ends) of this rank as receiver, ``rows_needed`` int64 ``[W]`` (aligned rows every rank receives).
    """
    W, E = counts.shape
    L = E // W
    c = counts.to(torch.int64)
    total = c.sum(0).view(W, L)
    aligned = (total + expert_alignment - 1) // expert_alignment * expert_alignment
    seg_start = torch.cumsum(aligned, 1) - aligned
    prefix = c[:rank].sum(0).view(W, L)
    send_base = (seg_start + prefix).reshape(E).to(torch.int32)
    return {
        "send_base": send_base,
        "num_tokens_per_expert": total[rank].to(torch.int32),
        "expert_offsets": torch.cumsum(aligned[rank], 0).to(torch.int32),
        "rows_needed": aligned.sum(1),
    }


def route_rows_torch(topk_idx: torch.Tensor, send_base: torch.Tensor) -> torch.Tensor:
    """Destination row of every route of this rank: int32 ``[T, K]`` (-1 for masked slots).

    ``row = send_base[e] + rank of (t, k) among this rank's routes to e in (t, k) order``.
    """
    T, K = topk_idx.shape
    ids = topk_idx.reshape(-1).long()
    E = send_base.numel()
    valid = ids >= 0
    key = torch.where(valid, ids, torch.full_like(ids, E))
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    counts = torch.bincount(key, minlength=E + 1)
    start = torch.cumsum(counts, 0) - counts
    rank_sorted = torch.arange(ids.numel(), device=ids.device) - start[sorted_key]
    rank_in_expert = torch.empty_like(rank_sorted)
    rank_in_expert[order] = rank_sorted
    base = torch.cat([send_base.to(torch.int64), torch.zeros(1, dtype=torch.int64, device=ids.device)])
    rows = torch.where(valid, base[key] + rank_in_expert, torch.full_like(ids, -1))
    return rows.view(T, K).to(torch.int32)


# ------------------------------------------------------------------------------------------------ kernels
