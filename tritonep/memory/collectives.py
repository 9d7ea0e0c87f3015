"""Host collectives that work on every process group a multi-rank world can have (NCCL or gloo).

One rank per GPU gets an NCCL group; ranks that share a GPU get a gloo group, because NCCL refuses two ranks on one
device (docs/platform.md, "Several ranks on one GPU"). ``torch.distributed.barrier(device_ids=...)`` exists only on
NCCL, so every barrier of the library goes through :func:`group_barrier`, which does the right thing for the
group's backend. Idea: the xformers / FlashInfer single-GPU tests (gloo when ``device_count() < world_size``);
docs/platform.md records what was measured on the H200.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["uses_nccl", "group_barrier"]


def uses_nccl(group=None) -> bool:
    """True when ``group``'s backend (default: the world) is NCCL (also a mixed ``cpu:gloo,cuda:nccl`` group)."""
    return dist.Backend.NCCL in str(dist.get_backend(group)).lower()


def group_barrier(group=None, device: torch.device | str | int | None = None) -> None:
    """Barrier of ``group``: returns on every rank once every rank called it, with this rank's earlier device work
    on ``device`` ordered before it.

    * NCCL group, CUDA ``device``: ``dist.barrier(group, device_ids=[device.index])`` (the barrier's all-reduce runs
      on that device after the current stream's work; the host waits for it).
    * any other group (gloo: ranks that share a GPU, or CPU worlds), CUDA ``device``: ``torch.cuda.synchronize`` of
      the device, then ``dist.barrier(group)`` on the host.
    * no device or a CPU device: ``dist.barrier(group)``.

    Args:
        group: the process group (None: the default group).
        device: this rank's device (``torch.device``, ``"cuda:0"`` or a CUDA index), or None.

    Raises:
        whatever ``torch.distributed`` raises for a broken group (a peer that died, a timeout).
    """
    if isinstance(device, int):
        device = torch.device("cuda", device)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if uses_nccl(group):
            dist.barrier(group=group, device_ids=[index])
            return
        torch.cuda.synchronize(index)
    dist.barrier(group=group)
