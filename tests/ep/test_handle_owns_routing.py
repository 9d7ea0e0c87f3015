"""A dispatch handle owns the routing that combine and the backward passes read again.

A caller that refills its ``topk_idx`` / ``topk_weights`` in place between dispatch and combine (a serving loop that
reuses its buffers; vLLM fixed the same bug in its MoRI path) must get the same combine rows and the same gradients
as one that does not, on every backend and through the MoE layer; ids refilled with values outside ``[-1, E)`` must
never be indexed with (a crash before: the dispatch backward's combine indexed with the new ids). All checks are
bit-exact against the same calls without the refill.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import InputError, PeerInputError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs

E, H, TM, K = 8, 64, 12, 3


def _refill(idx, w, how):
    """Overwrite the caller's routing in place after dispatch."""
    if how == "valid":
        idx.copy_(torch.flip(idx, [0]).remainder(E))
        w.mul_(-3.0).add_(0.25)
    elif how == "out_of_range":
        idx.fill_(10 ** 6 if idx.dtype == torch.int64 else 2 ** 30)
        idx[::2] = -7
        w.fill_(float("nan"))
    else:
        raise ValueError(how)


def _calls(group, backend, kind, how, id_dtype):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, E, H, TM, K, backend=backend)
    out = []
    for refill in (False, True):
        x, idx, w = make_rank_inputs(rank, [9, 12][rank], H, E, K, seed=5, mask_frac=0.2)
        idx = idx.to(id_dtype).contiguous()
        x.requires_grad_(True)
        w = w.contiguous().requires_grad_(True)
        d = buf.dispatch(x, idx, w)
        if refill:
            with torch.no_grad():
                _refill(idx, w, how)
        y = buf.combine((d.x * 0.5 + 1.0).to(torch.bfloat16), d.handle, kind=kind)
        y.float().pow(2).sum().backward()
        out.append(dict(y=y.detach().clone(), gx=x.grad.clone(), gw=w.grad.clone()))
    buf.close()
    return out


@pytest.mark.parametrize("backend,kind", [("triton", "push"), ("triton", "pull"), ("nccl", None)])
@pytest.mark.parametrize("how", ["valid", "out_of_range"])
def test_refilled_routing_changes_nothing(backend, kind, how):
    res = run_cpu_world(2, _calls, backend, kind, how, torch.int64)
    for plain, refilled in res:
        for f in ("y", "gx"):
            assert torch.equal(plain[f], refilled[f]), f
        assert torch.equal(plain["gw"], refilled["gw"])


def test_refilled_int32_routing_on_triton():
    res = run_cpu_world(2, _calls, "triton", None, "out_of_range", torch.int32)
    for plain, refilled in res:
        assert torch.equal(plain["y"], refilled["y"]) and torch.equal(plain["gw"], refilled["gw"])


def _handle_copy(group):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, E, H, TM, K)
    x, idx, w = make_rank_inputs(rank, 7, H, E, K, seed=2, mask_frac=0.3)
    bad = idx.clone()
    bad[0, 0] = 2 ** 32 + 1  # low 32 bits valid: must be found at full width and never served by expert 1
    bad[1, 1] = -5
    d = buf.dispatch(x, idx, w)
    h = d.handle
    same = h.topk_idx.data_ptr() == idx.data_ptr() or h.topk_weights.data_ptr() == w.data_ptr()
    copy_ok = torch.equal(h.topk_idx.long(), idx) and torch.equal(h.topk_weights, w)
    # a sync-free dispatch with bad ids: no host read, so the handle exists; its copy holds -1 for the bad ids
    f = buf.dispatch(x, bad if rank == 0 else idx, w, sync_free=True)
    sanitized = f.handle.topk_idx.clone()
    y = buf.combine(buf.expert_out_buffer(), f.handle)  # must not index with 2**32 + 1 or -5
    err = None
    try:
        buf.check()
    except (InputError, PeerInputError) as e:
        err = type(e).__name__
    d2 = buf.dispatch(x, idx, w)  # usable afterwards
    buf.combine(buf.expert_out_buffer(d2.x.shape[0]), d2.handle)
    buf.close()
    return dict(aliased=same, copy_ok=copy_ok, sanitized=sanitized, err=err, y_shape=tuple(y.shape))


def test_handle_holds_a_sanitized_copy():
    res = run_cpu_world(2, _handle_copy)
    for r in res:
        assert not r["aliased"] and r["copy_ok"]
        assert r["y_shape"] == (7, H)
    s0 = res[0]["sanitized"]
    assert int(s0[0, 0]) == -1 and int(s0[1, 1]) == -1
    assert res[0]["err"] == "InputError" and res[1]["err"] == "PeerInputError"


def _layer(group, refill):
    rank = dist.get_rank(group)
    geo = tep.MoEGeometry(hidden=H, intermediate=32, num_experts=E, topk=K, max_tokens_per_rank=TM)
    layer = tep.MoELayer(tep.MoERecipe(), geo, group, seed=3)
    x, idx, w = make_rank_inputs(rank, [10, 6][rank], H, E, K, seed=8, mask_frac=0.1)
    x.requires_grad_(True)
    w = w.contiguous().requires_grad_(True)
    y = layer(x, idx, w)
    if refill:  # the ids (the weights are saved by autograd, whose version counter refuses an in-place change)
        idx.copy_(torch.flip(idx, [0]).remainder(E))
    y.float().pow(2).sum().backward()
    out = dict(y=y.detach(), gx=x.grad, gw=w.grad, g1=layer.w1.grad, g2=layer.w2.grad)
    layer.close()
    return out


def test_moe_layer_gradients_ignore_a_refilled_routing():
    a, b = run_cpu_world(2, _layer, False), run_cpu_world(2, _layer, True)
    for ra, rb in zip(a, b):
        for f in ra:
            assert torch.equal(ra[f], rb[f]), f
