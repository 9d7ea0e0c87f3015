"""The ranks must pass the same count routing to a dispatch (``count_ids`` / ``count_experts``): when they do not,
every rank refuses the call with :class:`tritonep.errors.CountRoutingError` instead of leaving stale sums.

Every rank's stamp of the call (``count_experts``, 0 without ``count_ids``) travels in the exchange the call runs
anyway (the triton backend: column ``count_columns`` of its ``xcounts`` row, on the decode tiles' one launch and the
counts exchange launch of the two-kernel and fused dispatches; the nccl backend: its counts row's refused-flag
word). Checked in CPU worlds of 2 and 3 ranks: one rank omits ``count_ids`` while the others pass it, one rank passes
another ``count_experts``; every rank raises the same error naming the disagreement (which ranks count, the differing
``count_experts``), no rank returns sums, the buffer's host reads grow by one per call (the verdict comes with the
call's one read), and later agreeing calls give the twin's sums
(:func:`tritonep.reference.count_sums_reference`). A sync-free disagreement (triton) is recorded on every rank and
raised by the next :meth:`tritonep.EPBuffer.check`. The GPU runs the same world (tests/backends/triton/
test_decode_gpu.py).
"""

import os

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import CountRoutingError, TritonEPError
from tritonep.reference import count_sums_reference
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.backends.triton.test_count_routing import H, K, TM, _count_ids


def _attempt(fn):
    """The error's ``(name, bad_ranks, counting, count_experts, rank)`` (a CountRoutingError; another error: its
    name and message), or, when ``fn()`` returns, ``("returned", its count_sums)`` (a dispatch's; None for a check)."""
    try:
        got = fn()
    except CountRoutingError as e:
        return type(e).__name__, e.bad_ranks, e.counting, e.count_experts, e.rank
    except TritonEPError as e:
        return type(e).__name__, str(e)
    return "returned", None if got is None else got.handle.count_sums


def agree_world(group, Ts, CE, CK, geometry, backend="triton"):
    """One rank of the agreement check (CPU worlds here, GPU worlds in test_decode_gpu.py): returns
    ``(record, the twin's sums over CE, over CE + W)``; the record holds each call's sums or refusal."""
    os.environ["TRITONEP_GEOMETRY"] = geometry
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    E, CE2 = 4 * W, CE + W
    x, idx, w = (t.to(dev) for t in make_rank_inputs(rank, Ts[rank], H, E, K, seed=3))
    w = w.float().contiguous()
    cids = [_count_ids(r, Ts[r], CE, CK).to(dev) for r in range(W)]
    cids2 = [_count_ids(r + 7, Ts[r], CE2, CK).to(dev) for r in range(W)]
    want, want2 = (count_sums_reference([c.cpu() for c in cs], ce)[rank] for cs, ce in ((cids, CE), (cids2, CE2)))
    buf = tep.EPBuffer(group, E, H, TM, K, device=dev, backend=backend, count_columns=CE2 // W)
    plain = buf.dispatch(x, idx, w)
    rec = {}
    counted = dict(count_ids=cids[rank], count_experts=CE)
    # an agreeing call first: its columns stay in the region (what a disagreeing call would read, stale)
    rec["first"] = buf.dispatch(x, idx, w, **counted).handle.count_sums
    reads = buf.host_reads
    # the last rank omits count_ids while the others pass it
    rec["omit"] = _attempt(lambda: buf.dispatch(x, idx, w, **({} if rank == W - 1 else counted)))
    # rank 1 passes another count_experts (and another routing over it)
    other = dict(count_ids=cids2[rank], count_experts=CE2) if rank == 1 else counted
    rec["experts"] = _attempt(lambda: buf.dispatch(x, idx, w, **other))
    rec["reads"] = buf.host_reads - reads  # the verdict came with each call's one read
    # agreeing calls afterwards: the sums are the twin's (both halves of the double-buffered exchange), rows unchanged
    rec["after"] = []
    for _ in range(2):
        d = buf.dispatch(x, idx, w, count_ids=cids2[rank], count_experts=CE2)
        rec["after"].append(d.handle.count_sums)
        assert torch.equal(d.x, plain.x) and torch.equal(d.expert_offsets, plain.expert_offsets)
    if backend == "triton":  # a sync-free disagreement: recorded on every rank, raised by the next check
        buf.dispatch(x, idx, w, sync_free=True, **({} if rank == 0 else counted))
        rec["sync_free"] = _attempt(buf.check)
        rec["after_free"] = buf.dispatch(x, idx, w, **counted).handle.count_sums
    buf.close()
    return rec, want, want2


def check_agreement(results, W, CE, backend="triton"):
    """Assert the records of :func:`agree_world` (every rank's; both backends, CPU and GPU worlds)."""
    CE2 = CE + W
    sums = backend == "triton"  # the nccl backend sums no count routing: None, but checks the agreement all the same
    for rank, (rec, want, want2) in enumerate(results):
        assert rec["first"] == (want if sums else None), (rank, rec)
        assert rec["omit"] == ("CountRoutingError", [W - 1], list(range(W - 1)), {0: CE, W - 1: 0}, rank), (rank, rec)
        assert rec["experts"] == ("CountRoutingError", [1], list(range(W)), {0: CE, 1: CE2}, rank), (rank, rec)
        assert rec["reads"] == 2, (rank, rec)
        assert rec["after"] == ([want2, want2] if sums else [None, None]), (rank, rec)
        if backend == "triton":
            assert rec["sync_free"] == ("CountRoutingError", [1], list(range(1, W)), {0: 0, 1: CE}, rank), (rank, rec)
            assert rec["after_free"] == want, (rank, rec)


@pytest.mark.parametrize("geometry", ["dec=2", "", "fs=2,fe=2"], ids=["decode", "two-kernel", "fused"])
@pytest.mark.parametrize("W,CE,CK", [(2, 8, 3), (3, 12, 8)])
def test_count_routing_disagreement_refused(W, CE, CK, geometry):
    """The decode tiles' one launch, and the counts exchange launch of the two-kernel and fused dispatches."""
    Ts = [16, 0, 5][:W]
    check_agreement(run_cpu_world(W, agree_world, Ts, CE, CK, geometry), W, CE)


@pytest.mark.parametrize("W", [2, 3])
def test_count_routing_disagreement_refused_nccl(W):
    """The nccl backend's synced dispatch: the stamps ride in the counts row every rank gathers."""
    Ts = [16, 0, 5][:W]
    check_agreement(run_cpu_world(W, agree_world, Ts, 4 * W, 3, "", "nccl"), W, 4 * W, "nccl")
