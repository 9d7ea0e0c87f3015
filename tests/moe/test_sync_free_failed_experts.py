"""``MoELayer(MoERecipe(sync_free=True))`` in a training loop where one rank's experts raise in one step's forward
(e.g. out of memory), both backends.

The failing rank cancels its combine (``EPBuffer.cancel_combine``), so its peers' output is NaN; but they read
nothing in a sync-free step and run their backward and next step, so a failing rank that raised at once left them
without it (the next step returned NaN on every rank on the triton backend; gloo aborted a rank on the nccl
backend). Now the failing rank, too, runs the step on (NaN output, the same collectives forward and backward, NaN
gradients) and raises the experts' error at its next ``check()`` (``EPBuffer.defer``), while its peers' ``check()``
raises PeerInputError naming it; the next step equals the dense reference on every rank. (An eager layer raises on
every rank in the step itself: tests/ep/test_failed_peer.py.)
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.outcomes import verdict

H, K, TM = 64, 2, 8


def _geo(W):
    return tep.MoEGeometry(hidden=H, intermediate=32, num_experts=2 * W, topk=K, max_tokens_per_rank=TM)


def _world(group, backend):
    import tritonep.moe.layer as mod

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    layer = tep.MoELayer(tep.MoERecipe(sync_free=True), _geo(W), group, seed=2, backend=backend, timeout_s=60)
    orig = mod.expert_ffn_parts_forward
    out = []
    for step in range(3):
        x, idx, w = make_rank_inputs(rank, 6, H, 2 * W, K, seed=step, mask_frac=0.0)
        x = x.clone().requires_grad_(True)
        if rank == 1 and step == 1:
            def boom(*a, **k):
                raise RuntimeError("experts ran out of memory")
            mod.expert_ffn_parts_forward = boom
        try:
            y = layer(x, idx, w)  # no rank raises in a sync-free step
        finally:
            mod.expert_ffn_parts_forward = orig
        y.float().sum().backward()  # every rank runs its backward, as any training loop does
        chk = verdict(layer.buffer.check, RuntimeError)
        out.append((y.detach().float().clone(), bool(torch.isnan(x.grad).any()), chk, (x.detach(), idx, w)))
    layer.close()
    return out


@pytest.mark.parametrize("W,backend", [(2, "triton"), (2, "nccl"), pytest.param(3, "triton", marks=pytest.mark.slow)])
def test_failed_experts_in_a_sync_free_step_raise_at_check_and_the_next_step_pairs(W, backend):
    from tritonep.reference import moe_dense_reference

    res = run_cpu_world(W, _world, backend, timeout_s=300)
    w1, w2 = tep.MoELayer.init_expert_weights(_geo(W), seed=2)
    for r, out in enumerate(res):
        y, nan_grad, chk, _ = out[1]
        assert bool(torch.isnan(y).all()), r  # every rank's output of the failed step: NaN
        assert chk == (("RuntimeError", "experts ran out of memory") if r == 1 else ("PeerInputError", [1])), (r, chk)
        if r == 1:
            assert nan_grad  # the failing rank's gradients cannot pass for a result either
        for step in (0, 2):
            y, nan_grad, chk, inp = out[step]
            assert chk == ("ok", None) and not nan_grad, (r, step, chk)
            ref = moe_dense_reference(*inp, w1, w2)
            assert torch.allclose(y, ref, rtol=2 ** -5, atol=2 ** -5), (r, step)
