"""The backward passes through the front door (dispatch backward = unweighted combine, combine backward = scaled
dispatch plus weight gradients) against tritonep.reference, with ranks of 0 tokens and expanded (stride-0) grads.

Tolerances: grad of the expert output within 2^-7 relative, grad x within 2^-6, grad of the weights within 1e-3
(fp32 dot products in the kernels' tile order)."""

import pytest
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import BF16, check_calls, check_grads, open_buffer, run_grad_call

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


def _grad_world(group, cfg, calls):
    """One buffer of the case; :func:`run_grad_call` on each of this rank's calls (grad seed 99 + rank + 7 * call)."""
    rank = dist.get_rank(group)
    buf = open_buffer(group, cfg)
    out = [run_grad_call(buf, *c, grad_seed=99 + rank + 7 * i) for i, c in enumerate(calls[rank])]
    buf.close()
    return out


@pytest.mark.parametrize("geometry", ["", "pf=1,bh=16"])
def test_gradients_match_reference(monkeypatch, geometry):
    """Both backwards; ``pf=1,bh=16``: the expander's next-tile prefetch in the combine backward (SCALE + DOT)."""
    monkeypatch.setenv("TRITONEP_GEOMETRY", geometry)
    W, cfg = 2, dict(E=8, H=64, Tmax=16, K=3)
    calls = [[make_rank_inputs(r, [11, 6][r], 64, 8, 3, seed=5)] for r in range(W)]
    res = run_cpu_world(W, _grad_world, cfg, calls, timeout_s=240)
    check_grads(cfg["E"], [r[0] for r in res])


_ZERO_STEPS = [[6, 0, 3], [0, 0, 5], [4, 0, 0], [0, 0, 0]]  # rank 1 never has a token; one step nobody has


def test_rank_with_zero_tokens_forward_and_backward():
    W, cfg = 3, dict(E=6, H=64, Tmax=8, K=2)
    calls = [[make_rank_inputs(r, Ts[r], 64, 6, 2, seed=40 + s) for s, Ts in enumerate(_ZERO_STEPS)] for r in range(W)]
    res = run_cpu_world(W, _grad_world, cfg, calls, timeout_s=240)
    check_calls(cfg, calls, res)
    for s in range(len(_ZERO_STEPS)):
        check_grads(cfg["E"], [r[s] for r in res], where=f"step {s}")


def _inplace_rows_world(group, geometry):
    from tests.support.harness import set_env

    set_env(TRITONEP_GEOMETRY=geometry or None)
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 8, H, 8, 3)
    x, idx, w = make_rank_inputs(rank, 6, H, 8, 3, seed=21)
    grads = []
    for inplace in (True, False):
        xx = x.clone().requires_grad_(True)
        d = buf.dispatch(xx, idx, w)
        r = d.x.mul_(2) if inplace else d.x * 2  # was a bug on the decode geometry: the rows were a view made
        r.float().sum().backward()  # inside DispatchFn (a cut of the pooled block) and in-place ops raised
        grads.append(xx.grad.clone())
    buf.close()
    return grads


@pytest.mark.parametrize("geometry", ["", "bt=2,dec=3"], ids=["two-kernel", "decode"])
def test_inplace_on_dispatched_rows(geometry):
    """A differentiable dispatch's rows take in-place ops (as any autograd output does) with the same gradient as the
    out-of-place op."""
    for inplace, outplace in run_cpu_world(2, _inplace_rows_world, geometry, timeout_s=240):
        assert inplace.abs().sum() > 0 and (inplace == outplace).all()
