"""Deterministic per-rank inputs for tests, benchmarks and soaks."""

from __future__ import annotations

import torch

__all__ = ["random_routing", "make_rank_inputs", "experts_for", "tokens_for", "script_for"]


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


def experts_for(num_experts: int, world_size: int) -> int:
    """``num_experts`` rounded up to a multiple of ``world_size`` (a test shape written for 2 ranks, at any world)."""
    return -(-num_experts // world_size) * world_size


def tokens_for(tokens: list, world_size: int) -> list:
    """Per-rank token counts of ``world_size`` ranks from a case's list, cycled: ``[13, 0]`` -> ``[13, 0, 13, 0]``."""
    return [tokens[r % len(tokens)] for r in range(world_size)]


def script_for(script: list, world_size: int) -> list:
    """A per-call token script (``script[i][r]`` = tokens of rank r in call i) widened to ``world_size`` ranks: rank
    r takes entry ``(r + r // n) % n`` of an ``n``-entry row, so each further copy of the row is rotated by one and
    the later ranks meet a different mix (``[8, 0]`` -> ``[8, 0, 0, 8]`` at W = 4, ``[8, 0, 0]`` at W = 3)."""
    return [[row[(r + r // len(row)) % len(row)] for r in range(world_size)] for row in script]
