"""The host's read of a dispatch's status word without a copy: the kernel publishes it into pinned host memory.

A synced eager dispatch must know (status, rows received) on the host before it returns. The copy path costs a
device-to-host copy, an event record and an event synchronize (19.5 us on an idle H200 host, measured with
``benchmarks/probes/launch_probe.py``) and waits for the whole launch. Here the launch that decides the verdict stores
the words and then this call's ``ticket`` into a pinned tensor (:func:`tritonep.device.signal.publish_host_status`) as
soon as the verdict is known, and the host spins on a NumPy view of it (a plain memory load per poll): program 0 of
the one-launch decode dispatch (:func:`tritonep.backends.triton.kernels.decode_dispatch.dispatch_decode_kernel`, ``HOST_ST``), or
the last program of the two-kernel / fused dispatch's counts exchange (:func:`tritonep.backends.triton.kernels.layout.
exchange_kernel`, ``host_st_ptr``; the send launch of a two-kernel dispatch is queued before the host waits).
One tensor and one ticket sequence serve both (the launches of one buffer run in stream order). The wait is
bounded: the kernel's own waits give up after the buffer's ``timeout_s`` and still publish, so a ticket that never
arrives means the launch never ran (the stream is blocked); the host then raises
:class:`tritonep.errors.PeerTimeoutError`.

Idea: DeepEP's normal-mode dispatch, whose notify kernel writes the received-token counts into host-mapped memory
(``moe_recv_counter_mapped``) that the CPU busy-waits on.
"""

from __future__ import annotations

import time

import torch

from ..errors import PeerTimeoutError

__all__ = ["HostStatus"]

_TICKET_MAX = 2 ** 31 - 2  # tickets stay int32 (the kernel's ``ticket`` is not specialised: one variant)


class HostStatus:
    """Tickets and the bounded spin read of a pinned ``[words + 1]`` int64 tensor a kernel publishes into.

    Args:
        mapped: int64 ``[words + 1]`` tensor (pinned host memory on CUDA; any CPU tensor for the interpreter).
        words: status words before the ticket word.
        rank: this rank (named in the error). timeout_s: the buffer's wait bound in seconds.
    """

    def __init__(self, mapped: torch.Tensor, words: int, rank: int, timeout_s: float):
        self._np = mapped.numpy()
        self.words, self.rank = words, rank
        self.bound_s = 2.0 * float(timeout_s) + 5.0  # the kernel's own waits give up first and still publish
        self._ticket = 0

    def ticket(self, sync) -> int:
        """This launch's ticket: :meth:`next_ticket` for a call that will read (``sync`` true), else 0."""
        return self.next_ticket() if sync else 0

    def next_ticket(self) -> int:
        """The ticket of a launch whose words the host will read: 1 .. 2**31 - 2, cycling. Launches nobody reads
        (sync-free calls, sync checks off, graph captures, whose replays publish their frozen ticket) pass 0, which
        no read waits for: the word a read finds before its launch published is 0 or an earlier read's ticket, never
        its own (a captured ticket would have been, after a cycle)."""
        self._ticket = self._ticket % _TICKET_MAX + 1
        return self._ticket

    def read(self, ticket: int) -> list:
        """The status words (a list of ints) once the launch carrying ``ticket`` published them.

        Raises:
            PeerTimeoutError: not published within ``2 * timeout_s + 5`` seconds (the launch did not run; ``wait``
                ``"dispatch.host_status"``, ``rank`` this rank). The caller marks its buffer unusable, as for a
                kernel's own wait that gave up (the launch may still run later).
        """
        a, w = self._np, self.words
        if a[w] != ticket:
            deadline = time.monotonic() + self.bound_s
            spins = 0
            while a[w] != ticket:
                spins += 1
                if spins & 0x3FF == 0:
                    if time.monotonic() > deadline:
                        raise PeerTimeoutError(
                            f"rank {self.rank}: the dispatch launch with ticket {ticket} did not publish its status "
                            f"within {self.bound_s:.0f} s (the launch did not run: the stream is blocked; last ticket "
                            f"seen {int(a[w])})", wait="dispatch.host_status", rank=self.rank)
                    if spins & 0xFFFF == 0:
                        time.sleep(0)  # let other Python threads run during a long wait
        return a[:w].tolist()
