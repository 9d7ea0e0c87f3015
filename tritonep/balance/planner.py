"""Host wrapper of the Triton virtual-expert planner: ONE launch, no host sync, bit-equal to the torch twins.

``plan(counts, topk_idx, rank, mode=m)`` == ``(place_torch(counts, m), remap_torch(topk_idx, place_torch(counts,
m), rank, counts))`` bit for bit in both modes (tested), computed by :func:`tritonep.balance.kernels.planner.plan_kernel`
(placement on one program while the others histogram, look back and remap their route chunks; one warp while the
placement tiles are small, see ``_plan_warps``). The kernel's roles and flags use a small persistent state per
device (``_sync_state``), zeroed once and never reset between calls (only after a launch that raised inside it,
see :func:`plan`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tritonep.balance.placement import (
    MAX_PLANNER_EXPERTS, MAX_PLANNER_WORLD, PLACEMENT_MODES, Placement, _check_mode, check_counts,
)
from tritonep.balance.remap import check_topk_idx
from tritonep.errors import PlanError
from tritonep.device import protocol as P
from tritonep.device.common import check_kernel_mode
from tritonep.balance.kernels.planner import plan_kernel

__all__ = ["plan", "plan_status", "check_plan_status", "raise_plan_bits"]

_STATUS_BITS = {P.v(P.PLAN_NEGATIVE_COUNT): "a negative entry in counts",
                P.v(P.PLAN_HISTOGRAM_MISMATCH): "topk_idx histogram differs from counts[rank]",
                P.v(P.PLAN_BAD_EXPERT_ID): "an expert id outside [-1, num_experts) in topk_idx",
                P.v(P.PLAN_WAIT_GAVE_UP): "an internal wait of the planner kernel gave up (TRITONEP_TIMEOUT_S)",
                P.v(P.PLAN_COUNT_OVERFLOW): "counts whose total valid routes does not fit int32"}
MAX_PLAN_PROGRAMS = 256  # route chunks per launch (the kernel's flag vector is sized from it)
# the kernel's persistent state per device, see _sync_state
_SYNC: dict = {}


# The launch runs one warp while the placement's largest tile (W_PAD * max(L_PAD, W_PAD)) has at most
# _ONE_WARP_TILE elements: every reduction of the serial placement loops (the critical path) is then a warp shuffle
# (no shared memory round trip, no barrier). Larger tiles take 4 warps up to 1024 elements, else 8. The placement
# loads _RB_ELEMS counts per unrolled step; the chunk programs sum 1024 * warps scratch elements per step.
_ONE_WARP_TILE = 512
_RB_ELEMS = 2048


def _plan_warps(w_pad: int, l_pad: int) -> int:
    """num_warps of the launch for padded world ``w_pad`` and padded local experts ``l_pad`` (see above)."""
    tile = w_pad * max(l_pad, w_pad)
    return 1 if tile <= _ONE_WARP_TILE else (4 if tile <= 1024 else 8)


def _pow2(n: int) -> int:
    return max(2, 1 << max(0, (int(n) - 1).bit_length()))


def _launch_config(world: int, num_experts: int, num_routes: int, num_programs: Optional[int],
                   block: Optional[int], num_warps: Optional[int], on_gpu: bool,
                   lookback_group: Optional[int]) -> dict:
    """Launch geometry of :func:`plan` from shapes only (graph-capturable): ``num_programs`` (G), ``chunk``
    (routes per chunk), ``group`` (look-back group size), ``num_groups``, ``num_warps`` and the kernel's
    constexprs ``W_PAD, L_PAD, E_PAD, BLOCK, CB, RB, CH, FB``. Raises :class:`PlanError` on a bad knob."""
    L = num_experts // world
    w_pad, l_pad, e_pad = _pow2(world), _pow2(L), _pow2(num_experts)
    warps = _plan_warps(w_pad, l_pad) if num_warps is None else num_warps
    if warps not in (1, 2, 4, 8):
        raise PlanError(f"num_warps={num_warps} must be 1, 2, 4 or 8")
    if block is None:  # the ordinal pass holds a [block, block] tile and [block, W_PAD] run rows in registers
        block = (64 if warps == 1 or w_pad > 16 else 128) if on_gpu else 64
    if block not in (16, 32, 64, 128, 256):
        raise PlanError(f"block={block} must be a power of two in [16, 256]")
    num_tiles = -(-num_routes // block)
    if num_programs is None:
        num_programs = max(1, min(128, -(-num_routes // 256))) if on_gpu else 1
    if not 1 <= num_programs <= MAX_PLAN_PROGRAMS:
        raise PlanError(f"num_programs={num_programs} must be in [1, {MAX_PLAN_PROGRAMS}]")
    if lookback_group is None:  # ceil(sqrt(G)): minimises the longest look-back, (group - 1) + (G / group - 1) rows
        lookback_group = math.isqrt(num_programs - 1) + 1
    if not 1 <= lookback_group <= MAX_PLAN_PROGRAMS:
        raise PlanError(f"lookback_group={lookback_group} must be in [1, {MAX_PLAN_PROGRAMS}]")
    chunk = max(1, -(-num_tiles // num_programs)) * block
    num_groups = -(-num_programs // lookback_group)
    # pass (C) holds [CB, W_PAD] ends / slot rows: at most ~64 registers each per thread
    cb = max(16, min(_pow2(chunk), 4 * block, max(block, 2048 * warps // w_pad)))
    return dict(num_programs=num_programs, chunk=chunk, group=lookback_group, num_groups=num_groups,
                num_warps=warps, W_PAD=w_pad, L_PAD=l_pad, E_PAD=e_pad, BLOCK=block, CB=cb,
                RB=max(1, min(w_pad, _RB_ELEMS // (w_pad * l_pad))), CH=max(1, min(32, 1024 * warps // e_pad)),
                FB=_pow2(max(lookback_group, num_groups)))


def plan(counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, *, num_programs: Optional[int] = None,
         block: Optional[int] = None, validate: bool = False, mode: str = "reference",
         num_warps: Optional[int] = None, lookback_group: Optional[int] = None) -> tuple[Placement, torch.Tensor]:
    """Plan this step's virtual experts and remap this rank's routes, in one Triton launch.

    Args:
        counts: ``[W, E]`` int32/int64 on the device, ``counts[r, e]`` = valid routes source rank ``r`` sends to
            expert ``e`` (identical on every rank: the gathered dispatch histogram). Any strides.
        topk_idx: ``[T, K]`` int32/int64 on the same device, this rank's global expert ids, -1 = masked. T may be 0.
        rank: this rank in ``[0, W)``.
        num_programs: number of route chunks ``G`` in ``[1, 256]`` (the launch runs ``G + 1`` programs: the
            placement and one per chunk). Default: 1 under the interpreter / on CPU, else ``min(128, ceil(T*K /
            256))`` (a sweep on the H200, ``benchmarks/planner_bench.py --num-programs``: 128 chunks beat 64 by 2-4
            us at 4096 x 8 routes). Derived from shapes only, so the launch stays graph-capturable.
        block: routes per tile, a power of two in ``[16, 256]``; default on CUDA 64 when the launch runs one warp
            (see ``_plan_warps``) or ``W > 16``, else 128; 64 elsewhere. (ptxas -v, sm_90a, E = 256, W = 2 / 4 / 8,
            both modes, these defaults: no register spills, 168-245 registers; 0-4 spill bytes with ``num_warps`` 2
            or 4.)
        validate: read the status word back and raise on bad data (a host sync); default False.
        mode: ``"reference"`` (default, MoonEP / Megatron placement) or ``"minimal"`` (no rank both sends and
            receives, moved routes == total excess when the slots suffice); see
            :func:`tritonep.balance.placement.place_torch`, whose output it equals bit for bit in either mode.
        num_warps: warps of every program of the launch (1, 2, 4 or 8); default ``_plan_warps`` (one warp while
            the placement tiles are small). A benchmark knob (benchmarks/planner_bench.py ``--warps``).
        lookback_group: chunks per look-back group (>= 1): a chunk sums the histograms of the earlier chunks of
            its group and the totals of the earlier groups (published by each group's last chunk), at most
            ``group - 1 + ceil(G / group) - 1`` rows instead of ``G - 1``. Default ``ceil(sqrt(G))``; 1 or ``G``
            reduce to one level. A benchmark knob (``--lookback-groups``).

    Returns:
        ``(placement, runtime_topk_idx)``: a :class:`Placement` of int32 device tensors (``status`` is
        ``[num_programs + 1]`` int32, OR of entries = error bits, see :func:`check_plan_status`) and ``[T, K]`` int32
        runtime expert ids (-1 stays -1; an id outside ``[-1, E)`` becomes ``2E``, outside the runtime range, so the
        dispatch of the runtime ids refuses it on every rank).

    Notes:
        The launch keeps a small persistent state per device (its call number and chunk flags, see
        ``_sync_state``): plan() calls on one device must not run concurrently on two streams, and the first call
        on a device belongs outside a CUDA-graph capture (a warm-up), else the graph also holds the state's
        zero-fill. A program waits only on programs that took an earlier arrival ticket, so no wait can outlive a
        schedule; every wait is still bounded (TRITONEP_TIMEOUT_S; status bit 8). A launch that raises inside
        (an interpreted kernel stopped by an error or Ctrl-C) zeroes the state before the error leaves, so the
        programs it never ran leave no arrival behind.

    Raises:
        PlanError: shape/dtype/device problems, ``E % W != 0``, ``W > MAX_PLANNER_WORLD`` (64), ``E >
            MAX_PLANNER_EXPERTS`` (1024), ``rank`` out of range, bad ``block``, ``num_programs``, ``num_warps`` or
            ``lookback_group``, unknown
            ``mode``; with ``validate=True`` also bad values (negative counts, counts whose total does not fit
            int32, ids outside ``[-1, E)``, ``topk_idx``
            not matching ``counts[rank]``) and an internal wait that gave up (status bit 8).
        ConfigError: the kernels were built for another device (CPU tensors without ``TRITON_INTERPRET=1``, or
            the reverse; :func:`tritonep.device.common.check_kernel_mode`).
    """
    mode_id = PLACEMENT_MODES.index(_check_mode(mode))
    check_counts(counts, max_world=MAX_PLANNER_WORLD, check_values=False)
    world, num_experts = int(counts.shape[0]), int(counts.shape[1])
    if num_experts > MAX_PLANNER_EXPERTS:
        raise PlanError(f"num_experts={num_experts} exceeds the planner limit {MAX_PLANNER_EXPERTS}")
    check_topk_idx(topk_idx, num_experts)
    if topk_idx.device != counts.device:
        raise PlanError(f"topk_idx on {topk_idx.device} but counts on {counts.device}")
    if counts.dtype not in (torch.int32, torch.int64):
        raise PlanError(f"counts must be int32 or int64 for the planner, got dtype {counts.dtype}")
    if not 0 <= int(rank) < world:
        raise PlanError(f"rank={rank} outside [0, {world})")
    on_gpu = counts.device.type == "cuda"
    check_kernel_mode(counts.device.type)
    L = num_experts // world
    num_tokens, topk = int(topk_idx.shape[0]), int(topk_idx.shape[1])
    num_routes = num_tokens * topk
    cfg = _launch_config(world, num_experts, num_routes, num_programs, block, num_warps, on_gpu, lookback_group)
    num_programs = cfg.pop("num_programs")
    chunk, group, num_groups, warps = cfg.pop("chunk"), cfg.pop("group"), cfg.pop("num_groups"), cfg.pop("num_warps")

    dev = counts.device
    i32 = dict(dtype=torch.int32, device=dev)
    out = torch.empty(num_routes, **i32)
    alloc = torch.empty(num_experts, world, **i32)
    slot = torch.empty(num_experts, world, **i32)
    ends = torch.empty(num_experts, world, **i32)
    etc = torch.empty(world, L, **i32)
    quota = torch.empty(world, world, **i32)
    cap = torch.empty(world, **i32)
    status = torch.empty(num_programs + 1, **i32)
    hist = torch.empty(num_programs, cfg["E_PAD"], **i32)  # row c: histogram of route chunk c
    gtot = torch.empty(num_groups, cfg["E_PAD"], **i32)  # row g: routes of look-back group g (its chunks' sum)
    sync, flags = _sync_state(dev, num_programs + 1 + num_groups)
    from tritonep.runtime.status import wait_bound

    try:
        plan_kernel[(num_programs + 1,)](
            counts, counts.stride(0), counts.stride(1),
            topk_idx, topk_idx.stride(0), topk_idx.stride(1), num_routes, chunk, group,
            hist, gtot, alloc, etc, slot, ends, quota, cap, out, status, sync, flags, wait_bound(dev), int(rank),
            W=world, L=L, K=max(1, topk), HAS_TIMER=on_gpu, MODE=mode_id, num_warps=warps, **cfg,
        )
    except BaseException:
        # a launch that stopped inside (an interpreted kernel raising, Ctrl-C) may leave arrivals counted for
        # programs that never ran: every later call would take shifted roles and pass its waits on this call's
        # marks, reading placements not yet written, with a clean status. Start the state afresh.
        _SYNC[str(dev)].zero_()
        raise
    placement = Placement(allocation=alloc, experts_to_copy=etc, expert_slot=slot, segment_ends=ends,
                          quota=quota, capacity=cap, status=status)
    if validate:
        check_plan_status(placement)
    return placement, out.reshape(num_tokens, topk)


def _sync_state(device: torch.device, n_flags: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's persistent state on ``device``: ``(sync [1], flags [>= n_flags])``, int64 views of one zeroed
    tensor, made once on first use at the size of the largest launch (``MAX_PLAN_PROGRAMS`` chunks in look-back
    groups of 1: ``2 * MAX_PLAN_PROGRAMS + 1`` flags, 4 KiB), so it never moves: a CUDA graph captured around one
    plan() keeps a valid pointer whatever later calls need (a state regrown for a larger call freed the one a
    graph had captured).

    One state per device, so plan() calls on one device must not run at the same time (two streams at once);
    calls in stream order and CUDA-graph replays in sequence are fine. Make the first call outside a CUDA-graph
    capture (a warm-up, as capture needs anyway): a state first made inside a capture adds its zero-fill to the
    graph, which stays correct (every replay restarts the call number and the flags together) but is a second
    node in the graph."""
    size = 2 * MAX_PLAN_PROGRAMS + 1
    if n_flags > size:  # _launch_config bounds G and the group count by MAX_PLAN_PROGRAMS
        raise PlanError(f"the planner needs {n_flags} flags, more than its state's {size}")
    key = str(device)
    st = _SYNC.get(key)
    if st is None:
        st = torch.zeros(1 + size, dtype=torch.int64, device=device)
        _SYNC[key] = st
    return st[:1], st[1:]


def plan_status(placement: Placement) -> int:
    """OR of the planner's status words (a host sync). 0 = ok, or for a :func:`place_torch` plan (no status)."""
    if placement.status is None:
        return 0
    bits = 0
    for v in placement.status.cpu().tolist():
        bits |= int(v)
    return bits


def check_plan_status(placement: Placement) -> None:
    """Raise :class:`PlanError` naming every error bit set by the planner kernel (a host sync)."""
    raise_plan_bits(plan_status(placement))


def raise_plan_bits(bits: int) -> None:
    """Raise :class:`PlanError` naming every bit of ``bits`` (the OR of a host copy of ``placement.status``, for
    an owner that reads it with its other host values); 0 returns."""
    bits = int(bits)
    if bits:
        names = [msg for bit, msg in _STATUS_BITS.items() if bits & bit]
        raise PlanError(f"planner status {bits}: " + "; ".join(names))
