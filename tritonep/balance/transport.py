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
adds the pulled gradients into the native gradient in place, only for the experts a peer ran (the pull kernel decides
that on the device, so every rank launches the same kernels whatever it holds: DESIGN.md §6a). Per step and weight it
moves: push ``M`` expert copies (M = used slots over the group), slot-gradient staging ``num_used`` experts, and the
in-place add: per held expert its holders' slot gradients read once and the native gradient read and written once.

Host protocol (identical on every rank, whatever T, the placement, the used slots or the held experts): push =
barrier B1, one push launch per weight, barrier B2; pull / pull_add = barrier B3, one pull launch per weight,
barrier B4 (all on a grid of ``num_programs``). No host collective runs inside a call.

Torch twins: :func:`pull_add_torch` (and :func:`pull_torch`) give the exact bits of the pull from every rank's slot
gradients on one process.

Idea: Megatron-LM / MoonEP virtual experts (weight push + grad reduce contracts); our kernels and protocol.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import triton

from ..errors import PlanError
from ..ep.launch import Launcher
from ..ep.status import raise_for_status, resolve_timeout, wait_bound
from ..kernels import protocol as P
from ..kernels.transport import barrier_kernel, pull_grads_kernel, push_weights_kernel
from ..memory import Region, get_heap

__all__ = ["ExpertTransport", "PushWeights", "PushUsedSlots", "used_slot_count", "transport_regions", "pull_add_torch",
           "pull_torch"]


def transport_regions(world_size: int, num_local_experts: int, shapes: dict, dtype: torch.dtype):
    """Symmetric regions of an :class:`ExpertTransport` (slots and gradient slots per weight, flags)."""
    regs = [Region("flags", (P.NUM_RENDEZVOUS, world_size), torch.int64),
            Region("calls", (P.v(P.NUM_CALLS),), torch.int64), Region("status", (P.v(P.STATUS_WORDS),), torch.int64)]
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
        dtype: weight dtype (bf16 or fp32); device: this rank's device.
        num_programs: grid of the copy kernels (default 1 on CPU, 64 on GPU).
        timeout_s: bound of the in-kernel rendezvous waits in seconds (default: ``TRITONEP_TIMEOUT_S``).

    On a GPU every kernel variant is compiled at construction (before the heap's construction barrier), so no call
    ever compiles (DESIGN.md §6a).

    Raises:
        PlanError: ``num_experts`` not divisible by the world size.
        ConfigError: a ``timeout_s`` that is not a positive number.
    """

    def __init__(self, group, num_experts: int, shapes: dict, dtype=torch.bfloat16, device=None, num_programs=None,
                 timeout_s: float | None = None):
        self.group = group
        self.rank, self.W = dist.get_rank(group), dist.get_world_size(group)
        if num_experts % self.W:
            raise PlanError(f"num_experts={num_experts} is not divisible by world_size={self.W}")
        self.E, self.L = num_experts, num_experts // self.W
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.has_timer = self.device.type == "cuda"
        self.timeout_s = resolve_timeout(timeout_s)
        self.timeout = wait_bound(self.device, self.timeout_s)
        self.G = num_programs or (64 if self.device.type == "cuda" else 1)
        self.WB = max(2, triton.next_power_of_2(self.W))
        self._launch = Launcher(self.device, group)
        # the pull kernel's target when a rank has no native gradient and holds nothing (num_targets = 0: untouched)
        self._dummy = torch.zeros(1, dtype=dtype, device=self.device)
        self._precompile()
        self.buf = get_heap(group, self.device).allocate(transport_regions(self.W, self.L, self.shapes, dtype))
        self.flags, self.calls, self.status = (self.buf.local(n) for n in ("flags", "calls", "status"))
        self.tab = {n: self.buf.ptr_table(n) for n in ["flags"] + [f"{p}_{k}" for k in self.shapes
                                                                     for p in ("slots", "gslots")]}

    def _precompile(self):
        """GPU: compile every kernel variant a call can launch (barrier, push and pull per weight dtype), with
        stand-in tensors of the real dtypes, before the construction barrier. No-op on CPU (interpreter)."""
        precompile = getattr(self._launch, "precompile", None)
        if precompile is None or self.device.type != "cuda":
            return
        dev, W, E, L = self.device, self.W, self.E, self.L
        i64 = torch.zeros(max(8, W), dtype=torch.int64, device=dev)
        slot_of = torch.full((E, W), -1, dtype=torch.int32, device=dev)
        etc = torch.full((W, L), -1, dtype=torch.int32, device=dev)
        w = torch.zeros(L, 1, dtype=self.dtype, device=dev)
        with precompile() as on:
            if on:
                self._launch(barrier_kernel, (1,), i64, i64, 0, i64, 0, i64, self.timeout, P.v(P.WAIT_RENDEZVOUS),
                             RANK=self.rank, W=W, WB=self.WB, HAS_TIMER=self.has_timer)
                self._launch(push_weights_kernel, (self.G,), w, i64, etc, 1, i64, RANK=self.rank, W=W, L=L,
                             BLOCK=1024)
                self._launch(pull_grads_kernel, (self.G,), w, 0, i64, slot_of, 1, i64, RANK=self.rank, W=W, L=L,
                             E=E, BLOCK=1024)

    def _barrier(self, row: int):
        """Rendezvous ``row`` (0..3 = B1..B4) of every rank: one barrier_kernel launch, bounded wait, no host sync."""
        self.calls[row:row + 1].add_(1)
        self._launch(barrier_kernel, (1,), self.flags, self.tab["flags"], P.flag_row_bytes(row, self.W), self.calls, row,
                     self.status, self.timeout, P.v(P.WAIT_RENDEZVOUS) + row, RANK=self.rank, W=self.W, WB=self.WB,
                     HAS_TIMER=self.has_timer)

    def _check_weights(self, weights: dict):
        """Raise PlanError unless every named weight is ``[L, *shape]`` in the transport's dtype and device."""
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
        """Collective: return each native expert's gradient summed over every peer that held it.

        Args:
            slot_grads: ``name -> [L, *shape]`` gradient of ALL this rank's slots (missing or None = zero).
            placement: the step's placement (identical on every rank).

        Returns:
            ``name -> [L, *shape]`` (weight dtype): ``DT(fp32 sum over holders d ascending of slot_grad_d)`` for
            the experts some peer held, zeros for the rest (:func:`pull_torch`). Same launches as
            :meth:`pull_add` (it is :meth:`pull_add` into zeros).
        """
        zeros = {k: torch.zeros(self.L, *shp, dtype=self.dtype, device=self.device) for k, shp in self.shapes.items()}
        return self.pull_add(zeros, slot_grads, placement, self.L, ())

    def pull_add(self, native_grads: dict, slot_grads: dict, placement, num_used: int, held=()) -> dict:
        """Collective backward of :class:`PushUsedSlots`: add every holder's slot gradient to this rank's natives.

        Every rank runs the same launches whatever its data: barrier B3, one pull launch per weight, barrier B4
        (DESIGN.md §6a). Which native experts receive a pulled sum is decided on the device from
        ``placement.expert_slot``; the others are left untouched (no dense temporary, no host loop).

        Args:
            native_grads: ``name -> [L, *shape]`` contiguous gradient of this rank's native weights from its own
                GEMMs (weight dtype, this device), or None / missing. Updated IN PLACE for the experts some peer held.
            slot_grads: ``name -> [num_used, *shape]`` gradient of this rank's first ``num_used`` slots (missing or
                None = zero).
            placement: the step's :class:`tritonep.balance.Placement` (identical on every rank).
            num_used: slots this rank used this step (slots ``>= num_used`` are unused: no peer reads them).
            held: host list of this rank's native expert indices ``j`` (``0 <= j < L``) that some peer held in a
                slot this step. Only decides what a missing native gradient becomes: zeros when ``held`` is not
                empty, else it stays None (the pull launch then gets a stand-in target and does nothing).

        Returns:
            ``name -> [L, *shape]`` native gradient (the tensor passed in, updated in place), or None where it was
            None and ``held`` is empty. For every expert j some peer held:
            ``grad[j] = DT(float(grad[j]) + float(DT(fp32 sum over holders d ascending of slot_grad_d)))``, the add
            torch's DT accumulation would do (:func:`pull_add_torch` gives the same bits).

        Raises:
            PlanError: ``num_used`` outside ``[0, L]``, a slot or native gradient of the wrong shape / dtype /
                device, ``held`` out of range. Raised before any launch (a rank that raises here leaves its peers
                waiting in B3 until the bounded wait expires).
        """
        n = int(num_used)
        if not 0 <= n <= self.L:
            raise PlanError(f"num_used={num_used} outside [0, {self.L}]")
        held = [int(j) for j in held]
        if any(not 0 <= j < self.L for j in held):
            raise PlanError(f"held={held} has an index outside [0, {self.L})")
        targets = {}
        for k, shp in self.shapes.items():
            g = native_grads.get(k)
            if g is None:
                g = torch.zeros(self.L, *shp, dtype=self.dtype, device=self.device) if held else None
            elif tuple(g.shape) != (self.L, *shp) or g.dtype != self.dtype or g.device != self.device:
                raise PlanError(f"native gradient {k!r} must be [{self.L}, {', '.join(map(str, shp))}] {self.dtype} "
                                f"on {self.device}, got {(tuple(g.shape), g.dtype, g.device)}")
            elif not g.is_contiguous():
                g = g.contiguous()  # the kernel adds into a dense [L, N] block (autograd's GEMM grads already are)
            targets[k] = g
            sg = slot_grads.get(k)
            dst = self.buf.local(f"gslots_{k}")[:n]
            if sg is None:
                dst.zero_()
            elif tuple(sg.shape) != (n, *shp):
                raise PlanError(f"slot gradient {k!r} must be [{n}, {', '.join(map(str, shp))}], got "
                                f"{tuple(sg.shape)}")
            else:
                dst.copy_(sg)
        slot_of = placement.expert_slot.to(device=self.device, dtype=torch.int32).contiguous()
        self._barrier(2)
        for k, shp in self.shapes.items():
            g = targets[k]
            self._launch(pull_grads_kernel, (self.G,), self._dummy if g is None else g, 0 if g is None else self.L,
                         self.tab[f"gslots_{k}"], slot_of, math.prod(shp), self.status, RANK=self.rank, W=self.W,
                         L=self.L, E=self.E, BLOCK=1024)
        self._barrier(3)
        return targets

    def check(self):
        """Raise a recorded device error (timeout) on the host (one sync)."""
        raise_for_status(self.status.cpu(), self.rank, 0, "expert transport", self.timeout_s, self.device.type)

    def close(self):
        """Free the symmetric regions (collective: every rank closes in the same order). Idempotent."""
        if self.buf is not None:
            self.buf.close()
            self.buf = None


class PushWeights(torch.autograd.Function):
    """``slots = PushWeights.apply(transport, placement, names, *weights)``: forward pushes, backward pulls."""

    @staticmethod
    def forward(ctx, transport, placement, names, *weights):
        """Push ``weights`` (``[L, *shape]`` each, in ``names`` order); returns copies of all L slots per weight."""
        ctx.transport, ctx.placement, ctx.names = transport, placement, names
        slots = transport.push(dict(zip(names, weights)), placement)
        return tuple(slots[k].clone() for k in names)

    @staticmethod
    def backward(ctx, *grads):
        """Pull the slots' gradients (``[L, *shape]``; None = zero) back to the owners: dense native gradients."""
        extra = ctx.transport.pull({k: g for k, g in zip(ctx.names, grads) if g is not None}, ctx.placement)
        return (None, None, None, *[extra[k] for k in ctx.names])


def pull_add_torch(native_grad, slot_grads, placement, rank: int):
    """Torch twin of one weight of :meth:`ExpertTransport.pull_add` on rank ``rank`` (same bits, one process).

    Args:
        native_grad: ``[L, *shape]`` bf16/fp32 native gradient of rank ``rank``, or None.
        slot_grads: list over ranks d of rank d's slot gradient ``[n_d, *shape]`` (``n_d`` = slots it used; None or
            a missing slot = zero); same dtype as the weights.
        placement: the step's :class:`tritonep.balance.Placement` (``expert_slot [E, W]``).
        rank: the owner whose native gradient is updated.

    Returns:
        A NEW tensor (the input is not modified): for every native expert j that some rank ``d != rank`` holds in
        slot ``s`` (``expert_slot[rank*L + j, d] = s >= 0``),
        ``out[j] = DT(float(g[j]) + float(DT(sum_{d ascending} float(slot_grads[d][s]))))``; other experts unchanged.
        None when ``native_grad`` is None and no peer holds any of this rank's experts (else None counts as zeros).
    """
    slot = placement.expert_slot.cpu()
    E, W = slot.shape
    L = E // W
    ref = next((t for t in [native_grad, *slot_grads] if t is not None), None)
    out = None if native_grad is None else native_grad.clone()
    for j in range(L):
        e = rank * L + j
        holders = [(d, int(slot[e, d])) for d in range(W) if d != rank and int(slot[e, d]) >= 0]
        if not holders:
            continue
        if out is None:
            if ref is None:
                raise PlanError("pull_add_torch needs a native or slot gradient to know the shape")
            out = torch.zeros(L, *ref.shape[1:], dtype=ref.dtype, device=ref.device)
        acc = torch.zeros(out.shape[1:], dtype=torch.float32, device=out.device)
        for d, s in holders:
            sg = slot_grads[d]
            if sg is not None and s < sg.shape[0]:
                acc += sg[s].to(out.device).float()
        out[j] = (out[j].float() + acc.to(out.dtype).float()).to(out.dtype)
    return out


def pull_torch(slot_grads, placement, rank: int, shape, dtype=torch.bfloat16):
    """Torch twin of one weight of :meth:`ExpertTransport.pull`: :func:`pull_add_torch` into zeros ``[L, *shape]``."""
    L = placement.expert_slot.shape[0] // placement.expert_slot.shape[1]
    return pull_add_torch(torch.zeros(L, *shape, dtype=dtype), slot_grads, placement, rank)


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
    experts some peer held, decided on the device) and returned as the weights' gradients, so no dense pulled
    gradient is accumulated. Forward and backward launch the same kernels on every rank whatever ``num_used`` and
    ``held`` are (DESIGN.md §6a).

    ``num_used`` and ``held`` are host facts of the step (see :func:`used_slot_count` and
    :meth:`ExpertTransport.pull_add`; ``held`` only decides whether a missing gradient becomes zeros). The slot
    views are valid until the next push: run this step's backward before the next forward that pushes (the MoE layer
    enforces it). ``w_out`` must only feed consumers whose
    gradients are fresh tensors (the layer's expert GEMMs), since they are modified in place.
    """

    @staticmethod
    def forward(ctx, transport, placement, names, num_used, held, *weights):
        """Push; return the weights themselves and ``[num_used, *shape]`` zero-copy slot views (see the class)."""
        ctx.transport, ctx.placement, ctx.names = transport, placement, tuple(names)
        ctx.num_used, ctx.held = int(num_used), list(held)
        transport.push(dict(zip(names, weights)), placement)
        views = transport.slot_views(num_used)
        return (*weights, *(views[k] for k in names))

    @staticmethod
    def backward(ctx, *grads):
        """:meth:`ExpertTransport.pull_add` of the slot gradients into the native ones (in place); same launches on
        every rank."""
        n = len(ctx.names)
        out = ctx.transport.pull_add(dict(zip(ctx.names, grads[:n])), dict(zip(ctx.names, grads[n:])),
                                     ctx.placement, ctx.num_used, ctx.held)
        return (None, None, None, None, None, *[out[k] for k in ctx.names])
