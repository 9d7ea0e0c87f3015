"""Gather every rank's per-expert route histogram through symmetric memory (the dispatch counts protocol alone).

The virtual-expert planner needs the ``[W, E]`` matrix of *native* expert loads before routes are remapped to
runtime experts; this runs the same two kernels as the first half of a dispatch (:mod:`tritonep.backends.triton.kernels.layout`)
on a small buffer of its own, with no host sync (graph-capturable).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton

from .kernels.layout import chunk_hist_kernel, exchange_kernel, exchange_tiles
from ...memory import Region, get_heap
from ...runtime.launch import Launch
from ...device import protocol as P
from ...runtime.status import raise_for_status, resolve_timeout, wait_bound
from ..checks import counts_input_refusal

_CX = P.v(P.CALL_EXCHANGE)  # this buffer's exchange number (the only counter it advances)

__all__ = ["CountsExchange", "counts_regions"]


def counts_regions(world_size: int, num_experts: int, max_tokens_per_rank: int, bt: int = 16):
    """The symmetric regions of a :class:`CountsExchange` (for sizing before any group exists)."""
    W, E = world_size, num_experts
    ncmax = max(1, triton.cdiv(max_tokens_per_rank, bt))
    return [Region("flags", (W,), torch.int64), Region("status", (P.v(P.STATUS_WORDS),), torch.int64),
            Region("calls", (P.v(P.NUM_CALLS),), torch.int64), Region("counts", (2, W, E + 1), torch.int32),
            Region("hist", (ncmax, E + 1), torch.int32), Region("pre", (ncmax, E), torch.int32),
            Region("send_base", (E,), torch.int32), Region("rows_needed", (W,), torch.int64)]


class CountsExchange:
    """``gather(topk_idx) -> counts [W, E] int32``: ``counts[r, e]`` = valid routes of rank r to expert e.

    Args:
        group: the EP group; num_experts: E; max_tokens_per_rank, topk: static capacity; device.
        timeout_s: bound of the exchange's in-kernel wait in seconds (default: ``TRITONEP_TIMEOUT_S``).
        max_programs: cap on the exchange's programs (0: none); launch: the launch path
            (:data:`tritonep.envs.LAUNCH_MODES`). The buffer that builds it passes its config's.
    Raises:
        InputError: topk_idx of the wrong shape or dtype. PeerTimeoutError via :meth:`check`.
    """

    BT = 16

    def __init__(self, group, num_experts: int, max_tokens_per_rank: int, topk: int, device,
                 timeout_s: float | None = None, max_programs: int = 0, launch: str = "packed"):
        self.rank, self.W = dist.get_rank(group), dist.get_world_size(group)
        self.E, self.Tm, self.K = num_experts, max_tokens_per_rank, topk
        self.device = torch.device(device)
        self.buf = get_heap(group, self.device).allocate(counts_regions(self.W, self.E, max_tokens_per_rank,
                                                                        self.BT))
        b = self.buf
        self.flags, self.status, self.calls = b.local("flags"), b.local("status"), b.local("calls")
        self.tab_counts, self.tab_flags = b.ptr_table("counts"), b.ptr_table("flags")
        self.timeout_s = resolve_timeout(timeout_s)
        self.timeout = wait_bound(self.device, self.timeout_s)
        self.host_reads = 0  # device->host reads (gather makes none; check makes one)
        self._launch = Launch(self.device, max_programs=max_programs, mode=launch)
        ncmax = max(1, triton.cdiv(max_tokens_per_rank, self.BT))
        EB = triton.next_power_of_2(self.E)
        L = self.E // self.W
        hist = b.local("hist")
        self._hist = self._launch.bind(chunk_hist_kernel, dict(
            hist_ptr=hist, K=self.K, E=self.E, EB=EB, BT=self.BT, KB=triton.next_power_of_2(self.K),
            bump_a=self.calls[_CX:_CX + 1], NBUMP=1), ("topk_idx_ptr", "T", "NC"), grid=(1,))
        # static tiles (never derived from a call's T: docs/protocols.md (host protocol rule))
        xgrid, xt = exchange_tiles(ncmax, self.E, max_programs)
        self._xchg = self._launch.bind(exchange_kernel, dict(
            hist_ptr=hist, counts_tab=self.tab_counts, flags_ptr=self.flags, flags_tab=self.tab_flags,
            flag_off=P.flag_row_bytes(P.FLAG_COUNTS, self.W), calls_ptr=self.calls[_CX:], status_ptr=self.status,
            timeout=self.timeout, pre_ptr=b.local("pre"), send_base_ptr=b.local("send_base"),
            rows_needed_ptr=b.local("rows_needed"), max_recv=2 ** 31 - 1, rank=self.rank, W=self.W, E=self.E, L=L,
            A=1, WB=max(2, triton.next_power_of_2(self.W)), LB=triton.next_power_of_2(L), EB=EB, **xt,
            HAS_TIMER=self.device.type == "cuda", DOUBLE=True,
            num_warps=8),  # the [256, 32] prefix tiles of exchange_tiles spill at 4 warps
            ("NC", "ntpe_ptr", "offs_ptr", "host_bad"), grid=(xgrid,))
        self._launch.dry_run(lambda: self.gather(torch.zeros(self.Tm, self.K, dtype=torch.int64,
                                                             device=self.device)), restore=(self.calls,))

    def gather(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """Exchange this rank's histogram of ``topk_idx`` ([T, K], ids in [-1, E)) and return the full matrix.

        A refused ``topk_idx`` (wrong shape or dtype, or ``T > max_tokens_per_rank``) still takes part in the
        exchange with no routes and the input-error flag in this rank's row (every rank runs the same launches,
        docs/protocols.md (host protocol rule)), then raises here; ids outside ``[-1, E)`` are flagged on the device without a host read.

        Raises:
            InputError: wrong shape / dtype. CapacityError: ``T > max_tokens_per_rank``.
        """
        refused = counts_input_refusal(topk_idx, self.K, self.Tm, self.device)
        if refused is not None:
            self._exchange(torch.empty(0, self.K, dtype=torch.int64, device=self.device), host_bad=1)
            raise refused
        return self._exchange(topk_idx.contiguous(), host_bad=0)

    def _exchange(self, idx: torch.Tensor, host_bad: int) -> torch.Tensor:
        """The two launches of one exchange and the matrix of this call (device tensors, no host read)."""
        T = idx.shape[0]
        nc = -(-T // self.BT)
        L = self.E // self.W
        ntpe = torch.empty(L, dtype=torch.int32, device=self.device)
        offs = torch.empty(L, dtype=torch.int32, device=self.device)
        self._hist(idx, T, nc)
        self._xchg(nc, ntpe, offs, host_bad)
        n = self.calls[_CX:_CX + 1] % 2  # device-side parity: no host read
        return torch.index_select(self.buf.local("counts"), 0, n)[0, :, :self.E].clone()

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes this rank holds (0 once closed)."""
        return self.buf.nbytes if self.buf is not None else 0

    def check(self):
        """Raise a recorded device error (timeout, a refused input of some rank) on the host (one sync).

        A refused input (PeerInputError) or capacity error is reported once and cleared, as
        :meth:`tritonep.EPBuffer.check` does: the exchange stays usable, and a later timeout is recorded (the
        first recorded error wins, so a refusal kept in the status word hid every later one). A timeout stays.
        """
        self.host_reads += 1
        self.raise_status(self.status_words().cpu().clone())  # .cpu() of a CPU tensor is the tensor itself

    def status_words(self) -> torch.Tensor:
        """The status word the exchange kernel writes (int64 device view, no copy), for an owner that reads it
        together with its other host values in one read and hands the values to :meth:`raise_status`."""
        return self.status[:P.v(P.STATUS_WORDS)]

    def raise_status(self, values) -> None:
        """Raise the error ``values`` (a host copy of :meth:`status_words`) records, as :meth:`check` does (a
        refusal is cleared on the device: reported once)."""
        st = torch.as_tensor(values, dtype=torch.int64)
        if int(st[P.v(P.ST_CODE)]) in (P.v(P.STATUS_CAPACITY), P.v(P.STATUS_BAD_INPUT)):
            self.status.zero_()
        raise_for_status(st, self.rank, 0, "counts exchange", self.timeout_s, self.device.type)

    def close(self):
        """Free the symmetric regions (collective: every rank closes in the same order). Idempotent."""
        if self.buf is not None:
            self.buf.close()
            self.buf = None
