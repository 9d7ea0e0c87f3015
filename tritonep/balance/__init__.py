"""Virtual-expert load balancing: placement reference, Triton planner, route remap and metrics.

See :mod:`tritonep.balance.placement` for the algorithm (MoonEP / Megatron-LM virtual experts) and the runtime
layout (rank ``d`` runs ``2L`` runtime experts: ``L`` native, then ``L`` virtual slots; id = ``d*2L + j``), and
for the two placement modes (``"reference"``, the default, and ``"minimal"``).
"""

from tritonep.balance.metrics import (
    balancedness, excess_routes, loads_after, maxvio, moved_routes, plan_shortfall, rank_loads, straggler_factor,
)
from tritonep.balance.placement import (
    MAX_PLANNER_EXPERTS, MAX_PLANNER_WORLD, PLACEMENT_MODES, Placement, check_counts, place_torch,
)
from tritonep.balance.planner import check_plan_status, plan, plan_status
from tritonep.balance.remap import remap_torch

__all__ = [
    "Placement",
    "place_torch",
    "remap_torch",
    "plan",
    "plan_status",
    "check_plan_status",
    "check_counts",
    "rank_loads",
    "loads_after",
    "moved_routes",
    "excess_routes",
    "plan_shortfall",
    "balancedness",
    "straggler_factor",
    "maxvio",
    "PLACEMENT_MODES",
    "MAX_PLANNER_WORLD",
    "MAX_PLANNER_EXPERTS",
]
