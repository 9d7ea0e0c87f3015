"""Bounded waits: a peer that skips dispatch, combine or the backward (or stops sending mid-call) makes every
waiting rank raise PeerTimeoutError naming the wait and the peer, within the buffer's bound, in the same call
(strict checks) or at the next one (deferred); the buffer then refuses calls (BufferStateError keeping the
details). The default bound and a per-buffer ``timeout_s``."""

import os
import time

import pytest
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import BufferStateError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import BF16, expert, set_env
from tests.support.hooks import backend_of
from tests.support.outcomes import timeout_verdict


def _strict_buffer(group, E, seed):
    """``(rank, buffer, this rank's inputs)``: waits bounded at 2 s, strict sync checks (a peer lost mid-call raises
    in that call); E experts, H 64, 8 tokens, top-2."""
    set_env(TRITONEP_TIMEOUT_S="2", TRITONEP_SYNC_CHECKS="1")
    rank = dist.get_rank(group)
    return rank, tep.EPBuffer(group, E, 64, 8, 2), make_rank_inputs(rank, 8, 64, E, 2, seed=seed)


def _dispatch_data_timeout_world(group):
    rank, buf, (x, idx, w) = _strict_buffer(group, 4, seed=1)
    if rank == 0:  # takes part in the counts exchange, then never sends (a peer that dies mid-dispatch)
        ks = backend_of(buf).k  # the backend's bound launches (tritonep.backends.triton.calls.KernelSet)
        ks.send = lambda *a: None
        ks.expand = lambda kq: (lambda *a: None)
        ks.fused = lambda kq: (lambda *a: None)  # the one-launch dispatch (geometry with fused_send > 0)
    return timeout_verdict(lambda: buf.dispatch(x, idx, w) and None, message=False)


def test_dispatch_data_timeout_raises_in_the_same_call():
    res = run_cpu_world(2, _dispatch_data_timeout_world, timeout_s=60, check_protocol=False)  # rank 0 skips on purpose
    assert res[1] == ("PeerTimeoutError", "dispatch.data", 0), res[1]


H = 64


def _timeout_state_world(group):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, H, 8, 2, timeout_s=1.0)
    if rank == 1:
        return "skipped"
    x, idx, w = make_rank_inputs(rank, 4, H, 4, 2, seed=2)
    out = [timeout_verdict(lambda: buf.dispatch(x, idx, w) and None)]
    for call in (lambda: buf.dispatch(x, idx, w) and None, buf.check, lambda: buf.expert_out_buffer(3).shape):
        out.append(timeout_verdict(call, BufferStateError))  # the dispatch, check() and expert_out_buffer after it
    buf.close()
    buf.close()  # idempotent
    return out


@pytest.fixture(scope="module")
def timed_out_buffer():
    """Rank 0's log of a 2-rank world where rank 1 never dispatches (one world for the tests that read it)."""
    return run_cpu_world(2, _timeout_state_world, timeout_s=120, check_protocol=False)[0]  # rank 1 skips on purpose


def test_timeout_leaves_a_buffer_that_refuses_calls(timed_out_buffer):
    out = timed_out_buffer
    assert out[0][:3] == ("PeerTimeoutError", "dispatch.counts", 1), out[0]
    msg = out[0][3]
    assert "bound 1 s" in msg and "after waiting " in msg and "unusable" in msg, msg
    assert out[1][0] == "BufferStateError", out[1]  # the dispatch after it
    assert out[2][0] in ("PeerTimeoutError", "BufferStateError"), out[2]  # check()


def test_unusable_buffer_error_keeps_the_timeout_details(timed_out_buffer):
    out = timed_out_buffer
    assert "dispatch.counts" in out[1][1] and "peer 1" in out[1][1], out[1]


def _timeout_world(group):
    os.environ["TRITONEP_TIMEOUT_S"] = "2"
    rank = dist.get_rank()
    buf = tep.EPBuffer(group, 6, 64, 8, 2)
    x, idx, w = make_rank_inputs(rank, 8, 64, 6, 2, seed=3)
    if rank == 1:
        return "skipped"  # this rank never calls dispatch
    return [timeout_verdict(lambda: buf.dispatch(x, idx, w) and None, BufferStateError) for _ in range(2)]


def test_missing_peer_raises_peer_timeout():
    res = run_cpu_world(3, _timeout_world, timeout_s=120, check_protocol=False)  # rank 1 skips on purpose
    for r in (0, 2):
        err, after = res[r]
        assert err[:3] == ("PeerTimeoutError", "dispatch.counts", 1), err
        assert after[0] == "BufferStateError" and "unusable" in after[1], after


def _timeout_s_world(group):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2, timeout_s=1.5)
    assert buf.timeout_s == 1.5 and backend_of(buf).timeout_s == 1.5
    if rank == 1:
        return "skipped"
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=2)
    return timeout_verdict(lambda: buf.dispatch(x, idx, w) and None)


def test_timeout_is_per_buffer_and_states_the_measured_wait():
    got = run_cpu_world(2, _timeout_s_world, timeout_s=120, check_protocol=False)[0]
    assert got[0] == "PeerTimeoutError", got
    msg = got[3]
    waited = float(msg.split("after waiting ")[1].split(" s")[0])  # measured wall time, also in the interpreter
    assert 1.5 <= waited < 30 and "bound 1.5 s" in msg, msg


def test_default_timeout_is_at_least_300_s(monkeypatch):
    monkeypatch.delenv("TRITONEP_TIMEOUT_S", raising=False)
    assert tep.envs.timeout_s() >= 300
    with pytest.raises(tep.errors.ConfigError, match="timeout_s"):
        from tritonep.runtime.status import resolve_timeout
        resolve_timeout(-1)


def _deferred_world(group):
    os.environ["TRITONEP_TIMEOUT_S"] = "2"
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2)
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=1)
    d = buf.dispatch(x, idx, w)
    if rank == 0:  # a peer that stops during the combine of call 1
        return "stopped"
    # deferred mode: the eager combine's own status read (its last launch publishes it) raises the lost peer
    first = timeout_verdict(lambda: tuple(buf.combine(d.x, d.handle).shape), message=False)
    return first + timeout_verdict(lambda: buf.dispatch(x, idx, w) and None, BufferStateError, message=False)


def test_deferred_checks_raise_a_lost_peer_at_the_next_dispatch():
    """A peer lost mid-combine: deferred checks raise it in that combine (one status read, no rows of the lost
    peer returned), and the buffer refuses the next dispatch (it used to return the combine and raise at the next
    dispatch)."""
    res = run_cpu_world(2, _deferred_world, timeout_s=120, check_protocol=False)  # rank 0 stops on purpose
    assert res[1] == ("PeerTimeoutError", "combine.data", 0, "BufferStateError"), res[1]


def _skip_combine_world(group, kind):
    rank, buf, (x, idx, w) = _strict_buffer(group, 6, seed=3)
    d = buf.dispatch(x, idx, w)
    if rank == 1:
        return "skipped"  # this rank never calls combine
    t0 = time.monotonic()
    err = timeout_verdict(lambda: float(buf.combine(expert(d.x), d.handle, kind=kind).float().abs().sum()))
    took = time.monotonic() - t0
    return err, took, timeout_verdict(lambda: buf.dispatch(x, idx, w) and None, BufferStateError)


@pytest.mark.parametrize("kind", ["push", "pull"])
def test_peer_skips_combine_raises_peer_timeout(kind):
    res = run_cpu_world(3, _skip_combine_world, kind, timeout_s=120, check_protocol=False)  # a rank skips on purpose
    assert res[1] == "skipped"
    for r in (0, 2):
        err, took, after = res[r]
        assert err[:3] == ("PeerTimeoutError", "combine.data", 1), err
        assert "combine" in err[3] and "peer 1" in err[3] and f"rank {r}" in err[3], err
        assert took < 30, f"rank {r} took {took:.1f} s to give up (TRITONEP_TIMEOUT_S=2)"
        assert after[0] == "BufferStateError" and "unusable" in after[1], after


def _skip_backward_world(group):
    rank, buf, (x, idx, w) = _strict_buffer(group, 6, seed=4)
    x = x.clone().requires_grad_(True)
    d = buf.dispatch(x, idx, w)
    y = buf.combine((d.x.float() * 0.5).to(BF16), d.handle)
    if rank == 1:
        return "skipped"  # this rank never runs the backward
    err = timeout_verdict(lambda: y.float().sum().backward() or float(x.grad.float().abs().sum()))
    return err, timeout_verdict(lambda: buf.dispatch(x.detach(), idx, w) and None, BufferStateError)


def test_peer_skips_backward_raises_peer_timeout():
    res = run_cpu_world(3, _skip_backward_world, timeout_s=120, check_protocol=False)  # a rank skips on purpose
    for r in (0, 2):
        err, after = res[r]
        assert err[0] == "PeerTimeoutError" and err[1] in ("dispatch.data", "dispatch.ack") and err[2] == 1, err
        assert "backward" in err[3], err
        assert after[0] == "BufferStateError" and "unusable" in after[1], after
