"""Load-balance metrics for expert parallelism.

Sources (``shared/reference/balance_anchors.md`` §2.4): rank balancedness ``mean/max`` is what vLLM intends and
SGLang logs per MoE layer (compute it per layer, over RANKS; vLLM once reduced over layers by mistake,
vllm-project/vllm#51784); expert-level ``maxvio = max_e(T_e) / mean_e(T_e) - 1`` is MoonEP's router-health metric.
"""

from __future__ import annotations

import torch

from tritonep.balance.placement import Placement
from tritonep.errors import PlanError

__all__ = ["rank_loads", "loads_after", "moved_routes", "excess_routes", "plan_shortfall", "balancedness",
           "straggler_factor", "maxvio"]


def rank_loads(counts: torch.Tensor, world_size: int) -> torch.Tensor:
    """Routes each rank computes WITHOUT balancing (every route runs on its expert's owner ``e // L``).

    Args:
        counts: ``[W_src, E]`` (gathered histogram, summed over source ranks) or ``[E]`` per-expert route counts,
            integer, non-negative.
        world_size: number of EP ranks ``W``; ``E`` must be divisible by it.

    Returns:
        ``[world_size]`` int64 on ``counts.device``, routes per rank.

    Raises:
        PlanError: wrong rank of tensor, ``E % world_size != 0`` or ``world_size < 1``.
    """
    if counts.dim() not in (1, 2):
        raise PlanError(f"counts must be [E] or [world_size, E], got shape {tuple(counts.shape)}")
    per_expert = counts.to(torch.int64)
    if per_expert.dim() == 2:
        per_expert = per_expert.sum(0)
    num_experts = int(per_expert.shape[0])
    if world_size < 1 or num_experts % world_size != 0:
        raise PlanError(f"num_experts={num_experts} is not divisible by world_size={world_size}")
    return per_expert.reshape(world_size, num_experts // world_size).sum(1)


def loads_after(placement: Placement) -> torch.Tensor:
    """Routes each rank computes under ``placement`` (``allocation.sum(0)``), ``[W]`` int64.

    Equals ``placement.capacity`` for every reference-mode plan of :func:`place_torch` / the Triton planner, and
    for a minimal-mode plan unless its slots ran out.
    """
    return placement.allocation.to(torch.int64).sum(0)


def moved_routes(placement: Placement) -> int:
    """Routes served away from their expert's owner under ``placement`` (a host sync on a GPU plan).

    ``allocation.sum() - sum_e allocation[e, e // L]`` (equals ``placement.quota.sum()``): the routes whose
    expert runs in a virtual slot of another rank, i.e. the work the balancer relocates (compare it with
    :func:`excess_routes`).

    Args:
        placement: a :class:`Placement` of either mode (torch or Triton).

    Returns:
        Python int ``>= 0``.
    """
    alloc = placement.allocation.detach().to("cpu", torch.int64)
    L = placement.num_local_experts
    owner = torch.arange(placement.num_experts) // L
    return int(alloc.sum()) - int(alloc.gather(1, owner[:, None]).sum())


def excess_routes(counts: torch.Tensor, world_size: int) -> int:
    """Total excess ``sum_d max(0, load[d] - cap[d])`` of a histogram: the fewest routes any balancing plan moves.

    ``load`` = :func:`rank_loads`, ``cap[d] = N // W`` plus one on the ``N % W`` lowest ranks (the planner's
    capacity). A minimal-mode plan moves exactly this many routes when its slots suffice.

    Args:
        counts: ``[W_src, E]`` or ``[E]`` non-negative integer routes; ``E`` divisible by ``world_size``.
        world_size: number of EP ranks ``W``.

    Raises:
        PlanError: as :func:`rank_loads`.
    """
    loads = rank_loads(counts, world_size).cpu()
    n = int(loads.sum())
    cap = torch.tensor([n // world_size + (1 if d < n % world_size else 0) for d in range(world_size)])
    return int((loads - cap).clamp(min=0).sum())


def plan_shortfall(placement: Placement) -> dict:
    """What a plan left unbalanced, and why: the routes still over capacity and the ranks that could not take them.

    A reference-mode plan (and a minimal-mode one whose slots sufficed) balances exactly, so this reports nothing.
    A minimal-mode plan stops early when every rank still under capacity has all ``L`` virtual slots in use (a slot
    holds one expert; :mod:`tritonep.balance.placement`, "Minimal mode"): the ranks over capacity then keep their
    excess.

    Args:
        placement: a :class:`Placement` of either mode (torch or Triton; a host sync on a GPU plan).

    Returns:
        A JSON-able dict: ``unmoved_routes`` (``sum_d max(0, after[d] - capacity[d])``, 0 for a balanced plan),
        ``over_capacity`` (``[{"rank", "load", "capacity"}]`` of the ranks above capacity after the plan),
        ``under_capacity`` (``[{"rank", "load", "capacity", "slots_used"}]`` of the ranks below it) and
        ``slots_per_rank`` (``L``).
    """
    after = loads_after(placement).cpu().tolist()
    cap = placement.capacity.detach().to("cpu", torch.int64).tolist()
    used = (placement.experts_to_copy.detach().cpu() >= 0).sum(1).tolist()
    over = [dict(rank=d, load=int(a), capacity=int(c)) for d, (a, c) in enumerate(zip(after, cap)) if a > c]
    under = [dict(rank=d, load=int(a), capacity=int(c), slots_used=int(used[d]))
             for d, (a, c) in enumerate(zip(after, cap)) if a < c]
    return dict(unmoved_routes=sum(o["load"] - o["capacity"] for o in over), over_capacity=over,
                under_capacity=under, slots_per_rank=placement.num_local_experts)


def _as_float_vector(x: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.dim() != 1 or x.numel() == 0:
        raise PlanError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(x.shape)}")
    x = x.detach().to("cpu", torch.float64)
    if bool((x < 0).any()):
        raise PlanError(f"{name} has a negative entry {float(x.min())}")
    return x


def balancedness(loads: torch.Tensor) -> float:
    """Rank balancedness ``mean_r(load) / max_r(load)`` of ONE layer; 1.0 = perfect, 1/W = one rank does all.

    Args:
        loads: ``[W]`` non-negative routes (or tokens) per rank, any numeric dtype.

    Returns:
        Float in ``(0, 1]``; 1.0 when every load is zero (nothing to balance).

    Raises:
        PlanError: not a non-empty 1-D tensor, or a negative load.
    """
    x = _as_float_vector(loads, "loads")
    peak = float(x.max())
    return 1.0 if peak == 0.0 else float(x.mean()) / peak


def straggler_factor(loads: torch.Tensor) -> float:
    """``max/mean`` rank load, i.e. ``1 / balancedness(loads)`` (how much the busiest rank sets the pace)."""
    return 1.0 / balancedness(loads)


def maxvio(expert_loads: torch.Tensor) -> float:
    """Expert-level maximum violation ``max_e(T_e) / mean_e(T_e) - 1`` (MoonEP's x-axis; 0.0 = uniform router).

    Args:
        expert_loads: ``[E]`` non-negative routes per expert (sum a ``[W, E]`` histogram over ranks first).

    Returns:
        Float ``>= 0``; 0.0 when every load is zero.

    Raises:
        PlanError: not a non-empty 1-D tensor, or a negative load.
    """
    x = _as_float_vector(expert_loads, "expert_loads")
    mean = float(x.mean())
    return 0.0 if mean == 0.0 else float(x.max()) / mean - 1.0
