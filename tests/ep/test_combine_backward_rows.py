"""The combine backward writes every row of its outputs itself (no zero fill first): routes' rows exactly as the
twin (tritonep.reference.combine_backward_reference, ``grad_expert_out`` rounded to bf16 once: bit-exact), the
alignment padding rows and the rows past the layout's end exactly zero in ``grad_expert_out`` and
``grad_recv_weights``. The outputs' allocation is poisoned (NaN) so a row the kernels never write shows, and the
expert output holds NaN in its padding and tail rows so a row read where it must not be shows too."""

import math

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
import tritonep.backends.triton.backend as backend_module
from tritonep.reference import combine_backward_reference, dispatch_reference
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import set_env

CPU = dict(E=8, H=64, Tmax=16, K=3, T=[11, 6])
# the GPU table's large-batch geometry (select_geometry, >= 1024 tokens: backward tile 8 x 32 warps, its grid the
# forward's 40 + 88 fused programs while the senders count 88 acks); BH 1024
GPU = dict(E=32, H=2048, Tmax=1024, K=8, T=[1000, 333, 1024, 0])


class _PoisonedTorch:
    """``torch`` for the backend module with ``empty`` returning NaN-filled floats (-1 for ints)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t.fill_(-1)


def _real_rows(ntpe, offs, nrows):
    """bool ``[nrows]``: the rows that hold a route (not padding, not past ``offs[-1]``)."""
    real = torch.zeros(nrows, dtype=torch.bool)
    begin = 0
    for n, end in zip(ntpe.tolist(), offs.tolist()):
        real[begin:begin + n] = True
        begin = end
    return real


def _world(group, case, A, sync_free, geometry):
    """Rank body: dispatch, the combine backward with poisoned allocations and NaN in the expert output's padding /
    tail rows, then the same again on a new dispatch (the acks of the first pair with the next calls); host copies."""
    rank = dist.get_rank(group)
    E, H, K = case["E"], case["H"], case["K"]
    T = case["T"][rank % len(case["T"])]
    set_env(TRITONEP_GEOMETRY=geometry)
    buf = tep.EPBuffer(group, E, H, case["Tmax"], K, expert_alignment=A, timeout_s=60.0)
    set_env(TRITONEP_GEOMETRY=None)
    dev = buf.device
    x, idx, w = make_rank_inputs(rank, T, H, E, K, seed=21, mask_frac=0.15)
    d = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev), sync_free=sync_free)
    R = buf.max_recv_tokens  # longer than the layout: rows past offs[-1] must come back zero
    real = _real_rows(d.num_tokens_per_expert.cpu(), d.expert_offsets.cpu(), R).to(dev)
    eo = torch.full((R, H), math.nan, dtype=torch.bfloat16, device=dev)
    n = d.x.shape[0]
    eo[:n][real[:n]] = (d.x[real[:n]].float() * 0.5 + 1.0).to(torch.bfloat16)
    gy = torch.randn(T, H, generator=torch.Generator().manual_seed(7 + rank)).to(torch.bfloat16).to(dev)
    orig = backend_module.torch
    backend_module.torch = _PoisonedTorch()
    try:
        g_eo, g_w = buf.combine_backward(gy, eo, d.handle)
        # the next dispatch-like calls pair with this one's acks (its expand may run another grid than the forward's)
        d2 = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev), sync_free=sync_free)
        again = buf.combine_backward(gy, eo, d2.handle)
    finally:
        backend_module.torch = orig
    total = int(d.expert_offsets[-1])
    buf.close()
    assert torch.equal(again[0].view(torch.int16), g_eo.view(torch.int16)) and torch.equal(again[1], g_w)
    return dict(x=x, idx=idx, w=w, gy=gy.cpu(), eo=eo.cpu(), g_eo=g_eo.cpu(), g_w=g_w.cpu(), total=total)


@pytest.mark.parametrize("A,sync_free,geometry", [(4, False, None), (4, True, None), (1, False, None),
                                                  (8, False, "bbt=2,bwarps=2"), (4, True, "bt=4,bbt=1,grid=3,bgrid=5"),
                                                  (1, False, "bt=2,fs=2,fe=3"), (4, False, "grid=3,bgrid=1")])
def test_combine_backward_writes_every_row(A, sync_free, geometry):
    _check(CPU["E"], A, run_cpu_world(2, _world, CPU, A, sync_free, geometry, timeout_s=240))


@pytest.mark.gpu
@pytest.mark.world1
@pytest.mark.parametrize("A,sync_free", [(16, False), (1, True)])
def test_combine_backward_writes_every_row_gpu_w1(gpu_world, A, sync_free):
    """The same on one GPU with the table's large-batch geometry (the lead's world-1 measurement's tile and grid)."""
    _check(GPU["E"], A, gpu_world(1, _world, GPU, A, sync_free, None))


@pytest.mark.gpu
def test_combine_backward_writes_every_row_gpu(gpu_world, gpu_world_size):
    _check(GPU["E"], 16, gpu_world(gpu_world_size, _world, GPU, 16, False, None))


def _check(E, A, res):
    """Every rank's rows against the twin (see the module docstring)."""
    W = len(res)
    ref = dispatch_reference([r["x"] for r in res], [r["idx"] for r in res], [r["w"] for r in res], E, W,
                             expert_alignment=A)
    g_eo, g_w = combine_backward_reference([r["gy"] for r in res], [r["eo"][:ref[d].x.shape[0]] for d, r in
                                                                     enumerate(res)], ref, [r["idx"] for r in res],
                                           [r["w"] for r in res])
    for d, r in enumerate(res):
        Rd = ref[d].x.shape[0]
        assert r["total"] == Rd, (d, r["total"], Rd)
        real = ref[d].src_rank >= 0
        assert A == 1 or not bool(real.all()), "the case must have padding rows"
        got, got_w = r["g_eo"], r["g_w"]
        # routes' rows: bit-exact (one fp32 product rounded to bf16, as the twin's fp32 value rounded once)
        assert torch.equal(got[:Rd][real].view(torch.int16), g_eo[d][real].to(torch.bfloat16).view(torch.int16)), d
        # padding and tail rows: exactly +0 (bits), never NaN from the poisoned allocation or the expert output
        zero_rows = torch.cat([got[:Rd][~real], got[Rd:]])
        assert zero_rows.shape[0] > 0 and not zero_rows.view(torch.int16).any(), (d, "grad_expert_out not zero")
        zero_w = torch.cat([got_w[:Rd][~real], got_w[Rd:]])
        assert not zero_w.view(torch.int32).any(), (d, "grad_recv_weights not zero")
        # the weight gradient of each real row: the twin's per-route dot, fp32 (tile order: 1e-3)
        src_r, src_t, src_k = ref[d].src_rank[real].long(), ref[d].src_token[real].long(), ref[d].src_k[real].long()
        want_w = torch.stack([g_w[s][t, k] for s, t, k in zip(src_r.tolist(), src_t.tolist(), src_k.tolist())])
        assert torch.allclose(got_w[:Rd][real], want_w, rtol=1e-3, atol=1e-3), d
