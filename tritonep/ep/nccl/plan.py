"""The host plan of the nccl backend (:mod:`tritonep.ep.nccl.backend`).

:func:`host_plan` turns the gathered counts matrix into the layout and the all_to_all split sizes on the host
(numpy), written into one persistent int32 vector that the dispatch copies to the device once. Quantized rows
travel as uint8 ``[payload | scale bytes]`` produced by the torch twins through the wire records
(:meth:`tritonep.wire.WireFormat.quantize_bytes` / ``dequantize_rows``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["host_plan", "plan_size"]


def plan_size(W: int, E: int) -> int:
    """Length of the plan vector: ``send_base [E] | dest_start [W] | num_tokens_per_expert [L] |
    expert_offsets [L] | counts [W * E]``."""
    return E + W + 2 * (E // W) + W * E


def host_plan(m, rank: int, W: int, E: int, A: int, out):
    """Layout and split sizes from the gathered counts matrix (numpy, host), as seen by ``rank``.

    Same integer arithmetic as :func:`tritonep.ep.layout.layout_torch` (tested equal), without torch's per-op
    overhead on tiny tensors.

    Args:
        m: int32 ``[W, >= E + W]``: per rank, routes per expert (E columns), then packets per destination rank
            (W columns).
        rank: this rank; W, E: world size and experts; A: expert alignment.
        out: int32 ``[plan_size(W, E)]``, written: ``send_base [E]`` (row of this rank's first route to expert e),
            ``dest_start [W]`` (first send packet of each destination rank), this rank's
            ``num_tokens_per_expert [L]`` and ``expert_offsets [L]``, the counts ``[W, E]``.

    Returns:
        ``(rows_needed int64 [W], send_splits tuple, recv_splits tuple)``.
    """
    L = E // W
    c = m[:, :E].astype(np.int64)
    total = c.sum(0).reshape(W, L)
    aligned = total if A == 1 else (total + (A - 1)) // A * A
    seg_start = np.cumsum(aligned, 1) - aligned
    pk = m[:, E:E + W]
    send = pk[rank]
    o = 0
    out[o:o + E] = seg_start.reshape(E) + c[:rank].sum(0)
    o += E
    out[o:o + W] = np.cumsum(send) - send
    o += W
    out[o:o + L] = total[rank]
    out[o + L:o + 2 * L] = np.cumsum(aligned[rank])
    out[o + 2 * L:] = m[:, :E].reshape(-1)
    return aligned.sum(1), tuple(send.tolist()), tuple(pk[:, rank].tolist())
