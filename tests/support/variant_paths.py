"""The code paths whose kernel launches a GPU run compiles, as CPU-world rank functions, and a recorder of their
launch keys per rank (:mod:`tests.support.variant_keys`): used by ``benchmarks/probes/variant_count.py`` (how many
variants a world of W ranks compiles) and ``tests/backends/test_rank_variants.py`` (every rank compiles the same ones)."""

from __future__ import annotations

import os
import tempfile

__all__ = ["PATHS", "record"]

PATHS = ("layer", "ep", "virtual", "nccl")


def _layer(group):
    """The MoE layer ``tritonep run`` builds (default recipe: bf16 wires, pull combine), forward + backward."""
    import torch
    import torch.distributed as dist

    from tritonep.bench.cases import make_rank_inputs
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    rank = dist.get_rank()
    layer = MoELayer(MoERecipe(), MoEGeometry(hidden=64, intermediate=32, num_experts=8, topk=2,
                                              max_tokens_per_rank=8), group)
    x, idx, w = make_rank_inputs(rank, 8, 64, 8, 2, seed=3)
    x.requires_grad_(True)
    w.requires_grad_(True)
    layer(x, topk_idx=idx, topk_weights=w).float().sum().backward()
    layer.close()
    del torch


def _ep(group):
    """An EPBuffer's paths: two-kernel push / pull combine, both backwards, every wire (kept quantized rows too),
    the fused one-launch path and the one-launch decode path."""
    import torch.distributed as dist

    import tritonep as tep
    from tritonep.bench.cases import make_rank_inputs

    rank = dist.get_rank()
    for geo in ("", "fs=1,fe=1,fc=1", "bt=2,dec=3"):
        os.environ["TRITONEP_GEOMETRY"] = geo
        try:
            for wire in ("bf16", "fp8", "mxfp4"):
                b = tep.EPBuffer(group, 8, 128, 16, 2, dispatch_wire=wire, combine_wire=wire, expert_alignment=4)
                x, i, w = make_rank_inputs(rank, 9, 128, 8, 2, seed=5)
                x.requires_grad_(True)
                w.requires_grad_(True)
                d = b.dispatch(x, i, w)
                kinds = ("push", "pull") if wire == "bf16" and not geo else ("push",)
                ys = [b.combine(d.x * 1, d.handle, kind=k) for k in kinds]
                sum(y.float().sum() for y in ys).backward()
                if wire != "bf16":
                    b.dispatch(x.detach(), i, w.detach(), keep_quantized=True)
                b.close()
        finally:
            os.environ.pop("TRITONEP_GEOMETRY", None)


def virtual_layer_step(group):
    """The virtual-expert layer (planner, counts exchange, weight push and gradient pull), push combine."""
    import torch.distributed as dist

    from tritonep.bench.cases import make_rank_inputs
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    rank = dist.get_rank()
    layer = MoELayer(MoERecipe(balance="virtual", combine="push"),
                     MoEGeometry(hidden=64, intermediate=32, num_experts=8, topk=2, max_tokens_per_rank=8), group)
    x, idx, w = make_rank_inputs(rank, 8, 64, 8, 2, seed=3)
    x.requires_grad_(True)
    layer(x, topk_idx=idx, topk_weights=w).float().sum().backward()
    layer.close()


def _nccl(group):
    """The nccl backend's Triton paths (``use_triton``): the synced and both sync-free modes, with the backward."""
    import torch.distributed as dist

    import tritonep as tep
    from tritonep.bench.cases import make_rank_inputs
    from tests.support.hooks import backend_of

    rank = dist.get_rank()
    for mode in ("gather", "onehop"):
        os.environ["TRITONEP_NCCL_SYNC_FREE"] = mode
        try:
            b = tep.EPBuffer(group, 8, 64, 32, 2, backend="nccl", expert_alignment=4)
        finally:
            os.environ.pop("TRITONEP_NCCL_SYNC_FREE", None)
        backend_of(b).use_triton = True
        x, i, w = make_rank_inputs(rank, 9, 64, 8, 2, seed=7)
        x.requires_grad_(True)
        w.requires_grad_(True)
        d = b.dispatch(x, i, w)
        b.combine(d.x * 1, d.handle).float().sum().backward()
        f = b.dispatch(x.detach(), i, w.detach(), sync_free=True)
        b.combine(f.x * 1, f.handle)
        b.check()
        b.close()


_FNS = dict(layer=_layer, ep=_ep, virtual=virtual_layer_step, nccl=_nccl)


def _world(group, paths, out):
    from tests.support.variant_keys import record_keys_to

    with record_keys_to(out):
        for p in paths:
            _FNS[p](group)
    return True


def record(world_size: int, paths=PATHS, timeout_s: float = 1800.0) -> list:
    """Run the ``paths`` in a CPU world of ``world_size`` ranks; returns the key records
    (:func:`tests.support.variant_keys.read_keys`)."""
    from tests.support.variant_keys import read_keys
    from tritonep.testing import run_cpu_world

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "keys.jsonl")
        run_cpu_world(world_size, _world, list(paths), out, timeout_s=timeout_s)
        return read_keys(out)
