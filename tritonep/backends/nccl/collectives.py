"""The collective helpers of the nccl backend's services: one flat all_gather, an even all_to_all between
persistent tensors bound once, and the CUDA-graph refusal.

Bounded waits: this backend has no kernel waits; a peer that never arrives is caught by the process group's own
timeout (``torch.distributed`` / NCCL watchdog).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import BackendError
from ...runtime import recorder as _rec
from ...runtime.recorder import record

__all__ = ["all_gather_flat", "all_to_all_rows", "refuse_capture", "BoundCollective"]


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group):
    """Gather every rank's ``inp`` (1-D, same length) into the flat ``out`` (``[W * len]``): one collective."""
    single = getattr(dist, "all_gather_single", None)  # torch >= 2.13 deprecates all_gather_into_tensor
    if single is None:
        dist.all_gather_into_tensor(out, inp, group=group)
    else:
        record(("collective", "all_gather_single"))  # the CPU world's protocol recorder does not wrap it
        single(out, inp, group=group)


def all_to_all_rows(recv: torch.Tensor, send: torch.Tensor, in_splits, out_splits, group) -> torch.Tensor:
    """``all_to_all_single`` of contiguous ``[N, ...]`` tensors along rows with uneven splits (``in_splits`` rows of
    ``send`` to each peer, ``out_splits`` rows of ``recv`` from each): one collective; returns ``recv``."""
    dist.all_to_all_single(recv, send, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
    return recv


class BoundCollective:
    """One synchronous even ``all_to_all_single`` between two FIXED tensors, bound once: ``c()`` runs it.

    Same semantics as ``dist.all_to_all_single(out, inp, group=group)`` (equal splits, ``async_op=False``: the same
    backend method with the same options, so on NCCL the collective is ordered on the caller's current stream, and
    ``wait()`` as the wrapper does), but the call goes straight to the process group's backend object for ``out``'s
    device: torch's Python wrapper (argument checks, a logging decorator, ``AllToAllOptions`` made per call, the c10d
    dispatcher op) is skipped. Host cost on the H200 host: ``benchmarks/probes/collective_cost.py`` row
    ``all_to_all_single_even_bound`` next to the wrapper's ``all_to_all_single_even``. Where the group has no backend
    object for the device (a fake or wrapped group), the call takes the wrapper.

    The CPU world's protocol recorder sees ``("collective", "all_to_all_single")`` as through the wrapper (which it
    wraps; the direct path records itself). Graph capture: as the wrapper (NCCL captures the collective).

    Args:
        out / inp: contiguous tensors of one dtype on one device with the same number of rows, a multiple of the
            group size, persistent for the life of the object (their addresses are bound).
        group: the process group (None: the default group), resolved on the first call.
    """

    __slots__ = ("out", "inp", "group", "_direct")

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, group):
        self.out, self.inp, self.group = out, inp, group
        self._direct = None  # (method, args), or False for the wrapper: resolved on the first call

    def _resolve(self):
        try:
            g = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
            be = g._get_backend(self.out.device)
            opts = dist.distributed_c10d.AllToAllOptions()
            if hasattr(opts, "asyncOp"):
                opts.asyncOp = False  # what the wrapper sets for async_op=False (NCCL: the current stream)
            return be.alltoall_base, (self.out, self.inp, [], [], opts)
        except (AttributeError, RuntimeError, TypeError, ValueError):
            return False

    def __call__(self):
        d = self._direct
        if d is None:
            d = self._direct = self._resolve()
        if d is False:
            dist.all_to_all_single(self.out, self.inp, group=self.group)
            return
        if _rec._RECORDER is not None:  # the CPU world's recorder wraps the torch.distributed entry points only
            _rec._RECORDER(_EVENT)
        work = d[0](*d[1])
        if work is not None:
            work.wait()


_EVENT = ("collective", "all_to_all_single")


def refuse_capture(device: torch.device, what: str):
    """Raise BackendError while ``device``'s current stream is being captured (host split sizes are needed)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise BackendError(f"the nccl backend's {what} cannot be captured in a CUDA graph (host split sizes); use "
                           f"backend='triton' for graphs")
