"""Capacity: a call over ``max_tokens_per_rank`` or ``max_recv_tokens`` is refused on every rank (CapacityError
naming the numbers), also when only one rank overflows, when a peer is slow, and with sync checks off; the buffer
stays usable; exactly at capacity passes."""

import os
import time

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import CapacityError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import BF16, calls_world, check_calls, run_call


def _nosync_capacity_world(group):
    os.environ["TRITONEP_SYNC_CHECKS"] = "0"  # graph-capture mode: errors are recorded, buf.check() raises them
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2, max_recv_tokens=9)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank)).to(BF16)
    buf.dispatch(x, torch.tensor([[0, 1]] * 5 + [[2, 3]] * 3), torch.ones(8, 2))  # rank 0 would get 20 > 9 rows
    try:
        buf.check()
        first = "no error"
    except CapacityError:
        first = "CapacityError"
    d = buf.dispatch(x[:4], torch.tensor([[0, 2]] * 2 + [[3, -1]] * 2), torch.ones(4, 2))  # fits
    y = buf.combine(d.x, d.handle)
    try:
        buf.check()
        second = "no error"
    except CapacityError:
        second = "CapacityError"
    want = torch.cat([(x[:2].float() * 2).to(BF16), x[2:4]])
    buf.close()
    return first, second, torch.equal(y, want)


def test_capacity_error_without_sync_checks_then_usable():
    for first, second, y_ok in run_cpu_world(2, _nosync_capacity_world, timeout_s=60):
        assert first == "CapacityError"
        assert second == "no error" and y_ok


def _capacity_race_world(group):
    os.environ["TRITONEP_TIMEOUT_S"] = "3"
    rank = dist.get_rank(group)
    if rank == 1:  # a peer delayed between the counts wait and reading the counts (any GPU block can be)
        import tritonep.backends.triton.kernels.layout as lay

        orig = lay.wait_all_ge

        def slow(*a, **k):
            r = orig(*a, **k)
            time.sleep(0.5)
            return r

        lay.wait_all_ge = slow
    buf = tep.EPBuffer(group, 4, 64, 8, 2, max_recv_tokens=20)
    log = []
    for idx in (torch.tensor([[0, 1]] * 8), torch.tensor([[2, 3]])):  # 32 rows > 20 on rank 0, then 4 rows
        try:
            buf.dispatch(torch.ones(idx.shape[0], 64, dtype=BF16), idx, torch.ones(idx.shape[0], 2))
            log.append("ok")
        except CapacityError:
            log.append("capacity")
        except Exception as e:  # noqa: BLE001
            log.append(type(e).__name__)
            break
    buf.close()
    return log


def test_capacity_error_seen_by_every_rank_with_a_slow_peer():
    assert run_cpu_world(2, _capacity_race_world, timeout_s=120) == [["capacity", "ok"]] * 2


def test_all_tokens_to_one_expert_and_exact_capacity():
    W, T, K = 2, 8, 1
    cfg = dict(E=4, H=64, Tmax=T, K=K, max_recv=2 * T, repeat=True)  # expert 1 gets exactly max_recv rows
    calls = []
    for r in range(W):
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(r)).bfloat16()
        calls.append([(x, torch.ones(T, K, dtype=torch.int64), torch.ones(T, K))])
    res = run_cpu_world(W, calls_world, cfg, calls, timeout_s=120)
    check_calls(cfg, calls, res, fp32=True)
    assert res[0][0]["ntpe"].tolist() == [0, 2 * T]


def _max_recv_refusal_world(group):
    buf = tep.EPBuffer(group, 4, 64, 8, 2, max_recv_tokens=9)
    x = torch.randn(8, 64).bfloat16()
    hot = torch.tensor([[0, 1]] * 5 + [[2, 3]] * 3)  # rank 0 receives 10 rows from each rank -> 20 > 9
    msgs = []
    for _ in range(2):
        try:
            buf.dispatch(x, hot, torch.ones(8, 2))
            msgs.append("no error")
        except CapacityError as e:
            msgs.append((str(e), e.needed, e.available))
    ok = torch.tensor([[0, 2]] * 2 + [[3, -1]] * 2)  # fits: 4 rows per rank on rank 0
    d = buf.dispatch(x[:4], ok, torch.ones(4, 2))
    y = buf.combine(d.x, d.handle)
    big = torch.zeros(9, 64, dtype=torch.bfloat16)
    try:
        buf.dispatch(torch.zeros(9, 64).bfloat16(), torch.zeros(9, 2, dtype=torch.long), torch.ones(9, 2))
        over = "no error"
    except CapacityError as e:
        over = str(e)
    buf.close()
    return msgs, y, x[:4], over, big.shape


def test_capacity_error_then_usable():
    res = run_cpu_world(2, _max_recv_refusal_world, timeout_s=120)
    for msgs, y, x, over, _ in res:
        for m in msgs:
            assert m != "no error"
            text, needed, available = m
            assert needed == 20 and available == 9 and "max_recv_tokens=9" in text
        # after the refused calls the buffer still works: tokens 0,1 -> experts 0 and 2 (w=1 each), 2,3 -> expert 3
        want = torch.cat([(x[:2].float() * 2).bfloat16(), x[2:]])
        assert torch.equal(y, want)
        assert "max_tokens_per_rank=8" in over


def _capacity_world(group, backend):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2, max_recv_tokens=16, backend=backend)
    errs = []
    try:  # one token over max_tokens_per_rank
        buf.dispatch(torch.zeros(9, 64, dtype=BF16), torch.zeros(9, 2, dtype=torch.int64), torch.ones(9, 2))
        errs.append(None)
    except CapacityError as e:
        errs.append((str(e), e.needed, e.available))
    for _ in range(2):  # skew: rank 0 would receive 2 ranks * 8 tokens * 2 routes = 32 rows > 16; rank 1 gets 0
        try:
            buf.dispatch(torch.ones(8, 64, dtype=BF16), torch.tensor([[0, 1]] * 8), torch.ones(8, 2))
            errs.append(None)
        except CapacityError as e:
            errs.append((str(e), e.needed, e.available))
    out = run_call(buf, *make_rank_inputs(rank, 4, 64, 4, 2, seed=5))  # <= 2 * 4 * 2 = 16 rows anywhere: fits
    buf.close()
    return errs, [out]


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_capacity_errors_then_usable(backend):
    res = run_cpu_world(2, _capacity_world, backend, timeout_s=120)
    for r, (errs, _) in enumerate(res):
        assert None not in errs, f"rank {r}: a call over capacity was not refused: {errs}"
        text, needed, available = errs[0]
        assert (needed, available) == (9, 8) and "9" in text and "max_tokens_per_rank=8" in text, text
        for text, needed, available in errs[1:]:  # raised on BOTH ranks, although only rank 0 overflows
            assert (needed, available) == (32, 16), (r, text)
            assert "32" in text and "max_recv_tokens=16" in text and "rank 0" in text, text
    cfg = dict(E=4, H=64, Tmax=8, K=2)
    calls = [[make_rank_inputs(r, 4, 64, 4, 2, seed=5)] for r in range(2)]
    check_calls(cfg, calls, [o for _, o in res])
