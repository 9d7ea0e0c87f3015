"""HostStatus: the decode dispatch's status word published into (pinned) host memory, read by a bounded spin."""

import threading
import time

import pytest
import torch

from tritonep.runtime.host_status import HostStatus
from tritonep.errors import PeerTimeoutError
from tests.support.hooks import backend_of
from tests.support.outcomes import timeout_verdict


def test_read_returns_words_once_the_ticket_is_published():
    m = torch.zeros(4, dtype=torch.int64)
    hs = HostStatus(m, 3, rank=1, timeout_s=1.0)
    t = hs.next_ticket()

    def publish():
        time.sleep(0.05)
        m[:3] = torch.tensor([5, 6, 7])
        m[3] = t

    th = threading.Thread(target=publish)
    th.start()
    assert hs.read(t) == [5, 6, 7]
    th.join()


def test_stale_ticket_is_not_taken_and_the_wait_is_bounded():
    m = torch.zeros(3, dtype=torch.int64)
    hs = HostStatus(m, 2, rank=3, timeout_s=0.0)
    hs.bound_s = 0.2
    old = hs.next_ticket()
    m[2] = old  # an earlier launch's publish (e.g. a captured graph's frozen ticket)
    new = hs.next_ticket()
    assert new != old
    t0 = time.monotonic()
    with pytest.raises(PeerTimeoutError, match=rf"rank 3: .*ticket {new} did not publish.*last ticket seen {old}"):
        hs.read(new)
    assert time.monotonic() - t0 < 5


def test_tickets_cycle_within_int32():
    hs = HostStatus(torch.zeros(2, dtype=torch.int64), 1, rank=0, timeout_s=1.0)
    hs._ticket = 2 ** 31 - 3
    assert [hs.next_ticket() for _ in range(3)] == [2 ** 31 - 2, 1, 2]


# ------------------------------------------------------------------------------------------ in a decode buffer
def _never_launched(*dyn):
    """A decode dispatch launch that never runs (a blocked stream): it publishes nothing."""


def _blocked_launch_world(group):
    """A decode buffer (world 1) whose second dispatch launch never runs: the host's bounded read gives up."""
    import torch.distributed as dist

    import tritonep as tep
    from tritonep.errors import BufferStateError
    from tritonep.bench.cases import make_rank_inputs
    from tests.support.harness import set_env

    set_env(TRITONEP_GEOMETRY="bt=2,dec=2", TRITONEP_SYNC_CHECKS="deferred")
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 4, 2, timeout_s=1.0)
    set_env(TRITONEP_GEOMETRY=None)
    impl = backend_of(buf)
    assert impl.tiles.decode == 2
    impl.call_status.host.bound_s = 0.3
    x, idx, w = make_rank_inputs(rank, 4, 64, 4, 2, seed=1)
    buf.dispatch(x, idx, w)
    real = impl.k.decode
    impl.k.decode = lambda kq: _never_launched
    err = timeout_verdict(lambda: buf.dispatch(x, idx, w) and None)
    impl.k.decode = real
    # a timeout makes the buffer unusable (EPBuffer.dispatch's contract), whichever read found it
    after = timeout_verdict(lambda: buf.dispatch(x, idx, w) and None, BufferStateError, message=False)
    buf.close()
    return err[:3] + (str(err[-1]).startswith(f"rank {rank}: "),), after


def test_a_launch_that_never_publishes_breaks_the_buffer():
    """HostStatus.read giving up is a PeerTimeoutError like a kernel's own wait: it names the rank and the buffer
    is unusable afterwards (the launch may still run later: a retry would pair with nothing on the peers)."""
    from tritonep.testing import run_cpu_world

    assert run_cpu_world(1, _blocked_launch_world, timeout_s=120) == [
        (("PeerTimeoutError", "dispatch.host_status", -1, True), ("BufferStateError",))]  # the message names the rank


def _stale_ticket_world(group):
    """A sync-free decode dispatch (what a captured graph's replays are: no host read) publishes a ticket; an eager
    dispatch whose ticket has cycled round to that value (2**31 - 2 calls later) and whose launch has not run yet must
    not take the sync-free launch's words for its own."""
    import torch.distributed as dist

    import tritonep as tep
    from tritonep.bench.cases import make_rank_inputs
    from tests.support.harness import set_env

    set_env(TRITONEP_GEOMETRY="bt=2,dec=2", TRITONEP_SYNC_CHECKS="deferred")
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 4, 2, timeout_s=1.0)
    set_env(TRITONEP_GEOMETRY=None)
    impl = backend_of(buf)
    hs = impl.call_status.host
    hs.bound_s = 0.3
    x, idx, w = make_rank_inputs(rank, 4, 64, 4, 2, seed=2)
    frozen = hs._ticket + 1  # the ticket a sync-free call would take
    buf.dispatch(x, idx, w, sync_free=True)
    hs._ticket = frozen - 1  # the eager tickets cycled round: the next one equals the sync-free call's
    impl.k.decode = lambda kq: _never_launched
    got = timeout_verdict(lambda: tuple(buf.dispatch(x, idx, w).x.shape), message=False)
    buf.close()
    return got


def test_an_eager_read_never_takes_a_sync_free_launchs_words():
    from tritonep.testing import run_cpu_world

    assert run_cpu_world(1, _stale_ticket_world, timeout_s=120) == [("PeerTimeoutError", "dispatch.host_status", -1)]
