"""A rank that reaches a call after its peers gave up waiting for it (triton backend; the nccl backend has no kernel
waits) never gets a value computed without their data.

A rank whose wait gives up keeps launching (sync-free calls read nothing) with kernels that skip their rows but still
signal, so a late peer used to take the rows and partial sums it skipped: a finite wrong ``y`` and a ``check()`` that
passed. Now the timed-out rank marks itself in every peer before each signal of a call whose rows it skipped
(``flags[FLAG_DEAD]``, :func:`tritonep.device.signal.mark_dead`), and a rank that acquired a peer's signal takes
its data only when no peer marked itself (:func:`tritonep.device.signal.peers_alive`): the late rank's combine
output is NaN, its ``check()`` (or, eagerly, the dispatch's own read) raises PeerTimeoutError naming the peer that
gave up (``wait == "peer.gave_up"``), and its buffer, like the timed-out ones, is rebuilt; the rebuilt buffers are
exact. Every kernel path: two kernels, fused, the one-launch decode kernels.
"""

import time

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import BufferStateError
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import check_grads, run_grad_call, set_env
from tests.support.outcomes import timeout_verdict

H, TM, K = 64, 8, 2
GEOMETRIES = {"two_kernel": "dec=0,fs=0,fe=0,fc=0", "fused": "fs=1,fe=1,fc=1", "decode": "bt=2,dec=2"}
BOUND_S, LATE_S = 3.0, 6.0  # a bound a loaded 2-core host keeps in the steps that must not time out


def _buffer(group, geometry, timeout_s):
    set_env(TRITONEP_GEOMETRY=GEOMETRIES[geometry])
    try:
        return tep.EPBuffer(group, 2 * dist.get_world_size(group), H, TM, K, backend="triton", timeout_s=timeout_s)
    finally:
        set_env(TRITONEP_GEOMETRY=None)


def _step(buf, rank, W, seed, sync_free):
    """One dispatch -> experts (0.5 x + 1) -> combine; ``("ok", NaN state)`` or ``("PeerTimeoutError", wait, peer)``."""
    x, idx, w = (t.to(buf.device) for t in make_rank_inputs(rank, 6, H, 2 * W, K, seed=seed, mask_frac=0.0))

    def call():
        d = buf.dispatch(x, idx, w, sync_free=sync_free)
        y = buf.combine((d.x.float() * 0.5 + 1).to(torch.bfloat16), d.handle)
        return "all NaN" if bool(torch.isnan(y).all()) else "not all NaN"
    return timeout_verdict(call, message=False)


def _late_world(group, geometry, sync_free):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    buf = _buffer(group, geometry, BOUND_S)
    out = {"warm": [_step(buf, rank, W, s, sync_free) for s in (1, 2)]}  # the interpreter's first launches are slow
    if rank == W - 1:
        time.sleep(LATE_S)  # the peers' waits of the next call give up before this rank arrives
    out["late"] = _step(buf, rank, W, 3, sync_free)
    got = timeout_verdict(buf.check, BufferStateError)
    out["check"] = got[:3] + ("build a new EPBuffer" in str(got[-1]),)  # (type, wait, peer, says to rebuild)
    buf.close()
    buf = _buffer(group, geometry, 60)  # rebuilt on every rank: exact again
    out["good"] = run_grad_call(buf, *make_rank_inputs(rank, 6, H, 2 * W, K, seed=5, mask_frac=0.0), grad_seed=5,
                                bias=1.0)
    buf.check()
    buf.close()
    return out


CASES = [(2, "two_kernel", True), pytest.param(3, "decode", True, marks=pytest.mark.slow),
         pytest.param(2, "fused", True, marks=pytest.mark.slow), (2, "decode", False)]


@pytest.mark.parametrize("W,geometry,sync_free", CASES)
def test_a_late_rank_never_takes_what_its_timed_out_peers_skipped(W, geometry, sync_free):
    # the late rank arrives after the others gave up: the launch sequences match, the timing does not
    res = run_cpu_world(W, _late_world, geometry, sync_free, timeout_s=300)
    late, early = res[-1], res[:-1]
    for out in res:
        assert out["warm"] == [("ok", "not all NaN")] * 2, out
    for out in early:  # they waited BOUND_S for the late rank's counts and gave up
        if sync_free:
            assert out["late"] == ("ok", "all NaN"), out
        else:
            assert out["late"] == ("PeerTimeoutError", "dispatch.counts", W - 1), out
        assert out["check"] == ("PeerTimeoutError", "dispatch.counts", W - 1, True), out  # (again, eagerly)
    if sync_free:  # no value computed without the peers' data, and the next read says so
        assert late["late"] == ("ok", "all NaN"), late
    else:  # the late rank's own dispatch read raises at once (it no longer waits timeout_s in the combine)
        assert late["late"] == ("PeerTimeoutError", "peer.gave_up", 0), late
    assert late["check"] == ("PeerTimeoutError", "peer.gave_up", 0, True), late
    check_grads(2 * W, [out["good"] for out in res], where="rebuilt buffer")
