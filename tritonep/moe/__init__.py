"""The MoE layer on EPBuffer: recipe + geometry, routers of real models, shared experts, grouped expert FFN, the
layer, its parameters / gradients / checkpoint keys, transformers weight import, and the custom ops.

See docs/moe.md. Public names: :class:`MoELayer`, :class:`MoERecipe`, :class:`MoEGeometry`, :class:`RouterConfig`,
the routers (:class:`TopKRouter`, :class:`DeepSeekV3Router`, :func:`topk_softmax_torch`,
:func:`deepseek_v3_topk_torch`, :func:`update_router_biases`), :func:`switch_aux_loss`, :class:`SharedExperts`, the
expert activations (:data:`ACTIVATIONS`, :func:`register_activation`), :func:`expert_ffn` (and its forward / backward
halves), the training helpers (:func:`expert_parameters`, :func:`replicated_parameters`, :func:`reduce_gradients`,
:mod:`tritonep.moe.checkpoint`), the transformers import (:mod:`tritonep.moe.hf_import`) and :func:`check_config`.
Importing this package registers the ``tritonep::moe_layer_forward`` / ``tritonep::moe_layer_backward`` ops.
"""

from .activations import ACTIVATIONS, ExpertActivation, get_activation, register_activation
from .experts import ExpertFFN, expert_ffn, expert_ffn_backward, expert_ffn_forward, swiglu_torch
from .layer import MoELayer
from .losses import attach_aux_loss, switch_aux_loss
from .params import expert_parameter_names, expert_parameters, reduce_gradients, replicated_parameters
from .recipe import (BALANCE_KINDS, COMBINE_KINDS, ROUTER_KINDS, ROW_MULTIPLE, MoEGeometry, MoERecipe, RouterConfig,
                     check_config)
from .router import RouterOutput, TopKRouter, topk_softmax_torch
from .routers import build_router
from .router_deepseek import DeepSeekV3Router, deepseek_v3_topk_torch, update_router_biases
from .shared import SharedExperts

__all__ = ["MoELayer", "MoERecipe", "MoEGeometry", "RouterConfig", "check_config", "TopKRouter", "DeepSeekV3Router",
           "RouterOutput", "build_router", "topk_softmax_torch", "deepseek_v3_topk_torch", "update_router_biases",
           "switch_aux_loss", "attach_aux_loss", "SharedExperts", "ACTIVATIONS", "ExpertActivation",
           "get_activation", "register_activation", "ExpertFFN", "expert_ffn", "expert_ffn_forward",
           "expert_ffn_backward", "swiglu_torch", "expert_parameters", "expert_parameter_names",
           "replicated_parameters", "reduce_gradients", "COMBINE_KINDS", "BALANCE_KINDS", "ROUTER_KINDS",
           "ROW_MULTIPLE"]
