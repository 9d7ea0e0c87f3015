"""The decode dispatch's carried top-k (``EPBuffer.dispatch(count_ids=..., count_weights=...)``: ``handle.carried``) in
CPU worlds.

Every received row gets its token's count ids local to the receiver and its weights, rows past the received ones -1
and 0, exactly as the twin :func:`tritonep.reference.carry_reference` over :func:`tritonep.reference.
dispatch_reference`'s rows; the dispatch's own outputs are those of the same call without it; synced, sync-free and
refused calls; buffers that cannot carry refuse the arguments by name.
"""

import os

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import InputError, PeerInputError
from tritonep.reference import carry_reference, dispatch_reference
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.hooks import backend_of

H, TM, K = 64, 16, 2


def _carried(rank: int, T: int, CE: int, CK: int):
    g = torch.Generator().manual_seed(200 + rank)
    ids = torch.randint(-1, CE + 2, (T, CK), generator=g)  # -1, ids past CE (carried as -1), repeats
    ids = ids.to(torch.int32 if rank % 2 else torch.int64)
    return ids, torch.rand(T, CK, generator=g) + 0.5


def carry_world(group, Ts, CE, CK, geometry, idx_dtype):
    """One rank: ``(ok of every check, error names of the refused call)``."""
    os.environ["TRITONEP_GEOMETRY"] = geometry
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    E = 4 * W
    inputs = [make_rank_inputs(r, Ts[r], H, E, K, seed=3) for r in range(W)]
    carried = [_carried(r, Ts[r], CE, CK) for r in range(W)]
    x, idx, w = (t.to(dev) for t in inputs[rank])
    w = w.float().contiguous()
    cid, cw = (t.to(dev) for t in carried[rank])
    ref = dispatch_reference([i[0] for i in inputs], [i[1] for i in inputs], [i[2].float() for i in inputs], E, W)
    buf = tep.EPBuffer(group, E, H, TM, K, device=dev, count_columns=CE // W, count_topk=CK + 1)
    assert buf.carries_topk
    R = buf.config.max_recv_tokens
    want_i, want_w = carry_reference(ref[rank], rank, [c[0] for c in carried], [c[1] for c in carried], CE, R)
    plain = buf.dispatch(x, idx, w)
    checks = []
    n = int(plain.expert_offsets[-1])
    for sync_free in (False, True, False):
        d = buf.dispatch(x, idx, w, count_ids=cid.to(idx_dtype), count_experts=CE, count_weights=cw,
                         sync_free=sync_free)
        oi, ow = d.handle.carried
        rows = R if sync_free else n  # the sync-free rows: the receive capacity, -1 / 0 past the received ones
        checks.append(torch.equal(d.x[:n], plain.x) and torch.equal(d.expert_offsets, plain.expert_offsets))
        checks.append(oi.dtype == idx_dtype and oi.shape == (rows, CK) and ow.shape == (rows, CK))
        checks.append(torch.equal(oi.cpu().to(torch.int64), want_i[:rows]) and torch.equal(ow.cpu(), want_w[:rows]))
        checks.append(sync_free or d.handle.count_sums is not None)
    # a refused call (a bad carried weight dtype on rank 0) is refused on every rank; the buffer stays usable
    err = None
    try:
        bad = cw.double() if rank == 0 else cw
        buf.dispatch(x, idx, w, count_ids=cid, count_experts=CE, count_weights=bad)
    except (InputError, PeerInputError) as e:
        err = type(e).__name__
    # sync-free and refused (rank 0's bad weights, read by nobody): the peers' rows are all -1 / 0
    try:
        bad = cw.double() if rank == 0 else cw
        d = buf.dispatch(x, idx, w, count_ids=cid, count_experts=CE, count_weights=bad, sync_free=True)
        oi, ow = d.handle.carried
        checks.append(bool((oi == -1).all()) and bool((ow == 0).all()))
    except InputError:
        pass
    try:
        buf.check()
    except PeerInputError:
        pass
    d = buf.dispatch(x, idx, w, count_ids=cid, count_experts=CE, count_weights=cw)
    checks.append(torch.equal(d.handle.carried[0].cpu().to(torch.int64), want_i[:n]))
    buf.close()
    return checks, err


@pytest.mark.parametrize("W,CE,CK,idx_dtype", [(2, 8, 3, torch.int64), (3, 12, 8, torch.int32)])
def test_carried_topk(W, CE, CK, idx_dtype):
    Ts = [16, 0, 5][:W]
    for rank, (checks, err) in enumerate(run_cpu_world(W, carry_world, Ts, CE, CK, "dec=2", idx_dtype)):
        assert all(checks), (rank, checks)
        assert err == ("InputError" if rank == 0 else "PeerInputError"), (rank, err)


def mixed_world(group):
    """Rank 0 carries its count routing with the rows, the others only count it: refused on every rank (the stamps
    differ), the buffer stays usable."""
    os.environ["TRITONEP_GEOMETRY"] = "dec=2"
    rank = dist.get_rank(group)
    x, idx, w = make_rank_inputs(rank, 8, H, 8, K, seed=3)
    w = w.float().contiguous()
    buf = tep.EPBuffer(group, 8, H, TM, K, device="cpu", count_columns=4, count_topk=K)
    try:
        buf.dispatch(x, idx, w, count_ids=idx, count_experts=8, count_weights=w if rank == 0 else None)
        got = None
    except tep.CountRoutingError as e:
        got = ("carried" in str(e), e.count_experts)
    d = buf.dispatch(x, idx, w, count_ids=idx, count_experts=8, count_weights=w)
    ok = d.handle.carried is not None
    buf.close()
    return got, ok


def test_carry_mismatch_refused():
    for rank, (got, ok) in enumerate(run_cpu_world(2, mixed_world)):
        assert got == (True, {0: 8, 1: 8}) and ok, (rank, got, ok)


def test_carry_refused_where_not_carried():
    """Off the decode tiles (or without count_topk) the arguments are refused by name, before the launch."""
    def fn(group):
        os.environ["TRITONEP_GEOMETRY"] = ""
        x, idx, w = make_rank_inputs(dist.get_rank(group), 8, H, 8, K, seed=3)
        buf = tep.EPBuffer(group, 8, H, TM, K, device="cpu", count_columns=4, count_topk=2)
        try:
            buf.dispatch(x, idx, w.float(), count_ids=idx, count_experts=8, count_weights=w.float())
        except InputError as e:
            msg = str(e)
        else:
            msg = ""
        buf.close()
        return buf.carries_topk, "does not carry" in msg
    assert run_cpu_world(2, fn) == [(False, True), (False, True)]


def test_count_topk_checked():
    from tritonep.ep.config import build_config
    with pytest.raises(tep.ConfigError, match="count_topk"):
        build_config(world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=16, topk=2, device_type="cpu",
                     count_topk=2, check_kernels=False)
    with pytest.raises(tep.ConfigError, match="count_topk=1024"):  # the width rides in the count stamp
        build_config(world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=16, topk=2, device_type="cpu",
                     count_columns=4, count_topk=1024, check_kernels=False)
    with pytest.raises(tep.ConfigError, match="expert_alignment"):
        build_config(world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=16, topk=2, device_type="cpu",
                     count_columns=4, count_topk=2, expert_alignment=4, check_kernels=False)


def width_world(group):
    """The ranks carry routings of different widths (rank 0 one id a token, rank 1 three) after a call where both
    carried three: refused on every rank (the stamps differ), never rank 0's tokens read with rank 1's width (the
    words past rank 0's id are an earlier call's); the buffer stays usable."""
    os.environ["TRITONEP_GEOMETRY"] = "dec=2"
    rank = dist.get_rank(group)
    x, idx, w = make_rank_inputs(rank, 8, H, 8, K, seed=3)
    w = w.float().contiguous()
    buf = tep.EPBuffer(group, 8, H, TM, K, device="cpu", count_columns=4, count_topk=3)
    buf.dispatch(x, idx, w, count_ids=torch.full((8, 3), 5), count_experts=8, count_weights=torch.full((8, 3), 7.0))
    ck = 1 if rank == 0 else 3
    try:
        d = buf.dispatch(x, idx, w, count_ids=torch.full((8, ck), -1), count_experts=8,
                         count_weights=torch.zeros(8, ck))
        got = ("carried", d.handle.carried[0].tolist(), d.handle.carried[1].tolist())
    except tep.CountRoutingError as e:
        got = ("3 ids" in str(e) and "1 id" in str(e), e.count_experts)
    d = buf.dispatch(x, idx, w, count_ids=torch.full((8, 2), 4), count_experts=8, count_weights=torch.ones(8, 2))
    ok = bool((d.handle.carried[0][:, 0] == 0).all()) if rank == 1 else bool((d.handle.carried[0] == -1).all())
    buf.close()
    return got, ok


def test_carry_width_mismatch_refused():
    for rank, (got, ok) in enumerate(run_cpu_world(2, width_world)):
        assert got == (True, {0: 8, 1: 8}) and ok, (rank, got, ok)


def pool_world(group):
    """The carried outputs come from the buffer's pool: a caller that keeps a handle's ``carried`` never sees them
    overwritten by a later call; once let go, later calls get the pool's blocks back and the pool makes no new set."""
    os.environ["TRITONEP_GEOMETRY"] = "dec=2"
    rank = dist.get_rank(group)
    x, idx, w = make_rank_inputs(rank, 8, H, 8, K, seed=3)
    w = w.float().contiguous()
    buf = tep.EPBuffer(group, 8, H, TM, K, device="cpu", count_columns=4, count_topk=2)
    kept = []
    for v in range(4):  # more calls than the pool's sets: the last ones allocate
        d = buf.dispatch(x, idx, w, count_ids=idx, count_experts=8, count_weights=w + v)
        kept.append((d.handle.carried, d.handle.carried[1].clone(), v))
    intact = all(torch.equal(c[1], k) and bool((k[c[0] >= 0] >= v).all()) for c, k, v in kept)
    del kept, d
    impl = backend_of(buf)
    before = impl.output_pool_bytes
    ptrs = []
    for v in range(3):
        d = buf.dispatch(x, idx, w, count_ids=idx, count_experts=8, count_weights=w + v)
        ptrs += [d.handle.carried[0].data_ptr(), d.handle.carried[1].data_ptr()]
        del d
    pooled = set().union(*(p.base_ptrs() for p in impl.output_pools()))
    ok = intact, all(p in pooled for p in ptrs), before == impl.output_pool_bytes
    buf.close()
    return ok


def test_carried_outputs_pooled():
    for rank, got in enumerate(run_cpu_world(2, pool_world)):
        assert got == (True, True, True), (rank, got)
