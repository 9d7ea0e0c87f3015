"""Soak: many dispatch + combine calls with fresh random routing, each checked against the reference.

Every rank regenerates every rank's inputs of call i from (seed, i), so each rank checks its own outputs against
:func:`tritonep.reference.dispatch_reference` / :func:`combine_reference_partial` without extra communication.
Token counts per rank are drawn from ``[0, max_tokens_per_rank]`` (zero included), with masked slots.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..reference import combine_reference_partial, dispatch_reference
from .cases import make_rank_inputs

__all__ = ["soak_world", "call_inputs"]


def call_inputs(i, world_size, cfg, seed=0):
    """Every rank's ``(x, topk_idx, topk_weights)`` of soak call ``i``."""
    g = torch.Generator().manual_seed(seed * 7777 + i)
    ts = torch.randint(0, cfg["Tmax"] + 1, (world_size,), generator=g).tolist()
    return [make_rank_inputs(r, ts[r], cfg["H"], cfg["E"], cfg["K"], seed=seed * 100003 + i,
                             mask_frac=cfg.get("mask", 0.15)) for r in range(world_size)]


def soak_world(group, n, cfg, seed=0):
    """Rank body: ``n`` checked calls; returns (calls done, list of failing call ids)."""
    import tritonep as tep

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    buf = tep.EPBuffer(group, cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"], expert_alignment=cfg.get("A", 1))
    bad = []
    for i in range(n):
        ins = call_inputs(i, W, cfg, seed)
        x, idx, w = (t.to(dev) for t in ins[rank])
        d = buf.dispatch(x, idx, w)
        eo = buf.expert_out_buffer(d.x.shape[0])
        eo.copy_((d.x.float() * 0.5 - 0.25).to(torch.bfloat16))
        y = buf.combine(eo, d.handle)
        ref = dispatch_reference([a[0] for a in ins], [a[1] for a in ins], [a[2] for a in ins], cfg["E"], W,
                                 expert_alignment=cfg.get("A", 1))
        ok = torch.equal(d.x.cpu(), ref[rank].x) and torch.equal(d.expert_offsets.cpu(), ref[rank].expert_offsets)
        eos = [(r_.x.float() * 0.5 - 0.25).to(torch.bfloat16) for r_ in ref]
        yp = combine_reference_partial(eos, ref, [a[1] for a in ins], [a[2] for a in ins],
                                       [len(a[0]) for a in ins])[rank]
        ok = ok and torch.equal(y.cpu(), yp.to(torch.bfloat16))
        if not ok:
            bad.append(i)
    buf.close()
    return n, bad
