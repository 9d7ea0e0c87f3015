"""The decode dispatch's count routing (``EPBuffer.dispatch(count_ids=..., count_experts=...)``) in CPU worlds.

Each rank's ``handle.count_sums`` equals the twin :func:`tritonep.reference.count_sums_reference` over every rank's
``count_ids`` (repeated ids, -1 and ids past the experts included), read with the call's one status read (the
buffer's host reads do not grow); the dispatch's own outputs are those of the same call without a count routing.
Both triton paths compute them (the decode tiles' one launch, the counts exchange of the two-kernel and fused
dispatches); where they are not (sync-free calls, the nccl backend) the handle says None; bad count ids are refused on
every rank.
"""

import os

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import InputError, PeerInputError
from tritonep.reference import count_sums_reference
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs

H, TM, K = 64, 16, 2


def _count_ids(rank: int, T: int, CE: int, CK: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(-1, CE + 2, (T, CK), generator=g)  # -1, ids past CE, repeats: all counted as specified
    return ids.to(torch.int32 if rank % 2 else torch.int64)


def count_world(group, Ts, CE, CK, geometry):
    """One rank of the count-routing check (CPU worlds here; GPU worlds: test_decode_gpu.py): returns
    ``(sums of two calls, the twin's, the refusal's error name, sums after it)``."""
    os.environ["TRITONEP_GEOMETRY"] = geometry
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    E = 4 * W
    x, idx, w = (t.to(dev) for t in make_rank_inputs(rank, Ts[rank], H, E, K, seed=3))
    w = w.float().contiguous()
    cids = [_count_ids(r, Ts[r], CE, CK) for r in range(W)]
    want = count_sums_reference(cids, CE)
    cids = [c.to(dev) for c in cids]
    buf = tep.EPBuffer(group, E, H, TM, K, device=dev, count_columns=CE // W + 1)
    plain = buf.dispatch(x, idx, w)
    reads = buf.host_reads
    got = []
    for _ in range(2):  # twice: both halves of the double-buffered exchange
        d = buf.dispatch(x, idx, w, count_ids=cids[rank], count_experts=CE)
        got.append(d.handle.count_sums)
        assert torch.equal(d.x, plain.x) and torch.equal(d.weights, plain.weights)
        assert torch.equal(d.expert_offsets, plain.expert_offsets)
    assert buf.host_reads == reads + 2  # one read per dispatch, the sums with it
    free = buf.dispatch(x, idx, w, count_ids=cids[rank], count_experts=CE, sync_free=True)
    assert free.handle.count_sums is None and plain.handle.count_sums is None
    # a bad count routing is refused on every rank, the buffer stays usable
    err = None
    try:
        bad = cids[rank][:, :1].float() if rank == 0 else cids[rank]
        buf.dispatch(x, idx, w, count_ids=bad, count_experts=CE)
    except (InputError, PeerInputError) as e:
        err = type(e).__name__
    d = buf.dispatch(x, idx, w, count_ids=cids[rank], count_experts=CE)
    again = d.handle.count_sums
    buf.close()
    return got, want[rank], err, again


@pytest.mark.parametrize("geometry", ["dec=2", "", "fs=2,fe=2"], ids=["decode", "two-kernel", "fused"])
@pytest.mark.parametrize("W,CE,CK", [(2, 8, 3), (3, 12, 8)])
def test_count_sums(W, CE, CK, geometry):
    """The decode tiles' one launch, and the counts exchange launch of the two-kernel and fused dispatches."""
    Ts = [16, 0, 5][:W]
    for rank, (got, want, err, again) in enumerate(run_cpu_world(W, count_world, Ts, CE, CK, geometry)):
        assert got == [want, want] and again == want, (rank, got, want)
        assert err == ("InputError" if rank == 0 else "PeerInputError"), (rank, err)


def test_count_sums_nccl_is_none():
    """The nccl backend sums no count routing: None (the caller counts its own way)."""
    def fn(group):
        x, idx, w = make_rank_inputs(dist.get_rank(group), 8, H, 8, K, seed=3)
        buf = tep.EPBuffer(group, 8, H, TM, K, device="cpu", backend="nccl", count_columns=4)
        d = buf.dispatch(x, idx, w.float(), count_ids=idx, count_experts=8)
        buf.close()
        return d.handle.count_sums, buf.sums_counts
    assert run_cpu_world(2, fn) == [(None, False), (None, False)]


def test_count_columns_checked():
    with pytest.raises(tep.ConfigError if hasattr(tep, "ConfigError") else Exception, match="count_columns"):
        from tritonep.ep.config import build_config
        build_config(world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=16, topk=2, device_type="cpu",
                     count_columns=-1, check_kernels=False)
