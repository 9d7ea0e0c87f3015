"""The status of a triton-backend buffer's calls: the device status word, the one host read of a dispatch, the
verdict and the typed errors, and whether the buffer is still usable (:class:`CallStatus`, a part of
:class:`tritonep.backends.triton.backend.TritonEP` with its own state).

Every dispatch's verdict (refused input, capacity, a wait that gave up) is written by its kernels into the status word
(:mod:`tritonep.device.protocol` ``ST_*``). A synced dispatch reads it once: the launch that decides the verdict
publishes (status, rows received, this call's number) and the call's ticket into a pinned host tensor
(:class:`tritonep.runtime.host_status.HostStatus`), and the host spins on the ticket. A refused call raises after
its launches, on every rank (docs/protocols.md, host protocol rule); a wait that gave up makes the buffer unusable.
"""

from __future__ import annotations

from collections import deque

import torch

from ... import envs
from ...device import protocol as P
from ...errors import BufferStateError, InputError, PeerTimeoutError, TritonEPError
from ...runtime.host_status import HostStatus
from ...runtime.status import REFUSAL_CODES, STATUS_COMBINE_REFUSED, bad_ranks, raise_for_status
from ..checks import check_expert_ids

__all__ = ["CallStatus", "ST_HOST"]

_ST_ERR = P.v(P.STATUS_WORDS)  # the status word's error part
_CODE = P.v(P.ST_CODE)
_ROWS = P.v(P.ST_ROWS_RECEIVED)
_THIS_CALL = P.v(P.ST_THIS_CALL)
ST_HOST = _THIS_CALL + 1  # what the one host read of a dispatch copies (status word, rows received, this call's number)


class CallStatus:
    """Status word, host read, verdicts and errors of one buffer (see the module docstring).

    Args:
        cfg: the buffer's :class:`tritonep.ep.config.EPConfig` (wait bound, capacity, experts).
        rank: this rank. device: its device.
        word: the device status word (the int64 ``status`` region, written by the kernels).
        launch: the buffer's :class:`tritonep.runtime.launch.Launch` (no eager check while it precompiles).

    Attributes:
        mapped: int64 ``[ST_HOST + 1]`` pinned host tensor (CPU: a plain one) the verdict launch publishes into.
        host: the :class:`tritonep.runtime.host_status.HostStatus` spinning on it.
        broken: why the buffer is unusable (a wait that gave up, a read that never arrived, closed), or None.
        host_reads: device->host reads the calls made so far (the eager budget: one per dispatch).
    """

    def __init__(self, cfg, rank: int, device: torch.device, word: torch.Tensor, launch):
        self.cfg, self.rank, self.device, self.word = cfg, rank, device, word
        self._launch = launch
        # every dispatch publishes its status words + the call's ticket here (the counts exchange's last program, or
        # the decode kernel's program 0; pinned: the kernel stores into it through unified addressing; CPU: the
        # interpreter writes it directly): HostStatus.read spins on the ticket, no device-to-host copy
        self.mapped = torch.zeros(ST_HOST + 1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host = HostStatus(self.mapped, ST_HOST, rank, cfg.timeout_s)
        self.broken: str | None = None
        self.host_reads = 0
        self._recent_idx: deque = deque(maxlen=4)  # the last dispatches' topk_idx: check() names a bad id by value
        # a dispatch whose input the front door refused and that read nothing (sync-free, sync checks off, capture):
        # True: it raised its own error at the call, so the read that finds its refusal names this rank
        # (PeerInputError, as on every other rank) instead of looking for a bad id; an exception: its caller deferred
        # its own error to that read (EPBuffer.refuse_dispatch), which raises it
        self.front_door_unread = False

    def usable(self):
        """Raise :class:`BufferStateError` when the buffer is unusable (closed, or a wait gave up)."""
        if self.broken:
            raise BufferStateError(f"EPBuffer on rank {self.rank} is unusable: {self.broken}")

    def note_ids(self, topk_idx: torch.Tensor):
        """Keep a dispatch's ``topk_idx`` (the caller's tensor, the last four), to name a bad id a later read finds."""
        self._recent_idx.append(topk_idx)

    def ticket(self, sync) -> int:
        """This launch's ticket: a fresh one for a call that will read (``sync`` true), else 0."""
        return self.host.ticket(sync)

    def read(self, ticket: int) -> list:
        """The one host read of a synced dispatch: the status words its launch published with ``ticket`` (a spin
        on pinned memory, no copy or event). A read that gives up (the launch never ran) makes the buffer unusable,
        as a kernel's own wait that gave up does: the launch may still run later and would pair with nothing."""
        self.host_reads += 1
        try:
            return self.host.read(ticket)
        except PeerTimeoutError as e:
            self.broken = str(e)
            raise

    def verdict(self, st):
        """``(code, refused, R)`` from the host copy of the status word (a list of ints; None: not read); raises
        PeerTimeoutError (and marks the buffer unusable) for a wait that gave up."""
        if st is None:
            return 0, False, None
        code = st[_CODE]
        # a refused combine or backward pass nobody read (they read nothing on the host) counts as a refusal too:
        # every rank recorded it, so every rank's call runs its data kernels and raises after them
        refused = code in REFUSAL_CODES  # a count-routing mismatch too (kernels/layout.py record_verdict)
        if code != 0 and not refused:
            try:
                raise_for_status(torch.tensor(st[:_ST_ERR]), self.rank, self.cfg.max_recv_tokens, "dispatch",
                                 self.cfg.timeout_s, self.device.type)
            except PeerTimeoutError as e:
                self.broken = str(e)  # later calls repeat the wait, the peer and the measured wait
                raise
        # a refusal may be an earlier call's that nobody read (sync-free, sync checks off, a graph replay): this call
        # is then a good one whose data kernels move its rows (the skip is keyed to the refused call's number), so a
        # refused call's outputs still hold the rows its layout gives (at most max_recv_tokens: a refusal of its own
        # moves nothing); it raises after its launches all the same
        return code, refused, (min(st[_ROWS], self.cfg.max_recv_tokens) if refused else st[_ROWS])

    def finish(self, refused: bool, st, sync, bad_input: bool):
        """After a dispatch's launches: raise a refused call's error (every rank, after the same launches), and in
        strict mode (``sync`` is ``SYNC_STRICT``) check the status word once more (a peer that stopped after the
        counts exchange raises in this call)."""
        if refused:
            self.word.zero_()  # reported once, here; the buffer stays usable (stream-ordered after the kernels)
            front, self.front_door_unread = self.front_door_unread, False
            if self.rank in bad_ranks(torch.tensor(st)) and not bad_input:
                if st[_CODE] != STATUS_COMBINE_REFUSED:
                    # raises InputError naming the value: this call's ids, or an earlier sync-free call's that nobody
                    # read (also behind an earlier capacity refusal nobody read: the code is the first refusal's,
                    # the mask every unread refused call's bad ranks)
                    self._raise_own_bad_ids(front)
                else:  # this rank refused an earlier combine / backward pass (the PeerInputError below names it),
                    for idx in reversed(self._recent_idx):  # unless its ids were bad since: that InputError first
                        check_expert_ids(idx, self.cfg.num_experts)
            raise_for_status(torch.tensor(st[:_ST_ERR]), self.rank, self.cfg.max_recv_tokens, "dispatch",
                             self.cfg.timeout_s, self.device.type, this_call=st[_THIS_CALL])
        if sync == envs.SYNC_STRICT:  # the front door's mode (read once per call; never under capture / dry run)
            self.check("dispatch")

    def check(self, what="EPBuffer"):
        """Read the status word on the host and raise its typed error (one sync).

        A refusal (capacity, a bad input, a refused combine) is reported once and cleared (the buffer stays usable);
        a timeout makes it unusable.
        """
        self.host_reads += 1
        self.raise_words(self.word[:_ST_ERR].cpu().clone(), what)  # .cpu() of a CPU tensor is the tensor itself

    def raise_words(self, st, what):
        """Raise the typed error of the status words ``st`` (host int64 ``[8]``; nothing for an OK word): a refusal
        is cleared on the device (reported once), a timeout marks the buffer unusable."""
        st = torch.as_tensor(st, dtype=torch.int64)
        code = int(st[_CODE])
        if code in REFUSAL_CODES:
            self.word.zero_()
            front, self.front_door_unread = self.front_door_unread, False
            if code != STATUS_COMBINE_REFUSED and self.rank in bad_ranks(st):
                self._raise_own_bad_ids(front)  # this rank's ids in a refused call (the code may be an earlier one's)
        try:
            raise_for_status(st, self.rank, self.cfg.max_recv_tokens, what, self.cfg.timeout_s, self.device.type)
        except PeerTimeoutError as e:
            self.broken = str(e)
            raise

    def next_ticket(self) -> int:
        """A fresh ticket for a launch whose status the host will read (an eager combine's last launch)."""
        return self.host.next_ticket()

    def after_combine(self, ticket: int, bad: int, what: str):
        """After a combine's launches: the host's one read of an eager combine (``ticket``: the status its last
        launch published; a peer that refused or never arrived raises here, on every rank), else the strict mode's
        check (none for a refused rank, which raises its own error). ``bad``: this rank took part as refused
        (``TritonEP.combine_refused``)."""
        if ticket:
            st = self.read(ticket)
            if not st[_CODE]:
                return
            st = st[:_ST_ERR]
            if not bad:
                self.raise_words(st, what)
            else:  # a refused rank raises its own error and keeps none of this call's (another rank's
                try:  # refusal in the same call, which that rank's peers raise now); a timeout stays fatal
                    self.raise_words(st, what)
                except PeerTimeoutError:
                    pass
                except TritonEPError:
                    pass
        elif not bad:
            self.eager_check(what)
        else:
            self.refused_check(what)

    def refused_check(self, what):
        """After a call this rank took part in as refused (it raises its own error) that read nothing: in strict
        mode every peer's :meth:`eager_check` raises the refusal in this call and clears it, so this rank clears its
        own record of it too (one sync; a timeout stays fatal: the buffer is marked unusable), else its next read
        would raise it alone and the ranks would leave different calls."""
        try:
            self.eager_check(what)
        except TritonEPError:
            pass

    def eager_check(self, what):
        """Strict eager calls (TRITONEP_SYNC_CHECKS=1, not capturing) raise a wait the kernels gave up on in the same
        call (one sync). By default (deferred) the next dispatch's one host read raises it instead."""
        if self.cfg.sync_checks != envs.SYNC_STRICT or self._launch.warming or (
                self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        self.check(what)

    def _raise_own_bad_ids(self, front_door=False):
        """This rank's input was refused on the device (sync checks off): raise InputError naming the value, from
        the most recent of the last dispatches' ``topk_idx`` that holds an id outside ``[-1, E)`` (the caller's
        tensors, kept only to name the value: a caller that refilled them in place may see another value named).
        ``front_door``: a refusal of the front door nobody read is among them: with no bad id to name, raise the
        error its caller deferred (an exception), or (True: it raised its own error at the call) return, and the
        caller raises PeerInputError naming this rank."""
        for idx in reversed(self._recent_idx):
            check_expert_ids(idx, self.cfg.num_experts)
        if isinstance(front_door, BaseException):
            raise front_door
        if front_door:
            return
        raise InputError(f"rank {self.rank}: the topk_idx of an earlier dispatch held an id outside "
                         f"[-1, num_experts={self.cfg.num_experts}) (found on the device; no longer held to name "
                         f"the value)")
