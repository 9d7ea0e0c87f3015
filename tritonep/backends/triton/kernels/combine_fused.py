"""Fused push combine: partials and output sums in ONE launch, overlapping NVLink transfer with the reduction.

The two-kernel combine (:mod:`tritonep.backends.triton.kernels.combine`) starts summing only after every expert rank pushed every
partial. Here programs ``[0, GS)`` (expert-rank role) walk the (chunk, source) items in chunk order, push the
partials of source ``src``'s token chunk ``c`` into ``src``'s staging and then raise ``ccflag[c, rank] = m`` (the
combine call number, atomic max, release) in ``src``'s memory only (:func:`tritonep.backends.triton.kernels.combine.partial_step`);
programs ``[GS, G)`` (source role) take this rank's token chunks in order, wait until every rank's flag of that chunk
reached ``m`` (bounded, acquire) and sum the chunk (:func:`tritonep.backends.triton.kernels.combine.sum_arrived`) while later chunks
are still in flight. The decode combine (:mod:`tritonep.backends.triton.kernels.decode_combine`) runs the same two steps, every
program taking both roles. Same idea as
:mod:`tritonep.backends.triton.kernels.dispatch_fused` (per-chunk signalling of DeepEP / pplx-kernels).

Compatibility: every program adds 1 to CDATA / CACK and the tiles make ``grid_partial == GS`` and ``grid_out
== GE``, so the per-call totals equal the two-kernel path's; the flag holds the call number, so the two-kernel kernels (pull
combine, dispatch backward with weight gradients) can run on the same buffer before or after. Push only, weighted,
no weight-gradient return. Requirements as in the fused dispatch (all programs resident at once).
Twin: :func:`tritonep.reference.combine_reference_partial` (same bits as the two-kernel path).
"""

import triton
import triton.language as tl

from .combine import (OutIO, PartialIO, finish_combine, open_partial, partial_item_source, partial_step, sum_arrived,
                      watch_refusals)
from ....device.common import RowTile
from ....device.protocol import CALL_COMBINE, DONE_COMBINE_FUSED, FLAG_CACK, WAIT_CACK
from ....device.signal import signal_peers, wait_all_ge
from ....wire.kernels.wirecodec import RAW_BF16


@triton.jit(do_not_specialize=['T', 'cdata_off', 'cack_off', 'timeout', 'G_partial_std', 'G_out_std', 'Tmax',
                               'NCmax', 'bad', 'ticket', 'rank'])
def combine_fused_kernel(eo_ptr, hmeta_ptr, hwts_ptr, hntok_ptr, stage_tab, ccflag_tab, ccflag_ptr,
                         topk_idx_ptr, y_ptr, T,
                         flags_ptr, flags_tab, cdata_off, cack_off, calls_ptr, status_ptr, timeout,
                         G_partial_std, G_out_std, Tmax, NCmax,
                         GS: tl.constexpr, rank, W: tl.constexpr, L: tl.constexpr, K: tl.constexpr,
                         KB: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, WB: tl.constexpr,
                         HAS_TIMER: tl.constexpr, RB: tl.constexpr, WIRE: tl.constexpr = RAW_BF16,
                         POW2: tl.constexpr = False, bad=0, cbad_tab=None, cbad_ptr=None, host_st_ptr=None,
                         ticket=0, HOST_ST: tl.constexpr = 0, DIRECT: tl.constexpr = False):
    """Weighted push combine in one launch (see the module docstring); grid ``GS + GE``, ``GS`` partial programs.

    ``ccflag``: ``[>= NCmax, W]`` int64 per rank (entry ``[c, r]`` = last combine call whose chunk-``c`` partial from
    expert rank ``r`` arrived here). ``y``: ``[T, H]`` output of this rank. ``bad`` != 0: this rank takes part as
    refused (:func:`tritonep.backends.triton.kernels.combine.open_partial`); a rank that did makes every output NaN and is recorded
    (:func:`tritonep.backends.triton.kernels.combine.sum_arrived`, :func:`tritonep.backends.triton.kernels.combine.watch_refusals`); the last
    program publishes the status for the host's read of an eager combine (``ticket``).

    DIRECT (world 1, raw bf16 wire, bf16 expert rows: the one partial of a token is its output row bit for bit, as
    :func:`tritonep.backends.triton.kernels.combine.combine_partial_kernel`'s ``y_ptr``): the partial programs store
    the output rows ``y`` themselves (zeros for a token without a route) before raising each chunk's flag, and the
    output programs only wait for the flags and write NaN over a failed call's chunks: the rows are read once, no
    partial is staged.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    m = tl.load(calls_ptr + CALL_COMBINE) + 1  # this combine's number; its last program advances the counter
    tile: tl.constexpr = RowTile(K, KB, H, BH, BT, RB, WIRE, HAS_TIMER)
    if pid < GS:
        wait_all_ge(flags_ptr + FLAG_CACK * W, W, (m - 1) * G_out_std, status_ptr, WAIT_CACK, timeout, HAS_TIMER, WB)
        live = open_partial(bad, m, cbad_tab, status_ptr, flags_tab, W, rank, WB)
        partial_io = PartialIO(eo_ptr, hmeta_ptr, hwts_ptr, hntok_ptr, hwts_ptr, stage_tab, stage_tab, Tmax, rank)
        for item in range(pid, W * NCmax, GS):
            c, src = partial_item_source(item, GS, W)
            if DIRECT:
                partial_step(src, c, live, m, ccflag_tab, partial_io, tile, W, True, True, False, POW2, y_ptr)
            else:
                partial_step(src, c, live, m, ccflag_tab, partial_io, tile, W, True, True, False, POW2)
        signal_peers(flags_tab, cdata_off, W, rank, WB)
    else:
        e = pid - GS
        GE = G - GS
        NC = tl.cdiv(T, BT)
        out_io = OutIO(topk_idx_ptr, y_ptr, T, stage_tab, y_ptr, y_ptr, Tmax, rank)
        for c in range(e, NC, GE):
            sum_arrived(c, m, ccflag_ptr, status_ptr, timeout, out_io, tile, W, L, WB, False, cbad_ptr, flags_ptr,
                        DIRECT)
        if e == 0:
            if NC == 0:
                if bad == 0:  # no token: still learn of a refusal in this call (a refused rank knows its own)
                    watch_refusals(m, ccflag_ptr, status_ptr, timeout, cbad_ptr, W, WB, HAS_TIMER)
        signal_peers(flags_tab, cack_off, W, rank, WB)
    finish_combine(calls_ptr, DONE_COMBINE_FUSED, m, status_ptr, host_st_ptr, ticket, HOST_ST, HAS_TIMER)
