"""Weight push / gradient pull for virtual experts over symmetric memory: the triton backend's expert transport.

Per step (every rank, same order):

* ``push``: rendezvous B1 (every rank finished with last step's slots) -> owners copy native expert weights into
  the peers' virtual slots (:func:`tritonep.backends.triton.kernels.transport.push_weights_kernel`) -> rendezvous B2 (every slot
  written) -> the expert GEMMs read the slots.
* ``pull``: each rank writes its slots' weight gradients into its symmetric gradient slots -> rendezvous B3 ->
  owners add every holder's slot gradient to their native gradient (fp32, holders in ascending rank order, only for
  the experts some peer held: decided on the device) -> rendezvous B4 (gradient slots may be rewritten).

Host protocol (identical on every rank, whatever T, the placement, the used slots or the held experts): push =
barrier B1, one push launch per weight, barrier B2; pull = barrier B3, one pull launch per weight, barrier B4 (all on
a grid of ``num_programs``). No host collective and no host read inside a call; graph-capturable.

Twin: :func:`tritonep.backends.slot_transport.pull_torch`. Idea: Megatron-LM / MoonEP virtual experts (weight push +
grad reduce contracts); our kernels and protocol.
"""

from __future__ import annotations

import math

import torch
import triton

from ...device import protocol as P
from .kernels.transport import barrier_kernel, pull_grads_kernel, push_weights_kernel
from ...memory import Region, get_heap
from ...runtime.launch import Launch
from ..slot_transport import SlotTransportBase
from ...runtime.status import raise_for_status, wait_bound

__all__ = ["ExpertTransport", "transport_regions"]


def transport_regions(world_size: int, num_local_experts: int, shapes: dict, dtype: torch.dtype):
    """Symmetric regions of an :class:`ExpertTransport` (slots and gradient slots per weight, flags)."""
    regs = [Region("flags", (P.NUM_RENDEZVOUS, world_size), torch.int64),
            Region("calls", (P.v(P.NUM_CALLS),), torch.int64), Region("status", (P.v(P.STATUS_WORDS),), torch.int64)]
    for name, shp in shapes.items():
        regs.append(Region(f"slots_{name}", (num_local_experts, *shp), dtype))
        regs.append(Region(f"gslots_{name}", (num_local_experts, *shp), dtype))
    return regs


class ExpertTransport(SlotTransportBase):
    """Virtual slots for the weights named in ``shapes`` (``name -> per-expert shape``) in symmetric memory.

    Args: as :class:`tritonep.backends.slot_transport.SlotTransportBase`, plus ``num_programs``: grid of the copy kernels
    (default 1 on CPU, 64 on GPU), clipped to ``max_programs`` (0: no cap; ranks that share a GPU under MPS: the copy
    loops are grid-strided), and ``launch``: the launch path (:data:`tritonep.envs.LAUNCH_MODES`); the buffer that
    builds it passes its config's. Every in-kernel rendezvous wait is bounded by ``timeout_s``.

    On a GPU every kernel variant is compiled at construction (before the heap's construction barrier), so no call
    ever compiles (docs/protocols.md (host protocol rule)).

    Raises:
        PlanError: ``num_experts`` not divisible by the world size. ConfigError: a bad ``timeout_s``.
    """

    def __init__(self, group, num_experts: int, shapes: dict, dtype=torch.bfloat16, device=None, num_programs=None,
                 timeout_s: float | None = None, max_programs: int = 0, launch: str = "packed"):
        super().__init__(group, num_experts, shapes, dtype, device, timeout_s)
        self.has_timer = self.device.type == "cuda"
        self.timeout = wait_bound(self.device, self.timeout_s)
        self.G = num_programs or (64 if self.device.type == "cuda" else 1)
        if max_programs:
            self.G = min(self.G, max_programs)
        self.WB = max(2, triton.next_power_of_2(self.W))
        self._launch = Launch(self.device, max_programs=max_programs, mode=launch)
        # the pull kernel's target when a rank has no native gradient and holds nothing (num_targets = 0: untouched)
        self._dummy = torch.zeros(1, dtype=dtype, device=self.device)
        self._precompile()
        self.buf = get_heap(group, self.device).allocate(transport_regions(self.W, self.L, self.shapes, dtype))
        self.flags, self.calls, self.status = (self.buf.local(n) for n in ("flags", "calls", "status"))
        self.tab = {n: self.buf.ptr_table(n) for n in ["flags"] + [f"{p}_{k}" for k in self.shapes
                                                                     for p in ("slots", "gslots")]}
        self._barriers, self._push, self._pull = self._bind(self.flags, self.tab["flags"], self.calls, self.status,
                                                            {k: self.tab[f"slots_{k}"] for k in self.shapes},
                                                            {k: self.tab[f"gslots_{k}"] for k in self.shapes})

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes this rank holds (0 once closed)."""
        return self.buf.nbytes if self.buf is not None else 0

    def _bind(self, flags, flags_tab, calls, status, slots_tabs: dict, gslots_tabs: dict, rows=range(4)):
        """The bound launches of a call: ``(barriers, push, pull)`` -- the rendezvous of each row in ``rows``, and per
        weight name the push (per call: the weights, the placement's ``experts_to_copy``) and the pull (per call: the
        gradient target, the number of targets, the placement's ``expert_slot``)."""
        W, E, L, lau = self.W, self.E, self.L, self._launch
        barriers = [lau.bind(barrier_kernel, dict(
            flags_ptr=flags, flags_tab=flags_tab, row_off=P.flag_row_bytes(row, W), calls_ptr=calls, call_idx=row,
            status_ptr=status, timeout=self.timeout, wait_id=P.v(P.WAIT_RENDEZVOUS) + row, rank=self.rank, W=W,
            WB=self.WB, HAS_TIMER=self.has_timer), grid=(1,)) for row in rows]
        push = {k: lau.bind(push_weights_kernel, dict(
            slots_tab=slots_tabs[k], N=math.prod(shp), status_ptr=status, rank=self.rank, W=W, L=L, BLOCK=1024),
            ("w_ptr", "etc_ptr"), grid=(self.G,)) for k, shp in self.shapes.items()}
        pull = {k: lau.bind(pull_grads_kernel, dict(
            gslots_tab=gslots_tabs[k], N=math.prod(shp), status_ptr=status, rank=self.rank, W=W, L=L, E=E,
            BLOCK=1024), ("grad_ptr", "num_targets", "slot_of_ptr"), grid=(self.G,)) for k, shp in self.shapes.items()}
        return barriers, push, pull

    def _precompile(self):
        """GPU: compile every kernel variant a call can launch (barrier, push and pull per weight dtype), with
        stand-in tensors of the real dtypes, before the construction barrier. No-op on CPU (interpreter)."""
        if self.device.type != "cuda":
            return
        dev, W, E, L = self.device, self.W, self.E, self.L
        i64 = torch.zeros(max(8, W), dtype=torch.int64, device=dev)
        slot_of = torch.full((E, W), -1, dtype=torch.int32, device=dev)
        etc = torch.full((W, L), -1, dtype=torch.int32, device=dev)
        w = torch.zeros(L, 1, dtype=self.dtype, device=dev)
        with self._launch.precompile() as on:
            if on:
                one = dict.fromkeys(self.shapes, i64)
                barriers, push, pull = self._bind(i64, i64, i64, i64, one, one)
                for bk in barriers:
                    bk()
                for k in self.shapes:
                    push[k](w, etc)
                    pull[k](w, 0, slot_of)

    def _barrier(self, row: int):
        """Rendezvous ``row`` (0..3 = B1..B4) of every rank: one barrier_kernel launch, bounded wait, no host sync."""
        self.calls[row:row + 1].add_(1)
        self._barriers[row]()

    def slots(self, name: str) -> torch.Tensor:
        """This rank's virtual slots of weight ``name``: ``[L, *shape]`` (valid after :meth:`push`)."""
        return self.buf.local(f"slots_{name}")

    def push(self, weights: dict, placement, experts_to_copy_host=None) -> dict:
        """Collective: fill every rank's virtual slots from the owners' native weights; returns this rank's slots.

        Args:
            weights: ``name -> [L, *shape]`` native weights (dtype and device of the transport).
            placement: the step's placement (identical on every rank); read on the device only.
            experts_to_copy_host: ignored here (the kernels read the placement on the device); accepted so every
                backend's transport takes the same arguments.

        Raises:
            PlanError: a weight of the wrong shape / dtype / device (before any launch).
        """
        self._check_weights(weights)
        etc = placement.experts_to_copy.to(torch.int32).contiguous()
        self._barrier(0)
        for k in self.shapes:
            self._push[k](weights[k].contiguous(), etc)
        self._barrier(1)
        return {k: self.slots(k) for k in self.shapes}

    def pull(self, slot_grads: dict, placement, num_used: int | None = None, held=(), into: dict | None = None,
             experts_to_copy_host=None) -> dict:
        """Collective: add every holder's slot gradient to this rank's native gradients (the gradient return).

        Args:
            slot_grads: ``name -> [num_used, *shape]`` gradient of this rank's first ``num_used`` slots (missing or
                None = zero).
            placement: the step's placement (identical on every rank).
            num_used: slots this rank used this step (default L; slots ``>= num_used`` are unused: no peer reads
                them).
            held: host list of this rank's native expert indices some peer held this step; only decides what an
                absent native gradient in ``into`` becomes (zeros when ``held`` is not empty, else it stays None).
            into: ``name -> [L, *shape]`` native gradients to accumulate into IN PLACE (None entries: see
                ``held``), or None: accumulate into fresh zeros (the dense pull).
            experts_to_copy_host: ignored (see :meth:`push`).

        Returns:
            ``name -> [L, *shape]``: for every expert j some peer held, ``grad[j] = DT(float(grad[j]) + float(DT(fp32
            sum over holders d ascending of slot_grad_d)))`` (:func:`tritonep.backends.slot_transport.pull_torch` gives
            the same bits); other experts untouched. The tensors of ``into`` themselves when given.

        Raises:
            PlanError: bad ``num_used`` / ``held`` / shapes, before any launch (a rank that raises here leaves its
                peers waiting in B3 until the bounded wait expires).
        """
        n, held, targets = self._pull_targets(slot_grads, num_used, held, into)
        for k in self.shapes:
            dst = self.buf.local(f"gslots_{k}")[:n]
            sg = slot_grads.get(k)
            dst.zero_() if sg is None else dst.copy_(sg)
        slot_of = placement.expert_slot.to(device=self.device, dtype=torch.int32).contiguous()
        self._barrier(2)
        for k in self.shapes:
            g = targets[k]
            self._pull[k](self._dummy if g is None else g, 0 if g is None else self.L, slot_of)
        self._barrier(3)
        return self._in_place(targets, into)

    def check(self):
        """Raise a recorded device error (timeout) on the host (one sync)."""
        self.host_reads += 1
        self.raise_status(self.status_words().cpu())

    def status_words(self) -> torch.Tensor:
        """The status word the rendezvous kernels write (int64 device view, no copy), for an owner that reads it
        with its other host values (see :meth:`raise_status`)."""
        return self.status[:P.v(P.STATUS_WORDS)]

    def raise_status(self, values) -> None:
        """Raise the error ``values`` (a host copy of :meth:`status_words`) records (a timeout: it stays, the
        transport is unusable after it)."""
        raise_for_status(torch.as_tensor(values, dtype=torch.int64), self.rank, 0, "expert transport",
                         self.timeout_s, self.device.type)

    def close(self):
        """Free the symmetric regions (collective: every rank closes in the same order). Idempotent."""
        if self.buf is not None:
            self.buf.close()
            self.buf = None
