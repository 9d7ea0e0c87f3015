"""Weight push / gradient pull for virtual experts over symmetric memory (graph-safe, no host sync).

Per step (every rank, same order):

* forward ``push``: rendezvous B1 (every rank finished with last step's slots) -> owners copy native expert weights
  into the peers' virtual slots (:func:`tritonep.kernels.transport.push_weights_kernel`) -> rendezvous B2 (every
  slot written) -> the expert GEMMs read the slots.
* backward ``pull``: each rank writes its slots' weight gradients into its symmetric gradient slots -> rendezvous B3
  -> owners add every holder's slot gradient to their native expert (fp32, holders in ascending rank order) ->
  rendezvous B4 (gradient slots may be rewritten).

:class:`PushWeights` wraps both as one autograd function: ``slots = PushWeights.apply(transport, placement, *w)``;
the gradient that reaches ``slots`` comes back to ``w`` through the pull. Weights are read from the tensors passed
in each call (never from cached addresses), so parameters that moved or were replaced are never used stale.

Idea: Megatron-LM / MoonEP virtual experts (weight push + grad reduce contracts); our kernels and protocol.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import triton

from ..errors import PlanError
from ..ep.launch import Launcher
from ..ep.status import raise_for_status, wait_bound
from ..kernels.transport import barrier_kernel, pull_grads_kernel, push_weights_kernel
from ..memory import Region, get_heap

__all__ = ["ExpertTransport", "PushWeights", "transport_regions"]


def transport_regions(world_size: int, num_local_experts: int, shapes: dict, dtype: torch.dtype):
    """Symmetric regions of an :class:`ExpertTransport` (slots and gradient slots per weight, flags)."""
    regs = [Region("flags", (4, world_size), torch.int64), Region("calls", (4,), torch.int64),
            Region("status", (8,), torch.int64)]
    for name, shp in shapes.items():
        regs.append(Region(f"slots_{name}", (num_local_experts, *shp), dtype))
        regs.append(Region(f"gslots_{name}", (num_local_experts, *shp), dtype))
    return regs


class ExpertTransport:
    """Virtual slots for the weights named in ``shapes`` (``name -> per-expert shape``) on every rank.

    Args:
        group: the EP group.
        num_experts: E (global); L = E / world_size native experts and L virtual slots per rank.
        shapes: e.g. ``{"w1": (H, 2*I), "w2": (I, H)}``.
        dtype: weight dtype; device: this rank's device.
        num_programs: grid of the copy kernels (default 1 on CPU, 64 on GPU).
    """

    def __init__(self, group, num_experts: int, shapes: dict, dtype=torch.bfloat16, device=None, num_programs=None):
        self.group = group
        self.rank, self.W = dist.get_rank(group), dist.get_world_size(group)
        if num_experts % self.W:
            raise PlanError(f"num_experts={num_experts} is not divisible by world_size={self.W}")
        self.E, self.L = num_experts, num_experts // self.W
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.buf = get_heap(group, self.device).allocate(transport_regions(self.W, self.L, self.shapes, dtype))
        self.flags, self.calls, self.status = (self.buf.local(n) for n in ("flags", "calls", "status"))
        self.tab = {n: self.buf.ptr_table(n) for n in ["flags"] + [f"{p}_{k}" for k in self.shapes
                                                                     for p in ("slots", "gslots")]}
        self.has_timer = self.device.type == "cuda"
        self.timeout = wait_bound(self.device)
        self.G = num_programs or (64 if self.device.type == "cuda" else 1)
        self.WB = max(2, triton.next_power_of_2(self.W))
        self._launch = Launcher(self.device, group)

    def _barrier(self, row: int):
        self.calls[row:row + 1].add_(1)
        self._launch(barrier_kernel, (1,), self.flags, self.tab["flags"], row * self.W * 8, self.calls, row,
                     self.status, self.timeout, 10 + row, RANK=self.rank, W=self.W, WB=self.WB,
                     HAS_TIMER=self.has_timer)

    def _check_weights(self, weights: dict):
        for k, shp in self.shapes.items():
            w = weights.get(k)
            if w is None or tuple(w.shape) != (self.L, *shp) or w.dtype != self.dtype or w.device != self.device:
                got = None if w is None else (tuple(w.shape), w.dtype, w.device)
                raise PlanError(f"weight {k!r} must be [{self.L}, {', '.join(map(str, shp))}] {self.dtype} on "
                                f"{self.device}, got {got}")

    def slots(self, name: str) -> torch.Tensor:
        """This rank's virtual slots of weight ``name``: ``[L, *shape]`` (valid after :meth:`push`)."""
        return self.buf.local(f"slots_{name}")

    def push(self, weights: dict, placement) -> dict:
        """Fill every rank's virtual slots from the owners' native weights; returns this rank's slot tensors."""
        self._check_weights(weights)
        etc = placement.experts_to_copy.to(torch.int32).contiguous()
        self._barrier(0)
        for k, shp in self.shapes.items():
            self._launch(push_weights_kernel, (self.G,), weights[k].contiguous(), self.tab[f"slots_{k}"], etc,
                         math.prod(shp), self.status, RANK=self.rank, W=self.W, L=self.L, BLOCK=1024)
        self._barrier(1)
        return {k: self.slots(k) for k in self.shapes}

    def pull(self, slot_grads: dict, placement) -> dict:
        """Given this rank's slot gradients, return each native expert's gradient from every holder (fp32 sum)."""
        slot_of = placement.expert_slot.to(torch.int32).contiguous()
        for k in self.shapes:
            g = slot_grads.get(k)
            dst = self.buf.local(f"gslots_{k}")
            if g is None:
                dst.zero_()
            else:
                dst.copy_(g)
        self._barrier(2)
        out = {}
        for k, shp in self.shapes.items():
            o = torch.empty(self.L, *shp, dtype=self.dtype, device=self.device)
            self._launch(pull_grads_kernel, (self.G,), o, self.tab[f"gslots_{k}"], slot_of, math.prod(shp),
                         self.status, RANK=self.rank, W=self.W, L=self.L, E=self.E, BLOCK=1024)
            out[k] = o
        self._barrier(3)
        return out

    def check(self):
        """Raise a recorded device error (timeout) on the host (one sync)."""
        raise_for_status(self.status.cpu(), self.rank, 0, "expert transport")

    def close(self):
        if self.buf is not None:
            self.buf.close()
            self.buf = None


class PushWeights(torch.autograd.Function):
    """``slots = PushWeights.apply(transport, placement, names, *weights)``: forward pushes, backward pulls."""

    @staticmethod
    def forward(ctx, transport, placement, names, *weights):
        ctx.transport, ctx.placement, ctx.names = transport, placement, names
        slots = transport.push(dict(zip(names, weights)), placement)
        return tuple(slots[k].clone() for k in names)

    @staticmethod
    def backward(ctx, *grads):
        extra = ctx.transport.pull({k: g for k, g in zip(ctx.names, grads) if g is not None}, ctx.placement)
        return (None, None, None, *[extra[k] for k in ctx.names])
