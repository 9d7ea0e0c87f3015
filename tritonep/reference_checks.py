"""The routing check every single-process oracle shares (:mod:`tritonep.reference`, :mod:`tritonep.reference_moe`)."""

from __future__ import annotations

from typing import Sequence

import torch

from .errors import ConfigError, InputError

__all__ = ["check_routing"]


def check_routing(
    topk_idxs: Sequence[torch.Tensor], topk_weights: Sequence[torch.Tensor] | None, num_experts: int, world_size: int
) -> tuple[int, int]:
    """Validate every rank's routing (the oracles' shared input check); returns ``(K, L)``.

    Raises:
        ConfigError: ``world_size`` not an int >= 1 or ``num_experts`` not a positive multiple of it.
        InputError: a list of the wrong length, a ``topk_idx`` not ``[T, K]`` int32/int64 or with ids outside
            ``[-1, num_experts)``, weights of another shape or not float, or K that differs across ranks.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(num_experts, int) or num_experts < 1 or num_experts % world_size != 0:
        raise ConfigError(f"num_experts={num_experts!r} must be a positive multiple of world_size={world_size}")
    if len(topk_idxs) != world_size:
        raise InputError(f"topk_idxs has {len(topk_idxs)} entries, expected world_size={world_size}")
    if topk_weights is not None and len(topk_weights) != world_size:
        raise InputError(f"topk_weights has {len(topk_weights)} entries, expected world_size={world_size}")
    ks = set()
    for r, idx in enumerate(topk_idxs):
        if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
            raise InputError(f"rank {r}: topk_idx must be [T, K] int32/int64, got {tuple(idx.shape)} {idx.dtype}")
        ks.add(idx.shape[1])
        if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= num_experts):
            raise InputError(
                f"rank {r}: topk_idx values must be in [-1, {num_experts}), "
                f"got min {int(idx.min())} max {int(idx.max())}"
            )
        if topk_weights is not None:
            w = topk_weights[r]
            if w.shape != idx.shape or not w.is_floating_point():
                raise InputError(
                    f"rank {r}: topk_weights must be float {tuple(idx.shape)}, got {tuple(w.shape)} {w.dtype}"
                )
    if len(ks) > 1:
        raise InputError(f"topk (K) differs across ranks: {[tuple(i.shape) for i in topk_idxs]}")
    return ks.pop(), num_experts // world_size
