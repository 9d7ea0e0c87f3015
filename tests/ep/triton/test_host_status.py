"""HostStatus: the decode dispatch's status word published into (pinned) host memory, read by a bounded spin."""

import threading
import time

import pytest
import torch

from tritonep.ep.triton.host_status import HostStatus
from tritonep.errors import PeerTimeoutError


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
