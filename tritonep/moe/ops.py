"""torch.library custom ops: the one forward / backward of :class:`tritonep.MoELayer`, eager and compiled.

Every layer call goes through :func:`moe_layer_forward` (eager too), so there is one forward and one backward.

Dispatch, the expert GEMMs and combine have data-dependent row counts and talk to peers through symmetric memory,
which a tracer cannot see into. The whole layer body is therefore one opaque op with a fake (meta) implementation
of the right output shape, and its backward is a second opaque op:

* ``tritonep::moe_layer_forward(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor w1, Tensor w2,
  int layer_id, bool save) -> (Tensor y, Tensor ticket)``: y ``[T, H]`` like x; ``ticket`` a 0-dim int64 CPU tensor
  naming the saved state of this call (only when ``save``; the layer keeps it until the backward).
* ``tritonep::moe_layer_backward(Tensor grad_y, Tensor ticket, Tensor x, Tensor topk_weights, Tensor w1,
  Tensor w2, int layer_id) -> (grad_x, grad_topk_weights, grad_w1, grad_w2)``.

Layers are found through a module-level registry keyed by ``layer_id`` (weak references: a dropped layer
disappears). ``torch.library.register_autograd`` wires the backward op to the forward op. Saved state is
consumed by the backward (a second backward through the same call, i.e. ``retain_graph=True``, is refused), and
dropped when the ticket tensor dies: the autograd graph holds the ticket (``save_for_backward``), so a graph that is
freed without a backward (evaluation with autograd on, activation checkpointing that discards the first forward's
saved tensors) frees its saved state too (:mod:`tritonep.moe.saved`).

Idea source: the torch.library "custom ops" tutorial (custom_op + register_fake + register_autograd).
"""

from __future__ import annotations

import itertools
import weakref

import torch

from ..errors import BackendError, BufferStateError, ConfigError

__all__ = ["register_layer", "unregister_layer", "get_layer", "moe_layer_forward", "moe_layer_backward"]

_LAYERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


def register_layer(layer) -> int:
    """Register a layer object (needs ``_forward_raw`` / ``_backward_raw``) and return its new ``layer_id``."""
    layer_id = next(_IDS)
    _LAYERS[layer_id] = layer
    return layer_id


def unregister_layer(layer_id: int) -> None:
    """Forget a layer id (no error if unknown)."""
    _LAYERS.pop(layer_id, None)


def get_layer(layer_id: int):
    """The registered layer of ``layer_id``. Raises ConfigError when it is unknown (closed or garbage collected)."""
    layer = _LAYERS.get(layer_id)
    if layer is None:
        raise ConfigError(f"no MoE layer with layer_id={layer_id} (closed or never built in this process)")
    return layer


@torch.library.custom_op("tritonep::moe_layer_forward", mutates_args=())
def moe_layer_forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
                      w2: torch.Tensor, layer_id: int, save: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Run layer ``layer_id``'s dispatch -> expert FFN -> combine on these tensors (see the module docstring)."""
    layer = get_layer(layer_id)
    y, ticket = layer._forward_raw(x, topk_idx, topk_weights, w1, w2, save)
    t = torch.tensor(ticket, dtype=torch.int64)
    if ticket >= 0:  # the saved state lives as long as the ticket, i.e. as long as the autograd graph that holds it
        weakref.finalize(t, layer._stash.discard, ticket)
    return y, t


@moe_layer_forward.register_fake
def _moe_layer_forward_fake(x, topk_idx, topk_weights, w1, w2, layer_id, save):
    return torch.empty_like(x), torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("tritonep::moe_layer_backward", mutates_args=())
def moe_layer_backward(grad_y: torch.Tensor, ticket: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                       w1: torch.Tensor, w2: torch.Tensor, layer_id: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one saved ``moe_layer_forward`` call: ``(grad_x, grad_topk_weights, grad_w1, grad_w2)``."""
    gx, gtw, gw1, gw2 = get_layer(layer_id)._backward_raw(int(ticket), grad_y)
    return gx, gtw.to(topk_weights.dtype), gw1, gw2


@moe_layer_backward.register_fake
def _moe_layer_backward_fake(grad_y, ticket, x, topk_weights, w1, w2, layer_id):
    return torch.empty_like(x), torch.empty_like(topk_weights), torch.empty_like(w1), torch.empty_like(w2)


def _setup_context(ctx, inputs, output):
    x, _topk_idx, topk_weights, w1, w2, layer_id, save = inputs
    _y, ticket = output
    ctx.save_for_backward(x, topk_weights, w1, w2, ticket)
    ctx.layer_id = layer_id
    ctx.saved_state = save


def _backward(ctx, grad_y, _grad_ticket):
    if not ctx.saved_state:
        raise BufferStateError("moe_layer_forward ran with save=False (no grad was needed then); cannot backward")
    x, topk_weights, w1, w2, ticket = ctx.saved_tensors
    gx, gtw, gw1, gw2 = torch.ops.tritonep.moe_layer_backward(grad_y, ticket, x, topk_weights, w1, w2, ctx.layer_id)
    return gx, None, gtw, gw1, gw2, None, None


moe_layer_forward.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise BackendError("MoELayer has no second-order gradient: a backward through a gradient the layer computed "
                       "with create_graph=True (gradient penalty, Hessian-vector product) is not supported; its "
                       "expert FFN backward is one opaque op. EPBuffer.dispatch / combine (and the tritonep::dispatch "
                       "/ combine ops) around torch experts support it")


def _no_setup(ctx, inputs, output):
    pass


# the backward op is differentiable only in the sense that autograd refuses clearly: without a registration torch
# raises an untyped error, and a gradient made with create_graph=True must never silently lose its second order
moe_layer_backward.register_autograd(_no_double_backward, setup_context=_no_setup)
