"""Host wrapper of the Triton virtual-expert planner: two launches, no host sync, bit-equal to the torch twins.

``plan(counts, topk_idx, rank, mode=m)`` == ``(place_torch(counts, m), remap_torch(topk_idx, place_torch(counts,
m), rank, counts))`` bit for bit in both modes (tested), computed by :func:`tritonep.kernels.planner.plan_kernel`
(placement + per-chunk expert histograms; one warp while the placement tiles are small, see ``_plan_warps``) then
:func:`tritonep.kernels.planner.plan_remap_kernel` (remap, one route chunk per program).
"""

from __future__ import annotations

from typing import Optional

import torch

from tritonep.balance.placement import (
    MAX_PLANNER_EXPERTS, MAX_PLANNER_WORLD, PLACEMENT_MODES, Placement, _check_mode, check_counts,
)
from tritonep.balance.remap import check_topk_idx
from tritonep.errors import PlanError
from tritonep.kernels.planner import plan_kernel, plan_remap_kernel

__all__ = ["plan", "plan_status", "check_plan_status"]

_STATUS_BITS = {1: "a negative entry in counts", 2: "topk_idx histogram differs from counts[rank]",
                4: "an expert id outside [-1, num_experts) in topk_idx"}


# Launch 1 runs one warp while the placement's largest tile (W_PAD * max(L_PAD, W_PAD)) has at most
# _ONE_WARP_TILE elements: every reduction of the serial placement loops is then a warp shuffle (no shared memory
# round trip, no barrier). Larger tiles take 4 warps up to 1024 elements, else 8 (no register spills for sm_90 at
# any W <= 64, E <= 1024, checked with ptxas). The placement loads _RB_ELEMS counts per unrolled step.
_ONE_WARP_TILE = 512
_RB_ELEMS = 2048


def _plan_warps(w_pad: int, l_pad: int) -> int:
    """num_warps of launch 1 for padded world ``w_pad`` and padded local experts ``l_pad`` (see above)."""
    tile = w_pad * max(l_pad, w_pad)
    return 1 if tile <= _ONE_WARP_TILE else (4 if tile <= 1024 else 8)


def _pow2(n: int) -> int:
    return max(2, 1 << max(0, (int(n) - 1).bit_length()))


def plan(counts: torch.Tensor, topk_idx: torch.Tensor, rank: int, *, num_programs: Optional[int] = None,
         block: Optional[int] = None, validate: bool = False,
         mode: str = "reference") -> tuple[Placement, torch.Tensor]:
    """Plan this step's virtual experts and remap this rank's routes, in two Triton launches.

    Args:
        counts: ``[W, E]`` int32/int64 on the device, ``counts[r, e]`` = valid routes source rank ``r`` sends to
            expert ``e`` (identical on every rank: the gathered dispatch histogram). Any strides.
        topk_idx: ``[T, K]`` int32/int64 on the same device, this rank's global expert ids, -1 = masked. T may be 0.
        rank: this rank in ``[0, W)``.
        num_programs: number of route chunks ``G`` (launch 1 runs ``G + 1`` programs: the placement and one
            histogram per chunk; launch 2 runs ``G``: one chunk each). Default: 1 under the interpreter / on CPU,
            else ``min(64, ceil(T*K / 512))``. Derived from shapes only, so the launches stay graph-capturable.
        block: routes per tile, a power of two in ``[16, 256]``; default 128 on CUDA, 64 elsewhere.
        validate: read the status word back and raise on bad data (a host sync); default False.
        mode: ``"reference"`` (default, MoonEP / Megatron placement) or ``"minimal"`` (no rank both sends and
            receives, moved routes == total excess when the slots suffice); see
            :func:`tritonep.balance.placement.place_torch`, whose output it equals bit for bit in either mode.

    Returns:
        ``(placement, runtime_topk_idx)``: a :class:`Placement` of int32 device tensors (``status`` is
        ``[num_programs + 1]`` int32, OR of entries = error bits, see :func:`check_plan_status`) and ``[T, K]`` int32
        runtime expert ids (-1 stays -1; an id outside ``[-1, E)`` becomes ``2E``, outside the runtime range, so the
        dispatch of the runtime ids refuses it on every rank).

    Raises:
        PlanError: shape/dtype/device problems, ``E % W != 0``, ``W > MAX_PLANNER_WORLD`` (64), ``E >
            MAX_PLANNER_EXPERTS`` (1024), ``rank`` out of range, bad ``block``, unknown ``mode``; with
            ``validate=True`` also bad values (negative counts, ids outside ``[-1, E)``, ``topk_idx`` not matching
            ``counts[rank]``).
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
    if block is None:
        block = 128 if on_gpu else 64
    if block not in (16, 32, 64, 128, 256):
        raise PlanError(f"block={block} must be a power of two in [16, 256]")
    L = num_experts // world
    num_tokens, topk = int(topk_idx.shape[0]), int(topk_idx.shape[1])
    num_routes = num_tokens * topk
    num_tiles = -(-num_routes // block)
    if num_programs is None:
        num_programs = max(1, min(64, -(-num_routes // 512))) if on_gpu else 1
    if num_programs < 1:
        raise PlanError(f"num_programs={num_programs} must be >= 1")
    tiles_per_program = max(1, -(-num_tiles // num_programs))

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
    e_pad = _pow2(num_experts)
    hist = torch.empty(num_programs + 1, e_pad, **i32)  # row 0: prefix over lower ranks; row c+1: chunk c
    chunk = tiles_per_program * block
    meta = dict(W=world, L=L, K=max(1, topk))
    w_pad, l_pad = _pow2(world), _pow2(L)
    plan_kernel[(num_programs + 1,)](
        counts, counts.stride(0), counts.stride(1),
        topk_idx, topk_idx.stride(0), topk_idx.stride(1), num_routes, chunk,
        hist, alloc, etc, slot, ends, quota, cap, status,
        int(rank), **meta, W_PAD=w_pad, L_PAD=l_pad, E_PAD=e_pad, BLOCK=block,
        RB=max(1, min(w_pad, _RB_ELEMS // (w_pad * l_pad))),
        MODE=mode_id, num_warps=_plan_warps(w_pad, l_pad),
    )
    plan_remap_kernel[(num_programs,)](
        counts, counts.stride(0), counts.stride(1),
        topk_idx, topk_idx.stride(0), topk_idx.stride(1), num_routes, chunk,
        hist, ends, slot, out, status,
        int(rank), **meta, W_PAD=_pow2(world), E_PAD=e_pad, BLOCK=block, CH=max(1, min(32, 4096 // e_pad)),
    )
    placement = Placement(allocation=alloc, experts_to_copy=etc, expert_slot=slot, segment_ends=ends,
                          quota=quota, capacity=cap, status=status)
    if validate:
        check_plan_status(placement)
    return placement, out.reshape(num_tokens, topk)


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
    bits = plan_status(placement)
    if bits:
        names = [msg for bit, msg in _STATUS_BITS.items() if bits & bit]
        raise PlanError(f"planner status {bits}: " + "; ".join(names))
