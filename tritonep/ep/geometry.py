"""Kernel geometry (tile sizes, grids, combine kind) from a small static table, never autotuned at run time.

Keyed by (device kind, world_size, hidden, token bucket, wire). The GPU rows were measured on the H200 with
``benchmarks/ep_bench.py`` (see benchmarks/README.md); CPU rows keep interpreter runs short (one program, big tiles).
Grids must be identical on every rank (receivers wait for ``calls * grid`` arrivals), so the choice depends only on
the static configuration, which EPBuffer checks is the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

from .. import envs

__all__ = ["Geometry", "select_geometry"]


@dataclass(frozen=True)
class Geometry:
    """Tiles and grids of the EP kernels.

    bt: tokens per tile; bh: hidden columns per tile; grid_*: programs of each kernel; num_warps; combine: "push"
    or "pull".
    """

    bt: int
    bh: int
    grid_hist: int
    grid_send: int
    grid_expand: int
    grid_partial: int
    grid_out: int
    num_warps: int
    combine: str


def select_geometry(device_type: str, world_size: int, hidden: int, max_tokens_per_rank: int, topk: int,
                    wire: str = "bf16", num_sms: int | None = None) -> Geometry:
    """The geometry for a static configuration (see module docstring).

    ``num_sms`` (or TRITONEP_NUM_SMS) caps every grid: communication kernels then leave the rest of the chip free
    for expert GEMMs.
    """
    cap = num_sms if num_sms else envs.num_sms()
    forced = envs.combine_kind()
    if device_type != "cuda":
        bh = min(triton.next_power_of_2(hidden), 1024)
        g = Geometry(bt=16, bh=bh, grid_hist=1, grid_send=1, grid_expand=1, grid_partial=1, grid_out=1,
                     num_warps=4, combine="push")
    else:
        bh = min(triton.next_power_of_2(hidden), 1024)
        bt = 16 if topk <= 8 else 8
        chunks = max(1, triton.cdiv(max_tokens_per_rank, bt))
        big = max_tokens_per_rank >= 1024
        grid = min(132, max(8, chunks * (2 if world_size <= 2 else 1)))
        g = Geometry(bt=bt, bh=bh, grid_hist=min(132, chunks), grid_send=grid, grid_expand=grid,
                     grid_partial=grid, grid_out=grid, num_warps=8 if big else 4, combine="push")
    if cap:
        g = Geometry(g.bt, g.bh, min(g.grid_hist, cap), min(g.grid_send, cap), min(g.grid_expand, cap),
                     min(g.grid_partial, cap), min(g.grid_out, cap), g.num_warps, g.combine)
    if forced in ("push", "pull"):
        g = Geometry(g.bt, g.bh, g.grid_hist, g.grid_send, g.grid_expand, g.grid_partial, g.grid_out,
                     g.num_warps, forced)
    return g
