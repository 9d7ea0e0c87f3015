"""The nccl backend's expert transport (virtual experts over ``torch.distributed``): all_to_all per weight.

Same results as the triton backend's :class:`tritonep.backends.triton.expert_transport.ExpertTransport`, bit for bit, for
groups whose ranks cannot map each other's memory (several hosts). Every step is a torch op or one
``torch.distributed`` collective on the current stream.

Host protocol (docs/protocols.md (host protocol rule); identical on every rank whatever its data: the placement, the
used slots, the held experts): ``push``: one ``all_to_all_single`` per weight; ``pull``: one ``all_to_all_single``
per weight. Their uneven split sizes come from the placement's ``experts_to_copy [W, L]`` on the host: pass
``experts_to_copy_host`` (the MoE layer reads it in the one host read its step already makes, so a step adds no
read), else the transport reads it once (counted in ``host_reads``).

Bounded waits: this backend has no kernel waits; a peer that never arrives is caught by the process group's own
timeout (``torch.distributed`` / NCCL watchdog). CUDA-graph capture is refused (:class:`tritonep.errors.BackendError`):
host split sizes are needed.

Idea: MoonEP / Megatron-LM virtual experts (weight push + grad reduce contracts); our code.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...errors import PlanError
from ..slot_transport import SlotTransportBase
from .collectives import refuse_capture

__all__ = ["NcclExpertTransport"]


class NcclExpertTransport(SlotTransportBase):
    """Virtual slots for the weights named in ``shapes`` in ordinary device memory, moved with all_to_all.

    Args: as :class:`tritonep.backends.triton.expert_transport.ExpertTransport` (``num_programs`` is ignored; ``timeout_s`` is
    checked and stored: the process group's timeout applies).

    ``push``: owner r sends ``w[j]`` for every slot ``(d, s)`` with ``experts_to_copy[d, s] = r*L + j``, ordered by
    (d, s); rank d receives them ordered by (owner, s) and copies them into its slots. ``pull`` runs the same
    routes backwards (holders send used slots' gradients, owners receive them ordered by (holder, s)) and adds
    ``DT(fp32 sum over holders d != owner ascending)`` into the native gradient exactly as the triton kernel does
    (:func:`tritonep.backends.slot_transport.pull_torch` is the twin of both).
    """

    def __init__(self, group, num_experts: int, shapes: dict, dtype=torch.bfloat16, device=None, num_programs=None,
                 timeout_s: float | None = None):
        super().__init__(group, num_experts, shapes, dtype, device, timeout_s)
        self._slots = {k: torch.zeros(self.L, *shp, dtype=dtype, device=self.device) for k, shp in self.shapes.items()}

    @property
    def allocated_bytes(self) -> int:
        """0: the slots live in ordinary device memory."""
        return 0

    def slots(self, name: str) -> torch.Tensor:
        """This rank's virtual slots of weight ``name``: ``[L, *shape]`` (valid after :meth:`push`)."""
        return self._slots[name]

    def _routes(self, placement, etc_host):
        """``(send [(d, s, j)] ordered by (d, s), recv [(owner, s)] ordered by (owner, s), send splits, recv
        splits)`` of this rank's push, from the host ``experts_to_copy`` (read here once when not given)."""
        if etc_host is None:
            self.host_reads += 1
            etc_host = placement.experts_to_copy.tolist()
        etc = [[int(e) for e in row] for row in etc_host]
        if len(etc) != self.W or any(len(row) != self.L for row in etc):
            raise PlanError(f"experts_to_copy must be [{self.W}, {self.L}], got {len(etc)} rows")
        L, me = self.L, self.rank
        send = [(d, s, e % L) for d in range(self.W) for s, e in enumerate(etc[d]) if e >= 0 and e // L == me]
        recv = sorted((e // L, s) for s, e in enumerate(etc[me]) if e >= 0)
        ssplit = [sum(1 for d, _, _ in send if d == p) for p in range(self.W)]
        rsplit = [sum(1 for o, _ in recv if o == p) for p in range(self.W)]
        return send, recv, ssplit, rsplit

    def _a2a(self, send_rows: torch.Tensor, nrecv: int, in_splits: list, out_splits: list) -> torch.Tensor:
        """``all_to_all_single`` of ``[n, N]`` weight rows (moved as bytes: any dtype, any process group)."""
        recv = torch.empty(nrecv, send_rows.shape[1], dtype=self.dtype, device=self.device)
        dist.all_to_all_single(recv.view(torch.uint8), send_rows.contiguous().view(torch.uint8),
                               output_split_sizes=out_splits, input_split_sizes=in_splits, group=self.group)
        return recv

    def _idx(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def push(self, weights: dict, placement, experts_to_copy_host=None) -> dict:
        """Collective: fill every rank's virtual slots from the owners' native weights; returns this rank's slots.

        Args: as :meth:`tritonep.backends.triton.expert_transport.ExpertTransport.push`; ``experts_to_copy_host``: host copy
        (nested lists or a CPU tensor ``[W, L]``) of ``placement.experts_to_copy``, saving this call's host read.

        Raises:
            PlanError: a weight of the wrong shape / dtype / device (before any collective).
            BackendError: CUDA-graph capture.
        """
        refuse_capture(self.device, "expert transport")
        self._check_weights(weights)
        send, recv, ssplit, rsplit = self._routes(placement, experts_to_copy_host)
        src, dst = self._idx([j for _, _, j in send]), self._idx([s for _, s in recv])
        for k, shp in self.shapes.items():
            N = math.prod(shp)
            rows = self._a2a(weights[k].reshape(self.L, N).index_select(0, src), len(recv), ssplit, rsplit)
            self._slots[k].view(self.L, N).index_copy_(0, dst, rows)
        return {k: self.slots(k) for k in self.shapes}

    def pull(self, slot_grads: dict, placement, num_used: int | None = None, held=(), into: dict | None = None,
             experts_to_copy_host=None) -> dict:
        """Collective: add every holder's slot gradient to this rank's native gradients (the gradient return).

        Arguments, result and bits as :meth:`tritonep.backends.triton.expert_transport.ExpertTransport.pull`;
        ``experts_to_copy_host`` as in :meth:`push`.

        Raises:
            PlanError: bad ``num_used`` / ``held`` / shapes, or a slot this rank uses at or past ``num_used``
                (before any collective). BackendError: CUDA-graph capture.
        """
        refuse_capture(self.device, "expert transport")
        n, held, targets = self._pull_targets(slot_grads, num_used, held, into)
        send, recv, ssplit, rsplit = self._routes(placement, experts_to_copy_host)
        if any(s >= n for _, s in recv):
            raise PlanError(f"rank {self.rank} holds an expert in a slot >= num_used={n} "
                            f"(slots {[s for _, s in recv]})")
        # owners receive in the push's send order: by holder d ascending, then slot; a holder's own experts excluded
        hold = {}
        for i, (d, _, j) in enumerate(send):
            if d != self.rank:
                hold.setdefault(j, []).append(i)
        js = sorted(hold)
        srcs, jix = self._idx([s for _, s in recv]), self._idx(js)
        for k, shp in self.shapes.items():
            N = math.prod(shp)
            sg = slot_grads.get(k)
            out = sg.reshape(n, N).index_select(0, srcs) if sg is not None else \
                torch.zeros(len(recv), N, dtype=self.dtype, device=self.device)
            back = self._a2a(out, len(send), rsplit, ssplit)
            g = targets[k]
            if g is None or not js:
                continue
            acc = torch.zeros(len(js), N, dtype=torch.float32, device=self.device)
            for d in range(self.W):  # fixed order: holders ascending, each expert at most once per holder
                rows = [(c, i) for c, j in enumerate(js) for i in hold[j] if send[i][0] == d]
                if rows:
                    acc.index_add_(0, self._idx([c for c, _ in rows]), back[self._idx([i for _, i in rows])].float())
            gv = g.view(self.L, N)
            gv.index_copy_(0, jix, (gv.index_select(0, jix).float() + acc.to(self.dtype).float()).to(self.dtype))
        return self._in_place(targets, into)

    def check(self):
        """Nothing is recorded on the device by this transport: errors are raised where they happen."""

    def status_words(self) -> torch.Tensor:
        """Empty: nothing is recorded on the device (kept for the interface, see :meth:`raise_status`)."""
        return torch.zeros(0, dtype=torch.int64, device=self.device)

    def raise_status(self, values) -> None:
        """Nothing to raise (see :meth:`status_words`)."""

    def close(self):
        """Drop the slots. Idempotent."""
        self._slots = {}
