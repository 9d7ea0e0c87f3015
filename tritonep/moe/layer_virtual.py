"""The virtual-expert steps of :class:`tritonep.MoELayer`'s forward (``balance='virtual'``; docs/moe.md).

Functions of the layer instance, moved out of layer.py to keep it one idea: plan the placement and remap the routes,
read the step's split facts once on the host, and cut the received rows into the native part and the used slots.
"""

from __future__ import annotations

import torch

from ..errors import PlanError
from .layer_parts import _Split

__all__ = ["plan_routes", "read_split", "row_parts"]


def plan_routes(layer, topk_idx: torch.Tensor):
    """Gather every rank's native expert histogram (the backend's counts exchange), plan the placement and remap
    this rank's routes to runtime ids in one Triton launch (:func:`tritonep.balance.plan`).

    Returns ``(placement, runtime topk_idx int64 [T, K])`` and sets ``layer.last_placement``.
    """
    from ..balance import plan

    counts = layer.counts_x.gather(topk_idx)
    placement, rt_idx = plan(counts, topk_idx, layer.rank)
    layer.last_placement = placement
    return placement, rt_idx.to(torch.int64)


def read_split(layer, offs: torch.Tensor, placement, given_idx=None) -> _Split:
    """One host read: the native/slot row boundary, the used slots, the held native experts, the placement's
    ``experts_to_copy`` (the nccl transport's split sizes) and the status words of the counts exchange, planner
    and transport, raised by :func:`tritonep.moe.layer_status.raise_balance_status` (its errors; ``given_idx``:
    this rank's global ids, to name a refused value).

    Raises:
        PlanError: also rows routed to a virtual slot the placement leaves unused (they would run no weights).
    """
    from ..balance.transport import used_slot_count
    from .layer_status import raise_balance_status

    L, W, lo = layer.num_local_experts, layer.world_size, layer.rank * layer.num_local_experts
    held = (placement.expert_slot[lo:lo + L] >= 0).any(dim=1)
    words = [layer.counts_x.status_words(), placement.status, layer.transport.status_words()]
    info = torch.cat([offs.to(torch.int64), placement.experts_to_copy.reshape(-1).to(torch.int64),
                      held.to(torch.int64)] + [w.reshape(-1).to(torch.int64) for w in words]).tolist()
    n_words = sum(w.numel() for w in words)
    info, status = info[:len(info) - n_words], info[len(info) - n_words:]
    raise_balance_status(layer, status, [w.numel() for w in words], given_idx)
    ends, held = info[:2 * L], info[2 * L + W * L:]
    etc = [info[2 * L + d * L:2 * L + (d + 1) * L] for d in range(W)]
    n = used_slot_count(etc[layer.rank])
    last = ends[L + n - 1] if n else ends[L - 1]
    if ends[-1] != last:
        raise PlanError(f"rank {layer.rank}: {ends[-1] - last} rows routed to virtual slots >= {n}, which the "
                        f"placement leaves unused (experts_to_copy[{layer.rank}]={etc[layer.rank]}, "
                        f"expert_offsets={ends})")
    return _Split(native_end=ends[L - 1], num_used=n, held=[j for j, h in enumerate(held) if h],
                  experts_to_copy=etc)


def row_parts(layer, d, split: _Split | None):
    """``(bounds, offs)`` of the split run: one part without virtual experts, else native rows then used slots."""
    rows, offs = d.x.shape[0], d.expert_offsets
    if split is None:
        return [0, rows], (offs,)
    L, ne = layer.num_local_experts, split.native_end
    return [0, ne, rows], (offs[:L], offs[L:L + split.num_used] - ne)
