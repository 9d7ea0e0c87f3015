"""The MoE layer on EPBuffer: recipe + geometry, softmax top-k router, grouped SwiGLU experts, MoELayer, custom ops.

See docs/moe.md. Public names: :class:`MoELayer`, :class:`MoERecipe`, :class:`MoEGeometry`, :class:`TopKRouter`,
:func:`topk_softmax_torch`, :func:`expert_ffn` (and its forward / backward halves), :func:`check_config`.
Importing this package registers the ``tritonep::moe_layer_forward`` / ``tritonep::moe_layer_backward`` ops.
"""

from .experts import ExpertFFN, expert_ffn, expert_ffn_backward, expert_ffn_forward, swiglu_torch
from .layer import MoELayer
from .recipe import BALANCE_KINDS, COMBINE_KINDS, ROW_MULTIPLE, MoEGeometry, MoERecipe, check_config
from .router import TopKRouter, topk_softmax_torch

__all__ = ["MoELayer", "MoERecipe", "MoEGeometry", "check_config", "TopKRouter", "topk_softmax_torch",
           "ExpertFFN", "expert_ffn", "expert_ffn_forward", "expert_ffn_backward", "swiglu_torch",
           "COMBINE_KINDS", "BALANCE_KINDS", "ROW_MULTIPLE"]
