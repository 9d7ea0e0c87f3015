"""dispatch(sync_free=True): no host read, max_recv_tokens rows, the real rows and the combine equal the synced call.

Bit-exact (torch.equal): rows [0, expert_offsets[-1]), counts, offsets, weights (zero past the real rows), combine.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs


def _world(group, ntokens):
    rank = dist.get_rank()
    E, H, Tm, K = 8, 64, 12, 3
    buf = tep.EPBuffer(group, E, H, Tm, K)
    out = []
    for seed in (1, 2):
        x, idx, w = make_rank_inputs(rank, ntokens[rank], H, E, K, seed=seed, mask_frac=0.2)
        d = buf.dispatch(x, idx, w)
        R = d.x.shape[0]
        eo = buf.expert_out_buffer(R)
        eo.copy_((d.x.float() * 0.25 - 1.0).to(torch.bfloat16))
        y = buf.combine(eo, d.handle)
        ref = dict(x=d.x.clone(), w=d.weights.clone(), offs=d.expert_offsets.clone(),
                   ntpe=d.num_tokens_per_expert.clone(), y=y.clone())
        reads = buf.host_reads
        f = buf.dispatch(x, idx, w, sync_free=True)
        assert buf.host_reads == reads, "sync_free dispatch read the device"
        assert f.x.shape[0] == buf.max_recv_tokens and f.handle.num_recv_rows is None
        eo2 = buf.expert_out_buffer()
        eo2[:R].copy_((f.x[:R].float() * 0.25 - 1.0).to(torch.bfloat16))
        y2 = buf.combine(eo2, f.handle)
        assert buf.host_reads == reads
        out.append(dict(ref=ref, x=f.x[:R].clone(), w=f.weights.clone(), offs=f.expert_offsets.clone(),
                        ntpe=f.num_tokens_per_expert.clone(), y=y2.clone(), R=R))
    buf.check()  # the status word holds no error
    buf.close()
    return out


@pytest.mark.parametrize("ntokens", [[9, 12], [0, 7]])
def test_sync_free_equals_synced(ntokens):
    res = run_cpu_world(2, _world, ntokens)
    for per_rank in res:
        for c in per_rank:
            ref, R = c["ref"], c["R"]
            assert torch.equal(c["x"], ref["x"])
            assert torch.equal(c["offs"], ref["offs"]) and torch.equal(c["ntpe"], ref["ntpe"])
            assert torch.equal(c["w"][:R], ref["w"]) and not c["w"][R:].any()
            assert torch.equal(c["y"], ref["y"])


def _nccl_world(group):
    buf = tep.EPBuffer(group, 4, 64, 8, 2, backend="nccl")
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    idx = torch.zeros(2, 2, dtype=torch.int64)
    reads = buf.host_reads
    d = buf.dispatch(x, idx, torch.ones(2, 2), sync_free=True)
    out = (buf.host_reads - reads, d.x.shape[0], buf.max_recv_tokens, d.handle.num_recv_rows,
           d.expert_offsets.tolist())
    buf.check()
    buf.close()
    return out


def test_sync_free_on_nccl():
    """The nccl backend has a sync-free dispatch too (tests/backends/nccl/test_sync_free.py checks it bit for bit)."""
    for rank, (reads, rows, max_recv, nrr, offs) in enumerate(run_cpu_world(2, _nccl_world)):
        assert reads == 0 and rows == max_recv and nrr is None
        assert offs == ([8, 8] if rank == 0 else [0, 0])  # 2 ranks x 2 tokens x 2 routes, all to expert 0


def _short_world(group):
    from tritonep.errors import InputError

    rank = dist.get_rank()
    buf = tep.EPBuffer(group, 8, 64, 12, 3)
    x, idx, w = make_rank_inputs(rank, 9, 64, 8, 3, seed=3)
    f = buf.dispatch(x, idx, w, sync_free=True)
    M = buf.max_recv_tokens
    short = buf.expert_out_buffer()[:M - 1]  # the kernels may address any row of the layout up to M
    errs = []
    for call in (lambda: buf.combine(short, f.handle), lambda: buf.combine_backward(torch.zeros_like(x), short,
                                                                                     f.handle),
                 lambda: buf.dispatch_backward(short, None, f.handle)):
        try:
            call()
            errs.append(None)
        except InputError as e:
            errs.append(str(e))
    y = buf.combine(buf.expert_out_buffer(), f.handle)  # the full rows pass
    try:  # the refused combine took part as refused on both ranks (tests/ep/test_failed_peer.py): reported once
        buf.check()
        refused = None
    except tep.errors.PeerInputError as e:
        refused = sorted(e.bad_ranks)
    buf.check()
    buf.close()
    return errs, tuple(y.shape), M, refused


def test_sync_free_handle_needs_max_recv_rows():
    """A sync-free handle's rows are unknown on the host: combine and both backwards refuse an input shorter than the
    max_recv_tokens rows its dispatch returned (before any kernel could address past it); the refused combine still
    takes part (as refused: no row moves), so the next check() reports it on every rank."""
    for errs, yshape, M, refused in run_cpu_world(2, _short_world):
        assert all(e is not None and f"{M - 1} rows" in e and str(M) in e for e in errs), errs
        assert yshape == (9, 64) and refused == [0, 1]
