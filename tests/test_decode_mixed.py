"""The decode geometry (``dec=G``) mixed with the two-kernel paths on one buffer: autograd (dispatch backward =
unweighted combine with weight gradients, combine backward = scaled dispatch) and the pull combine, each call's
results bit-equal to a two-kernel buffer's (review of the decode paths' counter compatibility)."""

import os

import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs

BF16 = torch.bfloat16


def _mixed_world(group, Ts):
    os.environ["TRITONEP_SYNC_CHECKS"] = "1"
    rank = dist.get_rank(group)
    E, H, Tm, K = 4, 64, 8, 2
    bufs = {}
    for name, geo in (("two", "bt=4,fs=0,fe=0"), ("one", "bt=4,dec=2")):
        os.environ["TRITONEP_GEOMETRY"] = geo
        bufs[name] = tep.EPBuffer(group, E, H, Tm, K, expert_alignment=2)
    os.environ.pop("TRITONEP_GEOMETRY", None)
    assert bufs["one"].geometry.decode == 2 and bufs["two"].geometry.decode == 0
    out = []
    for i, T in enumerate(Ts):
        x0, idx, w0 = make_rank_inputs(rank, T[rank], H, E, K, seed=40 + i, mask_frac=0.2)
        g = torch.randn(T[rank], H, generator=torch.Generator().manual_seed(7 + rank + i)).to(BF16)
        res = {}
        for name, buf in bufs.items():
            x = x0.clone().requires_grad_(True)
            w = w0.clone().requires_grad_(True)
            d = buf.dispatch(x, idx, w)
            eo = (d.x.float() * 0.5 + 1.0).to(BF16)
            y = buf.combine(eo, d.handle)
            (y.float() * g.float()).sum().backward()
            with torch.no_grad():
                d2 = buf.dispatch(x0, idx, w0)
                yp = buf.combine((d2.x.float() * 0.25).to(BF16), d2.handle, kind="pull")
                yq = buf.combine((d2.x.float() * 0.25).to(BF16), d2.handle)  # push (decode) after the pull
            res[name] = (y.detach().clone(), x.grad.clone(), w.grad.clone(), yp.clone(), yq.clone())
        out.append([torch.equal(a, b) for a, b in zip(res["one"], res["two"])])
    for buf in bufs.values():
        buf.close()
    return out


def test_decode_buffer_autograd_and_pull_equal_two_kernel_buffer():
    Ts = [[8, 5], [0, 7], [3, 0], [8, 8]]
    res = run_cpu_world(2, _mixed_world, Ts, timeout_s=600)
    for r in range(2):
        for i, eq in enumerate(res[r]):
            assert all(eq), f"rank {r} call {i} T={Ts[i]}: (y, x.grad, w.grad, y pull, y push) equal = {eq}"
