"""Higher-order and forward-mode gradients through a buffer whose dispatch wire is quantized (fp8, mxfp4).

Reverse mode treats the quantized dispatch as the linear row map ``P`` (its backward is the bf16 combine ``P^T``,
and the combine's backward moves ``grad_y`` in bf16: docs/protocols.md). ``create_graph=True`` must not change the
first-order values (tritonep/ep/autograd.py: "same bits for g_eo"), and a forward-mode tangent must be the same
linear map of the tangent, ``P dx``. Both rebuild ``P u`` with a new dispatch along the handle (``Redispatch``,
``DispatchFn.jvp``, the custom ops' ``_redispatch``); through the buffer's dispatch wire that dispatch would quantize
the gradient or tangent rows (first-order gradients under ``create_graph`` 3 % (fp8) to 20 % (mxfp4) of their
largest value off the plain ones, tangents not ``P dx``), so those rows travel as the combine backward moves them
(raw). Checked through the EPBuffer calls and the custom ops, synced and sync-free, both
backends; and a gradient penalty (second order) through a wire that carries the tokens exactly equals the bf16
wire's.
"""

import pytest
import torch
from torch.autograd import forward_ad as fwAD

import tritonep as tep
from tritonep.testing import run_cpu_world

H = 128


def _inputs(rank):
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, H, generator=g).bfloat16()
    idx = torch.randint(0, 4, (6, 2), generator=g)
    w = torch.rand(6, 2, generator=g)
    return x, idx, w, torch.randn(6, H, generator=g)


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def _create_graph_world(group, backend, wire, path, sync_free):
    """The largest difference of the first-order gradients with and without ``create_graph`` through the EPBuffer
    calls or the custom ops (``path``), relative to their largest value."""
    from tritonep.ep import ops

    buf = tep.EPBuffer(group, 4, H, 8, 2, backend=backend, dispatch_wire=wire)
    x0, idx, w0, gy = _inputs(group.rank())

    def step(cg):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        s = torch.tensor(1.25, requires_grad=True)
        if path == "ops":
            d = ops.dispatch(ops.buffer_id(buf), x, idx, w, sync_free=sync_free)
            rows, n = d.x, d.expert_offsets[-1]
        else:
            d = buf.dispatch(x, idx, w, sync_free=sync_free)
            rows, n = d.x, d.expert_offsets[-1]
        real = (torch.arange(rows.shape[0]) < n)[:, None]
        eo = (torch.where(real, rows.float(), 0.0) * s).bfloat16()
        y = ops.combine(eo, d) if path == "ops" else buf.combine(eo, d.handle)
        return torch.autograd.grad((y.float() * gy).sum(), [x, w, s], create_graph=cg)

    plain, graph = step(False), step(True)
    buf.close()
    return max(_rel(a.detach(), b) for a, b in zip(graph, plain))


@pytest.mark.parametrize("path,sync_free", [("buffer", False), ("buffer", True), ("ops", False), ("ops", True)])
@pytest.mark.parametrize("wire", ["fp8", "mxfp4"])
@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_create_graph_keeps_the_first_order_values(backend, wire, path, sync_free):
    res = run_cpu_world(2, _create_graph_world, backend, wire, path, sync_free, timeout_s=120)
    assert max(res) <= 1e-3, res


def _tangent_world(group, backend, wire):
    """The tangent of ``recv_x`` for a tangent ``dx`` of ``x`` against ``P dx``: the same routing's rows of ``dx``
    dispatched by a bf16-wire buffer (row moves only: exact)."""
    buf = tep.EPBuffer(group, 4, H, 8, 2, backend=backend, dispatch_wire=wire)
    raw = tep.EPBuffer(group, 4, H, 8, 2, backend=backend)
    x0, idx, w0, _ = _inputs(group.rank())
    dx = torch.randn(x0.shape, generator=torch.Generator().manual_seed(10 + group.rank())).bfloat16()
    with fwAD.dual_level():
        d = buf.dispatch(fwAD.make_dual(x0, dx), idx, w0)
        tangent = fwAD.unpack_dual(d.x).tangent
    want = raw.dispatch(dx, idx, w0).x
    buf.close()
    raw.close()
    return _rel(tangent, want)


@pytest.mark.parametrize("wire", ["fp8", "mxfp4"])
@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_forward_tangent_is_the_row_map_of_the_tangent(backend, wire):
    res = run_cpu_world(2, _tangent_world, backend, wire, timeout_s=120)
    assert max(res) == 0.0, res


def _penalty_world(group, backend, wire, sync_free):
    """A gradient penalty (``|dL/dx|^2 + |dL/dw|^2`` backward to x, w and the expert scale) through a quantized wire
    with tokens the wire carries exactly (every 128 / 32 block: values in {0, +-0.5, +-1, +-2}, amax 2): the same
    values as through the bf16 wire, first and second order."""
    x0, idx, w0, gy = _inputs(group.rank())
    vals = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0])
    x0 = vals[torch.randint(0, 7, x0.shape, generator=torch.Generator().manual_seed(5))].bfloat16()
    x0[:, ::32] = 2.0
    out = []
    for wr in (wire, "bf16"):
        buf = tep.EPBuffer(group, 4, H, 8, 2, backend=backend, dispatch_wire=wr)
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        s = torch.tensor(1.25, requires_grad=True)
        d = buf.dispatch(x, idx, w, sync_free=sync_free)
        real = (torch.arange(d.x.shape[0]) < d.expert_offsets[-1])[:, None]
        y = buf.combine((torch.where(real, d.x.float(), 0.0) * s).bfloat16(), d.handle)
        gx, gw = torch.autograd.grad((y.float() * gy).sum(), [x, w], create_graph=True)
        pen = (gx.float() ** 2).sum() + (gw ** 2).sum()
        out.append([gx.detach(), gw.detach()] + list(torch.autograd.grad(pen, [x, w, s])))
        buf.close()
    return max(_rel(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("wire", ["fp8", "mxfp4"])
@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_penalty_through_an_exact_quantized_wire_equals_bf16(backend, wire, sync_free):
    res = run_cpu_world(2, _penalty_world, backend, wire, sync_free, timeout_s=120)
    assert max(res) <= 1e-5, res
