"""Fused dispatch: send and expand in ONE launch, overlapping NVLink transfer with the receive-side expand.

The two-kernel dispatch (:mod:`tritonep.backends.triton.kernels.dispatch`) expands only after every source finished sending, so the
NVLink time and the HBM expand time add up. Here the grid is split by role: programs ``[0, GS)`` send token chunks
(:func:`tritonep.backends.triton.kernels.dispatch.send_chunk`) and after each chunk publish a per-(source, chunk) arrival flag in
every destination (``cflag[rank, c] = n``, the call number, atomic max with release semantics); programs
``[GS, G)`` walk the (chunk, source) items in send order, wait for that one chunk's flag (bounded, acquire) and
expand it (:func:`tritonep.backends.triton.kernels.dispatch.expand_arrived`, the receive step it shares with the decode dispatch)
while later chunks are still in flight. The senders open with the prologue every dispatch kernel shares
(:func:`tritonep.backends.triton.kernels.dispatch.open_send`). Idea: the per-chunk signalling of DeepEP's intranode kernels and of
pplx-kernels (see ../shared/reference), in a Triton grid.
The own rank's rows are not staged (any wire): its expanders read them from ``x_ptr`` in this same launch and encode
them themselves (:func:`tritonep.backends.triton.kernels.dispatch.source_tile`); the own chunk flags are still waited
for (the ``meta`` rows).

Compatibility with the two-kernel path (combine backward still uses it on the same buffer): every program of a
role adds 1 to DATA / ACK as the two-kernel grids do, and the tiles make the two-kernel grids EQUAL the role
sizes (``grid_send == GS``, ``grid_expand == GE``), so both paths add the same per-call totals and either can
follow the other. (Weighting one program's increment to make different grid sizes add up is wrong: a waiter can
see the total transiently reached while programs are still running.) The flag value is the call number, not a
count, so calls that do not use the fused path leave nothing to catch up.

Requirements: every program of the grid must be able to run at once (``G <= resident CTAs``; the kernel-tile table
keeps ``G`` within the SM count), else expanders could spin while senders wait for a free SM (the bounded wait then
reports a timeout instead of hanging). In the interpreter programs run in order, senders first, which is valid.
Twin: :func:`tritonep.reference.dispatch_reference` (the output equals the two-kernel path bit for bit).
"""

import triton
import triton.language as tl

from ....device.common import RowTile
from .dispatch import ExpandIO, SendIO, expand_arrived, open_send, send_chunk, zero_padding
from ....device.protocol import CALL_DISPATCH, ST_SKIP_CALL, STATUS_TIMEOUT
from ....device.signal import publish_epoch, signal_peers
from ....wire.kernels.wirecodec import RAW_BF16


@triton.jit(do_not_specialize=['T', 'data_off', 'ack_off', 'timeout', 'G_send_std', 'G_expand_std', 'Tmax',
                               'NCmax', 'nrows', 'rank'])
def dispatch_fused_kernel(x_ptr, topk_idx_ptr, topk_w_ptr, rows_ptr, T, pre_ptr, send_base_ptr,
                          stage_tab, meta_tab, wts_tab, ntok_tab, cflag_tab, cflag_ptr,
                          stage_ptr, meta_ptr, wts_ptr, ntok_ptr, out_ptr, out_w_ptr, hmeta_ptr, hwts_ptr,
                          hntok_ptr, ntpe_ptr, offs_ptr,
                          flags_ptr, flags_tab, data_off, ack_off, calls_ptr, status_ptr, timeout,
                          G_send_std, G_expand_std, Tmax, NCmax,
                          GS: tl.constexpr, rank, W: tl.constexpr, E: tl.constexpr,
                          L: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, H: tl.constexpr, BH: tl.constexpr,
                          BT: tl.constexpr, WB: tl.constexpr, BA: tl.constexpr, A: tl.constexpr,
                          HAS_TIMER: tl.constexpr, RB: tl.constexpr, WIRE: tl.constexpr = RAW_BF16,
                          POW2: tl.constexpr = False, KEEP_Q: tl.constexpr = False, q_ptr=None, s_ptr=None,
                          PF: tl.constexpr = False, nrows=0):
    """Forward dispatch in one launch (see the module docstring); grid ``GS + GE`` programs, ``GS`` senders.

    Sender side as :func:`tritonep.backends.triton.kernels.dispatch.dispatch_send_kernel` with COMPUTE_ROWS (every sender also
    writes ``ntok[rank] = T`` in every destination before its first flag); receiver side as
    :func:`tritonep.backends.triton.kernels.dispatch.dispatch_expand_kernel` with KEEP_HANDLE (no backward modes); ``nrows``: the
    rows of ``out`` / ``q`` / ``s`` / ``out_w`` (no row at or past it is written).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n = tl.load(calls_ptr + CALL_DISPATCH)
    tile: tl.constexpr = RowTile(K, KB, H, BH, BT, RB, WIRE, HAS_TIMER)
    if pid < GS:
        _, live = open_send(n, G_expand_std, None, 0, T, flags_ptr, flags_tab, status_ptr, ntok_tab, timeout, rank,
                            tile, W, WB)
        send_io = SendIO(x_ptr, topk_idx_ptr, topk_w_ptr, rows_ptr, T, pre_ptr, send_base_ptr, stage_tab, meta_tab,
                         wts_tab, Tmax, rank)
        for c in range(pid, NCmax, GS):
            if c * BT < T:
                send_chunk(c, live, send_io, tile, W, E, L, True, POW2, True)
            publish_epoch(cflag_tab, W, rank * NCmax + c, n, WB)
        signal_peers(flags_tab, data_off, W, rank, WB)
    else:
        e = pid - GS
        GE = G - GS
        skip = (tl.load(status_ptr) == STATUS_TIMEOUT) | (tl.load(status_ptr + ST_SKIP_CALL) == n)
        expand_io = ExpandIO(x_ptr, stage_ptr, meta_ptr, wts_ptr, ntok_ptr, out_ptr, out_w_ptr, hmeta_ptr, hwts_ptr,
                             hntok_ptr, out_ptr, out_w_ptr, q_ptr, s_ptr, Tmax, nrows, rank)
        for item in range(e, W * NCmax, GE):
            c = item // W
            src = item % W
            expand_arrived(src, c, n, skip, cflag_ptr, NCmax, status_ptr, flags_ptr, timeout, expand_io, tile, KEEP_Q,
                           PF, W, WB, POW2)
        if A > 1:
            if skip == 0:  # a refused call's segments may exceed the rows allocated: write nothing
                zero_padding(e, GE, expand_io, ntpe_ptr, offs_ptr, tile, L, BA, KEEP_Q)
        signal_peers(flags_tab, ack_off, W, rank, WB)
