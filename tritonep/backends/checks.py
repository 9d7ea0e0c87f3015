"""Host checks the backends share: naming a bad expert id the device found, and the counts exchanges' input rule."""

from __future__ import annotations

import torch

from ..errors import CapacityError, InputError

__all__ = ["check_expert_ids", "counts_input_refusal"]


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int):
    """Host check that every id is in [-1, num_experts) (one device->host read).

    Raises:
        InputError: naming the first offending value and its (token, k) position.
    """
    if topk_idx.numel() == 0:
        return
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        pos = torch.nonzero(bad)[0].tolist()
        val = int(topk_idx[pos[0], pos[1]])
        raise InputError(f"topk_idx[{pos[0]}, {pos[1]}] = {val} is outside [-1, num_experts={num_experts})")


def counts_input_refusal(topk_idx, topk: int, max_tokens_per_rank: int, device):
    """The error a counts exchange refuses ``topk_idx`` with (every backend's), or None when it is accepted.

    Returns:
        InputError: not an int32/int64 ``[T, topk]`` tensor on ``device``. CapacityError: ``T > max_tokens_per_rank``.
    """
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2 or topk_idx.shape[1] != topk \
            or topk_idx.dtype not in (torch.int32, torch.int64) or topk_idx.device != device:
        return InputError(f"topk_idx must be an int32/int64 [T, {topk}] tensor on {device}, got "
                          f"{tuple(getattr(topk_idx, 'shape', ()))} {getattr(topk_idx, 'dtype', type(topk_idx))}")
    if topk_idx.shape[0] > max_tokens_per_rank:
        return CapacityError(f"num_tokens={topk_idx.shape[0]} exceeds max_tokens_per_rank={max_tokens_per_rank}",
                             needed=topk_idx.shape[0], available=max_tokens_per_rank)
    return None
