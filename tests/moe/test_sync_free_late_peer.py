"""A sync-free MoE layer step that one rank reaches after its peer gave up waiting for it (triton backend; the nccl
backend has no kernel waits): neither rank returns a finite value computed without the other's data, and both
ranks' ``check()`` raise PeerTimeoutError (the late rank naming the peer that gave up); every step before it equals
the dense reference. Before, the late rank's forward returned a finite wrong ``y`` (its tokens routed to the
timed-out rank's experts took the partial sums that rank skipped) and its ``check()`` passed
(tests/ep/test_late_peer.py covers the buffer on every kernel path).
"""

import time

import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tests.support.outcomes import timeout_verdict

H, E, K, TM = 64, 4, 2, 8


def _geo():
    return tep.MoEGeometry(hidden=H, intermediate=32, num_experts=E, topk=K, max_tokens_per_rank=TM)


def _inputs(rank, step):
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(5, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(5)])
    return x, idx, torch.rand(5, K, generator=g) + 0.1


def _world(group):
    rank = dist.get_rank(group)
    layer = tep.MoELayer(tep.MoERecipe(sync_free=True), _geo(), group, seed=3, timeout_s=3.0, backend="triton")
    out = []
    for step in range(3):  # two warm-up steps (the interpreter's first launches are slow), then the late one
        if step == 2 and rank == 1:
            time.sleep(6.0)  # its peer gives up after 3 s
        out.append(layer(*_inputs(rank, step)).clone())
    err = timeout_verdict(layer.buffer.check, message=False)
    layer.close()
    return out, err


def test_late_rank_gets_no_finite_wrong_value_and_every_rank_raises():
    from tritonep.reference import moe_dense_reference

    w1, w2 = tep.MoELayer.init_expert_weights(_geo(), seed=3)
    res = run_cpu_world(2, _world, timeout_s=120)  # same launches on both ranks, one of them late
    for r, (ys, err) in enumerate(res):
        for step, y in enumerate(ys[:2]):
            ref = moe_dense_reference(*_inputs(r, step), w1, w2)
            assert torch.allclose(y.float(), ref.float(), rtol=2 ** -5, atol=2 ** -5), (r, step)
        assert bool(torch.isnan(ys[2]).all()), (r, ys[2])  # cannot pass for a result
    assert res[0][1] == ("PeerTimeoutError", "dispatch.counts", 1), res[0][1]  # rank 0 waited for rank 1 and gave up
    assert res[1][1] == ("PeerTimeoutError", "peer.gave_up", 0), res[1][1]  # rank 1 learned it from rank 0's mark
