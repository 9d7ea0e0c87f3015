"""The torch + all_to_all_single reference layer of ``tritonep bench moe``: it equals the dense fp32 oracle, and it
prints no warning (torch >= 2.13 deprecates the differentiable ``torch.distributed.nn.functional.all_to_all_single``
it uses on purpose: it is what a user writes without tritonep)."""

import warnings

import torch

from tritonep.testing import run_cpu_world


def _rank(group):
    from tritonep.bench.moe import reference_layer_step

    torch.manual_seed(group.rank())
    W, E, H, F, T, K = group.size(), 4, 16, 8, 6, 2
    x = torch.randn(T, H).bfloat16().requires_grad_()
    idx = torch.rand(T, E).argsort(1)[:, :K]
    w = torch.rand(T, K)
    torch.manual_seed(100)  # every rank draws every expert's weights alike, then keeps its own
    w1_all = (torch.randn(E, H, 2 * F) * 0.2).bfloat16()
    w2_all = (torch.randn(E, F, H) * 0.2).bfloat16()
    L = E // W
    w1, w2 = w1_all[group.rank() * L:][:L], w2_all[group.rank() * L:][:L]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        y = reference_layer_step(group, x, idx, w, w1, w2, E)
        y.float().sum().backward()
    ref = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            gate, up = (x[t].float() @ w1_all[e].float()).chunk(2)
            ref[t] += w[t, k] * ((torch.nn.functional.silu(gate) * up) @ w2_all[e].float())
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    return [f"{m.category.__name__}: {m.message}" for m in seen], err, x.grad is not None


def test_reference_layer_is_right_and_quiet():
    for seen, err, has_grad in run_cpu_world(2, _rank):
        assert not seen, seen
        assert err < 3e-2 and has_grad, err
