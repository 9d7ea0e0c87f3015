"""A refused ``EPBuffer.dispatch_backward`` input on one rank (or ``cancel_dispatch_backward``) takes part as refused.

The backward half of dispatch reads nothing on the host (as every backward), so it cannot raise on the peers; before,
a rank that refused its input raised before any launch and its peers waited ``timeout_s`` (triton) or hung (nccl).
Now the refusing rank runs the peers' launches and collectives with no row and a refused flag: the peers' outputs
(``grad_x`` and, with ``grad_recv_w``, ``grad_topk_weights``) are NaN (triton: all of them; nccl: every element
computed from the refused rank's rows, the others exact), and the next ``check()`` raises
PeerInputError naming the rank on every rank (the refused one too), once; so does the next synced dispatch instead,
after its launches. The buffer stays usable: a later backward
gives the same bits as before the refusal. Both backends; triton's two-kernel (push and pull) and one-launch decode
tiles; synced and sync-free handles; CPU worlds and (``-m gpu``) GPU ones.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.bench.cases import make_rank_inputs
from tritonep.testing import run_cpu_world
from tests.support.refused_backward import check_refused_backward, refused_call_outcomes

H, TM, K = 64, 8, 2
GEOMETRIES = {"push": "dec=0,fs=0,fe=0,fc=0,combine=push", "pull": "dec=0,fs=0,fe=0,fc=0,combine=pull",
              "decode": "bt=2,dec=2"}


def _nan_pattern(gx, gtw, before, idx, bad_rank, backend):
    """"NaN" when the refused call's outputs are NaN where the backend promises (triton: everywhere; nccl: every
    element computed from the refused rank's rows, i.e. of the routes to its experts, the rest equal to a good
    call's), else what differs."""
    if backend == "triton":
        nan_x = torch.ones(gx.shape[0], dtype=torch.bool, device=gx.device)
        nan_w = torch.ones(idx.shape, dtype=torch.bool, device=gx.device)
    else:
        nan_w = (idx >= 0) & (idx // 2 == bad_rank)  # 2 experts per rank
        nan_x = nan_w.any(1)
    ok = bool(gx[nan_x].isnan().all()) and torch.equal(gx[~nan_x], before[0][~nan_x])
    if gtw is not None:
        ok = ok and bool(gtw[nan_w].isnan().all()) and torch.equal(gtw[~nan_w], before[1][~nan_w])
    return "NaN" if ok else f"wrong: {int(gx.isnan().any(1).sum())} NaN rows of {gx.shape[0]}"


def _world(group, backend, geometry, sync_free, with_w, how, read="check", sync_checks=None):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bad_rank = W - 1
    buf = tep.EPBuffer(group, 2 * W, H, TM, K, backend=backend, timeout_s=30, tiles=GEOMETRIES[geometry],
                       sync_checks=sync_checks)
    x, idx, w = (t.to(buf.device) for t in make_rank_inputs(rank, 6, H, 2 * W, K, seed=5, mask_frac=0.0))
    d = buf.dispatch(x, idx, w, sync_free=sync_free)
    g = (d.x.float() * 0.25 + 1).to(torch.bfloat16)
    gw = torch.rand(d.x.shape[0], device=buf.device) if with_w else None
    before = buf.dispatch_backward(g, gw, d.handle)
    other = tep.EPBuffer(group, 2 * W, H, TM, K, backend=backend) if how == "handle" else None
    foreign = other.dispatch(x, idx, w).handle if other is not None else None  # every rank

    def call():  # what this rank's part of the refused call shows (strict sync checks: the peers raise in it)
        if rank != bad_rank:
            gx, gtw = buf.dispatch_backward(g, gw, d.handle)
            return _nan_pattern(gx, gtw, before, idx, bad_rank, backend)
        if how == "dtype":
            buf.dispatch_backward(g.float(), gw, d.handle)
        elif how == "handle":
            buf.dispatch_backward(g, gw, foreign)
        else:  # the rank's own code failed before its backward
            buf.cancel_dispatch_backward(d.handle, with_weights=with_w)
            return "cancelled"

    out = refused_call_outcomes(call, buf, read, lambda: buf.dispatch(x, idx, w))
    after = buf.dispatch_backward(g, gw, d.handle)
    out["same"] = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before, after))
    out["finite"] = not bool(after[0].isnan().any())
    if other is not None:
        other.close()
    buf.close()
    return out


CASES = [  # backend, geometry, sync_free, with grad_recv_w, how
    ("triton", "push", False, False, "dtype"),
    ("triton", "decode", True, True, "cancel"),
    ("nccl", "push", False, True, "dtype"),
    ("nccl", "push", True, False, "handle"),
]
SLOW_CASES = [
    ("triton", "pull", False, False, "handle"), ("triton", "pull", True, True, "dtype"),
    ("triton", "decode", False, False, "dtype"), ("nccl", "push", False, False, "cancel"),
]


def _run(W, backend, geometry, sync_free, with_w, how, world=None, read="check", sync_checks=None):
    res = (world or run_cpu_world)(W, _world, backend, geometry, sync_free, with_w, how, read, sync_checks,
                                   timeout_s=240)
    assert len(res) == W
    check_refused_backward(res, how, backend, sync_checks)


@pytest.mark.parametrize("backend,geometry,sync_free,with_w,how", CASES)
def test_refused_dispatch_backward_takes_part(backend, geometry, sync_free, with_w, how):
    _run(2, backend, geometry, sync_free, with_w, how)


@pytest.mark.parametrize("backend,geometry", [("triton", "push"), ("triton", "decode"), ("nccl", "push")])
def test_refused_dispatch_backward_then_synced_dispatch(backend, geometry):
    """No ``check()`` in between: the next synced dispatch raises the refusal on every rank after its launches (the
    triton backend raised it before its data launches, on every later call too, until the next call timed out)."""
    _run(2, backend, geometry, False, True, "cancel", read="dispatch")


@pytest.mark.parametrize("geometry,how", [("push", "dtype"), ("decode", "cancel")])
def test_refused_dispatch_backward_strict_sync_checks(geometry, how):
    """Strict sync checks (triton): every peer's end-of-call check raises the refusal in the call, so the refused
    rank clears its own record too (before, its next read raised it alone: the ranks left different calls)."""
    _run(2, "triton", geometry, False, True, how, sync_checks="strict")


@pytest.mark.slow
@pytest.mark.parametrize("backend,geometry,sync_free,with_w,how", SLOW_CASES)
def test_refused_dispatch_backward_takes_part_slow(backend, geometry, sync_free, with_w, how):
    _run(3, backend, geometry, sync_free, with_w, how)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,geometry,sync_free,with_w,how", CASES + SLOW_CASES)
def test_gpu_refused_dispatch_backward_takes_part(gpu_world, gpu_world_size, backend, geometry, sync_free, with_w,
                                                  how):
    """The same on GPUs (ranks may share one for triton; the nccl backend needs one GPU per rank)."""
    if gpu_world_size < 2:
        pytest.skip("a refusal needs a peer: gpu_world_size >= 2")

    def world(W, fn, *args, timeout_s):
        return gpu_world(W, fn, *args, timeout_s=timeout_s, nccl=backend == "nccl")
    _run(gpu_world_size, backend, geometry, sync_free, with_w, how, world=world)
