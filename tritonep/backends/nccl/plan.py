"""The host plan of the nccl backend (:mod:`tritonep.backends.nccl.backend`).

:func:`host_plan` turns the gathered counts matrix into the layout and the all_to_all split sizes on the host
(numpy), written into one persistent int32 vector that the dispatch copies to the device once. Quantized rows
travel as uint8 ``[payload | scale bytes]`` produced by the torch twins through the wire records
(:meth:`tritonep.wire.WireFormat.quantize_bytes` / ``dequantize_rows``).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["host_plan", "plan_size", "sf_plan_size", "status_size", "device_plan_torch"]


def plan_size(W: int, E: int) -> int:
    """Length of the plan vector: ``send_base [E] | dest_start [W] | num_tokens_per_expert [L] |
    expert_offsets [L] | counts [W * E]``."""
    return E + W + 2 * (E // W) + W * E


def host_plan(m, rank: int, W: int, E: int, A: int, out):
    """Layout and split sizes from the gathered counts matrix (numpy, host), as seen by ``rank``.

    Same integer arithmetic as :func:`tritonep.backends.layout.layout_torch` (tested equal), without torch's per-op
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


def sf_plan_size(W: int, E: int) -> int:
    """Length of the sync-free plan vector: :func:`plan_size`'s fields then ``recv_packets [W]``."""
    return plan_size(W, E) + W


def status_size(W: int) -> int:
    """Length of the nccl backend's int32 status word: ``code, rank, refusals seen, rows needed, bad-id flags [W],
    refused-input flags [W]`` (:mod:`tritonep.backends.nccl.kernels.plan`)."""
    return 4 + 2 * W


def device_plan_torch(m, rank: int, W: int, E: int, A: int, tcap: int, max_recv: int, plan, st, codes) -> None:
    """Twin of :func:`tritonep.backends.nccl.kernels.plan.sync_free_plan_kernel` (its docstring is the specification).

    Args:
        m: int32 ``[W * (E + W + 2)]`` device tensor (the gathered counts matrix, flat); rank, W, E, A as
            :func:`host_plan`; tcap: packet slots per peer; max_recv: rows a rank may receive.
        plan: int32 ``[sf_plan_size(W, E)]``, written; st: int32 ``[status_size(W)]``, updated in place.
        codes: ``(capacity code, bad-input code)`` of the status word.
    """
    L = E // W
    mm = m.view(W, E + W + 2).long()
    c = mm[:, :E]
    total = c.sum(0).view(W, L)
    aligned = total if A == 1 else (total + (A - 1)) // A * A
    incl = torch.cumsum(aligned, 1)
    need = aligned.sum(1)
    nbad, refd = mm[:, E + W] != 0, mm[:, E + W + 1] != 0
    any_bad = (nbad | refd).any()
    maxneed = need.max()
    worst = torch.nonzero(need == maxneed)[0, 0]  # the twin runs on the CPU: no device sync
    cap = maxneed > max_recv
    err = any_bad | cap
    keep = (~err).long()
    o = 0
    plan[o:o + E] = (incl - aligned).reshape(E) + c[:rank].sum(0)
    o += E
    plan[o:o + W] = torch.arange(W, device=m.device) * tcap
    o += W
    plan[o:o + L] = total[rank] * keep
    plan[o + L:o + 2 * L] = incl[rank] * keep
    o += 2 * L
    plan[o:o + W * E] = m.view(W, E + W + 2)[:, :E].reshape(-1)
    plan[o + W * E:] = mm[:, E + rank] * keep
    first = err & (st[0] == 0)
    code = torch.where(any_bad, codes[1], codes[0])
    st[0] = torch.where(first, code, st[0].long()).to(torch.int32)
    st[1] = torch.where(first, worst, st[1].long()).to(torch.int32)
    st[2] += err.to(torch.int32)
    st[3] = torch.where(first, maxneed, st[3].long()).to(torch.int32)
    st[4:4 + W] = torch.maximum(st[4:4 + W], nbad.to(torch.int32))
    st[4 + W:] = torch.maximum(st[4 + W:], refd.to(torch.int32))
