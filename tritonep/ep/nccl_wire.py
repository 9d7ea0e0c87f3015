"""Wire rows and the host plan of the nccl backend (:mod:`tritonep.ep.nccl_backend`).

Quantized rows travel as uint8 ``[payload | scale bytes]`` produced by the torch twins of :mod:`tritonep.wire`
(the same bits as the Triton codecs); :func:`_host_plan` turns the gathered counts matrix into the layout and
the all_to_all split sizes on the host (numpy).
"""

from __future__ import annotations

import numpy as np
import torch

from ..wire.formats import payload_bytes, scale_bytes, scale_dtype
from ..wire.fp8 import dequantize_fp8_torch, quantize_fp8_torch
from ..wire.mxfp4 import dequantize_mxfp4_torch, quantize_mxfp4_torch

__all__ = []


def _quantize(wire: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, H]`` rows (bf16 or fp32) -> ``(payload uint8 [N, P], scale bytes uint8 [N, S*itemsize])`` by the twin."""
    if wire == "fp8":
        q, s = quantize_fp8_torch(x)
        return q.view(torch.uint8), s.view(torch.uint8)
    q, s = quantize_mxfp4_torch(x)
    return q, s.view(torch.uint8)


def _wire_views(wire: str, rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 rows ``[N, >= row bytes]`` (any row stride) -> views ``(payload uint8 [N, P], scales [N, S])``."""
    p, nb = payload_bytes(wire, hidden), scale_bytes(wire, hidden)
    return rows[:, :p], rows[:, p:p + nb].view(scale_dtype(wire))


def _dequantize(wire: str, rows: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 fp8 / mxfp4 wire rows ``[N, >= row bytes]`` -> ``[N, H]`` of ``dtype`` (twin: fp32 value, one RNE cast)."""
    q, s = _wire_views(wire, rows, hidden)
    if wire == "fp8":
        return dequantize_fp8_torch(q, s, dtype)
    return dequantize_mxfp4_torch(q, s, dtype)


def _row_bytes(wire: str, hidden: int) -> int:
    """Bytes of one wire row (payload + scales)."""
    return payload_bytes(wire, hidden) + scale_bytes(wire, hidden)


def _host_plan(m, rank: int, W: int, E: int, A: int):
    """Layout and split sizes from the gathered counts matrix (numpy, host), as seen by ``rank``.

    Same integer arithmetic as :func:`tritonep.ep.layout.layout_torch` (tested equal), without torch's per-op
    overhead on tiny tensors.

    Args:
        m: int64 ``[W, E + W + 5]``: per rank, routes per expert (E columns), masked slots, packets per destination
            rank (W columns), packets to nobody, min id, max id, refused flag.
        rank: this rank; W, E: world size and experts; A: expert alignment.

    Returns:
        ``(rows_needed int64 [W], small int32 [(E + 1) + 2L + W*E], send_splits list, recv_splits list,
        routes of this rank)``; ``small`` = ``bms [E + 1]`` (row of this rank's route at sorted position i to
        expert e = ``bms[e] + i``), ``num_tokens_per_expert [L]``, ``expert_offsets [L]``, ``counts [W, E]``.
    """
    L = E // W
    c = m[:, :E]
    total = c.sum(0).reshape(W, L)
    aligned = total if A == 1 else (total + (A - 1)) // A * A
    seg_start = np.cumsum(aligned, 1) - aligned
    mine = m[rank, :E + 1]
    start = np.cumsum(mine) - mine
    bms = np.zeros(E + 1, dtype=np.int64)
    bms[:E] = seg_start.reshape(E) + c[:rank].sum(0) - start[:E]
    small = np.concatenate([bms, total[rank], np.cumsum(aligned[rank]), c.reshape(-1)]).astype(np.int32)
    pk = m[:, E + 1:E + 1 + W]
    return aligned.sum(1), small, pk[rank].tolist(), pk[:, rank].tolist(), int(mine[:E].sum())
