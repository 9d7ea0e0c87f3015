"""Routers (the gate of an MoE layer): softmax top-k here, DeepSeek-V3's in :mod:`tritonep.moe.router_deepseek`.

Every router is an ``nn.Module`` with a float32 gate ``weight [E, H]`` (the ``nn.Linear(H, E, bias=False)`` layout
of transformers, Megatron-LM and torchtitan, so a model's gate copies in unchanged) and two calls:

* ``router(x) -> (topk_idx [T, K] int64, topk_weights [T, K] float32)``;
* ``router(x, full=True)`` (or ``router.route(x)``) ``-> RouterOutput`` with, besides those two, ``logits [T, E]``
  (float32) and ``probs [T, E]`` (float32, rows summing to 1: what the switch-style aux loss,
  :func:`tritonep.moe.switch_aux_loss`, averages).

The routing weights are differentiable w.r.t. the gate weight and ``x``; the chosen ids are not. No router reads
anything back to the host (the layer's forward keeps its host reads to the dispatch's own; docs/moe.md).

Softmax top-k (:func:`topk_softmax_torch`, :class:`TopKRouter`): ``probs = softmax(x @ W^T)`` in float32, the K
largest probabilities are chosen (ties go to the lower expert id), optionally renormalised to sum to 1 per token
(``norm_topk_prob``), then multiplied by ``routed_scaling_factor``. Mixtral renormalises always; Qwen2-MoE /
Qwen3-MoE / OLMoE follow ``config.norm_topk_prob`` (OLMoE-1B-7B: False).

Idea source: the Switch / Mixtral style softmax top-k gate, as written in transformers' ``MixtralTopKRouter`` /
``Qwen3MoeTopKRouter`` / ``OlmoeTopKRouter`` (tests/moe/test_hf_equality.py holds ours equal to them).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, InputError

__all__ = ["RouterOutput", "TopKRouter", "topk_softmax_torch", "router_init"]


class RouterOutput(NamedTuple):
    """What :meth:`TopKRouter.route` / :meth:`tritonep.moe.DeepSeekV3Router.route` return.

    Attributes:
        topk_idx: ``[T, K]`` int64 chosen experts. topk_weights: ``[T, K]`` float32 routing weights (autograd).
        logits: ``[T, E]`` float32 ``x @ W^T`` (autograd). probs: ``[T, E]`` float32 per-token distribution over
            experts (softmax; for sigmoid scores, the scores divided by their sum), for the aux loss.
    """

    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor


def topk_softmax_torch(logits: torch.Tensor, topk: int, renormalize: bool = True, scale: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k over the last dimension (pure torch; the softmax router's spec).

    Args:
        logits: ``[T, E]`` float (computed in float32).
        topk: K, ``1 <= K <= E``.
        renormalize: divide the K chosen probabilities by their sum (``norm_topk_prob``).
        scale: multiply the final weights (``routed_scaling_factor``; 1.0 leaves them unchanged bit for bit).

    Returns:
        ``(topk_idx [T, K] int64, topk_weights [T, K] float32)``, highest probability first; among equal
        probabilities the lower expert id comes first (a stable descending sort). ``topk_weights`` carries autograd
        back to ``logits``.

    Raises:
        InputError: ``logits`` is not 2-D or ``topk`` is outside ``[1, E]``.
    """
    idx, w, _ = _softmax_topk(logits, topk, renormalize, scale)
    return idx, w


def _softmax_topk(logits, topk, renormalize, scale):
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
    if scale != 1.0:
        topk_weights = topk_weights * scale
    return topk_idx, topk_weights.contiguous(), probs


def router_init(hidden: int, num_experts: int, seed: int) -> torch.Tensor:
    """Deterministic gate weight ``[num_experts, hidden]`` float32, ``N(0, 1/hidden)``, from ``seed`` alone (the same
    on every rank, on every device: drawn on the CPU)."""
    g = torch.Generator().manual_seed(int(seed) * 7919 + 17)
    return (torch.randn(hidden, num_experts, generator=g, dtype=torch.float32) / math.sqrt(hidden)).t().contiguous()


def check_router_sizes(owner: str, hidden, num_experts, topk) -> None:
    """ConfigError unless hidden / num_experts / topk are positive ints with ``topk <= num_experts``."""
    for name, v in (("hidden", hidden), ("num_experts", num_experts), ("topk", topk)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{owner}.{name} must be a positive int, got {v!r}")
    if topk > num_experts:
        raise ConfigError(f"{owner}.topk={topk} exceeds num_experts={num_experts}")


def gate_logits(router: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x [T, H] -> x @ W^T [T, E]`` in float32 (``F.linear``, the op of the reference models). Raises InputError
    when ``x`` is not ``[T, H]``."""
    if x.dim() != 2 or x.shape[1] != router.hidden:
        raise InputError(f"router input must be [T, {router.hidden}], got shape {tuple(x.shape)}")
    return F.linear(x.float(), router.weight.float())


class TopKRouter(nn.Module):
    """Softmax top-k gate: ``x [T, H] -> (topk_idx [T, K] int64, topk_weights [T, K] float32)``.

    Args:
        hidden: H. num_experts: E. topk: K in ``[1, E]``.
        renormalize: renormalise the K weights to sum to 1 (``norm_topk_prob``; default True).
        routed_scaling_factor: multiplies the final weights (default 1.0).
        seed: initialisation seed (:func:`router_init`; identical on every rank).
        device: where the float32 gate weight ``weight [E, H]`` lives.

    Raises:
        ConfigError: sizes that are not positive ints or ``topk > num_experts``.
        InputError (forward): ``x`` is not ``[T, H]``.
    """

    def __init__(self, hidden: int, num_experts: int, topk: int, renormalize: bool = True, *,
                 routed_scaling_factor: float = 1.0, seed: int = 0, device: torch.device | str | None = None):
        super().__init__()
        check_router_sizes("TopKRouter", hidden, num_experts, topk)
        self.hidden, self.num_experts, self.topk, self.renormalize = hidden, num_experts, topk, renormalize
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(router_init(hidden, num_experts, seed).to(device))

    def route(self, x: torch.Tensor) -> RouterOutput:
        """Route ``x [T, H]`` (any float dtype; the gate runs in float32). See :func:`topk_softmax_torch`."""
        logits = gate_logits(self, x)
        idx, w, probs = _softmax_topk(logits, self.topk, self.renormalize, self.routed_scaling_factor)
        return RouterOutput(idx, w, logits, probs)

    def forward(self, x: torch.Tensor, full: bool = False):
        """``(topk_idx, topk_weights)`` of :meth:`route`, or the whole :class:`RouterOutput` with ``full=True`` (what
        the layer calls: through ``__call__``, so module hooks, e.g. FSDP's unsharding, run)."""
        out = self.route(x)
        return out if full else (out.topk_idx, out.topk_weights)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, num_experts={self.num_experts}, topk={self.topk}, " \
               f"renormalize={self.renormalize}, routed_scaling_factor={self.routed_scaling_factor}"
