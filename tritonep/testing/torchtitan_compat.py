"""torchtitan 0.3.0 under torch 2.11 (the GPU machine's torch): DeepSeek-V3 MoE layer configs built without the
``torchtitan.models.deepseek_v3`` package, and the one torch name torchtitan's AllToAll dispatcher calls that torch
2.11 lacks. Support for benchmarks, examples and tests; not part of the integration's API.

What torch 2.11 lacks (checked against torch 2.11.0's Python sources, every ``torch.*`` name the loaded torchtitan /
spmd_types modules use):

* ``torch.distributed.fsdp.DataParallelMeshDims``: imported at module level by ``torchtitan/models/deepseek_v3/
  mtp.py``, so ``import torchtitan.models.deepseek_v3`` (hence ``deepseekv3_configs``) raises ImportError on torch
  2.11. :func:`deepseek_v3_moe_config` builds the same ``MoE.Config`` from ``torchtitan.models.common`` classes, which
  import fine there.
* ``torch.compiler._is_non_strict_tracing``: called by ``AllToAllTokenDispatcher`` (count exchange, token
  exchange, combine) whenever it is not compiling, so its eager dispatch raises AttributeError on torch 2.11.
  :func:`add_missing_torch_names` defines it as what it means there: torch 2.11 has no non-strict tracing flag, so
  it is never set (False).

The other torch names those modules use exist in 2.11 or sit on paths the benchmarks never take (``set_pg_timeouts``
-> ``torch.distributed.set_timeout``; spmd_types imports ``_FlatLayout`` inside a try with a fallback).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from tritonep.errors import ConfigError

__all__ = ["DEEPSEEK_V3_MOE", "deepseek_v3_moe_config", "add_missing_torch_names"]

# torchtitan 0.3.0 torchtitan/models/deepseek_v3/__init__.py: the MoE numbers of _debugmodel, _16b, _671b (the
# arguments they pass to build_mla_moe_layers); n_dense_layers = the first MoE layer's id.
DEEPSEEK_V3_MOE = {
    "debugmodel": dict(dim=256, moe_hidden_dim=256, num_experts=8, num_shared_experts=2, top_k=3,
                       score_func="softmax", num_expert_groups=None, num_limited_groups=None, route_scale=1.0,
                       route_norm=False, n_layers=6, n_dense_layers=1),
    "16B": dict(dim=2048, moe_hidden_dim=1408, num_experts=64, num_shared_experts=2, top_k=6, score_func="softmax",
                num_expert_groups=None, num_limited_groups=None, route_scale=1.0, route_norm=False, n_layers=27,
                n_dense_layers=1),
    "671B": dict(dim=7168, moe_hidden_dim=2048, num_experts=256, num_shared_experts=1, top_k=8, score_func="sigmoid",
                 num_expert_groups=8, num_limited_groups=4, route_scale=2.5, route_norm=True, n_layers=61,
                 n_dense_layers=3),
}


def _inits(layer_id: int):
    """DeepSeek-V3's initialisers (deepseek_v3/__init__.py ``_LINEAR_INIT``, ``_depth_init``,
    ``_depth_experts_init``): std 0.02, depth-scaled ``0.02 / sqrt(2 (layer_id + 1))`` for the output projections."""
    from torchtitan.models.common.param_init import depth_scaled_std

    depth_std = depth_scaled_std(0.02, layer_id)
    linear = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    depth = {"weight": partial(nn.init.trunc_normal_, std=depth_std), "bias": nn.init.zeros_}
    experts = {"w1_EFD": partial(nn.init.trunc_normal_, std=0.02),
               "w2_EDF": partial(nn.init.trunc_normal_, std=depth_std),
               "w3_EFD": partial(nn.init.trunc_normal_, std=depth_std)}
    return linear, depth, experts


def deepseek_v3_moe_config(flavor: str, layer_id: int | None = None, num_experts: int | None = None):
    """torchtitan's ``MoE.Config`` of one DeepSeek-V3 layer with the ``"standard"`` comm backend, equal field by field
    to ``deepseekv3_configs[flavor](attn_backend=..., moe_comm_backend="standard").layers[layer_id].moe``
    (tests/integrations/test_torchtitan_compat.py checks it where that import works).

    Args:
        flavor: ``"debugmodel"`` (dim 256, 8 experts of 256, top-3 softmax, 2 shared), ``"16B"`` (dim 2048, 64 of
            1408, top-6 softmax, 2 shared) or ``"671B"`` (dim 7168, 256 of 2048, top-8 sigmoid, 8 groups / 4
            limited, route scale 2.5, normalised, 1 shared).
        layer_id: the transformer layer (its id sets the depth-scaled init std); None = the first MoE layer.
        num_experts: routed experts of the layer (None: the flavor's). Fewer experts are what one GPU of an EP
            group holds of the full layer (benchmarks/titan_bench.py sizes the layer to its card this way); with
            expert groups it must be a multiple of the flavor's group count. Every other field stays the flavor's.

    Returns:
        ``torchtitan.models.common.moe.MoE.Config`` (token dispatcher ``AllToAllTokenDispatcher.Config``, which
        runs locally without an EP mesh; swap it with :func:`tritonep.integrations.torchtitan.use_tritonep`).

    Raises:
        ConfigError: an unknown flavor, a layer_id that is a dense layer (no MoE) or past the last layer, or a
            num_experts below top-k or not a multiple of the expert groups.
    """
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    if flavor not in DEEPSEEK_V3_MOE:
        raise ConfigError(f"flavor={flavor!r} is not one of {sorted(DEEPSEEK_V3_MOE)}")
    c = DEEPSEEK_V3_MOE[flavor]
    if layer_id is None:
        layer_id = c["n_dense_layers"]
    if not c["n_dense_layers"] <= layer_id < c["n_layers"]:
        raise ConfigError(f"layer_id={layer_id} of DeepSeek-V3 {flavor} has no MoE (MoE layers: "
                          f"[{c['n_dense_layers']}, {c['n_layers']}))")
    D, E, K = c["dim"], num_experts or c["num_experts"], c["top_k"]
    if E < K or (c["num_expert_groups"] and E % c["num_expert_groups"]):
        raise ConfigError(f"num_experts={E} for DeepSeek-V3 {flavor}: needs at least top-k={K} experts and a "
                          f"multiple of its {c['num_expert_groups']} expert groups")
    shared_hidden = c["moe_hidden_dim"] * c["num_shared_experts"]
    linear, depth, experts = _inits(layer_id)
    return MoE.Config(
        num_experts=E,
        load_balance_coeff=1e-3,
        router=TokenChoiceTopKRouter.Config(
            num_experts=E,
            gate=Linear.Config(in_features=D, out_features=E, bias=False, param_init=depth),
            top_k=K, score_func=c["score_func"], route_norm=c["route_norm"], route_scale=c["route_scale"],
            num_expert_groups=c["num_expert_groups"], num_limited_groups=c["num_limited_groups"]),
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=c["moe_hidden_dim"], num_experts=E,
                                                param_init=experts),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=E, top_k=K)),
        shared_experts=FeedForward.Config(
            w1=Linear.Config(in_features=D, out_features=shared_hidden, param_init=linear),
            w2=Linear.Config(in_features=shared_hidden, out_features=D, param_init=depth),
            w3=Linear.Config(in_features=D, out_features=shared_hidden, param_init=depth)),
    )


def _never_non_strict_tracing() -> bool:
    """torch 2.11 stand-in for ``torch.compiler._is_non_strict_tracing``: that torch has no such tracing flag."""
    return False


def add_missing_torch_names() -> list[str]:
    """Define on this torch the names torchtitan 0.3.0's dispatchers call that it lacks (module docstring); returns
    the dotted names it added (empty on a torch that has them all, e.g. 2.13)."""
    added = []
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        torch.compiler._is_non_strict_tracing = _never_non_strict_tracing
        added.append("torch.compiler._is_non_strict_tracing")
    return added
