"""Virtual-expert weight transport as autograd: push the weights forward, pull their gradients back.

The data movement lives with the backends (imports go one way: ep -> balance): every backend has an expert transport
(:class:`tritonep.backends.ExpertTransport`; triton: :class:`tritonep.backends.triton.expert_transport.ExpertTransport`
over symmetric memory, nccl: :class:`tritonep.backends.nccl.expert_transport.NcclExpertTransport` over all_to_all), built with
:meth:`tritonep.EPBuffer.expert_transport`. This module adds the autograd function :class:`PushWeights` and the host
helper :func:`used_slot_count`; the MoE layer calls push / pull directly from its one forward and backward.

Idea: Megatron-LM / MoonEP virtual experts (weight push + grad reduce contracts); our code.
"""

from __future__ import annotations

import torch

__all__ = ["PushWeights", "used_slot_count"]


class PushWeights(torch.autograd.Function):
    """``slots = PushWeights.apply(transport, placement, names, *weights)``: forward pushes, backward pulls.

    ``transport``: any backend's expert transport; ``weights``: ``[L, *shape]`` each, in ``names`` order. Forward
    returns copies of all L slots per weight; backward returns the dense pulled gradient ``[L, *shape]`` per weight
    (``pull`` into zeros: the sum of every holder's slot gradient for the experts some peer held, zeros elsewhere).
    """

    @staticmethod
    def forward(ctx, transport, placement, names, *weights):
        """Push ``weights``; returns copies of all L slots per weight."""
        ctx.transport, ctx.placement, ctx.names = transport, placement, names
        slots = transport.push(dict(zip(names, weights)), placement)
        return tuple(slots[k].clone() for k in names)

    @staticmethod
    def backward(ctx, *grads):
        """Pull the slots' gradients (``[L, *shape]``; None = zero) back to the owners: dense native gradients."""
        extra = ctx.transport.pull({k: g for k, g in zip(ctx.names, grads) if g is not None}, ctx.placement)
        return (None, None, None, *[extra[k] for k in ctx.names])


def used_slot_count(experts_to_copy_row) -> int:
    """Slots a rank uses: ``1 + the highest s with experts_to_copy[rank, s] >= 0`` (0 when none); a host list.

    The planner fills slots from 0 upward (``tritonep.balance.placement`` step 4), so this equals the number of
    used slots; taking the highest index keeps the count right for any placement that leaves holes.
    """
    used = [s for s, e in enumerate(experts_to_copy_row) if int(e) >= 0]
    return used[-1] + 1 if used else 0
