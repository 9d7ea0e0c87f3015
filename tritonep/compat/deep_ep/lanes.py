"""The inner :class:`tritonep.EPBuffer` s of one compat Buffer ("lanes"), made on first use and grown together.

DeepEP's ``Buffer(group, num_nvl_bytes, num_rdma_bytes)`` knows neither the hidden size nor the tokens per rank; an
EPBuffer needs both (its symmetric regions are sized from them). A compat Buffer therefore builds its EPBuffers when
a call first needs one, keyed by what fixes their configuration (row width, receive capacity, experts, top-k). Every
lane of the normal mode shares one token capacity ``tcap``: the largest token count any rank has passed so far
(agreed with one ``all_gather_object`` when a lane is made), rounded up to a power of two (at least 64), or the
``max_tokens_per_rank`` the Buffer was given. A synced call that finds a rank over capacity raises on every rank (the
EPBuffer refusal protocol), and :meth:`Lanes.agree_regrow` then agrees on a larger capacity, retires the lanes of the
old one and lets the call retry (every rank took the same branch: same collectives, same order).

Making or growing a lane is collective and allocates: it happens in an eager call, never under CUDA-graph capture
(warm up eagerly first, as DeepEP's own allocation needs too).

Unread lanes: a lane call that reads nothing on the host (``sync_free``: ``num_worst_tokens``, cached dispatch,
low-latency mode, a combine or backward of such a handle) may have been refused on every rank (capacity, a peer's
refused input, a peer that took part in a combine as refused); EPBuffer records it in that lane's status word, and
only a read of that word raises it. The calls note such lanes (:meth:`Lanes.unread`) and :meth:`Lanes.check` reads
them: the compat Buffer's next synced dispatch (whichever lane it uses) and ``Buffer.check()``. Every rank makes the
same calls, so every rank reads the same lanes in the same order; a read is local (no collective, no launch).
"""

from __future__ import annotations

import torch.distributed as dist

from ... import envs
from ...errors import BufferStateError, ConfigError, TritonEPError

__all__ = ["Lanes"]

_MIN_TCAP = 64


def _pow2_at_least(n: int) -> int:
    p = _MIN_TCAP
    while p < n:
        p *= 2
    return p


class Lanes:
    """The EPBuffers of one compat Buffer.

    Args:
        group: the EP group (the compat Buffer's).
        backend: EPBuffer's ``backend`` (``"auto"`` | ``"triton"`` | ``"nccl"``).
        device: the device of every lane (None: EPBuffer's default).
        num_sms: EPBuffer's SM cap (None: the kernel-tile table).
        timeout_s: EPBuffer's wait bound (None: ``TRITONEP_TIMEOUT_S``).
        max_tokens_per_rank: a fixed token capacity of the normal-mode lanes (None: grown from the calls).

    Attributes: ``sync_checks`` (the lanes' host-read mode, ``tritonep.envs.SYNC_*``) and ``launch`` (their launch
    path, :data:`tritonep.envs.LAUNCH_MODES`), read once at construction from the environment and given to every
    EPBuffer lane.
    """

    def __init__(self, group, backend: str, device, num_sms, timeout_s, max_tokens_per_rank):
        if max_tokens_per_rank is not None and (not isinstance(max_tokens_per_rank, int)
                                                or isinstance(max_tokens_per_rank, bool) or max_tokens_per_rank < 1):
            raise ConfigError(f"max_tokens_per_rank={max_tokens_per_rank!r} must be a positive int or None")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.backend, self.device, self.num_sms, self.timeout_s = backend, device, num_sms, timeout_s
        # the host options every lane shares, read once here (tritonep.envs: TRITONEP_SYNC_CHECKS,
        # TRITONEP_FAST_LAUNCH / TRITONEP_PACKED_LAUNCH) and passed to each EPBuffer, so that the compat calls'
        # refusal paths (whether a refused call raised on every rank) and the lanes agree
        self.sync_checks, self.launch = envs.sync_checks(), envs.launch()
        self.fixed = max_tokens_per_rank
        self.tcap = max_tokens_per_rank
        self._lanes: dict = {}
        self._shared: set = set()  # keys of the lanes sized by the shared capacity (regrown together)
        self._retired: list = []  # lanes of earlier capacities, closed with the Buffer
        self._unread: list = []  # lanes that ran a call whose status nobody read yet, in the order first noted
        self.closed = False

    def _max_over_ranks(self, n: int) -> int:
        got = [None] * self.world_size
        dist.all_gather_object(got, int(n), group=self.group)
        return max(got)

    def capacity(self, num_tokens: int) -> int:
        """The shared token capacity ``tcap``, agreed now if no lane set it yet (collective: one
        ``all_gather_object`` of ``num_tokens``, the same on every rank whatever its data)."""
        if self.tcap is None:
            self.tcap = _pow2_at_least(self._max_over_ranks(num_tokens))
        return self.tcap

    def get(self, key, num_tokens: int, **cfg):
        """The lane ``key`` (made now, collectively, if new). ``cfg``: EPBuffer arguments besides group, backend,
        device, SM cap and timeout; ``max_tokens_per_rank`` defaults to the shared capacity (agreed now if unset:
        :meth:`capacity`), or is a function of it (a lane whose tokens are the shared capacity plus rows of its own);
        either way the lane is sized by the shared capacity (regrown with it). ``max_recv_tokens`` may be a function
        of the shared capacity too (of ``max_tokens_per_rank`` for a lane sized otherwise).

        Raises:
            BufferStateError: the Buffer was destroyed. ConfigError / PeerConfigError: as EPBuffer's constructor.
        """
        lane = self._lanes.get(key)
        if lane is not None:
            return lane
        if self.closed:
            raise BufferStateError("the DeepEP-compatible Buffer was destroyed")
        tm = cfg.get("max_tokens_per_rank")
        shared = tm is None or callable(tm)
        base = cfg.get("max_tokens_per_rank")
        if shared:
            base = self.capacity(num_tokens)
            cfg["max_tokens_per_rank"] = tm(base) if callable(tm) else base
        mrt = cfg.get("max_recv_tokens")
        if callable(mrt):
            cfg["max_recv_tokens"] = mrt(base)
        from ...ep import EPBuffer  # on first use: importing the compat package imports no kernel module

        lane = EPBuffer(self.group, backend=self.backend, device=self.device, num_sms=self.num_sms,
                        timeout_s=self.timeout_s, sync_checks=self.sync_checks, launch=self.launch, **cfg)
        self._lanes[key] = lane
        if shared:
            self._shared.add(key)
        return lane

    def drop(self, key) -> None:
        """Close the lane ``key`` and forget it (collective, as its construction: every rank drops the same lane,
        made by the same call, before using it)."""
        lane = self._lanes.pop(key)
        self._shared.discard(key)
        lane.close()

    def peek(self, key):
        """The lane ``key`` if it exists (never made here), else None."""
        return self._lanes.get(key)

    def agree_regrow(self, num_tokens: int, refused: bool) -> bool:
        """Collective, after an exchange refused a synced call on every rank: grow when the refusal was a capacity
        one. Every rank passes its token count and whether its own input was refused for another reason; when no
        rank was and some rank is over the shared capacity, every rank agrees on a new capacity (the largest token
        count, rounded up to a power of two), retires the lanes sized by the old one and returns True (the caller
        retries the call); else False (the caller re-raises). A retired lane stays open until :meth:`close` (handles
        made before the growth stay valid), so a Buffer that grows holds every size it grew through: size it with
        ``max_tokens_per_rank`` to avoid growth."""
        got = [None] * self.world_size
        dist.all_gather_object(got, (int(num_tokens), bool(refused)), group=self.group)
        need = max(t for t, _ in got)
        if self.fixed is not None or self.tcap is None or any(r for _, r in got) or need <= self.tcap:
            return False
        self.tcap = _pow2_at_least(need)
        for key in [k for k in self._lanes if k in self._shared]:
            self._shared.discard(key)
            self._retired.append(self._lanes.pop(key))
        return True

    @property
    def pending(self) -> bool:
        """Whether :meth:`unread` noted a lane since the last :meth:`check` (what a synced call reads first)."""
        return bool(self._unread)

    def unread(self, *lanes) -> None:
        """Note lanes (EPBuffers of this Buffer; None is skipped) that just ran a call reading nothing on the host, so
        that :meth:`check` reads them."""
        unread = self._unread
        for lane in lanes:
            if lane is not None:
                for u in unread:  # by identity (a loop: no generator per lane)
                    if u is lane:
                        break
                else:
                    unread.append(lane)

    def check(self, every: bool = False, skip=None) -> None:
        """Read the status word of every lane noted by :meth:`unread` since the last check (``every``: of every lane,
        retired ones included) and raise the first error found, once every lane was read (each error is reported
        once: a read clears it). ``skip``: a lane the caller's next call reads itself (a synced EPBuffer dispatch
        raises the unread refusals of its own lane), not read here. One host read per lane; no collective.

        Raises:
            CapacityError / PeerInputError / InputError / PeerTimeoutError: what a lane recorded
            (:meth:`tritonep.EPBuffer.check`).
        """
        lanes = (self._retired + list(self._lanes.values())) if every else self._unread
        kept = [lane for lane in self._unread if lane is skip and not every]
        self._unread = []
        first = None
        for lane in lanes:
            if lane is skip and not every:
                continue
            try:
                lane.check()
            except TritonEPError as e:
                first = first or e
        if first is not None:
            self._unread = kept  # the call that would have read the skipped lane does not run
            raise first

    def close(self) -> None:
        """Close every lane, retired ones first, each group in the order made (collective: every rank holds the same
        lanes); later :meth:`get` calls raise BufferStateError."""
        lanes = self._retired + list(self._lanes.values())
        self._retired, self._lanes, self._unread = [], {}, []
        self._shared.clear()
        self.closed = True
        for lane in lanes:
            lane.close()

    def __iter__(self):
        return iter(self._lanes.items())
