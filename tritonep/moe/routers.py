"""The router a :class:`tritonep.moe.RouterConfig` names (one place that knows every router kind).

Idea: a registry-free factory over the recipe's router config, as Megatron-LM's ``TopKRouter`` / DeepSeek-V3's
``MoEGate`` choices are made from one model config.
"""

from __future__ import annotations

from torch import nn

from .router import TopKRouter
from .router_deepseek import DeepSeekV3Router

__all__ = ["build_router"]


def build_router(config, hidden: int, num_experts: int, topk: int, *, seed: int = 0, device=None) -> nn.Module:
    """The router a :class:`tritonep.moe.RouterConfig` describes (:class:`TopKRouter` or
    :class:`tritonep.moe.DeepSeekV3Router`), initialised from ``seed`` on ``device``.

    Raises:
        ConfigError: as :meth:`tritonep.moe.RouterConfig.check` for these sizes.
    """
    config.check(num_experts, topk)
    if config.kind == "deepseek_v3":
        return DeepSeekV3Router(hidden, num_experts, topk, n_group=config.n_group, topk_group=config.topk_group,
                                norm_topk_prob=config.norm_topk_prob,
                                routed_scaling_factor=config.routed_scaling_factor,
                                bias_update_rate=config.bias_update_rate, seed=seed, device=device)
    return TopKRouter(hidden, num_experts, topk, renormalize=config.norm_topk_prob,
                      routed_scaling_factor=config.routed_scaling_factor, seed=seed, device=device)
