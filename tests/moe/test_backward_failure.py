"""One rank's own part of the MoE layer's BACKWARD fails (its expert FFN backward raises: out of memory, a dtype
error, a user's code; or the gradient's cast before the combine backward), both backends, W = 2 and 3.

Before, the failing rank left the backward at once, so its dispatch backward (which every peer waits for) never ran:
on the triton backend the peers waited ``timeout_s``, then returned a NaN ``x.grad`` without raising and their buffer
was unusable; on the nccl backend they hung in the collective. Now the failing rank runs the rest of the backward's
collectives as cancelled calls (``EPBuffer.cancel_dispatch_backward``; ``cancel_combine_backward`` when it failed
before the combine backward; with virtual experts the weight pull with NaN slot gradients) and returns NaN gradients
(the MoE layers before it run their backward too), then its own error leaves ``backward()`` when the pass ends; its
peers' gradients are NaN (triton: all of ``x.grad``; nccl: every element computed from the failing rank's
rows) and every rank's next ``check()`` -- or next synced dispatch -- raises PeerInputError naming the failing rank.
With ``MoERecipe(sync_free=True)`` no rank raises inside a step: the failing rank returns NaN gradients too and
raises its error at its next ``check()``. Then the layer gives the bits of the step before the failure on every rank.
Cases: the expert backward fails on a rank with tokens, on a rank with zero tokens, before the combine backward,
with virtual experts, and sync-free.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.bench.cases import make_rank_inputs
from tritonep.testing import run_cpu_world
from tests.support.outcomes import verdict

H, K, TM = 64, 2, 8
BAD = 1  # the failing rank


def _geo(W):
    return tep.MoEGeometry(hidden=H, intermediate=32, num_experts=2 * W, topk=K, max_tokens_per_rank=TM)


def _inputs(rank, W, how):
    """Rank ``rank``'s ``(x, topk_idx, topk_weights)``: 6 tokens (routes on every rank), none on the failing rank
    in the zero-tokens case."""
    T = 0 if (how == "zero_tokens" and rank == BAD) else 6
    return make_rank_inputs(rank, T, H, 2 * W, K, seed=3, mask_frac=0.0)


def _grad_kind(g, backend):
    """"NaN" for a gradient that cannot pass for a result where the backend promises (triton: all of it; nccl: at
    least the elements computed from the failing rank's rows), "finite" when it has no NaN, else "some NaN"."""
    if g.numel() == 0:
        return "empty"
    if bool(g.isnan().all()) or (backend == "nccl" and bool(g.isnan().any())):
        return "NaN"
    return "some NaN" if bool(g.isnan().any()) else "finite"


def _world(group, backend, how, read):
    import tritonep.moe.layer as mod

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    recipe = tep.MoERecipe(sync_free=how == "sync_free", balance="virtual" if how == "virtual" else "none")
    layer = tep.MoELayer(recipe, _geo(W), group, seed=2, backend=backend, timeout_s=60)
    x0, idx, w = _inputs(rank, W, how)
    gy = torch.randn(x0.shape, generator=torch.Generator().manual_seed(rank)).to(x0.dtype)
    x0, idx, w, gy = (t.to(layer.device) for t in (x0, idx, w, gy))  # CPU worlds and GPU ones

    def step():
        x = x0.clone().requires_grad_(True)
        y = layer(x, idx, w)
        (y.float() * gy.float()).sum().backward()
        return y.detach().clone(), x.grad.clone()

    first = step()  # a good step: the bits every later good step must give again
    names = {"before_combine": "combine_grad"}
    name = names.get(how, "expert_ffn_parts_backward")
    orig = getattr(mod, name)
    if rank == BAD:
        def boom(*a, **k):
            raise RuntimeError("expert backward ran out of memory")
        setattr(mod, name, boom)
    try:
        failed = verdict(lambda: _grad_kind(step()[1], backend), RuntimeError)
    finally:
        setattr(mod, name, orig)
    out = dict(failed=failed)
    if read == "check":
        out["read"] = verdict(layer.buffer.check, RuntimeError)
    else:  # the next step's synced dispatch raises it on every rank (after its launches)
        out["read"] = verdict(lambda: step() and None, RuntimeError)
    out["check_again"] = verdict(layer.buffer.check, RuntimeError)
    again = step()
    out["same"] = torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    out["finite"] = not bool(again[1].isnan().any())
    layer.buffer.check()
    layer.close()
    return out, first[0].cpu(), tuple(t.cpu() for t in (x0, idx, w))


def _run(W, backend, how, read, world=None):
    from tritonep.reference import moe_dense_reference

    res = (world or run_cpu_world)(W, _world, backend, how, read, timeout_s=300)
    w1, w2 = tep.MoELayer.init_expert_weights(_geo(W), seed=2)
    own = ("RuntimeError", "expert backward ran out of memory")
    for r, (out, y, inp) in enumerate(res):
        if how == "sync_free":  # no rank raises in the step; the failing rank's own error comes at its check()
            assert out["failed"] == ("ok", "NaN" if inp[0].shape[0] else "empty"), (r, out)
            assert out["read"] == (own if r == BAD else ("PeerInputError", [BAD])), (r, out)
        else:
            # never a finite gradient without the peer's rows
            assert out["failed"] == (own if r == BAD else ("ok", "NaN")), (r, out)
            assert out["read"] == ("PeerInputError", [BAD]), (r, out)
        assert out["check_again"] == ("ok", None) and out["same"] and out["finite"], (r, out)
        if inp[0].shape[0]:
            ref = moe_dense_reference(*inp, w1, w2)
            assert torch.allclose(y.float(), ref, rtol=2 ** -5, atol=2 ** -5), r


CASES = [  # W, backend, how, read
    (2, "triton", "experts", "check"),
    (2, "nccl", "experts", "check"),
    (3, "triton", "zero_tokens", "dispatch"),
    (2, "nccl", "before_combine", "dispatch"),
    (2, "triton", "sync_free", "check"),
]
SLOW_CASES = [
    (3, "nccl", "experts", "dispatch"), (2, "triton", "before_combine", "check"), (2, "nccl", "zero_tokens", "check"),
    (3, "nccl", "sync_free", "check"), (2, "triton", "virtual", "check"), (3, "nccl", "virtual", "dispatch"),
]


@pytest.mark.parametrize("W,backend,how,read", CASES)
def test_failed_backward_takes_part_and_raises_on_every_rank(W, backend, how, read):
    _run(W, backend, how, read)


@pytest.mark.slow
@pytest.mark.parametrize("W,backend,how,read", SLOW_CASES)
def test_failed_backward_takes_part_and_raises_on_every_rank_slow(W, backend, how, read):
    _run(W, backend, how, read)


def _two_layer_world(group, backend):
    """Two MoE layers in one eager model; the second layer's expert backward fails once on rank BAD: its first
    layer's backward (which the peers' first layers wait for) must still run there."""
    import tritonep.moe.layer as mod

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    layers = [tep.MoELayer(tep.MoERecipe(), _geo(W), group, seed=2 + i, backend=backend, timeout_s=60)
              for i in range(2)]
    x0, idx, w = (t.to(layers[0].device) for t in _inputs(rank, W, "experts"))

    def step():
        x = x0.clone().requires_grad_(True)
        y = layers[1](layers[0](x, idx, w), idx, w)
        y.float().pow(2).sum().backward()
        return x.grad.clone()

    first = step()
    orig, calls = mod.expert_ffn_parts_backward, []
    if rank == BAD:
        def boom_once(*a, **k):  # the second layer's backward runs first: it fails, the first layer's does not
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("expert backward ran out of memory")
            return orig(*a, **k)
        mod.expert_ffn_parts_backward = boom_once
    try:
        failed = verdict(lambda: _grad_kind(step(), backend), RuntimeError)
    finally:
        mod.expert_ffn_parts_backward = orig
    reads = [verdict(lay.buffer.check, RuntimeError) for lay in layers]
    again = step()
    out = dict(failed=failed, reads=reads, calls=len(calls), same=torch.equal(first, again))
    for lay in layers:
        lay.close()
    return out


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_failed_backward_lets_the_earlier_layers_take_part(backend):
    """Before, the failing rank raised out of the backward at once, so its earlier layer never ran its backward:
    the peers' earlier layer timed out (triton) or hung (nccl). Now it returns NaN gradients, the earlier layer runs
    as on the peers, and the error leaves backward() when the pass ends."""
    res = run_cpu_world(2, _two_layer_world, backend, timeout_s=300)
    for r, out in enumerate(res):
        want = ("RuntimeError", "expert backward ran out of memory") if r == BAD else ("ok", "NaN")
        assert out["failed"] == want, (r, out)
        assert out["reads"] == [("ok", None), ("PeerInputError", [BAD])], (r, out)  # the second layer's buffer
        assert out["same"], (r, out)
    assert res[BAD]["calls"] == 2  # the first layer's expert backward ran on the failing rank
