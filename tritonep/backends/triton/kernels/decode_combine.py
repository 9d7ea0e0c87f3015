"""Decode combine: partials, their push, the per-chunk wait and the output sums in ONE launch (small T); also the
dispatch backward of the decode tiles (``WEIGHTED=False``, with ``WGRAD`` the per-route weight gradients).

Every program of a grid of ``G`` programs (the tiles' ``dec``, the same grid as the decode dispatch):

1. waits (bounded) until every source finished reading the previous combine's partials (CACK, as the two-kernel
   partial kernel does);
2. for its token-chunk numbers ``c = pid, pid + G, ...`` and every source rank ``src``: reduces the routes of the
   source's chunk that live here (k ascending, fp32, wire-encoded), pushes them into ``src``'s combine staging and
   raises ``ccflag[c, rank] = m`` there, also for chunks past the source's T, so its waits complete
   (:func:`tritonep.backends.triton.kernels.combine.partial_step`, the fused combine's partial step);
3. sums the same chunk numbers of this rank's tokens: waits for ``ccflag[c, r] >= m`` of every rank ``r`` (set by
   program ``pid`` of rank ``r``) and adds the partials in rank order (:func:`tritonep.backends.triton.kernels.combine.sum_arrived`,
   the fused combine's output step);
4. the last program to finish advances ``calls[CALL_COMBINE]`` and adds G to CDATA and CACK in every rank
   (:func:`tritonep.device.signal.finish_launch`), so no torch op advances the counter before the launch.

Waits target only program ``pid`` of other ranks (the waiting program itself for its own rank) or earlier launches,
never another program of this rank's grid: correct in the interpreter at any grid and at grid 1; on the GPU every
program is resident with ``G <= 132`` (see :mod:`tritonep.backends.triton.kernels.decode_dispatch` for the full argument).
Compatibility: the grid adds G to CDATA and CACK (once all its programs finished) and the tiles set
``grid_partial == grid_out == G``, so the two-kernel combine (pull, dispatch backward) can run before or after on the
same buffer. Push only: the weighted combine, or (``WEIGHTED=False``) the dispatch backward, whose partial step
with ``WGRAD`` also pushes ``gw[row]`` into the source's ``wback`` before raising the chunk's flag and whose sum step
gathers them into ``gtw [T, K]`` (the two-kernel path's SEND_WGRAD / RECV_WGRAD).
Summation order and bits equal the two-kernel path. Twin: :func:`tritonep.reference.combine_reference_partial`.
"""

import triton
import triton.language as tl

from .combine import OutIO, PartialIO, open_partial, partial_step, sum_arrived, watch_refusals
from ....device.common import RowTile
from ....device.protocol import CALL_COMBINE, DONE_DECODE_COMBINE, FLAG_CACK, WAIT_CACK
from ....device.signal import finish_launch, publish_host_status, wait_all_ge
from ....wire.kernels.wirecodec import RAW_BF16

__all__ = ["combine_decode_kernel"]


@triton.jit(do_not_specialize=['T', 'cdata_off', 'cack_off', 'timeout', 'Tmax', 'NCmax', 'bad', 'ticket', 'rank'])
def combine_decode_kernel(eo_ptr, hmeta_ptr, hwts_ptr, hntok_ptr, stage_tab, ccflag_tab, ccflag_ptr, topk_idx_ptr,
                          y_ptr, T, flags_ptr, flags_tab, cdata_off, cack_off, calls_ptr, status_ptr, timeout, Tmax,
                          NCmax, rank, W: tl.constexpr, L: tl.constexpr, K: tl.constexpr,
                          KB: tl.constexpr, H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, WB: tl.constexpr,
                          HAS_TIMER: tl.constexpr, RB: tl.constexpr, WIRE: tl.constexpr = RAW_BF16,
                          POW2: tl.constexpr = False, gw_ptr=None, wback_tab=None, wback_ptr=None, gtw_ptr=None,
                          WEIGHTED: tl.constexpr = True, WGRAD: tl.constexpr = False, bad=0, cbad_tab=None,
                          cbad_ptr=None, host_st_ptr=None, ticket=0, HOST_ST: tl.constexpr = 0,
                          DIRECT: tl.constexpr = False):
    """Weighted push combine (or, ``WEIGHTED=False``, the dispatch backward) in one launch (module docstring).

    ``eo [R, H]`` expert outputs (bf16), the dispatch handle's ``hmeta``/``hwts [W, Tmax, K]`` and ``hntok [W]``,
    this rank's ``topk_idx [T, K]``; output ``y [T, H]`` (bf16) = sum over ranks ascending of the partials, each
    partial = sum over k ascending of ``w * eo[row]`` in fp32 (wire-rounded). ``ccflag``: int64 ``[NCmax, W]``.
    A wait that gives up records STATUS_TIMEOUT with the peer and the chunk's output is NaN. ``bad`` != 0: this
    rank takes part as refused (:func:`tritonep.backends.triton.kernels.combine.open_partial`); a rank that did makes every output
    NaN and is recorded (program 0: chunk 0, or with no token :func:`tritonep.backends.triton.kernels.combine.watch_refusals`);
    with ``ticket`` != 0 the last program publishes the status for the host's read of an eager combine.
    ``WEIGHTED=False``: partials without the weights (the dispatch backward); ``WGRAD`` also returns
    ``gtw[t, k] = gw[row(t, k)]`` (float32 ``gw [R]``, ``gtw [T, K]``; 0 where the route is masked) through
    ``wback`` (``wback_tab`` the peers' regions, ``wback_ptr`` this rank's).

    DIRECT (world 1, raw bf16 wire, bf16 rows, no WGRAD: a token's one partial is its output row bit for bit, as
    :func:`tritonep.backends.triton.kernels.combine.combine_partial_kernel`'s ``y_ptr``): the partial step stores the
    output rows ``y`` (zeros for a token without a route) before raising the chunk's flag, and the sum step only
    waits and writes NaN over a failed call's chunks: no partial is staged.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    m = tl.load(calls_ptr + CALL_COMBINE) + 1
    wait_all_ge(flags_ptr + FLAG_CACK * W, W, (m - 1) * G, status_ptr, WAIT_CACK, timeout, HAS_TIMER, WB)
    live = open_partial(bad, m, cbad_tab, status_ptr, flags_tab, W, rank, WB)
    tile: tl.constexpr = RowTile(K, KB, H, BH, BT, RB, WIRE, HAS_TIMER)
    if WGRAD:
        partial_io = PartialIO(eo_ptr, hmeta_ptr, hwts_ptr, hntok_ptr, gw_ptr, stage_tab, wback_tab, Tmax, rank)
        out_io = OutIO(topk_idx_ptr, y_ptr, T, stage_tab, wback_ptr, gtw_ptr, Tmax, rank)
    else:
        partial_io = PartialIO(eo_ptr, hmeta_ptr, hwts_ptr, hntok_ptr, hwts_ptr, stage_tab, stage_tab, Tmax, rank)
        out_io = OutIO(topk_idx_ptr, y_ptr, T, stage_tab, y_ptr, y_ptr, Tmax, rank)
    for c in range(pid, NCmax, G):
        for s in range(W):
            src = (s + rank) % W  # each rank starts with itself: the ranks' first pushes go to different peers
            if DIRECT:
                partial_step(src, c, live, m, ccflag_tab, partial_io, tile, W, True, WEIGHTED, WGRAD, POW2, y_ptr)
            else:
                partial_step(src, c, live, m, ccflag_tab, partial_io, tile, W, True, WEIGHTED, WGRAD, POW2)
    for c in range(pid, tl.cdiv(T, BT), G):
        sum_arrived(c, m, ccflag_ptr, status_ptr, timeout, out_io, tile, W, L, WB, WGRAD, cbad_ptr, flags_ptr,
                    DIRECT)
    if pid == 0:
        if T == 0:
            if bad == 0:  # no token: still learn of a refusal in this call (a refused rank knows its own)
                watch_refusals(m, ccflag_ptr, status_ptr, timeout, cbad_ptr, W, WB, HAS_TIMER)
    if finish_launch(calls_ptr, DONE_DECODE_COMBINE, CALL_COMBINE, m, CALL_COMBINE, m, False, flags_tab, cdata_off,
                     cack_off, W, rank, WB):
        if HOST_ST > 0:
            if ticket != 0:  # an eager combine: the host reads the status once every program is done
                publish_host_status(status_ptr, host_st_ptr, ticket, HOST_ST, HAS_TIMER)
