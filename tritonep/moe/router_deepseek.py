"""DeepSeek-V3's router: sigmoid scores, a selection-only correction bias, group-limited top-k, scaled weights; and
the aux-loss-free bias update that keeps its experts balanced.

For ``x [T, H]`` and the float32 gate ``weight [E, H]``::

    scores  = sigmoid(x @ W^T)                        # [T, E] float32, each in (0, 1)
    choice  = scores + e_score_correction_bias        # used to SELECT only (no gradient through the bias)
    # group-limited routing (n_group > 1): E experts in n_group equal groups; a group's score is the sum of its two
    # best `choice` values; each token keeps its topk_group best groups and picks its K experts inside them
    topk_idx     = top-K of choice (masked to the kept groups)
    topk_weights = scores[topk_idx]                   # the unbiased scores
    topk_weights /= topk_weights.sum(-1) + 1e-20      # if norm_topk_prob
    topk_weights *= routed_scaling_factor

Aux-loss-free balancing (DeepSeek-V3 report, section 2.1.2): while training, the router counts how many routes each
expert got (``tokens_per_expert``, float32 ``[E]``, not saved in checkpoints); :func:`update_router_biases` (once per
optimizer step, on every rank of the group that shares the router) sums the counts over that group and moves every
bias by ``bias_update_rate`` towards balance: ``bias[e] += rate * sign(mean_load - load[e])``, then clears the
counts. Only the sign of each expert's deviation matters, so a forward that runs twice (activation recompute) doubles
every count and leaves the update unchanged. The bias is a persistent buffer: it is saved and loaded with the model.

Idea sources: DeepSeek-V3 technical report (arXiv 2412.19437, sections 2.1.2 and 4.2); transformers'
``DeepseekV3TopkRouter`` (tests/moe/test_hf_equality.py holds ours equal to it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from .router import RouterOutput, check_router_sizes, gate_logits, router_init

__all__ = ["DeepSeekV3Router", "deepseek_v3_topk_torch", "update_router_biases"]


def deepseek_v3_topk_torch(logits: torch.Tensor, bias: torch.Tensor, topk: int, n_group: int = 1,
                           topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing of ``logits [T, E]`` (float32) with correction ``bias [E]`` (pure torch; the spec).

    Returns:
        ``(topk_idx [T, K] int64, topk_weights [T, K] float32, scores [T, E] float32)``; the weights carry autograd
        to ``logits`` (through the sigmoid scores, never through ``bias``). The K slots of a token are in descending
        order of the biased score.

    Raises:
        ConfigError: ``n_group`` does not split E into groups of >= 2 experts, ``topk_group > n_group``, or K exceeds
            the experts of the kept groups.
    """
    T, E = logits.shape
    if n_group < 1 or E % n_group or (n_group > 1 and E // n_group < 2) or not 1 <= topk_group <= n_group:
        raise ConfigError(f"n_group={n_group} / topk_group={topk_group} do not fit num_experts={E}")
    if not 1 <= topk <= topk_group * (E // n_group):
        raise ConfigError(f"topk={topk} exceeds the experts of topk_group={topk_group} groups of {E // n_group}")
    scores = torch.sigmoid(logits.float())
    choice = scores.detach() + bias.detach().float()
    if n_group > 1:
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    topk_idx = choice.topk(topk, dim=-1).indices
    topk_weights = scores.gather(1, topk_idx)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * routed_scaling_factor
    return topk_idx, topk_weights.contiguous(), scores


class DeepSeekV3Router(nn.Module):
    """DeepSeek-V3 gate: ``x [T, H] -> (topk_idx [T, K] int64, topk_weights [T, K] float32)`` (module docstring).

    Args:
        hidden: H. num_experts: E. topk: K.
        n_group, topk_group: group-limited routing (1 / 1: none). norm_topk_prob: renormalise the K weights.
        routed_scaling_factor: multiplies the final weights (DeepSeek-V3: 2.5).
        bias_update_rate: the aux-loss-free update speed (0: counts are not kept, the bias stays as loaded).
        seed: initialisation seed (:func:`tritonep.moe.router.router_init`). device: where weight and buffers live.

    State: parameter ``weight [E, H]`` float32; buffers ``e_score_correction_bias [E]`` float32 (persistent, zeros
    at start) and ``tokens_per_expert [E]`` float32 (not persistent; routes counted while training).

    Raises:
        ConfigError: bad sizes or group options (as :func:`deepseek_v3_topk_torch`), a negative rate.
        InputError (forward): ``x`` is not ``[T, H]``.
    """

    def __init__(self, hidden: int, num_experts: int, topk: int, *, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, bias_update_rate: float = 0.0,
                 seed: int = 0, device: torch.device | str | None = None):
        super().__init__()
        check_router_sizes("DeepSeekV3Router", hidden, num_experts, topk)
        self.hidden, self.num_experts, self.topk = hidden, num_experts, topk
        self.n_group, self.topk_group, self.norm_topk_prob = n_group, topk_group, bool(norm_topk_prob)
        self.routed_scaling_factor = float(routed_scaling_factor)
        if not bias_update_rate >= 0:
            raise ConfigError(f"DeepSeekV3Router.bias_update_rate={bias_update_rate!r} must be >= 0")
        self.bias_update_rate = float(bias_update_rate)
        deepseek_v3_topk_torch(torch.zeros(0, num_experts), torch.zeros(num_experts), topk, n_group, topk_group)
        self.weight = nn.Parameter(router_init(hidden, num_experts, seed).to(device))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32, device=device),
                             persistent=False)

    def route(self, x: torch.Tensor) -> RouterOutput:
        """Route ``x [T, H]`` (module docstring); while training with a bias update rate, count the routes."""
        logits = gate_logits(self, x)
        idx, w, scores = deepseek_v3_topk_torch(logits, self.e_score_correction_bias, self.topk, self.n_group,
                                                self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)
        if self.training and self.bias_update_rate > 0:
            with torch.no_grad():
                self.tokens_per_expert.index_add_(0, idx.reshape(-1),
                                                  torch.ones(idx.numel(), dtype=torch.float32, device=idx.device))
        probs = scores / scores.sum(dim=-1, keepdim=True)  # DeepSeek-V3's normalised scores (its balance loss)
        return RouterOutput(idx, w, logits, probs)

    def forward(self, x: torch.Tensor, full: bool = False):
        """``(topk_idx, topk_weights)`` of :meth:`route`, or the whole :class:`RouterOutput` with ``full=True`` (what
        the layer calls: through ``__call__``, so module hooks, e.g. FSDP's unsharding, run)."""
        out = self.route(x)
        return out if full else (out.topk_idx, out.topk_weights)

    @torch.no_grad()
    def apply_bias_update(self, total_tokens_per_expert: torch.Tensor) -> None:
        """``bias += rate * sign(mean - load)`` from the group-wide counts ``[E]``, then clear the local counts."""
        load = total_tokens_per_expert.float()
        self.e_score_correction_bias.add_(self.bias_update_rate * torch.sign(load.mean() - load))
        self.tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, num_experts={self.num_experts}, topk={self.topk}, n_group={self.n_group}, "
                f"topk_group={self.topk_group}, norm_topk_prob={self.norm_topk_prob}, "
                f"routed_scaling_factor={self.routed_scaling_factor}, bias_update_rate={self.bias_update_rate}")


@torch.no_grad()
def update_router_biases(model: nn.Module, group=None) -> int:
    """Aux-loss-free balancing step for every :class:`DeepSeekV3Router` of ``model`` with a positive rate.

    Sums every such router's ``tokens_per_expert`` over ``group`` (one ``all_reduce`` for all routers together; None:
    the default group; no collective when torch.distributed is not initialised), updates its bias and clears its
    counts.
    Call it once per optimizer step on every rank of the group that shares the routers (data x expert parallel:
    the whole world), at the same point on every rank (one collective; docs/protocols.md host protocol rule).

    Returns:
        the number of routers updated.
    """
    routers = [m for m in model.modules() if isinstance(m, DeepSeekV3Router) and m.bias_update_rate > 0]
    if not routers:
        return 0
    flat = torch.cat([r.tokens_per_expert for r in routers])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flat, group=group)
    for r, counts in zip(routers, flat.split([r.num_experts for r in routers])):
        r.apply_bias_update(counts)
    return len(routers)
