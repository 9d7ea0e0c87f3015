"""Softmax top-k router (the gate of an MoE layer).

``logits = x @ W_g`` in float32, ``probs = softmax(logits)``, the K largest probabilities are chosen (ties go to the
lower expert id), optionally renormalised to sum to 1 per token. The routing weights are differentiable w.r.t. the
gate weight and ``x`` (through the gathered probabilities); the chosen ids are not.

Idea source: the Switch / Mixtral style softmax top-k gate (renormalised top-k as in Mixtral, OLMoE).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError, InputError

__all__ = ["TopKRouter", "topk_softmax_torch", "router_init"]


def topk_softmax_torch(logits: torch.Tensor, topk: int, renormalize: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k over the last dimension (pure torch; the router's spec).

    Args:
        logits: ``[T, E]`` float (computed in float32).
        topk: K, ``1 <= K <= E``.
        renormalize: divide the K chosen probabilities by their sum.

    Returns:
        ``(topk_idx [T, K] int64, topk_weights [T, K] float32)``, highest probability first; among equal
        probabilities the lower expert id comes first (a stable descending sort). ``topk_weights`` carries autograd
        back to ``logits``.

    Raises:
        InputError: ``logits`` is not 2-D or ``topk`` is outside ``[1, E]``.
    """
    if logits.dim() != 2:
        raise InputError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= logits.shape[1]:
        raise InputError(f"topk={topk!r} must be an int in [1, num_experts={logits.shape[1]}]")
    probs = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices
    topk_idx = order[:, :topk].contiguous()
    topk_weights = torch.gather(probs, 1, topk_idx)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_idx, topk_weights.contiguous()


def router_init(hidden: int, num_experts: int, seed: int) -> torch.Tensor:
    """Deterministic gate weight ``[hidden, num_experts]`` float32, ``N(0, 1/hidden)``, from ``seed`` alone (the same
    on every rank, on every device: drawn on the CPU)."""
    g = torch.Generator().manual_seed(int(seed) * 7919 + 17)
    return torch.randn(hidden, num_experts, generator=g, dtype=torch.float32) / math.sqrt(hidden)


class TopKRouter(nn.Module):
    """Softmax top-k gate: ``x [T, H] -> (topk_idx [T, K] int64, topk_weights [T, K] float32)``.

    Args:
        hidden: H. num_experts: E. topk: K in ``[1, E]``.
        renormalize: renormalise the K weights to sum to 1 (default True).
        seed: initialisation seed (:func:`router_init`; identical on every rank).
        device: where the float32 gate weight ``weight [H, E]`` lives.

    Raises:
        ConfigError: sizes that are not positive ints or ``topk > num_experts``.
        InputError (forward): ``x`` is not ``[T, H]``.
    """

    def __init__(self, hidden: int, num_experts: int, topk: int, renormalize: bool = True, *, seed: int = 0,
                 device: torch.device | str | None = None):
        super().__init__()
        for name, v in (("hidden", hidden), ("num_experts", num_experts), ("topk", topk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"TopKRouter.{name} must be a positive int, got {v!r}")
        if topk > num_experts:
            raise ConfigError(f"TopKRouter.topk={topk} exceeds num_experts={num_experts}")
        self.hidden, self.num_experts, self.topk, self.renormalize = hidden, num_experts, topk, renormalize
        self.weight = nn.Parameter(router_init(hidden, num_experts, seed).to(device))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route ``x [T, H]`` (any float dtype; the gate runs in float32). See :func:`topk_softmax_torch`."""
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise InputError(f"router input must be [T, {self.hidden}], got shape {tuple(x.shape)}")
        logits = x.float() @ self.weight
        return topk_softmax_torch(logits, self.topk, self.renormalize)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, num_experts={self.num_experts}, topk={self.topk}, " \
               f"renormalize={self.renormalize}"
