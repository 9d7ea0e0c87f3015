"""Route remap: topk_idx (global experts) -> runtime expert ids under a :class:`Placement` (pure-torch reference).

Rule (MoonEP / Megatron-LM virtual experts, ``shared/reference/balance_anchors.md`` §1.5): the routes of expert
``e`` from all ranks are put in the global stable order (source rank, token, k) and cut into contiguous runs, one
per destination rank, in destination-rank order (the native owner's share sits at its own rank position, not
first). A route with global ordinal ``g`` goes to the first rank ``d`` with ``segment_ends[e, d] > g``.

Rank ``r`` only sees its own ``topk_idx``: the global ordinal of its route is
``sum_{r' < r} counts[r', e]`` plus the route's stable ordinal among rank ``r``'s routes to ``e`` (token-major,
then k). Masked routes (-1) get no ordinal and stay -1.
"""

from __future__ import annotations

import torch

from tritonep.balance.placement import Placement
from tritonep.errors import PlanError

__all__ = ["remap_torch", "check_topk_idx"]


def check_topk_idx(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Validate ``topk_idx`` metadata: ``[T, K]`` integer tensor. Raises :class:`PlanError` naming the value."""
    if not isinstance(topk_idx, torch.Tensor):
        raise PlanError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
    if topk_idx.dim() != 2:
        raise PlanError(f"topk_idx must be [num_tokens, topk], got shape {tuple(topk_idx.shape)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise PlanError(f"topk_idx must be int32 or int64, got dtype {topk_idx.dtype}")


def remap_torch(topk_idx: torch.Tensor, placement: Placement, rank: int, counts: torch.Tensor) -> torch.Tensor:
    """Map this rank's routes to runtime expert ids (reference for the Triton planner).

    Args:
        topk_idx: ``[T, K]`` int32/int64 global expert ids of this rank's tokens, -1 = masked (T may be 0).
        placement: the plan of this step (from :func:`place_torch` or the Triton planner).
        rank: this rank, ``0 <= rank < W``.
        counts: ``[W, E]`` integer, the gathered histogram the placement was built from; row ``rank`` must be
            the histogram of ``topk_idx``.

    Returns:
        ``[T, K]`` int32 runtime ids on ``topk_idx.device``: ``d*2L + e % L`` when the route runs natively on its
        owner ``d = e // L``, ``d*2L + L + expert_slot[e, d]`` when it runs in a virtual slot of rank ``d``;
        -1 where ``topk_idx`` is -1.

    Raises:
        PlanError: bad shapes/dtypes, ``rank`` out of range, an id outside ``[-1, E)``, or a histogram of
            ``topk_idx`` that differs from ``counts[rank]`` (the global order would be inconsistent).
    """
    world, num_experts = placement.world_size, placement.num_experts
    L = placement.num_local_experts
    check_topk_idx(topk_idx, num_experts)
    if tuple(counts.shape) != (world, num_experts):
        raise PlanError(f"counts shape {tuple(counts.shape)} does not match the placement ({world}, {num_experts})")
    if not 0 <= int(rank) < world:
        raise PlanError(f"rank={rank} outside [0, {world})")
    flat = topk_idx.detach().reshape(-1).to("cpu", torch.int64)
    if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= num_experts):
        bad = flat[(flat < -1) | (flat >= num_experts)][0]
        raise PlanError(f"topk_idx holds expert id {int(bad)} outside [-1, {num_experts})")
    valid = flat >= 0
    e = flat[valid]
    c = counts.detach().to("cpu", torch.int64)
    hist = torch.bincount(e, minlength=num_experts)
    if not torch.equal(hist, c[rank]):
        diff = int(torch.nonzero(hist != c[rank])[0])
        raise PlanError(
            f"topk_idx of rank {rank} sends {int(hist[diff])} routes to expert {diff}, counts[{rank}, {diff}]="
            f"{int(c[rank, diff])}")

    # Stable ordinal of every valid route among this rank's routes to the same expert.
    order = torch.sort(e, stable=True).indices
    sorted_e = e[order]
    starts = torch.cumsum(hist, 0) - hist
    local = torch.empty_like(e)
    local[order] = torch.arange(e.numel(), dtype=torch.int64) - starts[sorted_e]
    glob = c[:rank].sum(0)[e] + local

    ends = placement.segment_ends.detach().to("cpu", torch.int64)
    dest = (ends[e] <= glob[:, None]).sum(1)  # first d with ends[e, d] > g (ends are non-decreasing)
    owner = e // L
    slot = placement.expert_slot.detach().to("cpu", torch.int64)[e, dest.clamp(max=world - 1)]
    if bool((dest >= world).any()) or bool(((dest != owner) & (slot < 0)).any()):
        raise PlanError("placement does not cover every route of counts (stale or foreign placement)")
    rid = torch.where(dest == owner, dest * 2 * L + e % L, dest * 2 * L + L + slot)
    out = torch.full_like(flat, -1)
    out[valid] = rid
    return out.to(torch.int32).reshape(topk_idx.shape).to(topk_idx.device)
