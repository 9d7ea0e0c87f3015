"""Kernel launches for multi-rank protocols: compile every variant on every rank before its first use.

A bounded wait must never expire because a peer is still compiling the kernel that would signal it (on a fresh
machine a compile takes seconds). On a GPU, the first launch of each kernel variant (name + constexpr values) is
compiled with ``kernel.warmup`` on every rank and followed by a host barrier of the group; later launches go
straight to the kernel. Data-dependent integer arguments are marked ``do_not_specialize`` in the kernels, so a
variant depends only on the static configuration, identical on every rank (checked at construction).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Launcher"]


class Launcher:
    """``launcher(kernel, grid, *args, **kwargs)``: launch with compile-then-barrier on first use (GPU only)."""

    def __init__(self, device: torch.device, group):
        self.device = device
        self.group = group
        self.compiled: set = set()

    def __call__(self, kernel, grid, *args, **kwargs):
        if self.device.type == "cuda":
            key = (getattr(getattr(kernel, "fn", None), "__name__", repr(kernel)),
                   tuple(sorted((k, repr(v)) for k, v in kwargs.items() if not hasattr(v, "data_ptr"))))
            if key not in self.compiled:
                kernel.warmup(*args, grid=grid, **kwargs)
                self.compiled.add(key)
                if not torch.cuda.is_current_stream_capturing():
                    torch.cuda.synchronize(self.device)
                    dist.barrier(group=self.group, device_ids=[self.device.index])
        return kernel[grid](*args, **kwargs)
