"""An in-place edit of a tensor autograd saved, between the forward and the backward, is refused (as torch does
with its version counters), never turned into a gradient of other values than the forward used.

Combine uses the row weights the dispatch moved, so ``d.weights.mul_(2)`` after dispatch changed the gradient
(through the in-place op's own backward) but not the forward sum: a wrong gradient. It was refused only on the
pooled triton outputs (by accident: they are views); now on every path: pool on, off or exhausted, sync-free, the
decode geometry, the nccl backend and the ``tritonep::dispatch`` op (graph capture: the GPU test of
tests/ep/test_failed_peer_gpu.py). Also the expert output combine saved, and the MoE layer's weights.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import set_env


def _outcome(fn):
    """"refused at the edit" / "refused at backward" (torch's RuntimeErrors) / "accepted" (the backward ran)."""
    try:
        fn()
    except RuntimeError as e:
        msg = str(e)
        if "modified by an inplace operation" in msg:
            return "refused at backward"
        if "is a view and is being modified inplace" in msg or "has been modified inplace" in msg:
            return "refused at the edit"  # a view autograd made (the pooled outputs): at the edit or its next use
        raise
    return "accepted"


def _world(group, backend, pool, geometry):
    set_env(TRITONEP_OUTPUT_POOL=pool, TRITONEP_GEOMETRY=geometry)
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    E = 2 * W
    buf = tep.EPBuffer(group, E, 64, 8, 2, backend=backend)
    set_env(TRITONEP_GEOMETRY=None)
    res = {}
    keep = []  # "exhausted": every pooled set held by the caller
    for case in ("weights", "weights_sync_free", "weights_no_grad", "expert_out", "weights_after_backward", "op"):
        x, idx, w = make_rank_inputs(rank, 5, 64, E, 2, seed=len(res) + 1)
        x.requires_grad_(True)
        w.requires_grad_(True)

        def step():
            if case == "op":
                from tritonep.ep import ops

                d = ops.dispatch(ops.buffer_id(buf), x, idx, w)
                d.weights.mul_(2)
                y = ops.combine(d.x.clone(), d)
            else:
                d = buf.dispatch(x, idx, w, sync_free=case == "weights_sync_free")
                keep.append(d if pool == "held" else None)
                eo = d.x.clone()
                if case in ("weights", "weights_sync_free"):
                    d.weights.mul_(2)
                elif case == "weights_no_grad":
                    with torch.no_grad():
                        d.weights.mul_(2)
                y = buf.combine(eo, d.handle)
                if case == "expert_out":
                    eo.add_(1.0)
            y.float().sum().backward()
            if case == "weights_after_backward":
                d.weights.mul_(2)  # after the backward: nothing saved is needed any more
        res[case] = _outcome(step)
    buf.close()
    return res


REFUSED = ("refused at backward", "refused at the edit")


def _check(res):
    for r, out in enumerate(res):
        for case, got in out.items():
            # after the backward nothing saved is needed: no refusal at backward (a pooled output is a view that
            # autograd refuses to modify in place at any time, as before)
            want = ("accepted", "refused at the edit") if case == "weights_after_backward" else REFUSED
            assert got in want, (r, case, got)


@pytest.mark.parametrize("W,backend,pool,geometry", [(2, "triton", None, None), (2, "nccl", None, None)])
def test_inplace_edit_of_saved_tensors_is_refused(W, backend, pool, geometry):
    _check(run_cpu_world(W, _world, backend, pool, geometry, timeout_s=240))


@pytest.mark.slow
@pytest.mark.parametrize("W,backend,pool,geometry", [
    (3, "triton", "0", None), (3, "nccl", "0", None),
    (3, "triton", None, None), (2, "triton", "held", None), (2, "triton", None, "bt=2,dec=2"),
    (3, "triton", "0", "fs=1,fe=1,fc=1"), (2, "nccl", "held", None), (2, "nccl", "0", None)])
def test_inplace_edit_of_saved_tensors_is_refused_every_path(W, backend, pool, geometry):
    _check(run_cpu_world(W, _world, backend, "3" if pool == "held" else pool, geometry, timeout_s=240))


def _moe_world(group, backend):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    geo = tep.MoEGeometry(hidden=64, intermediate=32, num_experts=2 * W, topk=2, max_tokens_per_rank=8)
    layer = tep.MoELayer(tep.MoERecipe(), geo, group, seed=1, backend=backend)
    x, idx, w = make_rank_inputs(rank, 5, 64, 2 * W, 2, seed=3)
    out = []
    for edit in ("w1", "x"):
        xr = x.clone().requires_grad_(True)
        y = layer(xr, idx, w)

        def step():
            with torch.no_grad():  # e.g. an optimizer step before the backward
                (layer.w1 if edit == "w1" else xr).mul_(2)
            y.float().sum().backward()

        out.append(_outcome(step))
    layer.close()
    return out


@pytest.mark.slow
def test_moe_layer_refuses_an_edit_of_its_saved_weights():
    for out in run_cpu_world(2, _moe_world, "triton", timeout_s=240):
        assert out == ["refused at backward"] * 2, out
