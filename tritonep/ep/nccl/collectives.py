"""The collective helpers of the nccl backend's services: one flat all_gather, and the CUDA-graph refusal.

Bounded waits: this backend has no kernel waits; a peer that never arrives is caught by the process group's own
timeout (``torch.distributed`` / NCCL watchdog).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import BackendError
from ..recorder import record

__all__ = ["all_gather_flat", "refuse_capture"]


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group):
    """Gather every rank's ``inp`` (1-D, same length) into the flat ``out`` (``[W * len]``): one collective."""
    single = getattr(dist, "all_gather_single", None)  # torch >= 2.13 deprecates all_gather_into_tensor
    if single is None:
        dist.all_gather_into_tensor(out, inp, group=group)
    else:
        record(("collective", "all_gather_single"))  # the CPU world's protocol recorder does not wrap it
        single(out, inp, group=group)


def refuse_capture(device: torch.device, what: str):
    """Raise BackendError while ``device``'s current stream is being captured (host split sizes are needed)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise BackendError(f"the nccl backend's {what} cannot be captured in a CUDA graph (host split sizes); use "
                           f"backend='triton' for graphs")
