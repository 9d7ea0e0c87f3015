"""Load-balancing loss of an MoE layer: the switch-style auxiliary loss and how the layer adds it to training.

Switch-style loss (Switch Transformer eq. 4-6, as transformers' ``load_balancing_loss_func`` computes it for one
layer without an attention mask)::

    f[e] = (routes to expert e) / T          # sums to K; not differentiable
    P[e] = mean over tokens of probs[t, e]   # sums to 1; differentiable
    aux  = E * sum_e f[e] * P[e]             # K when perfectly balanced

``probs`` is the router's per-token distribution (:class:`tritonep.moe.RouterOutput.probs`: the softmax, or for
sigmoid scores the scores over their sum, as DeepSeek-V3's balance loss normalises them).

With ``RouterConfig.aux_loss_coef = c > 0`` the layer computes ``aux`` on every training forward and attaches it to
its output (:func:`attach_aux_loss`): the backward adds ``c * d(aux)`` to the router's gradient as if ``c * aux`` had
been added to the loss, without the training loop collecting anything (the idea of Megatron-LM's
``MoEAuxLossAutoScaler``). ``layer.last_aux_loss`` keeps the detached value for logging. The added gradient does not
follow the loss's own scaling: when the loss is divided by the number of micro-batches (gradient accumulation), divide
``aux_loss_coef`` by it too. Each rank's loss uses its own tokens (the router's gradient is then reduced like any
replicated parameter's, docs/moe.md "Training"), which is per-micro-batch balancing as in transformers.
"""

from __future__ import annotations

import torch

from ..errors import InputError

__all__ = ["switch_aux_loss", "attach_aux_loss"]


def switch_aux_loss(probs: torch.Tensor, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The switch-style load-balancing loss of one layer (module docstring).

    Args:
        probs: ``[T, E]`` float per-token expert distribution (differentiable).
        topk_idx: ``[T, K]`` int chosen experts (``-1`` slots are not counted).
        num_experts: E.

    Returns:
        0-dim float32 tensor (0 when ``T == 0``).

    Raises:
        InputError: shapes that do not agree.
    """
    if probs.dim() != 2 or probs.shape[1] != num_experts or topk_idx.dim() != 2 or \
            topk_idx.shape[0] != probs.shape[0]:
        raise InputError(f"need probs [T, {num_experts}] and topk_idx [T, K]; got {tuple(probs.shape)}, "
                         f"{tuple(topk_idx.shape)}")
    T = probs.shape[0]
    if T == 0:
        return probs.sum() * 0.0
    with torch.no_grad():
        valid = topk_idx >= 0
        counts = torch.zeros(num_experts, dtype=torch.float32, device=probs.device)
        counts.scatter_add_(0, topk_idx.clamp(min=0).reshape(-1).long(), valid.reshape(-1).float())  # no host read
        frac = counts / T
    return num_experts * torch.sum(frac * probs.float().mean(dim=0))


class _AttachAuxLoss(torch.autograd.Function):
    """``y -> y`` whose backward also sends ``coef`` as the gradient of ``aux`` (module docstring)."""

    @staticmethod
    def forward(ctx, y, aux, coef):
        ctx.coef = coef
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y):
        shape, dtype, device = ctx.aux_meta
        return grad_y, torch.full(shape, ctx.coef, dtype=dtype, device=device), None


def attach_aux_loss(y: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
    """Return ``y`` (same values) such that a backward through it also backpropagates ``coef * aux``.

    Args:
        y: any differentiable output that reaches the loss. aux: 0-dim loss term. coef: its weight (float).
    """
    return _AttachAuxLoss.apply(y, aux, float(coef))
