"""Fused dispatch: send and expand in ONE launch, overlapping NVLink transfer with the receive-side expand.

The two-kernel dispatch (:mod:`tritonep.kernels.dispatch`) expands only after every source finished sending, so the
NVLink time and the HBM expand time add up. Here the grid is split by role: programs ``[0, GS)`` send token chunks
(:func:`tritonep.kernels.dispatch.send_chunk`) and after each chunk publish a per-(source, chunk) arrival flag in
every destination (``cflag[RANK, c] = n``, the call number, atomic max with release semantics); programs
``[GS, G)`` walk the (chunk, source) items in send order, wait for that one chunk's flag (bounded, acquire) and
expand it (:func:`tritonep.kernels.dispatch.expand_item`) while later chunks are still in flight. Idea: the
per-chunk signalling of DeepEP's intranode kernels and of pplx-kernels (see ../shared/reference), in a Triton grid.
On the raw bf16 wire the own rank's rows are not staged: its expanders read them from ``x_ptr`` in this same launch
(:func:`tritonep.kernels.dispatch.source_tile`); the own chunk flags are still waited for (the ``meta`` rows).

Compatibility with the two-kernel path (combine backward still uses it on the same buffer): every program of a
role adds 1 to DATA / ACK as the two-kernel grids do, and the geometry makes the two-kernel grids EQUAL the role
sizes (``grid_send == GS``, ``grid_expand == GE``), so both paths add the same per-call totals and either can
follow the other. (Weighting one program's increment to make different grid sizes add up is wrong: a waiter can
see the total transiently reached while programs are still running.) The flag value is the call number, not a
count, so calls that do not use the fused path leave nothing to catch up.

Requirements: every program of the grid must be able to run at once (``G <= resident CTAs``; the geometry table
keeps ``G`` within the SM count), else expanders could spin while senders wait for a free SM (the bounded wait then
reports a timeout instead of hanging). In the interpreter programs run in order, senders first, which is valid.
Twin: :func:`tritonep.reference.dispatch_reference` (the output equals the two-kernel path bit for bit).
"""

import triton
import triton.language as tl

from .dispatch import expand_item, send_chunk, zero_padding
from .protocol import CALL_DISPATCH, FLAG_ACK, ST_SKIP_CALL, STATUS_TIMEOUT, WAIT_ACK, WAIT_DATA
from .signal import publish_epoch, signal_peers, wait_all_ge, wait_ge
from .wirecodec import RAW_BF16


@triton.jit(do_not_specialize=['T', 'data_off', 'ack_off', 'timeout', 'G_send_std', 'G_expand_std', 'Tmax',
                               'NCmax'])
def dispatch_fused_kernel(x_ptr, topk_idx_ptr, topk_w_ptr, rows_ptr, T, pre_ptr, send_base_ptr,
                          stage_tab, meta_tab, wts_tab, ntok_tab, cflag_tab, cflag_ptr,
                          stage_ptr, meta_ptr, wts_ptr, ntok_ptr, out_ptr, out_w_ptr, hmeta_ptr, hwts_ptr,
                          hntok_ptr, ntpe_ptr, offs_ptr,
                          flags_ptr, flags_tab, data_off, ack_off, calls_ptr, status_ptr, timeout,
                          G_send_std, G_expand_std, Tmax, NCmax,
                          GS: tl.constexpr, RANK: tl.constexpr, W: tl.constexpr, E: tl.constexpr,
                          L: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, H: tl.constexpr, BH: tl.constexpr,
                          BT: tl.constexpr, WB: tl.constexpr, BA: tl.constexpr, A: tl.constexpr,
                          HAS_TIMER: tl.constexpr, RB: tl.constexpr, WIRE: tl.constexpr = RAW_BF16,
                          POW2: tl.constexpr = False, KEEP_Q: tl.constexpr = False, q_ptr=None, s_ptr=None,
                          PF: tl.constexpr = False):
    """Forward dispatch in one launch (see the module docstring); grid ``GS + GE`` programs, ``GS`` senders.

    Sender side as :func:`tritonep.kernels.dispatch.dispatch_send_kernel` with COMPUTE_ROWS (every sender also
    writes ``ntok[RANK] = T`` in every destination before its first flag); receiver side as
    :func:`tritonep.kernels.dispatch.dispatch_expand_kernel` with KEEP_HANDLE (no backward modes).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    n = tl.load(calls_ptr + CALL_DISPATCH)
    if pid < GS:
        wait_all_ge(flags_ptr + FLAG_ACK * W, W, (n - 1) * G_expand_std, status_ptr, WAIT_ACK, timeout, HAS_TIMER, WB)
        live = (tl.load(status_ptr) != STATUS_TIMEOUT) & (tl.load(status_ptr + ST_SKIP_CALL) != n)
        for d in range(W):
            nt = tl.load(ntok_tab + d).to(tl.pointer_type(tl.int32))
            tl.store(nt + RANK, T)
        for c in range(pid, NCmax, GS):
            if c * BT < T:
                send_chunk(c, x_ptr, topk_idx_ptr, topk_w_ptr, rows_ptr, T, pre_ptr, send_base_ptr, stage_tab,
                           meta_tab, wts_tab, live, Tmax, RANK, W, E, L, K, KB, H, BH, BT, True, RB, WIRE, POW2,
                           HAS_TIMER)
            publish_epoch(cflag_tab, W, RANK * NCmax + c, n, WB)
        signal_peers(flags_tab, data_off, W, RANK, WB)
    else:
        e = pid - GS
        GE = G - GS
        skip = (tl.load(status_ptr) == STATUS_TIMEOUT) | (tl.load(status_ptr + ST_SKIP_CALL) == n)
        for item in range(e, W * NCmax, GE):
            c = item // W
            src = item % W
            wait_ge(cflag_ptr + src * NCmax + c, n, status_ptr, WAIT_DATA, src, timeout, HAS_TIMER)
            skip_now = skip | (tl.load(status_ptr) == STATUS_TIMEOUT)
            Ts = tl.load(ntok_ptr + src, volatile=True)
            if c == 0:
                tl.store(hntok_ptr + src, Ts)
            if c * BT < Ts:
                expand_item(src, c, Ts, skip_now, x_ptr, stage_ptr, meta_ptr, wts_ptr, out_ptr, out_w_ptr,
                            hmeta_ptr, hwts_ptr, out_ptr, out_w_ptr, Tmax, RANK, K, KB, H, BH, BT, False, False, True,
                            HAS_TIMER, RB, WIRE, KEEP_Q, q_ptr, s_ptr, PF)
        if A > 1:
            if skip == 0:  # a refused call's segments may exceed the rows allocated: write nothing
                zero_padding(e, GE, out_ptr, out_w_ptr, out_w_ptr, ntpe_ptr, offs_ptr, L, H, BH, BA, False, KEEP_Q)
        signal_peers(flags_tab, ack_off, W, RANK, WB)
