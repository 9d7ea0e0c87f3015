"""Several forwards of one MoELayer before their backwards (pipeline micro-batches, activation recompute).

Three micro-batches per rank run (a) interleaved: forward 1, backward 1, forward 2, ...; (b) all forwards first, then
the backwards in reverse order; (c) through ``torch.utils.checkpoint`` (the first forward keeps nothing, the backward
recomputes it). Every output and every per-micro-batch gradient (input, router, experts) must be bit-equal across
(a), (b), (c): the same arithmetic on the same data, only the order of calls differs. The saved forwards of (b) spill
their expert output rows out of the shared region (one spill per later forward), (a) and (c) spill nothing. (a) and (b) run on the
triton backend (push combine with virtual experts, so both the expert rows and the slot weights live in symmetric
memory; 2 micro-batches) and the nccl backend, (c) on the nccl backend (the saved-state lifetime is
backend-independent), in 2-rank CPU worlds. A forward past ``MoERecipe.max_saved_forwards`` drops the oldest, whose
backward raises BufferStateError naming the limit. A second forward before the first backward, on a plain layer,
gives the first backward's gradients unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from tritonep.errors import BufferStateError
from tritonep.moe import MoEGeometry, MoELayer, MoERecipe
from tritonep.testing import run_cpu_world
from tests.support.harness import BF16

TOKENS = [[12, 16, 5], [9, 0, 16]]  # per rank, per micro-batch (a rank with 0 tokens in micro-batch 2)


def _grads(layer, x):
    return [x.grad.clone()] + [p.grad.clone() for p in (layer.router.weight, layer.w1, layer.w2)]


def _micro_world(group, recipe_kw, backend, modes, n):
    rank = dist.get_rank(group)
    geo = MoEGeometry(64, 32, 8, 2, 16)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(T, 64, generator=g).bfloat16() for T in TOKENS[rank][:n]]
    gys = [torch.randn(T, 64, generator=g) for T in TOKENS[rank][:n]]

    def run(layer, mode):
        layer.zero_grad(set_to_none=True)
        ins = [x.clone().requires_grad_() for x in xs]
        ys, grads, spills = [None] * n, [None] * n, layer._stash.spills

        def back(i):
            layer.zero_grad(set_to_none=True)
            (ys[i].float() * gys[i]).sum().backward()
            grads[i] = _grads(layer, ins[i])

        if mode == "interleaved":
            for i in range(n):
                ys[i] = layer(ins[i])
                back(i)
        elif mode == "reversed":
            for i in range(n):
                ys[i] = layer(ins[i])
            for i in reversed(range(n)):
                back(i)
        else:  # activation recompute
            for i in range(n):
                ys[i] = checkpoint(layer, ins[i], use_reentrant=False)
                back(i)
        assert not layer._stash, (mode, len(layer._stash))  # every saved forward consumed or freed with its graph
        return [y.detach() for y in ys], grads, layer._stash.spills - spills

    layer = MoELayer(MoERecipe(**recipe_kw), geo, group, seed=2, dtype=torch.float32, backend=backend)
    out = {m: run(layer, m) for m in ("interleaved",) + modes}
    if backend == "nccl":  # past the limit: the oldest saved forward is dropped, its backward raises on every rank
        limited = MoELayer(MoERecipe(max_saved_forwards=2, **recipe_kw), geo, group, seed=2, dtype=torch.float32,
                           backend=backend)
        ys = [limited(x.clone().requires_grad_()) for x in xs]
        try:
            ys[0].float().sum().backward()
            out["limit"] = "no error"
        except BufferStateError as e:
            out["limit"] = str(e)
        for y in ys[1:]:
            y.float().sum().backward()
        limited.close()
    layer.close()
    return out


# the triton world runs 2 micro-batches (each interpreted call costs seconds; virtual experts: both the expert rows and
# the slot weights live in symmetric memory), the nccl world 3
CASES = [(dict(combine="push", balance="virtual"), "triton", ("reversed",), 2),
         (dict(), "nccl", ("reversed", "recompute"), 3)]


@pytest.mark.parametrize("recipe_kw,backend,modes,n", CASES, ids=["triton-push-virtual", "nccl"])
def test_forwards_before_backwards_equal_interleaved(recipe_kw, backend, modes, n):
    for rank, r in enumerate(run_cpu_world(2, _micro_world, recipe_kw, backend, modes, n, timeout_s=400)):
        ys_a, g_a, spills_a = r["interleaved"]
        for mode in modes:
            ys_b, g_b, spills = r[mode]
            for i in range(n):
                assert torch.equal(ys_a[i], ys_b[i]), (rank, mode, i, "y")
                for name, u, v in zip(("x", "router", "w1", "w2"), g_a[i], g_b[i]):
                    assert torch.equal(u, v), (rank, mode, i, name)
            assert spills == (n - 1 if mode == "reversed" else 0), (rank, mode, spills)
        assert spills_a == 0
        if backend == "nccl":
            assert "max_saved_forwards=2" in r["limit"], r["limit"]


def _moe_two_forwards_world(group, interleave):
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    rank = dist.get_rank(group)
    geo = MoEGeometry(hidden=64, intermediate=32, num_experts=4, topk=2, max_tokens_per_rank=8)
    layer = MoELayer(MoERecipe(), geo, group, seed=3)
    g = torch.Generator().manual_seed(rank)
    xa = torch.randn(8, 64, generator=g).to(BF16).requires_grad_(True)
    xb = torch.randn(8, 64, generator=g).to(BF16).requires_grad_(True)
    ya = layer(xa)
    if interleave:
        layer(xb)  # a second forward (next micro-batch / recompute) before the first backward
    try:
        ya.float().sum().backward()
    except RuntimeError:
        layer.close()
        return "error"  # a loud refusal would be acceptable
    out = (xa.grad.clone(), layer.router.weight.grad.clone())
    layer.close()
    return out


def test_moe_second_forward_before_backward_is_correct_or_refused():
    ref = run_cpu_world(2, _moe_two_forwards_world, False, timeout_s=120)
    got = run_cpu_world(2, _moe_two_forwards_world, True, timeout_s=120)
    for r in range(2):
        if got[r] != "error":
            assert torch.equal(got[r][0], ref[r][0]) and torch.equal(got[r][1], ref[r][1])
