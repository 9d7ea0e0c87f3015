"""Deterministic per-rank inputs for tests, benchmarks and soaks."""

from __future__ import annotations

import torch

__all__ = ["random_routing", "make_rank_inputs"]


def random_routing(num_tokens: int, num_experts: int, topk: int, seed: int, mask_frac: float = 0.0,
                   distinct: bool = True):
    """Random routing: ``topk_idx [T, K]`` int64 (distinct experts per token unless ``distinct=False``), a fraction
    ``mask_frac`` of slots set to -1, and positive float32 ``topk_weights [T, K]``."""
    g = torch.Generator().manual_seed(seed)
    if distinct and topk <= num_experts:
        idx = torch.argsort(torch.rand(num_tokens, num_experts, generator=g), dim=1)[:, :topk]
    else:
        idx = torch.randint(0, num_experts, (num_tokens, topk), generator=g)
    if mask_frac > 0:
        idx = torch.where(torch.rand(num_tokens, topk, generator=g) < mask_frac, torch.full_like(idx, -1), idx)
    w = torch.rand(num_tokens, topk, generator=g) + 0.05
    return idx.to(torch.int64), w.to(torch.float32)


def make_rank_inputs(rank: int, num_tokens: int, hidden: int, num_experts: int, topk: int, seed: int = 0,
                     mask_frac: float = 0.1, dtype=torch.bfloat16):
    """``(x [T, H], topk_idx [T, K], topk_weights [T, K])`` for one rank, deterministic in (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 1000003 + rank)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    idx, w = random_routing(num_tokens, num_experts, topk, seed * 7919 + rank, mask_frac)
    return x, idx, w
