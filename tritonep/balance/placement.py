"""Virtual-expert placement: the pure-torch reference planner (the spec of the Triton planner).

Idea and tie-breaks from MoonEP (MoonshotAI/MoonEP, Kimi K3 tech report §5.2.1) as ported to Megatron-LM
(``virtual_expert_triton.py``, NVIDIA/Megatron-LM PR #7450); see ``shared/reference/balance_anchors.md`` §1.4.
Our extension: ranks may route different numbers of tokens and masked (-1) routes are not counted, so the
per-rank capacity comes from the total number of valid routes instead of a fixed ``T*K``.

Runtime layout: rank ``d`` runs ``2L`` runtime experts, ``L`` native ones then ``L`` virtual slots. Runtime id of
native expert ``e`` on its owner ``d = e // L``: ``d*2L + e % L``; of slot ``s`` on rank ``d``: ``d*2L + L + s``.

Algorithm (``place_torch``), with ``W`` = world_size, ``E`` = num_experts, ``L = E // W``:

1. ``total[e] = sum_r counts[r, e]``; ``N = sum_e total[e]``. Capacity ``cap[d] = N // W + (1 if d < N % W)``
   (remainder to the lowest ranks). ``balance[d] = sum_{e // L == d} total[e] - cap[d]`` (sums to zero).
2. Quota greedy, at most ``W`` rounds: while ``max(balance) > 0``: ``sender = argmax(balance)``,
   ``receiver = argmin(balance)`` (ties: lowest rank), ``quota[sender, receiver] = -balance[receiver]`` (the
   receiver's WHOLE deficit: single-sender rule), ``balance[sender] -= that``, ``balance[receiver] = 0``.
3. Per sender, at most ``W + L`` rounds: ``dest = argmax(quota[sender])`` (ties: lowest rank), ``expert`` = the
   sender's native expert with the most remaining routes (ties: lowest id), move ``min(quota, remaining)``
   routes of it from the sender to ``dest``.
4. Slot fill per destination: the remote experts with ``allocation[e, d] > 0``, sorted by allocation descending,
   ties to the HIGHEST expert id, take slots ``0, 1, ...``; unused slots hold -1.

Guarantees (proved in the module tests by exhaustion of adversarial cases, argued here): a receiver's balance is
zeroed once and never changes again, so step 2 ends in ``< W`` rounds and every receiver has exactly one sender,
which owns ``L`` experts, hence ``L`` slots always suffice. Every deficit is at most its rank's capacity and
capacities differ by at most one, so a sender never gives away more than its native load and step 3 always
completes. Hence EVERY input (hot expert, one expert holding all routes, a rank with all the traffic, all zero)
is balanced exactly: ``allocation.sum(0) == capacity``. The price is over-migration: a sender may end below its
capacity and then host another sender's experts (see the worked example in the tests). The unreachable failure
branches raise :class:`tritonep.errors.PlanError` instead of returning a wrong plan.

Minimal mode (``mode="minimal"``, ours): the reference moves the receiver's whole deficit, so
a sender can drop below capacity and then receive (flame layer 3 on 8 ranks: ranks 2 and 5 start over capacity
yet host expert 63 of rank 7; 342 routes move where the total excess is 334). The minimal mode keeps step 1 and
step 4 and replaces steps 2-3 by one greedy over pieces, at most ``W*L`` rounds (each round fills one slot):

M2. while some rank is over capacity: ``sender = argmax(balance)``; ``receiver = argmin(balance)`` over the
    ranks with ``balance < 0`` and a free slot (ties: lowest rank; none left: stop); ``expert`` = the sender's
    native expert with the most remaining routes (ties: lowest id); move ``m = min(balance[sender],
    remaining[expert], -balance[receiver])`` routes of it to the receiver, which spends one slot on it.

Every round zeroes the sender's excess, the expert or the receiver's deficit, so an (expert, receiver) pair gets
at most one piece and a slot per piece is exact. ``m > 0`` always (a rank's excess never exceeds its native
load), senders never go below capacity and receivers never above it, so NO rank both sends and receives and
moved routes ``<= sum_d max(0, load[d] - cap[d])`` (the total excess). When the greedy runs to the end the
moved routes EQUAL the total excess and every rank ends at exactly its capacity (the excess equals the total
deficit). It stops early only when every rank still under capacity has all ``L`` slots in use; the plan is then
as balanced as that greedy got (loads between ``min(load, cap)`` and ``max(load, cap)``, ``allocation.sum(0)``
may exceed ``capacity``), never an error. This cannot happen with a single over-capacity rank: a piece that does
not end its receiver's deficit empties the sender's hottest expert, which holds more than ``cap/L`` routes, so a
receiver takes at most ``L - 1`` such pieces plus its last one. With several senders it can (``L = 1`` and two
senders facing one receiver is the smallest case); on random heavy-tailed histograms it happens for small
``L`` (e.g. ``W=8, L<=3``; never for ``W<=8, L>=4`` in the tests), and on the packaged FLAME / OLMoE traces at
``E=64`` only from ``W>=16`` (``L<=4``). ``quota[s, d]`` is then the routes rank ``s`` hands to rank ``d``
(several senders per receiver are allowed; no rank has both a non-zero row and a non-zero column).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tritonep.errors import PlanError

__all__ = ["Placement", "place_torch", "check_counts", "check_planner_limits", "PLACEMENT_MODES", "MAX_PLANNER_WORLD",
           "MAX_PLANNER_EXPERTS"]

# Largest world / expert count the Triton planner keeps in registers (place_torch has no limit of its own).
MAX_PLANNER_WORLD = 64
MAX_PLANNER_EXPERTS = 1024
# place_torch / plan modes; "reference" is the default and the MoonEP / Megatron algorithm bit for bit.
PLACEMENT_MODES = ("reference", "minimal")


@dataclass
class Placement:
    """Where every expert's routes run this step. Identical on every rank (depends only on ``counts``).

    All tensors are int32 on the device of ``counts``. ``W`` = world_size, ``E`` = num_experts, ``L = E // W``.

    Attributes:
        allocation: ``[E, W]``: routes of expert ``e`` served on rank ``d``. Row sums equal the expert's total
            valid routes; column sums equal ``capacity`` (minimal mode: unless its slots ran out, see the module
            docstring).
        experts_to_copy: ``[W, L]``: global expert whose weights virtual slot ``s`` of rank ``d`` must hold, or
            -1 for an unused slot. This is the whole contract of weight push / gradient pull: owner
            ``experts_to_copy[d, s] // L`` pushes that expert into ``(d, s)`` and pulls its gradient back.
        expert_slot: ``[E, W]``: the slot of expert ``e`` on rank ``d`` when ``d`` serves it as a virtual expert
            (``allocation[e, d] > 0`` and ``d != e // L``), else -1. Inverse of ``experts_to_copy``.
        segment_ends: ``[E, W]``: ``cumsum(allocation, dim=1)``: exclusive end of rank ``d``'s run of expert
            ``e`` in the GLOBAL stable route order of ``e`` (source rank, token, k). Rank ``d`` serves the routes
            with global ordinal in ``[segment_ends[e, d] - allocation[e, d], segment_ends[e, d])``.
        quota: ``[W, W]``: routes rank ``s`` (row, sender) hands to rank ``d`` (column). Reference mode: each
            column has at most one non-zero entry (single-sender rule). Minimal mode: no rank has both a
            non-zero row and a non-zero column.
        capacity: ``[W]``: the balanced load: ``N // W``, plus one on the ``N % W`` lowest ranks (the routes every
            rank executes, except in a minimal-mode plan whose slots ran out).
        status: ``[1]`` int32 device error word of the Triton planner (0 = ok; bit 1: a negative count;
            bit 2: ``topk_idx`` disagrees with ``counts[rank]``; bit 4: an expert id outside ``[-1, E)``; bit 8: an
            internal wait gave up; bit 16: counts whose total does not fit int32), or
            None for ``place_torch`` (which raises instead).
    """

    allocation: torch.Tensor
    experts_to_copy: torch.Tensor
    expert_slot: torch.Tensor
    segment_ends: torch.Tensor
    quota: torch.Tensor
    capacity: torch.Tensor
    status: Optional[torch.Tensor] = None

    @property
    def world_size(self) -> int:
        """Number of EP ranks ``W``."""
        return int(self.allocation.shape[1])

    @property
    def num_experts(self) -> int:
        """Number of global experts ``E``."""
        return int(self.allocation.shape[0])

    @property
    def num_local_experts(self) -> int:
        """Native experts per rank ``L`` (also the number of virtual slots per rank)."""
        return int(self.experts_to_copy.shape[1])

    @property
    def num_runtime_experts(self) -> int:
        """Runtime experts per rank, ``2L``."""
        return 2 * self.num_local_experts

    def equal(self, other: "Placement") -> bool:
        """True when every planned tensor (not ``status``) is bit-identical to ``other``'s."""
        names = ("allocation", "experts_to_copy", "expert_slot", "segment_ends", "quota", "capacity")
        return all(torch.equal(getattr(self, n).cpu(), getattr(other, n).cpu()) for n in names)


def check_counts(counts: torch.Tensor, *, max_world: Optional[int] = None, check_values: bool = True) -> None:
    """Validate a gathered histogram; raises :class:`PlanError` naming the bad value.

    Args:
        counts: ``[W, E]`` integer tensor, ``counts[r, e]`` = valid routes source rank ``r`` sends to expert ``e``.
        max_world: largest ``W`` accepted (the Triton planner passes :data:`MAX_PLANNER_WORLD`), None = any.
        check_values: also reject negative entries (reads the data: a host sync on a GPU tensor).
    """
    if not isinstance(counts, torch.Tensor):
        raise PlanError(f"counts must be a torch.Tensor, got {type(counts).__name__}")
    if counts.dim() != 2:
        raise PlanError(f"counts must be [world_size, num_experts], got shape {tuple(counts.shape)}")
    if counts.dtype.is_floating_point or counts.dtype.is_complex or counts.dtype == torch.bool:
        raise PlanError(f"counts must be an integer tensor, got dtype {counts.dtype}")
    world, num_experts = int(counts.shape[0]), int(counts.shape[1])
    if world < 1 or num_experts < 1:
        raise PlanError(f"counts must be non-empty, got shape {tuple(counts.shape)}")
    if num_experts % world != 0:
        raise PlanError(f"num_experts={num_experts} is not divisible by world_size={world}")
    if max_world is not None and world > max_world:
        raise PlanError(f"world_size={world} exceeds the planner limit {max_world}")
    if check_values and counts.numel() and int(counts.min()) < 0:
        r, e = divmod(int(torch.argmin(counts.reshape(-1))), num_experts)
        raise PlanError(f"counts[{r}, {e}]={int(counts[r, e])} is negative")


def check_planner_limits(world_size: int, num_experts: int, what: str = "virtual experts") -> None:
    """The Triton planner's static limits, for a constructor to check before it allocates anything (the planner
    keeps the whole placement in registers: :data:`MAX_PLANNER_WORLD` ranks, :data:`MAX_PLANNER_EXPERTS` experts).

    Args:
        world_size: W of the EP group; num_experts: E (global, native experts).
        what: what the limits are checked for (named in the message).

    Raises:
        ConfigError: ``world_size > MAX_PLANNER_WORLD`` or ``num_experts > MAX_PLANNER_EXPERTS`` (the message names
            the value and the limit).
    """
    from tritonep.errors import ConfigError

    if int(num_experts) > MAX_PLANNER_EXPERTS:
        raise ConfigError(f"{what}: num_experts={num_experts} exceeds the planner limit MAX_PLANNER_EXPERTS="
                          f"{MAX_PLANNER_EXPERTS} (the Triton planner keeps every expert's load in registers)")
    if int(world_size) > MAX_PLANNER_WORLD:
        raise ConfigError(f"{what}: world_size={world_size} exceeds the planner limit MAX_PLANNER_WORLD="
                          f"{MAX_PLANNER_WORLD}")


def _argmax_lowest(values: list[int]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _argmin_lowest(values: list[int]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v < values[best]:
            best = i
    return best


def _check_mode(mode: str) -> str:
    if mode not in PLACEMENT_MODES:
        raise PlanError(f"mode={mode!r} is not one of {PLACEMENT_MODES}")
    return mode


def _reference_moves(total: list[int], cap: list[int], world: int, L: int):
    """Steps 2-3 of the reference mode: ``(quota [W][W], moved_to [E][W], remaining [E])`` (module docstring)."""
    num_experts = world * L
    balance = [sum(total[d * L:(d + 1) * L]) - cap[d] for d in range(world)]

    # Step 2: rank -> rank quotas, single-sender rule.
    quota = [[0] * world for _ in range(world)]
    for _ in range(world):
        sender = _argmax_lowest(balance)
        if balance[sender] <= 0:
            break
        receiver = _argmin_lowest(balance)
        moved = -balance[receiver]
        quota[sender][receiver] += moved
        balance[sender] -= moved
        balance[receiver] = 0
    if max(balance) != 0 or min(balance) != 0:  # unreachable: each round zeroes one rank for good
        raise PlanError(f"quota greedy did not converge, balance={balance}")

    # Step 3: carve each sender's quotas from its hottest remaining experts.
    moved_to = [[0] * world for _ in range(num_experts)]
    remaining = list(total)
    for s in range(world):
        q = list(quota[s])
        for _ in range(world + L):
            dest = _argmax_lowest(q)
            if q[dest] <= 0:
                break
            j = _argmax_lowest(remaining[s * L:(s + 1) * L])
            e = s * L + j
            m = min(q[dest], remaining[e])
            if m <= 0:  # unreachable: a sender never owes more than its native load
                raise PlanError(f"rank {s} owes {q[dest]} routes to rank {dest} but has none left")
            remaining[e] -= m
            q[dest] -= m
            moved_to[e][dest] += m
        if max(q) > 0:
            raise PlanError(f"rank {s} could not serve its quota {quota[s]}")
    return quota, moved_to, remaining


def _minimal_moves(total: list[int], cap: list[int], world: int, L: int):
    """Steps M2 of the minimal mode: ``(quota [W][W], moved_to [E][W], remaining [E])`` (module docstring)."""
    num_experts = world * L
    balance = [sum(total[d * L:(d + 1) * L]) - cap[d] for d in range(world)]
    quota = [[0] * world for _ in range(world)]
    moved_to = [[0] * world for _ in range(num_experts)]
    remaining = list(total)
    used = [0] * world
    big = 2**31 - 1
    for _ in range(num_experts):  # every round fills one of the W*L slots
        sender = _argmax_lowest(balance)
        if balance[sender] <= 0:
            break
        open_deficit = [balance[d] if balance[d] < 0 and used[d] < L else big for d in range(world)]
        receiver = _argmin_lowest(open_deficit)
        if open_deficit[receiver] >= 0:  # every rank still under capacity has all L slots in use
            break
        j = _argmax_lowest(remaining[sender * L:(sender + 1) * L])
        e = sender * L + j
        m = min(balance[sender], remaining[e], -balance[receiver])  # > 0: excess <= native load left
        remaining[e] -= m
        balance[sender] -= m
        balance[receiver] += m
        quota[sender][receiver] += m
        moved_to[e][receiver] += m
        used[receiver] += 1
    return quota, moved_to, remaining


def place_torch(counts: torch.Tensor, mode: str = "reference") -> Placement:
    """Placement of the virtual-expert planner (the spec of the Triton planner, see the module docstring).

    Args:
        counts: ``[W, E]`` integer tensor (any int dtype, any device), ``counts[r, e]`` = number of valid
            routes source rank ``r`` sends to expert ``e`` (the matrix the dispatch counts exchange gathers).
            Ranks may have different token counts; masked routes are simply not counted.
        mode: ``"reference"`` (default; MoonEP / Megatron greedy, single-sender rule, always exact balance) or
            ``"minimal"`` (ours: only over-capacity ranks send, only under-capacity ranks receive, moved routes
            == total excess; exact balance when the ``L`` slots per rank suffice, else the greedy's best effort).

    Returns:
        :class:`Placement` with int32 tensors on ``counts.device``.

    Raises:
        PlanError: wrong shape/dtype, ``E % W != 0``, a negative entry, a total above int32, an unknown
            ``mode``, or (unreachable by the arguments in the module docstring) an unsatisfiable quota or more
            than ``L`` remote experts on a rank.
    """
    _check_mode(mode)
    check_counts(counts)
    world, num_experts = int(counts.shape[0]), int(counts.shape[1])
    L = num_experts // world
    c = counts.detach().to("cpu", torch.int64)
    total = c.sum(0).tolist()
    n_routes = sum(total)
    if n_routes >= 2**31:
        raise PlanError(f"total valid routes {n_routes} does not fit int32")
    cap = [n_routes // world + (1 if d < n_routes % world else 0) for d in range(world)]
    moves = _reference_moves if mode == "reference" else _minimal_moves
    quota, moved_to, remaining = moves(total, cap, world, L)

    allocation = [[0] * world for _ in range(num_experts)]
    for e in range(num_experts):
        allocation[e] = list(moved_to[e])
        allocation[e][e // L] = remaining[e]

    # Step 4: slot fill, allocation descending, ties to the highest expert id.
    experts_to_copy = [[-1] * L for _ in range(world)]
    expert_slot = [[-1] * world for _ in range(num_experts)]
    for d in range(world):
        remote = [e for e in range(num_experts) if e // L != d and allocation[e][d] > 0]
        remote.sort(key=lambda e: (-allocation[e][d], -e))
        if len(remote) > L:  # unreachable under the single-sender rule; a slotless expert would run stale weights
            raise PlanError(f"rank {d} needs {len(remote)} virtual slots, only {L} exist: {remote}")
        for s, e in enumerate(remote):
            experts_to_copy[d][s] = e
            expert_slot[e][d] = s

    dev = counts.device
    alloc_t = torch.tensor(allocation, dtype=torch.int32).reshape(num_experts, world)
    return Placement(
        allocation=alloc_t.to(dev),
        experts_to_copy=torch.tensor(experts_to_copy, dtype=torch.int32).reshape(world, L).to(dev),
        expert_slot=torch.tensor(expert_slot, dtype=torch.int32).reshape(num_experts, world).to(dev),
        segment_ends=torch.cumsum(alloc_t, dim=1, dtype=torch.int32).to(dev),
        quota=torch.tensor(quota, dtype=torch.int32).reshape(world, world).to(dev),
        capacity=torch.tensor(cap, dtype=torch.int32).to(dev),
    )
