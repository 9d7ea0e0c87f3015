"""Handles as :class:`tritonep.backends.triton.outputs.HandleLayout` cuts them (one int32 block per dispatch, its fields
:class:`tritonep.runtime.field_view.FieldView` s whose tensors are built on first read): handles of different T alive at once, each kept across later dispatches of the same buffer.

The caller refills its routing tensors in place after every dispatch and combines the calls in reverse order (the
first one last, after three later dispatches, and twice): every combine must equal the reference of its own call's
inputs, because each handle owns its storage and its copy of the routing. The views themselves: dtype, shape,
contiguity, 16-byte (on the GPU 256-byte) alignment of every field, the row weights (field ``rw``) at storage offset
0, no two handles sharing storage. After ``close`` every call raises BufferStateError, also the backward of a call
made before it.
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.errors import BufferStateError
from tritonep.testing import run_cpu_world
from tests.support.harness import _host, call_inputs, diff, expected, expert, make_calls, open_buffer
from tests.support.hooks import backend_of

_CFG = dict(E=8, H=64, Tmax=12, K=3)
_TOKENS = [(5, 12), (0, 3), (12, 0), (1, 1)]  # per call, per rank


def _check_views(h, T, cfg, W):
    K, E, Tm, L = cfg["K"], cfg["E"], cfg["Tmax"], cfg["E"] // W
    want = dict(topk_idx=(torch.int32, (T, K)), topk_weights=(torch.float32, (T, K)), rows=(torch.int32, (T, K)),
                meta=(torch.int32, (W, Tm, K)), wts=(torch.float32, (W, Tm, K)), ntok=(torch.int32, (W,)),
                ntpe=(torch.int32, (L,)), offs=(torch.int32, (L,)), counts=(torch.int32, (W, E)))
    base = h.store.data_ptr()
    for name, (dt, shape) in want.items():
        v = getattr(h, name)
        assert (v.dtype, tuple(v.shape)) == (dt, shape) and v.is_contiguous(), (name, v.dtype, v.shape, v.stride())
        assert v.untyped_storage().data_ptr() == h.store.untyped_storage().data_ptr(), name  # one block
        if v.numel():  # (an empty view's data_ptr() is 0)
            assert (v.data_ptr() - base) % 256 == 0, (name, v.data_ptr() - base)
    rw = h.recv_weights  # at storage offset 0 of the block, contiguous: what the fake of tritonep::dispatch gives
    assert rw.storage_offset() == 0 and rw.is_contiguous()
    assert rw.untyped_storage().data_ptr() == h.store.untyped_storage().data_ptr()
    for fv in h.views:  # what the direct launch path passes: the address and dtype of the tensor a reader gets
        t = fv.tensor()
        assert (fv.data_ptr(), fv.dtype) == (t.data_ptr(), t.dtype) and t.dim() == 1, fv
        assert fv.tensor() is t  # built once


def _world(group, backend):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    cfg = dict(_CFG, backend=backend)
    calls = [make_calls(W, cfg, toks, [40 + i], mask_frac=0.2) for i, toks in enumerate(_TOKENS)]
    buf = open_buffer(group, cfg)
    kept, stores = [], []
    for i, c in enumerate(calls):
        x, idx, w = (t.clone() for t in c[rank][0])
        d = buf.dispatch(x, idx, w)
        x.fill_(7.0), idx.fill_(0), w.fill_(9.0)  # refilled in place after the dispatch
        if backend == "triton":
            _check_views(d.handle, x.shape[0], cfg, W)
            assert all(d.handle.store.data_ptr() != s for s in stores)
            stores.append(d.handle.store.data_ptr())
        kept.append((d, expert(d.x)))
    out = [None] * len(calls)
    for i in (3, 2, 1, 0, 0):
        d, eo = kept[i]
        y = buf.combine(eo, d.handle)
        rec = dict(x=_host(d.x), ntpe=_host(d.num_tokens_per_expert), offs=_host(d.expert_offsets),
                   w=_host(d.weights), counts=_host(d.handle.counts), eo=_host(eo), y=_host(y))
        assert out[i] is None or torch.equal(out[i]["y"], rec["y"]), f"call {i} rank {rank}: second combine differs"
        out[i] = rec
    # two calls with gradients: the first one's backward binds every backward kernel, the second's runs after close
    x, idx, w = calls[0][rank][0]
    ys = []
    for _ in range(2):
        xg, wg = x.clone().requires_grad_(True), w.float().requires_grad_(True)
        dg = buf.dispatch(xg, idx, wg)
        ys.append(buf.combine(expert(dg.x), dg.handle).float().sum())
    ys[0].backward()
    buf.close()
    # calls after close: typed refusals, nothing launched (the bound kernels hold the freed regions' addresses);
    # the autograd backward reaches the backend without the EPBuffer's front door
    d, eo = kept[0]
    for call in (lambda: buf.dispatch(x, idx, w), lambda: buf.combine(eo, d.handle), ys[1].backward,
                 lambda: backend_of(buf).combine_fwd(eo, d.handle)):
        with pytest.raises(BufferStateError, match="closed"):
            call()
    return out


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_handles_alive_at_once_combine_their_own_call(backend):
    res = run_cpu_world(2, _world, backend, timeout_s=120)
    for i, toks in enumerate(_TOKENS):
        calls = make_calls(2, dict(_CFG), toks, [40 + i], mask_frac=0.2)
        got = [res[r][i] for r in range(2)]
        want = expected(call_inputs(calls, 0), _CFG["E"], eos=[g["eo"] for g in got])
        for r in range(2):
            bad = diff(got[r], want[r])
            assert not bad, f"{backend} call {i} rank {r} (T={toks}): {bad} differ from the reference"
