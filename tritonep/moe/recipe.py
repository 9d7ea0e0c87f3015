"""MoE layer configuration: :class:`MoERecipe` (how it runs, which router), :class:`RouterConfig` (the router of a
real model) and :class:`MoEGeometry` (what it computes: sizes, expert activation, shared experts).

Both are frozen (hashable) dataclasses, so they can key caches and be compared across ranks. Their ``check``
methods refuse every inconsistent combination with :class:`tritonep.errors.ConfigError` naming the field and its
value; :func:`check_config` runs all checks that need the world size. Everything here runs before any allocation
(docs/moe.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError, WireError

from ..wire.formats import WIRES, check_wire, get_wire  # the wire registry (imports go one way: wire -> moe)

__all__ = ["MoERecipe", "MoEGeometry", "RouterConfig", "check_config", "COMBINE_KINDS", "BALANCE_KINDS",
           "ROUTER_KINDS", "ROW_MULTIPLE"]

COMBINE_KINDS = ("push", "pull")
"""``pull``: the source rank reads the partial rows from the expert rank (zero copy, bf16 only); ``push``: the
expert rank writes partials into the source's staging (the only kind that can carry a quantized combine wire)."""

BALANCE_KINDS = ("none", "virtual")
"""``none``: every route goes to its native expert; ``virtual``: per-step virtual-expert load balancing."""

ROUTER_KINDS = ("softmax_topk", "deepseek_v3")
"""``softmax_topk``: softmax over all experts, then top-k (Mixtral, Qwen2/3-MoE, OLMoE; :class:`tritonep.moe.TopKRouter`);
``deepseek_v3``: sigmoid scores, a selection-only correction bias, group-limited top-k
(:class:`tritonep.moe.DeepSeekV3Router`)."""

ROW_MULTIPLE = 8
"""hidden and intermediate must be multiples of 8 elements: a bf16 row is then a multiple of 16 bytes, which the
vectorised (16-byte) copies of the dispatch/combine kernels and ``torch._grouped_mm`` (it requires every stride to
be a multiple of 16 bytes) need; ``w1``'s rows of ``2*intermediate`` and ``w2``'s of ``hidden`` follow."""


def _positive_int(owner: str, field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{field} must be a positive int, got {value!r}")


def _real(owner: str, field: str, value, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")
    if not ok or value < 0 or (positive and value == 0):
        raise ConfigError(f"{owner}.{field} must be a finite {'positive' if positive else 'non-negative'} number, "
                          f"got {value!r}")


@dataclass(frozen=True)
class RouterConfig:
    """The router of an MoE layer, as the real models define it (docs/moe.md, "Routers").

    Attributes:
        kind: ``"softmax_topk"`` (default) or ``"deepseek_v3"`` (see :data:`ROUTER_KINDS`).
        norm_topk_prob: divide the K chosen weights by their sum (Mixtral always; Qwen2/3-MoE, OLMoE, DeepSeek-V3
            ``config.norm_topk_prob``; DeepSeek-V3 adds 1e-20 to the sum). Default True.
        n_group, topk_group: ``deepseek_v3`` only: the E experts form ``n_group`` equal groups, a group's score is the
            sum of its two best biased scores, and a token picks its K experts from its ``topk_group`` best groups
            (group-limited routing, DeepSeek-V3 ``n_group`` / ``topk_group``). Default 1 / 1 (no limit).
        routed_scaling_factor: multiplies the final routing weights (DeepSeek-V3 ``routed_scaling_factor``), > 0.
        aux_loss_coef: switch-style load-balancing loss (:func:`tritonep.moe.switch_aux_loss`) added to the
            training objective with this coefficient (Mixtral / Qwen ``router_aux_loss_coef``); 0 (default) = off.
        bias_update_rate: ``deepseek_v3`` only: aux-loss-free balancing (DeepSeek-V3, section 2.1.2): per
            :func:`tritonep.moe.update_router_biases` call every expert's correction bias moves by this amount
            towards balance (``gamma`` in the paper, 0.001 there); 0 (default) = the bias is not updated.
        jitter_noise: training only: the layer multiplies its input tokens by uniform noise in
            ``[1 - jitter_noise, 1 + jitter_noise]`` before routing (router and experts see the same tokens), as
            Mixtral's ``router_jitter_noise``; in ``[0, 1)``, 0 (default) = off.

    Raises:
        ConfigError: at construction, an unknown kind, a value of the wrong type or sign, group options on a
            softmax router, ``bias_update_rate`` on a softmax router; :meth:`check` with ``num_experts`` / ``topk``:
            groups that do not divide E, have fewer than 2 experts, or cannot supply K experts.
    """

    kind: str = "softmax_topk"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    jitter_noise: float = 0.0

    def __post_init__(self):
        self.check()

    def check(self, num_experts: int | None = None, topk: int | None = None) -> None:
        """Validate the router (and its fit to ``num_experts`` / ``topk`` when given). Raises ConfigError."""
        o = "RouterConfig"
        if self.kind not in ROUTER_KINDS:
            raise ConfigError(f"{o}.kind={self.kind!r} is not one of {ROUTER_KINDS}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ConfigError(f"{o}.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        _positive_int(o, "n_group", self.n_group)
        _positive_int(o, "topk_group", self.topk_group)
        _real(o, "routed_scaling_factor", self.routed_scaling_factor, positive=True)
        _real(o, "aux_loss_coef", self.aux_loss_coef, positive=False)
        _real(o, "bias_update_rate", self.bias_update_rate, positive=False)
        _real(o, "jitter_noise", self.jitter_noise, positive=False)
        if not self.jitter_noise < 1:
            raise ConfigError(f"{o}.jitter_noise={self.jitter_noise} must be in [0, 1)")
        if self.topk_group > self.n_group:
            raise ConfigError(f"{o}.topk_group={self.topk_group} exceeds {o}.n_group={self.n_group}")
        if self.kind == "softmax_topk" and (self.n_group, self.topk_group) != (1, 1):
            raise ConfigError(f"{o}.n_group={self.n_group} / topk_group={self.topk_group}: group-limited routing "
                              f"needs kind='deepseek_v3'")
        if self.kind == "softmax_topk" and self.bias_update_rate:
            raise ConfigError(f"{o}.bias_update_rate={self.bias_update_rate}: the correction bias belongs to "
                              f"kind='deepseek_v3'")
        if num_experts is not None and self.n_group > 1:
            if num_experts % self.n_group or num_experts // self.n_group < 2:
                raise ConfigError(f"{o}.n_group={self.n_group} must split num_experts={num_experts} into equal "
                                  f"groups of at least 2 experts")
            if topk is not None and topk > self.topk_group * (num_experts // self.n_group):
                raise ConfigError(f"topk={topk} exceeds the {self.topk_group} kept groups x "
                                  f"{num_experts // self.n_group} experts ({o}.topk_group)")


@dataclass(frozen=True)
class MoEGeometry:
    """The shape of one MoE layer.

    Attributes:
        hidden: H, model dimension (multiple of 8, see :data:`ROW_MULTIPLE`).
        intermediate: I, expert FFN width (multiple of 8); ``w1`` is ``[E, H, 2I]`` (gate | up), ``w2`` ``[E, I, H]``.
        num_experts: E, a multiple of the EP world size (checked by :meth:`check` with ``world_size``).
        topk: K, experts per token, ``1 <= K <= E``.
        max_tokens_per_rank: static capacity of tokens per rank and call.
        activation: the expert FFN's activation, a name of :data:`tritonep.moe.ACTIVATIONS` (default
            ``"swiglu"``: ``silu(gate) * up``, w1 ``[E, H, 2I]``; gated kinds have w1 ``[E, H, 2I]``, the others
            ``[E, H, I]``; register your own with :func:`tritonep.moe.register_activation`).
        shared_intermediate: width of the shared experts' dense FFN every token also runs (DeepSeek-V3:
            ``n_shared_experts * moe_intermediate_size``; Qwen2-MoE ``shared_expert_intermediate_size``); 0
            (default) = no shared experts.
        shared_gate: scale the shared experts' output by ``sigmoid(x @ shared_gate)`` (Qwen2-MoE
            ``shared_expert_gate``); needs ``shared_intermediate > 0``.
        max_recv_tokens: rows one rank can receive per call (the expert-output region's rows); None (default): the
            worst case ``W * max_tokens_per_rank * topk + L * (expert_alignment - 1)``. Smaller saves memory; a call
            that needs more raises CapacityError on every rank (docs/moe.md "Sizing").

    Raises:
        ConfigError: at construction, for any field that is not a positive int, a hidden / intermediate that is not a
            multiple of 8, ``topk > num_experts``, an unknown activation, a negative ``shared_intermediate`` or a
            shared gate without shared experts (the message names the field and value).
    """

    hidden: int
    intermediate: int
    num_experts: int
    topk: int
    max_tokens_per_rank: int
    activation: str = "swiglu"
    shared_intermediate: int = 0
    shared_gate: bool = False
    max_recv_tokens: int | None = None

    def __post_init__(self):
        self.check()

    @property
    def w1_width(self) -> int:
        """Columns of one expert's ``w1``: ``2 * intermediate`` for a gated activation (gate | up), else
        ``intermediate``."""
        from .activations import get_activation

        return get_activation(self.activation).width(self.intermediate)

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
        from .activations import get_activation  # the registry (ConfigError naming the known names)

        get_activation(self.activation, "MoEGeometry.activation")
        si = self.shared_intermediate
        if isinstance(si, bool) or not isinstance(si, int) or si < 0:
            raise ConfigError(f"MoEGeometry.shared_intermediate must be an int >= 0, got {si!r}")
        if self.max_recv_tokens is not None:
            _positive_int("MoEGeometry", "max_recv_tokens", self.max_recv_tokens)
        if not isinstance(self.shared_gate, bool) or (self.shared_gate and si == 0):
            raise ConfigError(f"MoEGeometry.shared_gate={self.shared_gate!r} needs a bool and shared experts "
                              f"(shared_intermediate > 0, got {si})")
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
        router: the :class:`RouterConfig` (default: softmax top-k, renormalised, no aux loss).
        max_saved_forwards: forwards of the layer whose backward may still come (activation recompute, pipeline
            micro-batches; docs/moe.md "Several forwards before their backwards"); the oldest saved forward past
            this many is dropped and its backward raises BufferStateError. Default 8.
        sync_free: no host read in forward or backward: the dispatch returns ``max_recv_tokens`` rows
            (:meth:`tritonep.EPBuffer.dispatch` ``sync_free=True``), the expert GEMMs run over them with the device
            ``expert_offsets`` (``torch._grouped_mm``; rows past the last segment are never read), so a whole layer
            step can be captured in one CUDA graph. Errors (capacity, a peer's bad input, timeouts) surface at the
            next :meth:`tritonep.EPBuffer.check`; size ``MoEGeometry.max_recv_tokens`` to a capacity, since every
            step moves that many rows through the GEMMs. Needs ``balance="none"`` (the virtual-expert split run
            reads its boundary on the host); either backend (nccl: fixed per-peer packet slots,
            :mod:`tritonep.backends.nccl.sync_free`).

    Raises:
        ConfigError: at construction, for any invalid field or inconsistent combination (names field and value).
    """

    dispatch_wire: str = "bf16"
    combine_wire: str = "bf16"
    combine: str = "pull"
    balance: str = "none"
    expert_alignment: int = 1
    router: RouterConfig = RouterConfig()
    max_saved_forwards: int = 8
    sync_free: bool = False

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
        _positive_int("MoERecipe", "max_saved_forwards", self.max_saved_forwards)
        if not isinstance(self.router, RouterConfig):
            raise ConfigError(f"MoERecipe.router must be a RouterConfig, got {type(self.router).__name__}")
        if not isinstance(self.sync_free, bool):
            raise ConfigError(f"MoERecipe.sync_free must be a bool, got {self.sync_free!r}")
        if self.sync_free and self.balance != "none":
            raise ConfigError(f"MoERecipe.sync_free=True needs balance='none', got MoERecipe.balance="
                              f"{self.balance!r} (the virtual-expert split run reads its native/slot boundary on "
                              f"the host every step)")
        if get_wire(self.combine_wire).quantized and self.combine == "pull":
            raise ConfigError(f"MoERecipe.combine_wire={self.combine_wire!r} needs combine='push' (quantized combine "
                              f"is push only), got MoERecipe.combine='pull'")
        if geometry is not None:
            self.router.check(geometry.num_experts, geometry.topk)
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
