"""The host plan of the nccl backend (:mod:`tritonep.ep.nccl.backend`).

:func:`host_plan` turns the gathered counts matrix into the layout and the all_to_all split sizes on the host
(numpy). Quantized rows travel as uint8 ``[payload | scale bytes]`` produced by the torch twins through the
wire records (:meth:`tritonep.wire.WireFormat.quantize_bytes` / ``dequantize_rows``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["host_plan"]


def host_plan(m, rank: int, W: int, E: int, A: int):
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
