"""MoE layer soak: many forward+backward steps with fresh random routing, each checked against the dense reference.

Every rank regenerates every rank's inputs of step i from (seed, i) (token counts drawn from ``[0, Tmax]``, zero
included, with masked ``-1`` slots), so each rank checks its own output and gradients against
:func:`tritonep.reference.moe_dense_reference` + autograd over all ranks' tokens without extra communication. One
:class:`tritonep.MoELayer` serves every step (its weights are not updated, so the reference weights stay those of
:meth:`tritonep.MoELayer.init_expert_weights`).

Error measure per step (the same as ``tritonep run``): ``max |got - ref| / max |ref|`` for the output, grad x, grad
topk_weights and this rank's grad w1 / grad w2, the maximum taken over the whole reference tensor (all ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["moe_soak_world", "step_inputs", "TOL"]

TOL = 3e-2
"""Relative tolerance of a step (bf16 activations, weights and wires; fp32 accumulation), as ``tritonep run``."""


def step_inputs(i: int, world_size: int, cfg: dict, seed: int = 0):
    """Every rank's ``(x [T_r, H] bf16, topk_idx [T_r, K] int64, topk_weights [T_r, K] float32, grad_y [T_r, H]
    bf16)`` of soak step ``i``; ``T_r`` drawn from ``[0, cfg["Tmax"]]``. Deterministic in ``(seed, i)``."""
    from .cases import make_rank_inputs

    g = torch.Generator().manual_seed(seed * 7777 + i)
    ts = torch.randint(0, cfg["Tmax"] + 1, (world_size,), generator=g).tolist()
    out = []
    for r in range(world_size):
        x, idx, w = make_rank_inputs(r, ts[r], cfg["H"], cfg["E"], cfg["K"], seed=seed * 100003 + i,
                                     mask_frac=cfg.get("mask", 0.15))
        gy = torch.randn(ts[r], cfg["H"], generator=torch.Generator().manual_seed(seed * 31337 + i * 131 + r))
        out.append((x, idx.to(torch.int64), w.to(torch.float32), gy.to(torch.bfloat16)))
    return out


def _rel(got: torch.Tensor, ref_part: torch.Tensor, ref_all: torch.Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    return float((got.float() - ref_part.float()).abs().max() / ref_all.float().abs().max().clamp_min(1e-12))


def moe_soak_world(group, n: int, cfg: dict, seed: int = 0):
    """Rank body: ``n`` checked MoE layer forward+backward steps.

    Args:
        group: the EP group (world size W; ``cfg["E"]`` must be a multiple of W).
        n: steps. cfg: ``E`` experts, ``H`` hidden, ``I`` intermediate, ``K`` top-k, ``Tmax`` max tokens per rank,
            optional ``mask`` (fraction of -1 slots), ``combine`` (``"pull"``/``"push"``), ``balance``
            (``"none"``/``"virtual"``).
        seed: input and weight seed.

    Returns:
        ``(steps done, failing step ids, worst relative error)`` of this rank.

    Raises:
        ConfigError: from the layer's construction (e.g. E not a multiple of W); any layer error of a step.
    """
    from ..moe import MoEGeometry, MoELayer, MoERecipe
    from ..reference import moe_dense_reference

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    geo = MoEGeometry(hidden=cfg["H"], intermediate=cfg["I"], num_experts=cfg["E"], topk=cfg["K"],
                      max_tokens_per_rank=cfg["Tmax"])
    recipe = MoERecipe(combine=cfg.get("combine", "pull"), balance=cfg.get("balance", "none"))
    layer = MoELayer(recipe, geo, group, device=dev, seed=seed)
    # drawn on the layer's device type (CUDA and CPU draws differ), then to the host for the reference
    w1_all, w2_all = (t.cpu() for t in MoELayer.init_expert_weights(geo, seed=seed, dtype=torch.bfloat16, device=dev))
    L = cfg["E"] // W
    bad, worst = [], 0.0
    try:
        for i in range(n):
            ins = step_inputs(i, W, cfg, seed)
            x, idx, w, gy = ins[rank]
            layer.zero_grad(set_to_none=True)
            xr = x.to(dev).clone().requires_grad_(True)
            wr = w.to(dev).clone().requires_grad_(True)
            y = layer(xr, topk_idx=idx.to(dev), topk_weights=wr)
            (y.float() * gy.to(dev).float()).sum().backward()
            # dense fp32 reference over every rank's tokens, this rank's slice compared
            X = torch.cat([a[0] for a in ins]).float().requires_grad_(True)
            Wt = torch.cat([a[2] for a in ins]).requires_grad_(True)
            w1 = w1_all.float().requires_grad_(True)
            w2 = w2_all.float().requires_grad_(True)
            yref = moe_dense_reference(X, torch.cat([a[1] for a in ins]), Wt, w1, w2)
            (yref * torch.cat([a[3] for a in ins]).float()).sum().backward()
            for t in (X, Wt, w1, w2):  # a leaf no valid route touched has no gradient: it is zero
                if t.grad is None:
                    t.grad = torch.zeros_like(t)
            lo = sum(a[0].shape[0] for a in ins[:rank])
            sl = slice(lo, lo + x.shape[0])
            e0 = rank * L
            g1 = layer.w1.grad if layer.w1.grad is not None else torch.zeros_like(layer.w1)
            g2 = layer.w2.grad if layer.w2.grad is not None else torch.zeros_like(layer.w2)
            errs = [_rel(y.detach().cpu(), yref.detach()[sl], yref.detach()),
                    _rel(xr.grad.cpu() if xr.grad is not None else torch.zeros_like(x), X.grad[sl], X.grad),
                    _rel(wr.grad.cpu() if wr.grad is not None else torch.zeros_like(w), Wt.grad[sl], Wt.grad),
                    _rel(g1.detach().cpu(), w1.grad[e0:e0 + L], w1.grad),
                    _rel(g2.detach().cpu(), w2.grad[e0:e0 + L], w2.grad)]
            err = max(errs)
            worst = max(worst, err)
            if not err <= TOL:  # NaN fails too
                bad.append(i)
    finally:
        layer.close()
    return n, bad, worst
