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
import tritonep.ep.triton.backend as backend_module
from tritonep.reference import combine_backward_reference, dispatch_reference
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs
from tritonep.testing.harness import set_env

E, H, TM, K = 8, 64, 16, 3
TOKENS = [11, 6]


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


def _world(group, A, sync_free, geometry, monkeypatch_torch=True):
    rank = dist.get_rank(group)
    set_env(TRITONEP_GEOMETRY=geometry)
    buf = tep.EPBuffer(group, E, H, TM, K, expert_alignment=A, timeout_s=20.0)
    set_env(TRITONEP_GEOMETRY=None)
    x, idx, w = make_rank_inputs(rank, TOKENS[rank], H, E, K, seed=21, mask_frac=0.15)
    d = buf.dispatch(x, idx, w, sync_free=sync_free)
    R = buf.max_recv_tokens  # longer than the layout: rows past offs[-1] must come back zero
    real = _real_rows(d.num_tokens_per_expert, d.expert_offsets, R)
    eo = torch.full((R, H), math.nan, dtype=torch.bfloat16)
    n = d.x.shape[0]
    eo[:n][real[:n]] = (d.x[real[:n]].float() * 0.5 + 1.0).to(torch.bfloat16)
    gy = torch.randn(TOKENS[rank], H, generator=torch.Generator().manual_seed(7 + rank)).to(torch.bfloat16)
    orig = backend_module.torch
    backend_module.torch = _PoisonedTorch()
    try:
        g_eo, g_w = buf.combine_backward(gy, eo, d.handle)
        # the next dispatch-like calls pair with this one's acks (its expand may run another grid than the forward's)
        d2 = buf.dispatch(x, idx, w, sync_free=sync_free)
        again = buf.combine_backward(gy, eo, d2.handle)
    finally:
        backend_module.torch = orig
    total = int(d.expert_offsets[-1])
    buf.close()
    assert torch.equal(again[0].view(torch.int16), g_eo.view(torch.int16)) and torch.equal(again[1], g_w)
    return dict(x=x, idx=idx, w=w, gy=gy, eo=eo, g_eo=g_eo, g_w=g_w, total=total)


@pytest.mark.parametrize("A,sync_free,geometry", [(4, False, None), (4, True, None), (1, False, None),
                                                  (8, False, "bbt=2,bwarps=2"), (4, True, "bt=4,bbt=1,grid=3,bgrid=5"),
                                                  (1, False, "bt=2,fs=2,fe=3"), (4, False, "grid=3,bgrid=1")])
def test_combine_backward_writes_every_row(A, sync_free, geometry):
    res = run_cpu_world(2, _world, A, sync_free, geometry, timeout_s=240)
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
