"""Saved state of an MoE layer's forwards until their backwards: several forwards may precede their backwards.

Activation recompute and pipeline schedules run a layer's forward for micro-batch 2 (or run it again) before the
backward of micro-batch 1. The backward of one forward needs that forward's received rows, first-GEMM output,
expert output rows and dispatch handle. All are private tensors of the call except two things that live in memory
the NEXT forward of the layer overwrites:

* the expert output rows (``eo``): the expert GEMM writes them straight into the buffer's shared expert-output region
  (zero copy into combine; symmetric memory on the triton backend, a persistent tensor on the nccl backend);
* with virtual experts, the weights of the virtual slots used (views of the shared slot region).

So the layer keeps up to ``max_saved_forwards`` (:class:`tritonep.MoERecipe`) saved forwards, and when a forward
starts while others still wait for their backward, it first *spills* their shared tensors into private copies
(one ``[R, H]`` copy of expert rows per waiting forward, plus the used slot weights; nothing when every forward's
backward came before the next forward, the ordinary training step). Backwards may then come in any order. Memory per
waiting forward: ``R * (2H + width) * itemsize`` of activations (received rows, ``h``, expert rows), the same a
dense FFN of R rows keeps.

Lifetime: a saved forward lives as long as its autograd graph. The custom op's ticket tensor is saved for backward
in that graph and a finalizer on it discards the entry (:meth:`SavedForwards.discard`) when the graph is freed
without a backward (evaluation forwards with autograd on, ``torch.utils.checkpoint``, whose first forward keeps no
saved tensor and whose recompute saves a fresh one). Bounded: past ``max_saved_forwards`` live waiting forwards the
oldest is dropped; its backward then raises :class:`tritonep.errors.BufferStateError` naming the limit.
:meth:`SavedForwards.clear` (``MoELayer.release_saved()``) drops them all.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from ..errors import BufferStateError

__all__ = ["SavedForwards"]

SHARED_KEYS = ("eo",)  # entries that live in the layer's shared memory (plus slot weights, see spill)


class SavedForwards:
    """Tickets -> saved state of one layer's forwards (module docstring).

    Args:
        limit: most forwards kept waiting for their backward (>= 1).
        owner: a name for error messages (e.g. ``"MoELayer 3"``).
    """

    def __init__(self, limit: int, owner: str):
        self.limit, self.owner = int(limit), owner
        self._saved: OrderedDict = OrderedDict()
        self._tickets = itertools.count()
        self._dropped: dict[int, str] = {}
        self.spills = 0  # forwards whose shared tensors were copied out so far (a statistic)

    def __len__(self) -> int:
        return len(self._saved)

    def __bool__(self) -> bool:
        return bool(self._saved)

    def spill(self) -> None:
        """Copy every waiting forward's shared tensors into private memory (call before the next forward writes
        them). Stream-ordered after the forward that wrote them; already private entries are skipped."""
        with torch.no_grad():
            for st in self._saved.values():
                if st.get("private"):
                    continue
                st["eo"] = st["eo"].clone()
                if st.get("n_slot_parts"):  # virtual experts: the used slot weights are views of the slot region
                    st["w1"] = st["w1"][:1] + tuple(w.clone() for w in st["w1"][1:])
                    st["w2"] = st["w2"][:1] + tuple(w.clone() for w in st["w2"][1:])
                st["private"] = True
                self.spills += 1

    def add(self, state: dict) -> int:
        """Keep ``state`` (its shared tensors still in place) and return its ticket; drops the oldest past the
        limit."""
        ticket = next(self._tickets)
        self._saved[ticket] = state
        while len(self._saved) > self.limit:
            old, _ = self._saved.popitem(last=False)
            self._dropped[old] = (f"dropped after {self.limit} later forwards were saved (MoERecipe."
                                  f"max_saved_forwards={self.limit}; raise it for deeper recompute / pipeline "
                                  f"schedules)")
            if len(self._dropped) > 4 * self.limit:
                self._dropped.pop(next(iter(self._dropped)))
        return ticket

    def pop(self, ticket: int) -> dict:
        """The saved state of ``ticket`` (removed).

        Raises:
            BufferStateError: consumed by an earlier backward, dropped past the limit, or released.
        """
        st = self._saved.pop(ticket, None)
        if st is None:
            why = self._dropped.pop(ticket, "consumed by an earlier backward (a second backward through the same "
                                            "forward, retain_graph=True, is refused) or released by "
                                            "release_saved()")
            raise BufferStateError(f"{self.owner}: no saved forward for ticket {ticket}: {why}")
        return st

    def discard(self, ticket: int) -> None:
        """Forget ``ticket`` if still saved (its autograd graph is gone: no backward will come). No error."""
        self._saved.pop(ticket, None)

    def clear(self) -> None:
        """Drop every saved forward (their backwards then raise BufferStateError)."""
        self._saved.clear()
