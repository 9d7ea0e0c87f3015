"""Weights of a transformers MoE block into an :class:`tritonep.MoELayer` (and the layer's config from the model's).

Layouts (``E`` experts, ``H`` hidden, ``I`` expert width, ``L`` experts on this rank, ``lo = rank * L``):

================================================  ==============================  ======================================
transformers                                       shape                           tritonep
================================================  ==============================  ======================================
``gate.weight`` (router)                           ``[E, H]``                      ``router.weight`` (same)
``gate.e_score_correction_bias`` (DeepSeek-V3)     ``[E]``                         ``router.e_score_correction_bias``
``experts.gate_up_proj`` (transformers >= 5)       ``[E, 2I, H]`` gate rows first  ``w1 = gate_up_proj[lo:lo+L].mT``
``experts.down_proj`` (transformers >= 5)          ``[E, H, I]``                   ``w2 = down_proj[lo:lo+L].mT``
``experts.<e>.gate_proj|up_proj|down_proj.weight``  ``[I, H]``, ``[I, H]``, ``[H, I]``  checkpoint files of Qwen / OLMoE /
``experts.<e>.w1|w3|w2.weight`` (Mixtral files)                                    DeepSeek / Mixtral: the same, per expert
``shared_experts.*_proj.weight`` (DeepSeek-V3)     ``nn.Linear``                   ``shared.*_proj.weight`` (same)
``shared_expert.*_proj.weight`` (Qwen2-MoE)        ``nn.Linear``                   ``shared.*_proj.weight`` (same)
``shared_expert_gate.weight`` (Qwen2-MoE)          ``[1, H]``                      ``shared.gate.weight`` (same)
================================================  ==============================  ======================================

``w1[j] = [gate_j^T | up_j^T]`` (``[H, 2I]``, the gate's I columns first) and ``w2[j] = down_j^T`` (``[I, H]``): our
grouped GEMM multiplies rows by ``[H, ...]`` matrices where ``nn.Linear`` stores ``[out, in]``. Only this rank's
experts are read (a full model's expert tensors may stay on the CPU or be lazily loaded slices).

Idea source: the weight names of transformers' Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / DeepSeek-V3 modeling files
and of their checkpoint files; tests/moe/test_hf_equality.py checks the import by equality of outputs and gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from .recipe import MoEGeometry, MoERecipe, RouterConfig

__all__ = ["config_from_hf", "load_hf_moe_block", "load_hf_moe_state_dict", "to_hf_experts", "HF_MODEL_TYPES"]

HF_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
"""``config.model_type`` values :func:`config_from_hf` maps."""

_ACTS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu"}

# config fields that change what one MoE block computes but have no counterpart here: ``config_from_hf`` refuses
# a model whose value differs from the one the layer computes (``field -> (the values honoured, why)``); a caller
# who accepts the difference passes the field in ``ignore``. Fields it maps are read in config_from_hf itself
# (Mixtral's ``router_jitter_noise`` -> ``RouterConfig.jitter_noise``); fields of the model around the block
# (which layers are MoE: ``decoder_sparse_step``, ``mlp_only_layers``, ``first_k_dense_replace``, ``moe_layer_freq``;
# attention, norms) and ``output_router_logits`` / ``router_aux_loss_coef`` (the ``aux_loss`` argument) are not the
# block's.
_UNSUPPORTED = {
    "deepseek_v3": {
        "scoring_func": (("sigmoid",), "the deepseek_v3 router scores with a sigmoid"),
        "topk_method": (("noaux_tc",), "the deepseek_v3 router picks with the correction bias and group limit "
                                        "(noaux_tc)"),
    },
}


def config_from_hf(config, max_tokens_per_rank: int, aux_loss: bool = False, ignore: tuple = (),
                   **recipe_kwargs) -> tuple[MoERecipe, MoEGeometry]:
    """The :class:`MoERecipe` / :class:`MoEGeometry` of one MoE block of a transformers model config.

    Every config field that changes what the block computes is either mapped (sizes, activation, router kind and
    options, shared experts, Mixtral's ``router_jitter_noise`` as ``RouterConfig.jitter_noise``) or, when its
    value is one the layer does not compute (e.g. a DeepSeek ``scoring_func`` other than ``"sigmoid"``), refused.

    Args:
        config: a transformers ``PretrainedConfig`` of a model in :data:`HF_MODEL_TYPES` (read by attribute only;
            transformers itself is not imported).
        max_tokens_per_rank: the layer's static token capacity per rank and call.
        aux_loss: take the model's ``router_aux_loss_coef`` as ``RouterConfig.aux_loss_coef`` (models that have one).
        ignore: names of config fields whose value may differ from what the layer computes (the caller accepts
            the difference; e.g. ``("router_jitter_noise",)`` trains a Mixtral block without its jitter).
        **recipe_kwargs: the other :class:`MoERecipe` fields (wires, combine, balance, ...).

    Raises:
        ConfigError: an unknown ``model_type`` or ``hidden_act``; a field the layer does not compute with the
            model's value (named with the value and what the layer computes instead), unless in ``ignore``.
    """
    mt = getattr(config, "model_type", None)
    if mt not in HF_MODEL_TYPES:
        raise ConfigError(f"config.model_type={mt!r} is not one of {HF_MODEL_TYPES}")
    act = _ACTS.get(getattr(config, "hidden_act", "silu"))
    if act is None:
        raise ConfigError(f"config.hidden_act={config.hidden_act!r} has no gated expert activation here "
                          f"(known: {sorted(_ACTS)})")
    ignore = (ignore,) if isinstance(ignore, str) else tuple(ignore)
    for field, (ok, what) in _UNSUPPORTED.get(mt, {}).items():
        v = getattr(config, field, None)
        if v is not None and v not in ok and field not in ignore:
            raise ConfigError(f"config.{field}={v!r} ({mt}) is not supported: {what}; pass ignore=({field!r},) to "
                              f"build the layer anyway")
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if aux_loss else 0.0
    shared, gate = 0, False
    if mt == "mixtral":
        jitter = 0.0 if "router_jitter_noise" in ignore else float(getattr(config, "router_jitter_noise", 0.0) or 0.0)
        E, inter = config.num_local_experts, config.intermediate_size
        router = RouterConfig(aux_loss_coef=coef, jitter_noise=jitter)
    elif mt == "deepseek_v3":
        E, inter = config.n_routed_experts, config.moe_intermediate_size
        shared = config.n_shared_experts * config.moe_intermediate_size
        router = RouterConfig(kind="deepseek_v3", norm_topk_prob=bool(config.norm_topk_prob),
                              n_group=config.n_group or 1, topk_group=config.topk_group or 1,
                              routed_scaling_factor=float(config.routed_scaling_factor))
    else:  # qwen2_moe, qwen3_moe, olmoe: softmax top-k with norm_topk_prob
        E = config.num_experts
        inter = config.intermediate_size if mt == "olmoe" else config.moe_intermediate_size
        router = RouterConfig(norm_topk_prob=bool(config.norm_topk_prob), aux_loss_coef=coef)
        if mt == "qwen2_moe":
            shared, gate = config.shared_expert_intermediate_size, True
    geometry = MoEGeometry(hidden=config.hidden_size, intermediate=inter, num_experts=E,
                           topk=config.num_experts_per_tok, max_tokens_per_rank=max_tokens_per_rank, activation=act,
                           shared_intermediate=shared, shared_gate=gate)
    return MoERecipe(router=router, **recipe_kwargs), geometry


def to_hf_experts(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our ``(w1 [n, H, 2I], w2 [n, I, H])`` (or their gradients) in transformers' fused layout ``(gate_up_proj
    [n, 2I, H], down_proj [n, H, I])`` (transposed views)."""
    return w1.transpose(1, 2), w2.transpose(1, 2)


def _take(sd: dict, key: str, shape, used: set) -> torch.Tensor:
    if key not in sd:
        raise ConfigError(f"transformers state dict has no {key!r}")
    t = sd[key]
    if tuple(t.shape) != tuple(shape):
        raise ConfigError(f"{key!r} has shape {tuple(t.shape)}, the layer needs {tuple(shape)}")
    used.add(key)
    return t


def _expert_weights(layer, sd, p, used):
    g = layer.geometry
    H, inter, E, ids = g.hidden, g.intermediate, g.num_experts, list(layer.expert_ids)
    if p + "experts.gate_up_proj" in sd:  # transformers >= 5 modules: fused [E, 2I, H] / [E, H, I]
        gu = _take(sd, p + "experts.gate_up_proj", (E, 2 * inter, H), used)[ids[0]:ids[-1] + 1]
        down = _take(sd, p + "experts.down_proj", (E, H, inter), used)[ids[0]:ids[-1] + 1]
        return gu.transpose(1, 2), down.transpose(1, 2)
    names = ("gate_proj", "up_proj", "down_proj") if p + f"experts.{ids[0]}.gate_proj.weight" in sd else \
        ("w1", "w3", "w2")  # per-expert checkpoint files (Mixtral names its gate w1, up w3, down w2)
    w1, w2 = [], []
    for e in ids:
        ga, up, dn = (p + f"experts.{e}.{n}.weight" for n in names)
        w1.append(torch.cat([_take(sd, ga, (inter, H), used).t(), _take(sd, up, (inter, H), used).t()], dim=1))
        w2.append(_take(sd, dn, (H, inter), used).t())
    return torch.stack(w1), torch.stack(w2)


@torch.no_grad()
def load_hf_moe_state_dict(layer: nn.Module, state_dict: dict, prefix: str = "") -> list[str]:
    """Copy this rank's share of a transformers MoE block's weights into ``layer`` (module docstring's table).

    Args:
        layer: the :class:`tritonep.MoELayer` (its geometry must match: see :func:`config_from_hf`; gated
            activation, shared experts and router kind as the model).
        state_dict: the block's tensors (``block.state_dict()``, or a checkpoint file's keys) on any device/dtype.
        prefix: the block's key prefix in ``state_dict`` (e.g. ``"model.layers.3.mlp."``).

    Returns:
        the keys used (sorted).

    Raises:
        ConfigError: a key the layer needs is missing or has the wrong shape (named with both shapes), or the layer
            has a plain (non-gated) activation, which these models do not use.
    """
    g = layer.geometry
    if g.w1_width != 2 * g.intermediate:
        raise ConfigError(f"layer activation {g.activation!r} is not gated; transformers MoE blocks are")
    used: set = set()
    sd, p = state_dict, prefix
    layer.router.weight.copy_(_take(sd, p + "gate.weight", (g.num_experts, g.hidden), used))
    bias = p + "gate.e_score_correction_bias"
    if hasattr(layer.router, "e_score_correction_bias"):
        layer.router.e_score_correction_bias.copy_(_take(sd, bias, (g.num_experts,), used))
    w1, w2 = _expert_weights(layer, sd, p, used)
    layer.w1.copy_(w1)
    layer.w2.copy_(w2)
    if layer.shared is not None:
        sp = p + ("shared_experts." if p + "shared_experts.up_proj.weight" in sd else "shared_expert.")
        for name, lin in (("gate_proj", getattr(layer.shared, "gate_proj", None)), ("up_proj", layer.shared.up_proj),
                          ("down_proj", layer.shared.down_proj)):
            if lin is not None:
                lin.weight.copy_(_take(sd, f"{sp}{name}.weight", lin.weight.shape, used))
        if layer.shared.gate is not None:
            layer.shared.gate.weight.copy_(_take(sd, p + "shared_expert_gate.weight", (1, g.hidden), used))
    return sorted(used)


def load_hf_moe_block(layer: nn.Module, block: nn.Module) -> list[str]:
    """:func:`load_hf_moe_state_dict` from a transformers MoE block module (``MixtralSparseMoeBlock``,
    ``Qwen2MoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``, ``OlmoeSparseMoeBlock``, ``DeepseekV3MoE``)."""
    return load_hf_moe_state_dict(layer, block.state_dict())
