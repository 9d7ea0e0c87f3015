"""What every backend's virtual-expert weight transport shares: argument checks, slot views and the torch twin.

A transport (one per backend: :class:`tritonep.backends.triton.expert_transport.ExpertTransport` over symmetric
memory, :class:`tritonep.backends.nccl.expert_transport.NcclExpertTransport` over ``torch.distributed``) holds L virtual
slots per weight on every rank and moves, per step, the weights the placement asks for (``push``) and their
gradients back (``pull``). The placement contract (from :class:`tritonep.balance.Placement`, read here by
attribute only: ep does not import balance): ``experts_to_copy [W, L]`` (slot s of rank d holds global expert e,
owner ``e // L``; -1 = unused) and its inverse ``expert_slot [E, W]``.

:func:`pull_torch` is the twin of ``pull``: the exact bits on one process from every rank's slot gradients.

Idea: Megatron-LM / MoonEP virtual experts (weight push + grad reduce contracts); our code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import PlanError
from ..runtime.status import resolve_timeout

__all__ = ["SlotTransportBase", "pull_torch", "alias"]


def alias(t: torch.Tensor) -> torch.Tensor:
    """A storage alias of ``t`` (same memory, own version counter, no autograd view relation to ``t``)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                              t.stride())


class SlotTransportBase:
    """Checks and views every transport shares (subclasses provide ``slots(name)``, ``push``, ``pull``).

    Args:
        group: the EP group; num_experts: E (global), divisible by the group size (L = E / W slots per rank);
        shapes: ``name -> per-expert shape`` (e.g. ``{"w1": (H, 2*I), "w2": (I, H)}``); dtype: weight dtype;
        device: this rank's device (default CPU); timeout_s: bound of waits in seconds (default
        ``TRITONEP_TIMEOUT_S``).

    Raises:
        PlanError: ``num_experts`` not divisible by the world size. ConfigError: a bad ``timeout_s``.
    """

    def __init__(self, group, num_experts: int, shapes: dict, dtype=torch.bfloat16, device=None,
                 timeout_s: float | None = None):
        self.group = group
        self.rank, self.W = dist.get_rank(group), dist.get_world_size(group)
        if num_experts % self.W:
            raise PlanError(f"num_experts={num_experts} is not divisible by world_size={self.W}")
        self.E, self.L = num_experts, num_experts // self.W
        self.shapes = {k: tuple(v) for k, v in shapes.items()}
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.timeout_s = resolve_timeout(timeout_s)
        self.host_reads = 0  # device->host reads made by calls

    def _shape_str(self, k: str, rows) -> str:
        return f"[{rows}, {', '.join(map(str, self.shapes[k]))}]"

    def _check_weights(self, weights: dict):
        """Raise PlanError unless every named weight is ``[L, *shape]`` in the transport's dtype and device."""
        for k, shp in self.shapes.items():
            w = weights.get(k)
            if w is None or tuple(w.shape) != (self.L, *shp) or w.dtype != self.dtype or w.device != self.device:
                got = None if w is None else (tuple(w.shape), w.dtype, w.device)
                raise PlanError(f"weight {k!r} must be {self._shape_str(k, self.L)} {self.dtype} on {self.device}, "
                                f"got {got}")

    def slot_views(self, num_used: int) -> dict:
        """Zero-copy ``[num_used, *shape]`` views of this rank's first ``num_used`` slots, one per weight name.

        The views are storage aliases (:func:`alias`); the next ``push`` overwrites their memory.

        Raises:
            PlanError: ``num_used`` outside ``[0, L]``.
        """
        if not 0 <= int(num_used) <= self.L:
            raise PlanError(f"num_used={num_used} outside [0, {self.L}]")
        return {k: alias(self.slots(k)[:int(num_used)]) for k in self.shapes}

    def _pull_targets(self, slot_grads: dict, num_used, held, into):
        """Check ``pull``'s arguments (before any collective or launch) and return ``(n, held, targets)``.

        ``targets[name]``: the tensor the pulled sums are added into: ``into[name]`` (made contiguous), fresh zeros
        when ``into`` is None or when it has no tensor for a weight and ``held`` is not empty, else None.

        Raises:
            PlanError: ``num_used`` outside ``[0, L]``, ``held`` out of range, a slot or native gradient of the wrong
                shape / dtype / device.
        """
        n = self.L if num_used is None else int(num_used)
        if not 0 <= n <= self.L:
            raise PlanError(f"num_used={num_used} outside [0, {self.L}]")
        held = [int(j) for j in held]
        if any(not 0 <= j < self.L for j in held):
            raise PlanError(f"held={held} has an index outside [0, {self.L})")
        targets = {}
        for k, shp in self.shapes.items():
            g = None if into is None else into.get(k)
            if g is None:
                g = torch.zeros(self.L, *shp, dtype=self.dtype, device=self.device) if (held or into is None) \
                    else None
            elif tuple(g.shape) != (self.L, *shp) or g.dtype != self.dtype or g.device != self.device:
                raise PlanError(f"native gradient {k!r} must be {self._shape_str(k, self.L)} {self.dtype} on "
                                f"{self.device}, got {(tuple(g.shape), g.dtype, g.device)}")
            elif not g.is_contiguous():
                g = g.contiguous()  # the sums are added into a dense [L, N] block; :meth:`_in_place` copies back
            targets[k] = g
            sg = slot_grads.get(k)
            if sg is not None and tuple(sg.shape) != (n, *shp):
                raise PlanError(f"slot gradient {k!r} must be {self._shape_str(k, n)}, got {tuple(sg.shape)}")
        return n, held, targets


    @staticmethod
    def _in_place(targets: dict, into: dict | None) -> dict:
        """``pull``'s result: where a native gradient of ``into`` was not contiguous (the sums went into a dense
        copy), copy the result back into it, so ``into``'s own tensors hold the sums (the in-place contract)."""
        if into is None:
            return targets
        out = dict(targets)
        for k, g in targets.items():
            orig = into.get(k)
            if orig is not None and g is not None and g is not orig:
                orig.copy_(g)
                out[k] = orig
        return out


def pull_torch(slot_grads, placement, rank: int, into=None, shape=None, dtype=torch.bfloat16):
    """Torch twin of one weight of ``pull`` on rank ``rank`` (same bits, one process, any backend).

    Args:
        slot_grads: list over ranks d of rank d's slot gradient ``[n_d, *shape]`` (``n_d`` = slots it used; None or
            a missing slot = zero); same dtype as the weights.
        placement: the step's placement (``expert_slot [E, W]``).
        rank: the owner whose native gradient is computed.
        into: ``[L, *shape]`` native gradient of rank ``rank`` to accumulate into (not modified), or None: then
            ``shape`` / ``dtype`` give fresh zeros (the dense pull).

    Returns:
        A NEW tensor: for every native expert j that some rank ``d != rank`` holds in slot ``s``
        (``expert_slot[rank*L + j, d] = s >= 0``), ``out[j] = DT(float(g[j]) + float(DT(sum_{d ascending}
        float(slot_grads[d][s]))))``; other experts unchanged. With ``into=None`` and no ``shape``: None when no
        peer holds any of this rank's experts (an absent native gradient stays absent), else zeros plus the sums.

    Raises:
        PlanError: nothing gives the gradient's shape.
    """
    slot = placement.expert_slot.cpu()
    E, W = slot.shape
    L = E // W
    ref = next((t for t in [into, *slot_grads] if t is not None), None)
    if into is not None:
        out = into.clone()
    elif shape is not None:
        out = torch.zeros(L, *shape, dtype=dtype)
    else:
        out = None
    for j in range(L):
        e = rank * L + j
        holders = [(d, int(slot[e, d])) for d in range(W) if d != rank and int(slot[e, d]) >= 0]
        if not holders:
            continue
        if out is None:
            if ref is None:
                raise PlanError("pull_torch needs a native or slot gradient to know the shape")
            out = torch.zeros(L, *ref.shape[1:], dtype=ref.dtype, device=ref.device)
        acc = torch.zeros(out.shape[1:], dtype=torch.float32, device=out.device)
        for d, s in holders:
            sg = slot_grads[d]
            if sg is not None and s < sg.shape[0]:
                acc += sg[s].to(out.device).float()
        out[j] = (out[j].float() + acc.to(out.dtype).float()).to(out.dtype)
    return out
