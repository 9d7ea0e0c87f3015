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
It returns copies of all L slots and a dense ``[L, ...]`` pulled gradient per weight.

:class:`PushUsedSlots` is the variant the MoE layer uses: given two host facts of the step (how many slots this rank
uses, which of its native experts a peer runs) it returns zero-copy views of the used slots only, and its backward
adds the pulled gradients into the native gradient in place, only for the experts a peer ran. Per step and weight it
moves: push ``M`` expert copies (M = used slots over the group), slot-gradient staging ``num_used`` experts, and on
ranks with at least one expert run elsewhere the pull kernel's dense ``[L, ...]`` output (it writes all L experts,
zeros for the rest; a kernel-side limit) plus one add per held expert.

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

__all__ = ["ExpertTransport", "PushWeights", "PushUsedSlots", "used_slot_count", "transport_regions"]


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

    def slot_views(self, num_used: int) -> dict:
        """Zero-copy ``[num_used, *shape]`` views of this rank's first ``num_used`` slots, one per weight name.

        The views are storage aliases (own version counter, no autograd view relation to the symmetric buffer);
        the next :meth:`push` overwrites their memory.

        Raises:
            PlanError: ``num_used`` outside ``[0, L]``.
        """
        if not 0 <= int(num_used) <= self.L:
            raise PlanError(f"num_used={num_used} outside [0, {self.L}]")
        out = {}
        for k in self.shapes:
            t = self.slots(k)[:int(num_used)]
            out[k] = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                                        t.shape, t.stride())
        return out

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

    def pull_add(self, native_grads: dict, slot_grads: dict, placement, num_used: int, held) -> dict:
        """Collective backward of :class:`PushUsedSlots`: add every holder's slot gradient to this rank's natives.

        Args:
            native_grads: ``name -> [L, *shape]`` gradient of this rank's native weights from its own GEMMs, or None
                (then zeros are made if needed). Updated IN PLACE for the experts in ``held``.
            slot_grads: ``name -> [num_used, *shape]`` gradient of this rank's used slots (missing or None = zero).
            placement: the step's :class:`tritonep.balance.Placement` (identical on every rank).
            num_used: slots this rank used this step (slots ``>= num_used`` are unused: no peer reads them).
            held: host list of this rank's native expert indices ``j`` (``0 <= j < L``) that some peer held in a
                slot this step (``expert_slot[rank*L + j, d] >= 0`` for some d). Empty: the pull kernel is skipped
                (the rendezvous still runs).

        Returns:
            ``name -> [L, *shape]`` native gradient, or None where it was None and ``held`` is empty.
            ``grad[j] += bf16(fp32 sum over holders d ascending of slot_grad_d)`` for ``j`` in ``held`` (the sum is
            that of :meth:`pull`, the add rounds once in the weight dtype, as autograd's accumulation would).

        Raises:
            PlanError: ``num_used`` outside ``[0, L]``, a slot gradient of the wrong shape, ``held`` out of range.
        """
        n = int(num_used)
        if not 0 <= n <= self.L:
            raise PlanError(f"num_used={num_used} outside [0, {self.L}]")
        held = [int(j) for j in held]
        if any(not 0 <= j < self.L for j in held):
            raise PlanError(f"held={held} has an index outside [0, {self.L})")
        for k, shp in self.shapes.items():
            g = slot_grads.get(k)
            dst = self.buf.local(f"gslots_{k}")[:n]
            if g is None:
                dst.zero_()
            elif tuple(g.shape) != (n, *shp):
                raise PlanError(f"slot gradient {k!r} must be [{n}, {', '.join(map(str, shp))}], got {tuple(g.shape)}")
            else:
                dst.copy_(g)
        self._barrier(2)
        out = dict(native_grads)
        if held:
            slot_of = placement.expert_slot.to(torch.int32).contiguous()
            for k, shp in self.shapes.items():
                o = torch.empty(self.L, *shp, dtype=self.dtype, device=self.device)
                self._launch(pull_grads_kernel, (self.G,), o, self.tab[f"gslots_{k}"], slot_of, math.prod(shp),
                             self.status, RANK=self.rank, W=self.W, L=self.L, E=self.E, BLOCK=1024)
                g = out.get(k)
                if g is None:
                    g = torch.zeros(self.L, *shp, dtype=self.dtype, device=self.device)
                for j in held:  # one add per held expert: 3 * len(held) experts of traffic, nothing else
                    g[j].add_(o[j])
                out[k] = g
        self._barrier(3)
        return {k: out.get(k) for k in self.shapes}

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


def used_slot_count(experts_to_copy_row) -> int:
    """Slots a rank uses: ``1 + the highest s with experts_to_copy[rank, s] >= 0`` (0 when none); a host list.

    The planner fills slots from 0 upward (``tritonep.balance.placement`` step 4), so this equals the number of
    used slots; taking the highest index keeps the count right for any placement that leaves holes.
    """
    used = [s for s, e in enumerate(experts_to_copy_row) if int(e) >= 0]
    return used[-1] + 1 if used else 0


class PushUsedSlots(torch.autograd.Function):
    """``(*w_out, *slots) = PushUsedSlots.apply(transport, placement, names, num_used, held, *weights)``.

    Forward: :meth:`ExpertTransport.push` (copies only the used slots of every rank), then returns the weights
    themselves (``w_out``, for the native experts' GEMMs: no copy) and zero-copy views of this rank's first
    ``num_used`` slots (:meth:`ExpertTransport.slot_views`). Backward: :meth:`ExpertTransport.pull_add`: the
    gradients reaching ``w_out`` are updated in place with the slot gradients pulled from the peers (only for the
    experts in ``held``) and returned as the weights' gradients, so no dense pulled gradient is accumulated.

    ``num_used`` and ``held`` are host facts of the step (see :func:`used_slot_count` and
    :meth:`ExpertTransport.pull_add`). The slot views are valid until the next push: run this step's backward
    before the next forward that pushes (the MoE layer enforces it). ``w_out`` must only feed consumers whose
    gradients are fresh tensors (the layer's expert GEMMs), since they are modified in place.
    """

    @staticmethod
    def forward(ctx, transport, placement, names, num_used, held, *weights):
        ctx.transport, ctx.placement, ctx.names = transport, placement, tuple(names)
        ctx.num_used, ctx.held = int(num_used), list(held)
        transport.push(dict(zip(names, weights)), placement)
        views = transport.slot_views(num_used)
        return (*weights, *(views[k] for k in names))

    @staticmethod
    def backward(ctx, *grads):
        n = len(ctx.names)
        out = ctx.transport.pull_add(dict(zip(ctx.names, grads[:n])), dict(zip(ctx.names, grads[n:])),
                                     ctx.placement, ctx.num_used, ctx.held)
        return (None, None, None, None, None, *[out[k] for k in ctx.names])
