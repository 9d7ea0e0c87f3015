"""Low-latency calls whose receive hooks run late: three dispatches (bf16, fp8, bf16 on one lane) issued before any
hook runs, then three combines issued before any reduction hook runs, the hooks called in another order than the
calls. DeepEP's hooks finish each call's own receive: every result equals the plain loops over every rank's inputs.
Inputs are non-contiguous views and are overwritten after each call (the calls took their data at call time)."""

import pytest
import torch

from tests.compat.deepep_reference import gather, ll_ref
from tritonep.testing import run_cpu_world

H, E, K, M = 128, 4, 2, 4


def _f(rows, e):
    return (rows.float() * ((e + 1) / 4) - 1).bfloat16()


def _deferred_world(group, backend):
    import tritonep.compat.deep_ep as deep_ep
    from tritonep.wire.fp8 import dequantize_fp8_torch, quantize_fp8_torch
    rank, W = group.rank(), group.size()
    L = E // W
    buf = deep_ep.Buffer(group, 0, 0, low_latency_mode=True, backend=backend)
    calls = []
    for c, (T, fp8) in enumerate([(3, False), (4, True), (1 if rank else 0, False)]):
        g = torch.Generator().manual_seed(300 + 10 * c + rank)
        big = torch.randn(T, 2 * H, generator=g).bfloat16()
        x = big[:, ::2]  # non-contiguous
        idx = torch.rand(T, E, generator=g).argsort(1)[:, :K].t().contiguous().t()  # column-major ids
        if T:
            idx[0, -1] = -1
        w = torch.rand(T, K, generator=g) + 0.25
        keep = (x.clone(), idx.clone(), w.clone())
        recv, count, h, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8, round_scale=fp8,
                                                           return_recv_hook=True)
        big.normal_()  # the caller reuses its input after the call
        calls.append((keep, recv, count, h, hook, fp8))
    for c in (1, 2, 0):
        calls[c][4]()
    bad = []
    sims = []
    for c, ((x, idx, w), recv, count, h, _, fp8) in enumerate(calls):
        xs, ids = map(list, zip(*gather(group, (x, idx))))
        srcs, rng = ll_ref(xs, ids, rank, E, W, M)
        if count.tolist() != [len(s) for s in srcs] or not torch.equal(h[1], rng):
            bad.append((c, "count", count.tolist(), [len(s) for s in srcs]))
        sim = torch.full((L, W * M, H), float("nan"), dtype=torch.bfloat16)
        for j in range(L):
            n = len(srcs[j])
            if not n:
                continue
            if h[0][j, :n].tolist() != [t for _, t in srcs[j]]:
                bad.append((c, "src_info", j))
            if fp8:
                q, s = recv
                tw = [quantize_fp8_torch(xr, pow2_scale=True) for xr in xs]
                e_q = torch.stack([tw[s_][0][t] for s_, t in srcs[j]])
                e_s = torch.stack([tw[s_][1][t] for s_, t in srcs[j]])
                if not (torch.equal(q[j, :n].view(torch.uint8), e_q.view(torch.uint8))
                        and torch.equal(s[j, :n], e_s)):
                    bad.append((c, "fp8 rows", j))
                rows = dequantize_fp8_torch(e_q, e_s)
            else:
                rows = torch.stack([xs[s_][t] for s_, t in srcs[j]])
                if not torch.equal(recv[j, :n].view(torch.int16), rows.view(torch.int16)):
                    bad.append((c, "rows", j))
            sim[j, :n] = _f(rows, rank * L + j)
        sims.append(sim)
    ys = []
    for c, ((x, idx, w), recv, count, h, _, fp8) in enumerate(calls):
        src = sims[c].clone()
        y, _, hook = buf.low_latency_combine(src, idx, w, h, return_recv_hook=True)
        src.fill_(7.0)  # the caller reuses the expert outputs after the call
        ys.append((y, hook))
    for c in (2, 0, 1):
        ys[c][1]()
    for c, ((x, idx, w), _, _, _, _, fp8) in enumerate(calls):
        xr = dequantize_fp8_torch(*quantize_fp8_torch(x, pow2_scale=True)) if fp8 else x
        ref = torch.zeros(x.shape[0], H)
        for t in range(x.shape[0]):
            for k in range(K):
                if idx[t, k] >= 0:
                    ref[t] += float(w[t, k]) * _f(xr[t:t + 1], int(idx[t, k])).float()[0]
        if not torch.allclose(ys[c][0].float(), ref.bfloat16().float(), rtol=2 ** -7, atol=2 ** -7):
            bad.append((c, "combine", (ys[c][0].float() - ref).abs().max().item()))
    buf.check()
    buf.destroy()
    return bad


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_hooks_called_late_and_out_of_order(backend):
    assert run_cpu_world(2, _deferred_world, backend, timeout_s=180) == [[], []]
