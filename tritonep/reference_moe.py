"""The single-rank dense MoE oracle (fp32 SwiGLU experts): the end-to-end spec of :class:`tritonep.MoELayer`.

Public path: :func:`tritonep.reference.moe_dense_reference` (re-exported there; this module imports nothing of it).
"""

from __future__ import annotations

import torch

from .errors import InputError
from .reference_checks import check_routing

__all__ = ["moe_dense_reference"]


def moe_dense_reference(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Single-rank dense MoE forward in fp32 (the end-to-end oracle of the MoE layer).

    ``y[t] = sum_{k ascending, valid} w[t,k] * (silu(x[t] @ w1[e][:, :I]) * (x[t] @ w1[e][:, I:])) @ w2[e]`` with
    ``e = topk_idx[t, k]``: SwiGLU where the FIRST half of w1's output columns is the gate (goes through silu) and the
    SECOND half is the up projection. All math in fp32 (inputs are widened first); masked slots (-1) skipped.

    Args:
        x: ``[T, H]`` float. topk_idx: ``[T, K]`` int32/int64 in ``[-1, E)``. topk_weights: ``[T, K]`` float.
        w1: ``[E, H, 2I]`` float. w2: ``[E, I, H]`` float.

    Returns:
        ``[T, H]`` float32.

    Raises:
        InputError: shapes that do not agree or ids outside ``[-1, E)``.
    """
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise InputError(f"need x [T, H], w1 [E, H, 2I], w2 [E, I, H]; got {tuple(x.shape)}, {tuple(w1.shape)}, "
                         f"{tuple(w2.shape)}")
    t_n, hidden = x.shape
    num_experts, inter2 = w1.shape[0], w1.shape[2]
    inter = inter2 // 2
    if w1.shape[1] != hidden or inter2 % 2 or tuple(w2.shape) != (num_experts, inter, hidden):
        raise InputError(f"w1 {tuple(w1.shape)} / w2 {tuple(w2.shape)} do not fit hidden={hidden} (need [E, H, 2I], "
                         f"[E, I, H])")
    if topk_idx.shape[0] != t_n:
        raise InputError(f"topk_idx has {topk_idx.shape[0]} tokens, x has {t_n}")
    check_routing([topk_idx], [topk_weights], num_experts, 1)
    xf, w = x.float(), topk_weights.float()
    outs = torch.zeros(t_n, topk_idx.shape[1], hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_idx[topk_idx >= 0]).tolist():
        t, k = torch.nonzero(topk_idx == e, as_tuple=True)
        h = xf[t] @ w1[e].float()
        outs[t, k] = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].float()
    y = torch.zeros(t_n, hidden, dtype=torch.float32, device=x.device)
    for kk in range(topk_idx.shape[1]):
        valid = (topk_idx[:, kk] >= 0)[:, None]
        term = w[:, kk : kk + 1] * outs[:, kk]
        y = y + torch.where(valid, term, torch.zeros_like(term))
    return y
