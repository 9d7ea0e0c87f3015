"""The backward passes through the front door (dispatch backward = unweighted combine, combine backward = scaled
dispatch plus weight gradients) against tritonep.reference, with ranks of 0 tokens and expanded (stride-0) grads.

Tolerances: grad of the expert output within 2^-7 relative, grad x within 2^-6, grad of the weights within 1e-3
(fp32 dot products in the kernels' tile order)."""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.reference import (combine_backward_reference, combine_reference_partial, dispatch_backward_reference,
                                dispatch_reference)
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs

BF16 = torch.bfloat16


H = 64


def _empty_rank_grad_world(group, backend, loss):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 8, H, 8, 2, backend=backend)
    T = 0 if rank == 1 else 5
    x, idx, w = make_rank_inputs(rank, T, H, 8, 2, seed=11)
    x.requires_grad_(True)
    d = buf.dispatch(x, idx, w)
    y = buf.combine((d.x.float() * 0.5).to(BF16), d.handle)
    (y.sum() if loss == "sum" else y.float().sum()).backward()  # grad_y = ones expanded: stride (0, 0)
    g = x.grad.clone()
    buf.close()
    return g


@pytest.mark.parametrize("loss", ["sum", "float-sum"])
@pytest.mark.parametrize("backend", [
    "triton",
    "nccl",  # was a bug: grad_y [0, H] with stride 0 broke nccl.pack._as_words (fixed)
])
def test_backward_with_an_empty_rank_and_an_expanded_grad(backend, loss):
    g = run_cpu_world(2, _empty_rank_grad_world, backend, loss, timeout_s=120)
    assert g[1].shape == (0, H) and g[0].shape == (5, H)


def _grad_world(group, calls):
    rank = dist.get_rank()
    x, idx, w = calls[rank]
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    buf = tep.EPBuffer(group, 8, 64, 16, 3)
    d = buf.dispatch(x, idx, w)
    eo = (d.x.float() * 0.5).to(torch.bfloat16)  # differentiable expert "FFN"
    eo.retain_grad()
    y = buf.combine(eo, d.handle)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(99 + rank)).to(torch.bfloat16)
    (y.float() * g.float()).sum().backward()
    out = dict(gx=x.grad.clone(), gw=w.grad.clone(), geo=eo.grad.clone(), eo=eo.detach().clone(), g=g)
    buf.close()
    return out


@pytest.mark.parametrize("geometry", ["", "pf=1,bh=16"])
def test_gradients_match_reference(monkeypatch, geometry):
    """Both backwards; ``pf=1,bh=16``: the expander's next-tile prefetch in the combine backward (SCALE + DOT)."""
    monkeypatch.setenv("TRITONEP_GEOMETRY", geometry)
    W = 2
    calls = [make_rank_inputs(r, [11, 6][r], 64, 8, 3, seed=5) for r in range(W)]
    res = run_cpu_world(W, _grad_world, calls, timeout_s=240)
    xs, idxs, ws = [c[0] for c in calls], [c[1] for c in calls], [c[2] for c in calls]
    ref = dispatch_reference(xs, idxs, ws, 8, W)
    gys = [res[r]["g"] for r in range(W)]
    g_eo, g_w_ref = combine_backward_reference(gys, [res[r]["eo"] for r in range(W)], ref, idxs, ws)
    for r in range(W):
        assert torch.allclose(res[r]["geo"].float(), g_eo[r].float(), rtol=2 ** -7, atol=1e-6)
    # grad of recv rows = 0.5 * grad_eo; grad_x = sum over routes (dispatch backward)
    gx_ref = dispatch_backward_reference([0.5 * res[r]["geo"].float() for r in range(W)], ref, idxs,
                                         [len(x) for x in xs])
    for r in range(W):
        assert torch.allclose(res[r]["gx"].float(), gx_ref[r].float(), rtol=2 ** -6, atol=2 ** -6)
        assert torch.allclose(res[r]["gw"], g_w_ref[r].float(), rtol=1e-3, atol=1e-3)


_ZERO_STEPS = [[6, 0, 3], [0, 0, 5], [4, 0, 0], [0, 0, 0]]  # rank 1 never has a token; one step nobody has


def _zero_tokens_world(group, steps):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 6, 64, 8, 2)
    outs = []
    for s, Ts in enumerate(steps):
        x, idx, w = make_rank_inputs(rank, Ts[rank], 64, 6, 2, seed=40 + s)
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        d = buf.dispatch(x, idx, w)
        eo = (d.x.float() * 0.5).to(BF16)
        eo.retain_grad()
        y = buf.combine(eo, d.handle)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(99 + rank + 7 * s)).to(BF16)
        (y.float() * g.float()).sum().backward()
        outs.append(dict(y=y.detach().clone(), eo=eo.detach().clone(), g=g, gx=x.grad, gw=w.grad,
                         geo=eo.grad if eo.grad is not None or eo.shape[0] else torch.zeros(eo.shape, dtype=BF16)))
    buf.close()
    return outs


def test_rank_with_zero_tokens_forward_and_backward():
    W = 3
    res = run_cpu_world(W, _zero_tokens_world, _ZERO_STEPS, timeout_s=240)
    for s, Ts in enumerate(_ZERO_STEPS):
        ins = [make_rank_inputs(r, Ts[r], 64, 6, 2, seed=40 + s) for r in range(W)]
        xs, idxs, ws = ([a[j] for a in ins] for j in range(3))
        ref = dispatch_reference(xs, idxs, ws, 6, W)
        got = [res[r][s] for r in range(W)]
        yp = combine_reference_partial([o["eo"] for o in got], ref, idxs, ws, Ts)
        g_eo, g_w = combine_backward_reference([o["g"] for o in got], [o["eo"] for o in got], ref, idxs, ws)
        gx = dispatch_backward_reference([0.5 * o["geo"].float() for o in got], ref, idxs, Ts)
        for r in range(W):
            o = got[r]
            assert None not in (o["gx"], o["gw"], o["geo"]), f"step {s} rank {r}: no gradient"
            assert o["gx"].shape == (Ts[r], 64) and o["gw"].shape == (Ts[r], 2), (s, r)
            assert torch.equal(o["y"], yp[r].to(BF16)), (s, r)
            assert torch.allclose(o["geo"].float(), g_eo[r].float(), rtol=2 ** -7, atol=1e-6), (s, r)
            assert torch.allclose(o["gx"].float(), gx[r].float(), rtol=2 ** -6, atol=2 ** -6), (s, r)
            assert torch.allclose(o["gw"], g_w[r].float(), rtol=1e-3, atol=1e-3), (s, r)
