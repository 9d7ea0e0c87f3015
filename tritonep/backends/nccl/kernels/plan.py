"""The device plan of the nccl backend's sync-free dispatch: one program, no host read.

:func:`sync_free_plan_kernel` turns the gathered counts matrix (int32 ``[W, E + W + 2]``: per source rank, routes
per expert, packets per destination rank, ids outside ``[-1, E)``, the refused flag) into what the synced
dispatch's host plan (:func:`tritonep.backends.nccl.plan.host_plan`) computes, with fixed per-peer packet slots, plus the
per-source received-packet counts and the buffer's status word. Every rank sees the same matrix, so every rank
reaches the same verdict. Twin (the specification, same bits): :func:`tritonep.backends.nccl.plan.device_plan_torch`.

Plan vector (int32): ``send_base [E] | dest_start [W] (= d * TCAP) | num_tokens_per_expert [L] |
expert_offsets [L] | counts [W * E] | recv_packets [W]``. A refused call (some rank's input bad or refused, or some
rank needing more than MAXR rows) writes zeros into ``num_tokens_per_expert``, ``expert_offsets`` and
``recv_packets`` (the receiver then drops every packet: no row lands) and records the refusal in the status word
(int32 ``[4 + 2W]``: code, rank of the worst capacity, refusals seen, rows it needed, then per rank a bad-id flag and
a refused-input flag; the code, rank and rows are the first unread refusal's, the flags gather every one's).

Idea: the ``num_worst_tokens`` layout of DeepEP / Hybrid-EP (fixed-size receive, layout on the device); our code.
"""

import triton
import triton.language as tl

__all__ = ["sync_free_plan_kernel"]


@triton.jit(do_not_specialize=['rank'])
def sync_free_plan_kernel(m_ptr, plan_ptr, st_ptr, rank, W: tl.constexpr, E: tl.constexpr,
                          L: tl.constexpr, A: tl.constexpr, TCAP: tl.constexpr, MAXR: tl.constexpr,
                          WB: tl.constexpr, LB: tl.constexpr, CODE_CAP: tl.constexpr, CODE_BAD: tl.constexpr):
    """One program (module docstring). ``m`` int32 ``[W, E + W + 2]``; ``plan`` int32 (layout above), written;
    ``st`` int32 ``[4 + 2W]``, updated."""
    NC: tl.constexpr = E + W + 2
    s = tl.arange(0, WB)  # source rank (axis 0) / destination rank (axis 1)
    j = tl.arange(0, LB)
    sm = s < W
    jm = j < L
    m3 = sm[:, None, None] & sm[None, :, None] & jm[None, None, :]
    c = tl.load(m_ptr + s[:, None, None] * NC + s[None, :, None] * L + j[None, None, :], mask=m3, other=0)
    total = tl.sum(c, 0)  # [WB (dest rank), LB]: rows of every expert
    aligned = (total + (A - 1)) // A * A
    incl = tl.cumsum(aligned, 1)
    before = tl.sum(tl.where(s[:, None, None] < rank, c, 0), 0)  # routes of lower source ranks
    need = tl.sum(aligned, 1)  # [WB]
    nbad = tl.load(m_ptr + s * NC + E + W, mask=sm, other=0)
    refd = tl.load(m_ptr + s * NC + E + W + 1, mask=sm, other=0)
    any_bad = tl.max(((nbad != 0) | (refd != 0)).to(tl.int32), 0) > 0
    maxneed = tl.max(need, 0)
    worst = tl.min(tl.where(need == maxneed, s, WB), 0)
    cap = maxneed > MAXR
    err = any_bad | cap
    rj = sm[:, None] & jm[None, :]
    tl.store(plan_ptr + s[:, None] * L + j[None, :], incl - aligned + before, mask=rj)
    tl.store(plan_ptr + E + s, s * TCAP, mask=sm)
    mine = (s == rank)[:, None]
    ntpe = tl.sum(tl.where(mine, total, 0), 0)
    offs = tl.sum(tl.where(mine, incl, 0), 0)
    tl.store(plan_ptr + E + W + j, tl.where(err, 0, ntpe), mask=jm)
    tl.store(plan_ptr + E + W + L + j, tl.where(err, 0, offs), mask=jm)
    tl.store(plan_ptr + E + W + 2 * L + s[:, None, None] * E + s[None, :, None] * L + j[None, None, :], c, mask=m3)
    rc = tl.load(m_ptr + s * NC + E + rank, mask=sm, other=0)
    tl.store(plan_ptr + E + W + 2 * L + W * E + s, tl.where(err, 0, rc), mask=sm)
    # the status word: the first unread refusal's code / rank / rows, every refusal's flags
    code0 = tl.load(st_ptr)
    first = err & (code0 == 0)
    tl.store(st_ptr, tl.where(first, tl.where(any_bad, CODE_BAD, CODE_CAP), code0))
    tl.store(st_ptr + 1, tl.where(first, worst, tl.load(st_ptr + 1)))
    tl.store(st_ptr + 2, tl.load(st_ptr + 2) + err.to(tl.int32))
    tl.store(st_ptr + 3, tl.where(first, maxneed, tl.load(st_ptr + 3)))
    fb = tl.load(st_ptr + 4 + s, mask=sm, other=0)
    tl.store(st_ptr + 4 + s, tl.maximum(fb, (nbad != 0).to(tl.int32)), mask=sm)
    fr = tl.load(st_ptr + 4 + W + s, mask=sm, other=0)
    tl.store(st_ptr + 4 + W + s, tl.maximum(fr, (refd != 0).to(tl.int32)), mask=sm)
