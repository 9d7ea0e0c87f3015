"""A refused ``EPBuffer.combine_backward`` input on one rank (or ``cancel_combine_backward``) takes part as refused.

The combine backward reads nothing on the host (as every backward), so it cannot raise on the peers. Before, a rank
whose input was refused (wrong dtype, too few rows, another buffer's handle) raised before any launch and its peers
waited ``timeout_s`` (triton) or hung in the collective (nccl). Now the refusing rank runs the peers' launches and
collectives with no row and the refused mark (triton: its send writes token count -1 in every rank, which every
expand reads; nccl: NaN rows and one gathered flag per rank): the peers' outputs (``grad_expert_out`` and
``grad_recv_weights``) are NaN (triton: all of them; nccl: every row received from the refused rank, the others
exact), and the next ``check()`` -- or the next synced dispatch, which runs its launches and then raises -- raises
PeerInputError naming the rank on every rank (the refused one too), once. In strict sync checks the triton peers raise
in the call itself and no rank keeps the refusal. The buffer stays usable: a later combine backward gives the same
bits as before the refusal. Both backends; two-kernel and decode tiles, alignment padding, synced and sync-free
handles; CPU worlds and (``-m gpu``) GPU ones.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.bench.cases import make_rank_inputs
from tritonep.testing import run_cpu_world
from tests.support.refused_backward import check_refused_backward, refused_call_outcomes

H, TM, K = 64, 8, 2
GEOMETRIES = {"push": "dec=0,fs=0,fe=0,fc=0,combine=push", "decode": "bt=2,dec=2"}


def _rows_from(d, src, rank, L):
    """bool ``[rows]``: the rows of ``d`` (this rank's dispatch result) received from rank ``src`` (inside expert
    segment j of global expert e, source s's rows follow those of the lower sources: ``counts[:s, e]``)."""
    counts, offs, ntpe = d.handle.counts.cpu(), d.expert_offsets.cpu(), d.num_tokens_per_expert.cpu()
    mask = torch.zeros(d.x.shape[0], dtype=torch.bool)
    for j in range(L):
        e = rank * L + j
        begin = int(offs[j - 1]) if j else 0
        start = begin + int(counts[:src, e].sum())
        mask[start:start + int(counts[src, e])] = True
        assert start + int(counts[src, e]) <= begin + int(ntpe[j])
    return mask.to(d.x.device)


def _nan_pattern(ge, gw, before, d, bad_rank, rank, backend):
    """"NaN" when the refused call's outputs are NaN where the backend promises (triton: every row; nccl: every row
    received from the refused rank, the rest equal to a good call's), else what differs."""
    if backend == "triton":
        nan = torch.ones(ge.shape[0], dtype=torch.bool, device=ge.device)
    else:
        nan = _rows_from(d, bad_rank, rank, 2)
    if not bool(nan.any()):
        return "no row of the refused rank"  # the inputs route rows everywhere: the test would prove nothing
    ok = bool(ge[nan].isnan().all()) and torch.equal(ge[~nan], before[0][~nan])
    ok = ok and bool(gw[nan].isnan().all()) and torch.equal(gw[~nan], before[1][~nan])
    return "NaN" if ok else f"wrong: {int(ge.isnan().any(1).sum())} NaN rows of {ge.shape[0]}"


def _world(group, backend, geometry, sync_free, how, align, read, sync_checks):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    bad_rank = W - 1
    buf = tep.EPBuffer(group, 2 * W, H, TM, K, backend=backend, timeout_s=30, tiles=GEOMETRIES[geometry],
                       expert_alignment=align, sync_checks=sync_checks)
    x, idx, w = (t.to(buf.device) for t in make_rank_inputs(rank, 6, H, 2 * W, K, seed=5, mask_frac=0.0))
    d = buf.dispatch(x, idx, w, sync_free=sync_free)
    eo = (d.x.float() * 0.5 - 0.25).to(torch.bfloat16)
    gy = (x.float() * 0.25 + 1).to(torch.bfloat16)
    before = buf.combine_backward(gy, eo, d.handle)
    other = tep.EPBuffer(group, 2 * W, H, TM, K, backend=backend) if how == "handle" else None
    foreign = other.dispatch(x, idx, w).handle if other is not None else None  # every rank

    def call():  # what this rank's part of the refused call shows (strict sync checks: the peers raise in it)
        if rank != bad_rank:
            ge, gw = buf.combine_backward(gy, eo, d.handle)
            return _nan_pattern(ge, gw, before, d, bad_rank, rank, backend)
        if how == "dtype":
            buf.combine_backward(gy.float(), eo, d.handle)
        elif how == "rows":
            buf.combine_backward(gy, eo[:-1], d.handle)
        elif how == "handle":
            buf.combine_backward(gy, eo, foreign)
        else:  # the rank's own code failed before its combine backward
            buf.cancel_combine_backward(d.handle)
            return "cancelled"

    out = refused_call_outcomes(call, buf, read, lambda: buf.dispatch(x, idx, w))
    d2 = buf.dispatch(x, idx, w, sync_free=sync_free)  # the buffer pairs again on every rank
    after = buf.combine_backward(gy, eo, d2.handle)
    out["same"] = all(torch.equal(a, b) for a, b in zip(before, after))
    y = buf.combine(eo, d2.handle)
    out["finite"] = not bool(after[0].isnan().any()) and not bool(y.isnan().any())
    if other is not None:
        other.close()
    buf.close()
    return out


CASES = [  # W, backend, geometry, sync_free, how, expert_alignment, read, sync_checks
    (2, "triton", "push", False, "dtype", 1, "check", None),
    (3, "triton", "decode", True, "cancel", 4, "dispatch", None),
    (2, "triton", "push", True, "handle", 4, "check", None),
    (2, "triton", "push", False, "rows", 1, "check", "strict"),
    (2, "nccl", "push", False, "rows", 1, "dispatch", None),
    (3, "nccl", "push", True, "handle", 1, "check", None),
]
SLOW_CASES = [
    (3, "triton", "push", False, "rows", 1, "dispatch", None), (2, "triton", "decode", False, "handle", 1, "check",
                                                                  None),
    (2, "nccl", "push", False, "cancel", 4, "check", None), (3, "nccl", "push", True, "dtype", 1, "dispatch", None),
]


def _run(W, backend, geometry, sync_free, how, align, read, sync_checks, world=None):
    res = (world or run_cpu_world)(W, _world, backend, geometry, sync_free, how, align, read, sync_checks,
                                   timeout_s=240)
    assert len(res) == W
    check_refused_backward(res, how, backend, sync_checks)


@pytest.mark.parametrize("W,backend,geometry,sync_free,how,align,read,sync_checks", CASES)
def test_refused_combine_backward_takes_part(W, backend, geometry, sync_free, how, align, read, sync_checks):
    _run(W, backend, geometry, sync_free, how, align, read, sync_checks)


@pytest.mark.slow
@pytest.mark.parametrize("W,backend,geometry,sync_free,how,align,read,sync_checks", SLOW_CASES)
def test_refused_combine_backward_takes_part_slow(W, backend, geometry, sync_free, how, align, read, sync_checks):
    _run(W, backend, geometry, sync_free, how, align, read, sync_checks)


@pytest.mark.gpu
@pytest.mark.parametrize("backend,geometry,sync_free,how,align,read,sync_checks",
                         sorted({c[1:] for c in CASES + SLOW_CASES}, key=repr))
def test_gpu_refused_combine_backward_takes_part(gpu_world, gpu_world_size, backend, geometry, sync_free, how,
                                                 align, read, sync_checks):
    """The same on GPUs at ``gpu_world_size`` ranks (ranks may share one for triton; the nccl backend needs one GPU
    per rank)."""
    if gpu_world_size < 2:
        pytest.skip("a refusal needs a peer: gpu_world_size >= 2")

    def world(_W, fn, *args, timeout_s):
        return gpu_world(gpu_world_size, fn, *args, timeout_s=timeout_s, nccl=backend == "nccl")
    _run(gpu_world_size, backend, geometry, sync_free, how, align, read, sync_checks, world=world)
