"""``dispatch(keep_quantized=True)`` with routing weights that require a gradient: the quantized rows carry none (the
caller decodes them itself), but the combine still sums ``w * expert_out`` with the weights the dispatch moved, so the
router's gradient ``grad_topk_weights[t, k] = <grad_y[t], expert_out[row(t, k)]>`` exists exactly; a dispatch
outside autograd would drop it without a word (``topk_weights.grad`` None: a router trained with fp8 kept rows would
learn nothing from the experts).
Checked against the same call without ``keep_quantized`` (the same layout and the same expert outputs): equal
weight gradients, bit for bit; ``x`` gets no gradient through the kept rows. Both backends, synced and sync-free."""

import pytest
import torch

import tritonep as tep
from tritonep.testing import run_cpu_world

H = 128


def _world(group, backend, wire, sync_free):
    rank = group.rank()
    buf = tep.EPBuffer(group, 4, H, 8, 2, backend=backend, dispatch_wire=wire, expert_alignment=2)
    g = torch.Generator().manual_seed(rank)
    x0 = torch.randn(6, H, generator=g).bfloat16()
    idx = torch.randint(-1, 4, (6, 2), generator=g)
    w0 = torch.rand(6, 2, generator=g)
    gy = torch.randn(6, H, generator=g)
    got = []
    for kq in (False, True):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        d = buf.dispatch(x, idx, w, keep_quantized=kq, sync_free=sync_free)
        rows = d.x.shape[0]
        s = torch.tensor(1.0, requires_grad=True)  # an expert parameter: y has a graph either way
        eo = ((torch.arange(rows * H, dtype=torch.float32).reshape(rows, H) % 7 - 3) * s).bfloat16()
        y = buf.combine(eo, d.handle)
        (y.float() * gy).sum().backward()
        got.append((y.detach(), w.grad, x.grad))
    buf.check()
    buf.close()
    (y0, gw0, gx0), (y1, gw1, gx1) = got
    return bool(torch.equal(y0, y1)), gw1 is not None and bool(torch.equal(gw0, gw1)), gx1 is None and gx0 is not None


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("wire", ["fp8", "mxfp4"])
@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_kept_rows_keep_the_weight_gradient(backend, wire, sync_free):
    assert run_cpu_world(2, _world, backend, wire, sync_free, timeout_s=120) == [(True, True, True)] * 2
