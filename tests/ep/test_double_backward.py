"""Second-order gradients through dispatch and combine (``create_graph=True``) equal dense autograd.

Before, ``torch.autograd.grad(..., create_graph=True)`` through EPBuffer returned a gradient without a graph: a
gradient penalty's second-order terms vanished silently (a scale gradient 10x too small). Dispatch is linear and
combine bilinear, so their backward passes are differentiable again (tritonep/ep/autograd.py); checked on both
backends, synced and sync-free handles, the EPBuffer calls and the custom ops, against the same computation in one
process with :mod:`tritonep.reference` (fp32, plain torch autograd):

* gradient penalty: ``pen = sum_r |dL_r/dx_r|^2 + |dL_r/dw_r|^2`` with ``L_r = sum(y_r^2) / 2``, backward to the
  expert's scale ``s`` (summed over ranks: each rank holds the rows its experts ran), to ``x`` and to the routing
  weights;
* Hessian-vector product ``d/dx (<dL/dx, v>)``.

The expert is ``eo = bf16(s * x^2)``; rows, expert outputs and y travel as bf16 (one rounding each, compounded by
the two backward passes), so every tensor must satisfy ``max|ours - dense| <= 4e-2 * max|dense|``. The MoE layer has
no second order: it refuses with a typed error (tests/moe: its test below).
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import BackendError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs

H, K, TM, TOL = 32, 2, 8, 4e-2
TOKENS = [5, 3, 4]


def _inputs(rank, W, seed=3):
    x, idx, w = make_rank_inputs(rank, TOKENS[rank % 3], H, 2 * W, K, seed=seed, mask_frac=0.15)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(50 + rank))
    return x, idx, w, v


def _world(group, backend, sync_free, use_ops):
    from tritonep.ep import ops

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    buf = tep.EPBuffer(group, 2 * W, H, TM, K, backend=backend)
    bid = ops.buffer_id(buf)
    x0, idx, w0, v = _inputs(rank, W)

    def expert(d, s):  # rows past expert_offsets[-1] (a sync-free call's tail) are unspecified: never computed on
        real = torch.arange(d.x.shape[0]) < d.expert_offsets[-1]
        xr = torch.where(real[:, None], d.x.float(), 0.0)  # masked before use: 0 * NaN would reach s's gradient
        return (xr ** 2 * s).to(torch.bfloat16)

    def forward(x, w, s):
        if use_ops:
            d = ops.dispatch(bid, x, idx, w, sync_free=sync_free)
            return ops.combine(expert(d, s), d)
        d = buf.dispatch(x, idx, w, sync_free=sync_free)
        return buf.combine(expert(d, s), d.handle)

    s = torch.tensor(0.7, requires_grad=True)
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    y = forward(x, w, s)
    L = 0.5 * y.float().pow(2).sum()
    gx, gw = torch.autograd.grad(L, (x, w), create_graph=True)
    out = dict(graph=gx.requires_grad and gw.requires_grad)
    (gx.float().pow(2).sum() + gw.pow(2).sum()).backward()
    out.update(pen_s=s.grad.clone(), pen_x=x.grad.clone(), pen_w=w.grad.clone())
    # Hessian-vector product in x
    s2 = torch.tensor(0.7, requires_grad=True)
    x2 = x0.clone().requires_grad_(True)
    y2 = forward(x2, w0, s2)
    g2, = torch.autograd.grad(0.5 * y2.float().pow(2).sum(), x2, create_graph=True)
    hv, = torch.autograd.grad((g2.float() * v).sum(), x2)
    out["hvp"] = hv.clone()
    buf.check()
    buf.close()
    return out


def _dense(W):
    """The same penalty and HVP with the reference dispatch / combine (fp32) over every rank's tokens at once."""
    from tritonep.reference import combine_reference, dispatch_reference

    ins = [_inputs(r, W) for r in range(W)]
    idxs = [i[1] for i in ins]

    def ys(xs, ws, s):
        ref = dispatch_reference(xs, idxs, ws, 2 * W, W)
        eos = [r.x.float() ** 2 * s for r in ref]
        return combine_reference(eos, ref, idxs, ws, [len(x) for x in xs])

    s = torch.tensor(0.7, requires_grad=True)
    xs = [i[0].float().requires_grad_(True) for i in ins]
    ws = [i[2].clone().requires_grad_(True) for i in ins]
    L = sum(0.5 * y.pow(2).sum() for y in ys(xs, ws, s))
    g = torch.autograd.grad(L, xs + ws, create_graph=True)
    sum(t.pow(2).sum() for t in g).backward()
    dense = dict(pen_s=s.grad, pen_x=[x.grad for x in xs], pen_w=[w.grad for w in ws])
    xs2 = [i[0].float().requires_grad_(True) for i in ins]
    L2 = sum(0.5 * y.pow(2).sum() for y in ys(xs2, [i[2] for i in ins], torch.tensor(0.7)))
    g2 = torch.autograd.grad(L2, xs2, create_graph=True)
    dense["hvp"] = torch.autograd.grad(sum((a * i[3]).sum() for a, i in zip(g2, ins)), xs2)
    return dense


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def _check(res):
    W = len(res)
    dense = _dense(W)
    errs = {"pen_s": _rel(sum(r["pen_s"] for r in res), dense["pen_s"])}
    for r, out in enumerate(res):
        assert out["graph"], "the first gradient has no graph"
        for k in ("pen_x", "pen_w", "hvp"):
            errs[f"{k}{r}"] = _rel(out[k], dense[k][r])
    bad = {k: v for k, v in errs.items() if not v <= TOL}
    assert not bad, (bad, errs)


@pytest.mark.parametrize("W,backend,sync_free,use_ops", [(2, "triton", False, False), (3, "nccl", True, False)])
def test_second_order_gradients_equal_dense_autograd(W, backend, sync_free, use_ops):
    _check(run_cpu_world(W, _world, backend, sync_free, use_ops, timeout_s=300))


@pytest.mark.slow
@pytest.mark.parametrize("W,backend,sync_free,use_ops", [
    (3, "triton", False, False), (2, "triton", True, False), (2, "nccl", False, False), (3, "nccl", False, True),
    (3, "triton", True, True), (2, "triton", True, True)])
def test_second_order_gradients_equal_dense_autograd_every_path(W, backend, sync_free, use_ops):
    _check(run_cpu_world(W, _world, backend, sync_free, use_ops, timeout_s=300))


def _moe_world(group):
    geo = tep.MoEGeometry(hidden=H, intermediate=16, num_experts=4, topk=2, max_tokens_per_rank=TM)
    layer = tep.MoELayer(tep.MoERecipe(), geo, group, seed=1)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(dist.get_rank())).bfloat16().requires_grad_(True)
    g, = torch.autograd.grad(layer(x).float().pow(2).sum(), x, create_graph=True)
    try:
        g.float().pow(2).sum().backward()
        err = None
    except BackendError as e:
        err = str(e)
    layer.close()
    return g.requires_grad, err


def test_moe_layer_refuses_a_second_order_gradient_clearly():
    for has_graph, err in run_cpu_world(2, _moe_world, timeout_s=120):
        assert has_graph and err and "second-order" in err, err
