"""``MoELayer(MoERecipe(sync_free=True))`` in a training loop (forward + backward every step) with an input one rank
refuses on the host (more tokens than ``max_tokens_per_rank``; a wrong hidden size; or, found on the device only, an
expert id outside ``[-1, E)``), then a step with good inputs; both backends.

A sync-free step reads nothing, so no rank learns of a refusal before ``check()``; a rank that raised at once would
leave its peers' combine, backward and next step without it (they waited ``timeout_s`` and ended timed out on the
triton backend; their collectives stopped matching and gloo aborted a rank on the nccl backend). So the refusing
rank runs the step as its peers do (``EPBuffer.refuse_dispatch``: the same collectives with no row, its combine
taking part as refused) and returns NaN; every rank's output of that step is NaN, every rank's backward runs, and
every rank's next ``check()`` raises: the refusing rank its own error naming the value, the others PeerInputError
naming it. An id outside ``[-1, E)`` is seen by no host either: every rank runs the step as the refused call it is
(the empty layout, zeros) and every ``check()`` raises (the bad rank naming the value). The steps before and after
equal the dense reference (output and input gradient) on every rank.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import CapacityError, InputError
from tritonep.testing import run_cpu_world
from tests.support.outcomes import verdict

H, E, K, TM = 64, 4, 2, 8


def _geo():
    return tep.MoEGeometry(hidden=H, intermediate=32, num_experts=E, topk=K, max_tokens_per_rank=TM)


def _inputs(rank, step, how):
    g = torch.Generator().manual_seed(10 * step + rank)
    T = TM + 1 if (step == 1 and rank == 1 and how == "cap") else 5
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.1
    gy = torch.randn(T, H, generator=g)
    if step == 1 and rank == 1 and how == "shape":
        x = torch.randn(T, H + 8, generator=g).bfloat16()
        gy = torch.randn(T, H + 8, generator=g)
    if step == 1 and rank == 1 and how == "id":
        idx[2, 1] = E + 3
    return x, idx, w, gy


def _world(group, backend, how):
    rank = dist.get_rank(group)
    layer = tep.MoELayer(tep.MoERecipe(sync_free=True), _geo(), group, seed=3, timeout_s=60, backend=backend)
    out = []
    for step in range(3):
        x, idx, w, gy = (t.to(layer.device) for t in _inputs(rank, step, how))  # CPU worlds and GPU ones
        x = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = layer(x, idx, w)  # no rank raises in a sync-free step
        (y.float() * gy).sum().backward()  # every rank runs its backward
        chk = verdict(layer.buffer.check, InputError, CapacityError)
        out.append((y.detach().float().cpu(), x.grad.float().cpu(), chk))
    layer.close()
    return out


@pytest.mark.parametrize("backend,how", [("triton", "cap"), ("nccl", "cap"), ("triton", "shape"),
                                         ("nccl", "shape"), ("triton", "id"), ("nccl", "id")])
def test_sync_free_layer_refused_input_fails_on_every_rank_and_the_next_step_pairs(backend, how):
    check_results(run_cpu_world(2, _world, backend, how, timeout_s=300), how)


def check_results(res, how):
    """Every rank's record of :func:`_world` (tests/ep/test_late_peer_gpu.py runs it on the GPU too)."""
    from tritonep.reference import moe_dense_reference

    w1, w2 = tep.MoELayer.init_expert_weights(_geo(), seed=3)
    for step in (0, 2):  # before and after: output and input gradient of every rank equal the dense reference
        ins = [_inputs(r, step, how) for r in range(2)]
        x = torch.cat([i[0] for i in ins]).float().requires_grad_(True)
        y = moe_dense_reference(x, torch.cat([i[1] for i in ins]), torch.cat([i[2] for i in ins]), w1.float(),
                                w2.float())
        (y * torch.cat([i[3] for i in ins])).sum().backward()
        for r, (yr, gr) in enumerate(zip(y.detach().split(5), x.grad.split(5))):
            got_y, got_g, chk = res[r][step]
            assert chk == ("ok", None), (r, step, chk)
            assert (got_y - yr).norm() <= 3e-2 * yr.norm(), (r, step, "y")
            assert (got_g - gr).norm() <= 3e-2 * gr.norm(), (r, step, "grad x")
    for r in range(2):
        y, _, chk = res[r][1]
        if how == "id":  # found on the device: every rank ran the refused call (its empty layout: zeros)
            assert bool((y == 0).all()), r
            assert chk == (("InputError", "topk_idx[2, 1] = 7 is outside [-1, num_experts=4)") if r == 1 else
                           ("PeerInputError", [1])), (r, chk)
        else:  # every output NaN (never a finite wrong value); the refusing rank's own error at check()
            assert bool(torch.isnan(y).all()) and y.shape == _inputs(r, 1, how)[0].shape, r
            own = ("CapacityError", "num_tokens=9 exceeds max_tokens_per_rank=8") if how == "cap" else \
                ("InputError", "x must be [..., hidden=64], got shape (5, 72)")
            assert chk == (own if r == 1 else ("PeerInputError", [1])), (r, chk)
