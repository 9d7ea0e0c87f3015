"""MoE layer configuration: :class:`MoERecipe` (how it runs) and :class:`MoEGeometry` (what it computes).

Both are frozen (hashable) dataclasses, so they can key caches and be compared across ranks. Their ``check``
methods refuse every inconsistent combination with :class:`tritonep.errors.ConfigError` naming the field and its
value; :func:`check_config` runs all checks that need the world size. Everything here runs before any allocation
(docs/moe.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, WireError

from ..wire.formats import WIRES, check_wire, get_wire  # the wire registry (imports go one way: wire -> moe)

__all__ = ["MoERecipe", "MoEGeometry", "check_config", "COMBINE_KINDS", "BALANCE_KINDS", "ROW_MULTIPLE"]

COMBINE_KINDS = ("push", "pull")
"""``pull``: the source rank reads the partial rows from the expert rank (zero copy, bf16 only); ``push``: the
expert rank writes partials into the source's staging (the only kind that can carry a quantized combine wire)."""

BALANCE_KINDS = ("none", "virtual")
"""``none``: every route goes to its native expert; ``virtual``: per-step virtual-expert load balancing."""

ROW_MULTIPLE = 8
"""hidden and intermediate must be multiples of 8 elements: a bf16 row is then a multiple of 16 bytes, which the
vectorised (16-byte) copies of the dispatch/combine kernels and ``torch._grouped_mm`` (it requires every stride to
be a multiple of 16 bytes) need; ``w1``'s rows of ``2*intermediate`` and ``w2``'s of ``hidden`` follow."""


def _positive_int(owner: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{field} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class MoEGeometry:
    """The shape of one MoE layer.

    Attributes:
        hidden: H, model dimension (multiple of 8, see :data:`ROW_MULTIPLE`).
        intermediate: I, expert FFN width (multiple of 8); ``w1`` is ``[E, H, 2I]`` (gate | up), ``w2`` ``[E, I, H]``.
        num_experts: E, a multiple of the EP world size (checked by :meth:`check` with ``world_size``).
        topk: K, experts per token, ``1 <= K <= E``.
        max_tokens_per_rank: static capacity of tokens per rank and call.

    Raises:
        ConfigError: at construction, for any field that is not a positive int, a hidden / intermediate that is not a
            multiple of 8, or ``topk > num_experts`` (the message names the field and value).
    """

    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    max_tokens_per_rank: int

    def __post_init__(self):
        self.check()

    def num_local_experts(self, world_size: int) -> int:
        """L = E / world_size (raises ConfigError when E is not divisible by world_size)."""
        self.check(world_size)
        return self.num_experts // world_size

    def check(self, world_size: int | None = None) -> None:
        """Validate the geometry (and, when given, its fit to an EP world of ``world_size`` ranks).

        Raises:
            ConfigError: naming the field (``MoEGeometry.<field>``) and the value.
        """
        for f in ("hidden", "intermediate", "num_experts", "topk", "max_tokens_per_rank"):
            _positive_int("MoEGeometry", f, getattr(self, f))
        for f in ("hidden", "intermediate"):
            v = getattr(self, f)
            if v % ROW_MULTIPLE:
                raise ConfigError(f"MoEGeometry.{f}={v} is not a multiple of {ROW_MULTIPLE} (rows must be multiples "
                                  f"of 16 bytes for vectorised copies and torch._grouped_mm)")
        if self.topk > self.num_experts:
            raise ConfigError(f"MoEGeometry.topk={self.topk} exceeds MoEGeometry.num_experts={self.num_experts}")
        if world_size is not None:
            _positive_int("world", "world_size", world_size)
            if self.num_experts % world_size:
                raise ConfigError(f"MoEGeometry.num_experts={self.num_experts} is not divisible by "
                                  f"world_size={world_size}")


@dataclass(frozen=True)
class MoERecipe:
    """How an MoE layer runs: wire formats, combine kind, load balancing, expert segment alignment.

    Attributes:
        dispatch_wire: a registered wire, :data:`tritonep.wire.WIRES` (``"bf16"``, ``"fp8"``, ``"mxfp4"``,
            ``"fp8_e5m2"``; docs/wire-formats.md).
        combine_wire: same names; anything but ``"bf16"`` needs ``combine="push"`` (a pull reads the expert
            output region as written by the GEMM, in bf16).
        combine: ``"pull"`` | ``"push"`` (see :data:`COMBINE_KINDS`).
        balance: ``"none"`` | ``"virtual"`` (see :data:`BALANCE_KINDS`).
        expert_alignment: every expert segment starts at a multiple of this many rows (>= 1), e.g. the M tile of
            a grouped GEMM kernel that needs aligned groups.

    Raises:
        ConfigError: at construction, for any invalid field or inconsistent combination (names field and value).
    """

    dispatch_wire: str = "bf16"
    combine_wire: str = "bf16"
    combine: str = "pull"
    balance: str = "none"
    expert_alignment: int = 1

    def __post_init__(self):
        self.check()

    def check(self, geometry: MoEGeometry | None = None) -> None:
        """Validate the recipe (and, when given, its wires against ``geometry.hidden``).

        Raises:
            ConfigError: naming the field (``MoERecipe.<field>``) and the value. A wire that cannot carry
                ``hidden`` (fp8 needs a multiple of 128, mxfp4 of 32) is reported as a ConfigError too, chained
                to the WireError that explains it.
        """
        for f in ("dispatch_wire", "combine_wire"):
            v = getattr(self, f)
            if v not in WIRES:
                raise ConfigError(f"MoERecipe.{f}={v!r} is not a wire format; supported: {', '.join(WIRES)}")
        if self.combine not in COMBINE_KINDS:
            raise ConfigError(f"MoERecipe.combine={self.combine!r} is not one of {COMBINE_KINDS}")
        if self.balance not in BALANCE_KINDS:
            raise ConfigError(f"MoERecipe.balance={self.balance!r} is not one of {BALANCE_KINDS}")
        _positive_int("MoERecipe", "expert_alignment", self.expert_alignment)
        if get_wire(self.combine_wire).quantized and self.combine == "pull":
            raise ConfigError(f"MoERecipe.combine_wire={self.combine_wire!r} needs combine='push' (quantized combine "
                              f"is push only), got MoERecipe.combine='pull'")
        if geometry is not None:
            for f in ("dispatch_wire", "combine_wire"):
                try:
                    check_wire(getattr(self, f), geometry.hidden, f)
                except WireError as e:
                    raise ConfigError(f"MoERecipe.{f}={getattr(self, f)!r} does not fit "
                                      f"MoEGeometry.hidden={geometry.hidden}: {e}") from e


def check_config(recipe: MoERecipe, geometry: MoEGeometry, world_size: int) -> None:
    """Run every static check of a (recipe, geometry, world_size) triple; nothing is allocated.

    Raises:
        ConfigError: the first inconsistent field (see :meth:`MoERecipe.check`, :meth:`MoEGeometry.check`); with
            ``balance='virtual'`` also an expert count or world size beyond the planner's limits
            (:func:`tritonep.balance.placement.check_planner_limits`).
    """
    if not isinstance(recipe, MoERecipe):
        raise ConfigError(f"recipe must be a MoERecipe, got {type(recipe).__name__}")
    if not isinstance(geometry, MoEGeometry):
        raise ConfigError(f"geometry must be a MoEGeometry, got {type(geometry).__name__}")
    geometry.check(world_size)
    recipe.check(geometry)
    if recipe.balance == "virtual":  # the planner's limits, before anything is allocated (not at every forward)
        from ..balance.placement import check_planner_limits

        check_planner_limits(world_size, geometry.num_experts, "MoERecipe.balance='virtual'")
