"""EPBuffer's entry points for a call this rank cannot make normally: taking part as refused
(:meth:`refuse_dispatch`, :meth:`cancel_combine`), deferring its own error (:meth:`defer`) and reading the errors
recorded on the device (:meth:`check`, :attr:`last_dispatch_read`) (docs/protocols.md, host protocol rule).

A mixin of :class:`tritonep.ep.buffer.EPBuffer` (its methods are EPBuffer's: no extra call per entry); it reads the
buffer's ``_backend``, sync mode and last-read flag, which :mod:`tritonep.ep.buffer` sets up.

Idea source: our own host protocol (every rank runs the same launches and collectives whatever its data; a refusal
travels in the counts row and the status word instead of stranding the peers).
"""

from __future__ import annotations

import torch

from .. import envs
from ..errors import CapacityError, ConfigError, InputError, PeerInputError, PeerTimeoutError, TritonEPError
from .handle import Dispatched, DispatchHandle

__all__ = ["RefusalCalls"]


class RefusalCalls:
    """The refusal / cancel / deferred-error entry points of :class:`tritonep.ep.buffer.EPBuffer` (a mixin; see
    the methods). ``refuse_dispatch`` and ``cancel_combine`` are collective: each stands for this rank's call."""

    @property
    def last_dispatch_read(self) -> bool:
        """Whether this buffer's latest dispatch (a refused one included) read its status on the host, i.e. whether
        its refusal, if any, raised on every rank in that call. False after a sync-free call (or sync checks off,
        graph capture): a refusal of this rank's input raised here only, and the peers go on to their combine, in
        which this rank must take part with :meth:`cancel_combine` (:meth:`dispatch`)."""
        return self._last_synced

    def refuse_dispatch(self, error: Exception, *, sync_free: bool = False) -> Dispatched:
        """Take part in a dispatch whose input this rank's caller refused (``error``: its own
        :class:`InputError` / :class:`CapacityError` naming the value), as :meth:`dispatch` does with an input it
        refuses itself: the call's launches / collectives with no token and the refusal flag, so it fails on every
        rank and no row moves.

        With a host read (``sync_free`` False and sync checks on: every rank raises in this call) ``error`` is
        raised at once (the peers raise :class:`PeerInputError` naming this rank). Without one (``sync_free=True``,
        sync checks off, capture) nothing is raised now: the call returns the empty layout, as on the peers
        (``x`` ``max_recv_tokens`` unspecified rows, ``weights``, counts and offsets 0, a handle of T = 0 tokens),
        so this rank can run the rest of its step like its peers (SPMD: the same collectives, backward included).
        Its :meth:`combine` takes part as refused (:meth:`cancel_combine`: the peers' output is NaN) and returns
        NaN ``[0, H]``; :meth:`combine_backward` / :meth:`dispatch_backward` run as on the peers (no row); the next
        read (:meth:`check`, a synced dispatch) raises ``error`` on this rank and :class:`PeerInputError` naming it
        on every other rank. What ``MoELayer(MoERecipe(sync_free=True))`` does with an input it refuses.

        Raises:
            ConfigError: ``error`` is not an InputError / CapacityError. BufferStateError: closed or broken.
            ``error``: with a host read (above).
        """
        if not isinstance(error, (InputError, CapacityError)):
            raise ConfigError(f"refuse_dispatch takes the InputError / CapacityError that refused the input, got "
                              f"{type(error).__name__}")
        self._check_open()
        if sync_free and not self._backend.sync_free:
            raise ConfigError(f"refuse_dispatch(sync_free=True) is not supported by this buffer's backend "
                              f"{self.backend!r}")
        sync = envs.SYNC_NONE if sync_free else self._sync
        if sync and self._cuda and torch._C._cuda_isCurrentStreamCapturing():
            sync = envs.SYNC_NONE
        try:
            out, out_w, ntpe, offs, handle = self._backend.dispatch_fwd(*self._no_input, sync, False, True, sync_free)
        except TritonEPError as e:
            self._last_synced = True  # read: every rank raises in this call
            if isinstance(e, (PeerInputError, CapacityError)):
                raise error from None
            raise
        self._last_synced = False
        self._backend.defer_refusal(error)
        handle.__dict__["refused_here"] = error  # its combine takes part as refused (combine)
        return Dispatched(out, ntpe, offs, handle, out_w, handle.x_scales)

    def cancel_combine(self, handle: DispatchHandle | None = None, kind: str | None = None) -> None:
        """Take part in the combine that matches ``handle`` (default: this buffer's latest dispatch) WITHOUT an
        expert output: for a rank whose own code failed between dispatch and combine (call it in the ``except``
        block, then re-raise), so its peers do not wait for it and no rank returns a value computed without its data.

        Collective: it stands for this rank's :meth:`combine` call (same launches, no row moves). Every other rank's
        combine of that call fails: in an eager call (the handle's dispatch read the host) it raises
        :class:`PeerInputError` naming this rank; otherwise (sync-free, sync checks off, graph capture) its output
        is NaN and the next :meth:`check` or synced call raises it on every rank, this one included. The buffer
        stays usable on every rank. :meth:`combine` does the same by itself when it refuses its input (wrong dtype,
        too few rows, another buffer's handle), then raises that error. ``MoELayer`` cancels for you.

        Args:
            handle: the dispatch's handle on this rank (decides whether the peers read: see above), or None.
            kind: the combine kind the peers pass (``"push"`` / ``"pull"``; None: the kernel tiles').
        """
        self._check_open()
        own = isinstance(handle, DispatchHandle) and handle.buffer_id == self._id
        synced = handle.num_recv_rows is not None if own else self._last_synced
        self._backend.combine_refused(kind if kind in ("push", "pull") else None,
                                      record_own=not (synced and self._reads_combine()),
                                      handle=handle if own else None)

    def defer(self, error: BaseException) -> None:
        """Raise ``error`` at this rank's next :meth:`check` instead of now: for a caller whose step failed on this
        rank (e.g. its experts raised between dispatch and combine, and it cancelled the combine:
        :meth:`cancel_combine`) while its peers, which read nothing in a sync-free step, run on through their
        backward and next step: raising at once would leave them without this rank (desynchronised collectives),
        so the caller runs the step on with NaN and the same calls, and the error surfaces where its peers' does.
        ``MoELayer(MoERecipe(sync_free=True))`` does so when its experts fail. The first deferred error is kept."""
        if self._deferred is None:
            self._deferred = error

    def check(self):
        """Raise any error the device recorded since the last check (one host sync). For graph-captured use.

        An error deferred by :meth:`defer` is raised instead of what the read finds (which the read clears: this
        rank's own refusals of that step), except a timeout, which makes the buffer unusable and is raised first."""
        self._check_open()
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            self._backend.check()
            return
        try:
            self._backend.check()
        except PeerTimeoutError:
            raise
        except TritonEPError:
            pass
        raise deferred
