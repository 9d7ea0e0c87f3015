"""tritonep::dispatch / combine custom ops (tritonep.ep.ops) equal the plain EPBuffer calls bit for bit.

Forward (rows, weights, counts, offsets, combine output) and gradients (x, topk_weights), eager and under
torch.compile(fullgraph=True): backend "aot_eager" (fake tensors, AOT autograd, the fakes' shapes and the
registered backward) for both modes, and inductor (the default backend, C++ codegen on this CPU) for the sync-free
op. The synced op's row count is an unbacked SymInt in the fake; the sync-free op's is max_recv_tokens.
"""

import gc

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import BufferStateError
from tritonep.ep import ops
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs

E, H, TM, K = 8, 64, 12, 3


def _step(buf, bid, x, idx, w, gy, sync_free, use_ops):
    """One differentiable dispatch -> elementwise "expert" -> combine; returns its outputs and gradients (dict)."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    if use_ops:
        d = ops.dispatch(bid, x, idx, w, sync_free=sync_free)
        recv_x, recv_w = d.x, d.weights
    else:
        d = buf.dispatch(x, idx, w, sync_free=sync_free)
        recv_x, recv_w = d.x, d.weights
    eo = (recv_x.float() * 0.5 - 0.25).to(torch.bfloat16)
    y = ops.combine(eo, d) if use_ops else buf.combine(eo, d.handle)
    (y.float() * gy).sum().backward()
    R = int(d.expert_offsets[-1]) if d.expert_offsets.numel() else 0
    return dict(x=recv_x[:R].detach().clone(), w=recv_w.detach().clone(), offs=d.expert_offsets.clone(),
                ntpe=d.num_tokens_per_expert.clone(), y=y.detach().clone(), gx=x.grad.clone(), gw=w.grad.clone(),
                R=R, rows=recv_x.shape[0])


def _world(group, ntokens, modes, compile_backend):
    """Per mode (sync_free False / True): the plain calls, the ops eagerly, the ops compiled with fullgraph=True."""
    rank = dist.get_rank()
    buf = tep.EPBuffer(group, E, H, TM, K)
    bid = ops.buffer_id(buf)
    out = []
    for seed, sync_free in modes:
        x, idx, w = make_rank_inputs(rank, ntokens[rank], H, E, K, seed=seed, mask_frac=0.2)
        gy = torch.randn(ntokens[rank], H, generator=torch.Generator().manual_seed(seed + 10 * rank))
        ref = _step(buf, bid, x, idx, w, gy, sync_free, use_ops=False)
        got = _step(buf, bid, x, idx, w, gy, sync_free, use_ops=True)
        comp = torch.compile(_compiled_body(bid, sync_free), backend=compile_backend, fullgraph=True)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        recv_x, recv_w, offs, ntpe, y = comp(xx, idx, ww)
        (y.float() * gy).sum().backward()
        R = int(offs[-1])
        cgot = dict(x=recv_x[:R].detach().clone(), w=recv_w.detach().clone(), offs=offs.clone(), ntpe=ntpe.clone(),
                    y=y.detach().clone(), gx=xx.grad.clone(), gw=ww.grad.clone(), R=R, rows=recv_x.shape[0])
        out.append(dict(ref=ref, got=got, comp=cgot, sync_free=sync_free, max_recv=buf.max_recv_tokens))
    del recv_x, recv_w, offs, ntpe, y
    gc.collect()
    left = len(ops._HANDLES)  # every handle died with its ticket
    stale = _stale_ticket(bid, x, idx, w)
    buf.check()
    buf.close()
    return out, left, stale


def _stale_ticket(bid, x, idx, w):
    """A ticket whose tensor was freed names no handle any more: BufferStateError."""
    d = ops.dispatch(bid, x, idx, w)
    ops.combine(d.x, d)
    key = int(d.ticket)
    del d
    gc.collect()
    try:
        ops.get_handle(torch.tensor(key))
    except BufferStateError as e:
        return str(e)
    return None


def _compiled_body(bid, sync_free):
    def body(x, idx, w):
        d = ops.dispatch(bid, x, idx, w, sync_free=sync_free)
        eo = (d.x.float() * 0.5 - 0.25).to(torch.bfloat16)
        y = ops.combine(eo, d)
        return d.x, d.weights, d.expert_offsets, d.num_tokens_per_expert, y
    return body


def _check(res):
    for per_rank, left, stale in res:
        assert left == 0, f"{left} dispatch handles outlived their tickets"
        assert stale and "ticket" in stale
        for c in per_rank:
            for name in ("got", "comp"):
                got, ref = c[name], c["ref"]
                assert got["rows"] == (c["max_recv"] if c["sync_free"] else ref["R"]), name
                for k in ("x", "w", "offs", "ntpe", "y", "gx", "gw"):
                    assert torch.equal(got[k], ref[k]), (name, k)


def test_ops_equal_plain_calls_aot_eager():
    """Synced (unbacked row count) and sync-free, uneven T."""
    _check(run_cpu_world(2, _world, [9, 12], ((1, False), (2, True)), "aot_eager", timeout_s=300))


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_sync_free_op_inductor_fullgraph():
    """The sync-free op under inductor (C++ codegen on CPU), a rank with 0 tokens."""
    _check(run_cpu_world(2, _world, [0, 7], ((3, True),), "inductor", timeout_s=400))
