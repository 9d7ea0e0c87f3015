"""The nccl backend's counts exchange (virtual experts over ``torch.distributed``): one ``all_gather``.

Same results as the triton backend's :class:`tritonep.backends.triton.counts.CountsExchange`, bit for bit, for groups whose
ranks cannot map each other's memory (several hosts). Every step is a torch op or one ``torch.distributed``
collective on the current stream.

Host protocol (docs/protocols.md (host protocol rule); identical on every rank whatever its data, T = 0 included):
``gather`` runs one ``all_gather`` of the ``[E + 1]`` row (histogram of ids in ``[0, E)``, then the count of ids
outside ``[-1, E)`` plus the refused-input flag). No host read (as on the triton backend).

Bounded waits: this backend has no kernel waits; a peer that never arrives is caught by the process group's own
timeout (``torch.distributed`` / NCCL watchdog), as for :class:`tritonep.backends.nccl.backend.NcclEP`. CUDA-graph capture
is refused (:class:`tritonep.errors.BackendError`).

Idea: Megatron-LM's all_to_all token dispatcher (counts exchange by collective); our code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import PeerInputError
from ..checks import counts_input_refusal
from .collectives import all_gather_flat, refuse_capture

__all__ = ["NcclCountsExchange"]


class NcclCountsExchange:
    """``gather(topk_idx) -> counts [W, E] int32`` (``counts[r, e]`` = routes of rank r to expert e) by all_gather.

    Args: as :class:`tritonep.backends.triton.counts.CountsExchange` (group, num_experts E, max_tokens_per_rank, topk, device,
    ``timeout_s`` stored only: the process group's timeout applies).
    """

    def __init__(self, group, num_experts: int, max_tokens_per_rank: int, topk: int, device,
                 timeout_s: float | None = None):
        self.group = group
        self.rank, self.W = dist.get_rank(group), dist.get_world_size(group)
        self.E, self.Tm, self.K = num_experts, max_tokens_per_rank, topk
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.host_reads = 0
        self._bad = None  # column E of the last gathered matrix (device): input errors per rank
        self._ones = torch.ones(max_tokens_per_rank * topk, dtype=torch.int64, device=self.device)

    @property
    def allocated_bytes(self) -> int:
        """0: no symmetric memory."""
        return 0

    def gather(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """Exchange this rank's histogram of ``topk_idx`` (``[T, K]``) and return the full ``[W, E]`` int32 matrix.

        Ids outside ``[0, E)`` are not counted; those outside ``[-1, E)`` are flagged in the gathered row (no host
        read; :meth:`check` raises them). A refused ``topk_idx`` still takes part with no routes and the flag, then
        raises here (every rank runs the same collective, docs/protocols.md (host protocol rule)).

        Raises:
            InputError: wrong shape / dtype / device. CapacityError: ``T > max_tokens_per_rank``.
            BackendError: CUDA-graph capture.
        """
        refuse_capture(self.device, "counts exchange")
        E = self.E
        refused = counts_input_refusal(topk_idx, self.K, self.Tm, self.device)
        row = torch.zeros(E + 1, dtype=torch.int64, device=self.device)
        if refused is None and topk_idx.numel():
            ids = topk_idx.reshape(-1).long()
            ok = (ids >= 0) & (ids < E)
            row.scatter_add_(0, torch.where(ok, ids, E), ok.long())
            row[E] = ((ids < -1) | (ids >= E)).sum()
        elif refused is not None:
            row[E] = 1
        out = torch.empty(self.W * (E + 1), dtype=torch.int64, device=self.device)
        all_gather_flat(out, row, self.group)
        m = out.view(self.W, E + 1)
        self._bad = m[:, E]
        if refused is not None:
            raise refused
        return m[:, :E].to(torch.int32)

    def check(self):
        """Raise :class:`PeerInputError` when the last exchange carried a rank's input error (one host read)."""
        if self._bad is None:
            return
        self.host_reads += 1
        self.raise_status(self._bad.tolist())

    def status_words(self) -> torch.Tensor:
        """Column E of the last gathered matrix (int64 ``[W]`` device tensor: input errors per rank; empty before
        the first exchange), for an owner that reads it with its other host values (see :meth:`raise_status`)."""
        if self._bad is None:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return self._bad

    def raise_status(self, values) -> None:
        """Raise :class:`PeerInputError` when ``values`` (a host copy of :meth:`status_words`) names a refused rank;
        reported once (the exchange forgets it)."""
        bad = [r for r, v in enumerate(list(values)) if int(v) > 0]
        if bad:
            self._bad = None
            raise PeerInputError(f"counts exchange: the input of rank(s) {bad} was refused, so this call failed on "
                                 f"every rank (rank {self.rank} raises this)", bad_ranks=bad, rank=self.rank)

    def close(self):
        """Nothing to free (kept for the interface)."""
        self._bad = None
