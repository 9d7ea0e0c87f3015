"""What dispatch returns: :class:`Dispatched` (rows + layout) and the frozen handle that undoes it.

:class:`DispatchHandle` (defined with the backends, :mod:`tritonep.backends.handle`) holds what every backend records;
each backend's handle type adds its routing state (:class:`tritonep.backends.triton.handle.TritonHandle`,
:class:`tritonep.backends.nccl.handle.NcclHandle`). A handle owns the routing its combine and backward passes read (a
copy made at dispatch): a caller that refills its ``topk_idx`` / ``topk_weights`` in place after dispatch changes
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..backends.handle import DispatchHandle

__all__ = ["Dispatched", "DispatchHandle"]


@dataclass
class Dispatched:
    """Output of :meth:`tritonep.EPBuffer.dispatch`.

    Attributes:
        x: ``[R, H]`` received rows, expert-grouped (segment j = rows of local expert j, ordered by (source rank,
            token, k); alignment padding rows are zero). ``R = expert_offsets[-1]`` when the host knows it, else
            ``max_recv_tokens`` rows whose tail past ``expert_offsets[-1]`` is unspecified.
        x_scales: wire scales when ``keep_quantized=True`` (fp8: float32 ``[R, H/128]``; mxfp4: uint8
            ``[R, H/32]``), else None.
        num_tokens_per_expert: int32 ``[L]`` real rows per local expert (device).
        expert_offsets: int32 ``[L]`` cumulative aligned segment ends (``offs`` of ``torch._grouped_mm``).
        weights: float32 ``[R]`` router weight of each row's route (0 on padding rows).
        handle: the frozen :class:`DispatchHandle` for combine.
    """

    x: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    handle: DispatchHandle
    weights: Optional[torch.Tensor] = None
    x_scales: Optional[torch.Tensor] = None
