"""Signals and the processes of a world: SIGINT / SIGTERM to the parent end every rank; no rank outlives it.

A world can be left running or hung three ways, which these rules close: SIGINT to the parent alone (the parent
would wait for ranks blocked writing their results), Ctrl-C to the process group (a traceback from every rank), and
SIGTERM to the parent (ranks left running as orphans with their temporary folders). The rules:

* Ranks (:func:`rank_process_setup`, the first thing every rank does): SIGINT is ignored (a terminal's Ctrl-C
  reaches the whole foreground process group; the parent decides), SIGTERM has its default action, and the kernel
  SIGKILLs the rank when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so a parent killed outright (SIGKILL,
  a crash) leaves no orphan.
* Parents: every live world registers its cleanup (:func:`register`): SIGKILL and reap its ranks, stop the MPS
  daemon it started, remove its temporary folder. :func:`kill_live_worlds` runs them all; it runs at interpreter
  exit and on SIGTERM: while a world lives (:func:`hold_sigterm`) and SIGTERM still has its default action, the
  handler cleans every live world up, prints one line and ends the process by SIGTERM, as the default action would
  have (exit status 143). SIGINT keeps Python's behaviour, ``KeyboardInterrupt``, whose unwinding runs each world's
  own cleanup (ranks are killed before they are waited for).
* Commands (:func:`command_signals`, used by the ``tritonep`` CLI): SIGINT and SIGTERM raise :class:`WorldInterrupted`
  (a ``KeyboardInterrupt``) once; the command prints one line and exits 128 + the signal number (130 / 143).

Idea: the usual process-supervisor pattern (torch.distributed.elastic's ``SignalException`` + process-group kill;
``PR_SET_PDEATHSIG`` as in torch.multiprocessing's spawn children); our own small version.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Callable

__all__ = ["WorldInterrupted", "rank_process_setup", "register", "unregister", "kill_live_worlds", "hold_sigterm",
           "release_sigterm", "command_signals", "deferred_signals", "ignoring_sigint"]

_PR_SET_PDEATHSIG = 1


class WorldInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the parent of a world (see the module docstring).

    Attributes:
        signum: the signal number. exit_code: ``128 + signum`` (130 for SIGINT, 143 for SIGTERM).
    """

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def rank_process_setup(parent_pid: int) -> None:
    """In a rank process, first thing: ignore SIGINT, default SIGTERM, die with the parent (Linux).

    Args:
        parent_pid: the world's parent; when it is already gone (it died before the request took effect) the rank
            exits at once.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the parent's own cleanup still kills the ranks
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


_LIVE: dict = {}  # token -> cleanup of a live world
_LOCK = threading.Lock()
_NEXT = [0]


def register(cleanup: Callable[[], None]) -> int:
    """Register a live world's cleanup (idempotent, callable from a signal handler); returns a token."""
    import multiprocessing.util  # noqa: F401 - registers its own exit handler, which joins child processes

    atexit.unregister(kill_live_worlds)  # so ours runs first (atexit is last in, first out): kill, then join
    atexit.register(kill_live_worlds)
    with _LOCK:
        _NEXT[0] += 1
        _LIVE[_NEXT[0]] = cleanup
        return _NEXT[0]


def unregister(token: int) -> None:
    """Forget a world's cleanup (the world ended and cleaned up itself)."""
    with _LOCK:
        _LIVE.pop(token, None)


def kill_live_worlds() -> int:
    """Run every registered cleanup (kill and reap ranks, stop MPS daemons, remove temp folders); returns how many."""
    with _LOCK:
        items = list(_LIVE.items())
        _LIVE.clear()
    for _, cleanup in items:
        try:
            cleanup()
        except Exception:  # noqa: BLE001 - one world's failed cleanup must not stop the others'
            pass
    return len(items)


atexit.register(kill_live_worlds)

_HOLD = [0, False]  # [worlds holding the SIGTERM handler, whether we installed it]


def _on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
    n = kill_live_worlds()
    print(f"tritonep: SIGTERM: stopped {n} running world(s) (every rank killed, temporary files removed)",
          file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def hold_sigterm() -> None:
    """A world starts: from the main thread, while SIGTERM has its default action, install the handler that kills
    every live world before the process ends (see the module docstring). Pair with :func:`release_sigterm`."""
    if threading.current_thread() is not threading.main_thread():
        return
    if _HOLD[0] == 0:
        _HOLD[1] = signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)
        if _HOLD[1]:
            signal.signal(signal.SIGTERM, _on_sigterm)
    _HOLD[0] += 1


def release_sigterm() -> None:
    """A world ended: the last one gives SIGTERM its default action back (if :func:`hold_sigterm` installed it)."""
    if threading.current_thread() is not threading.main_thread() or _HOLD[0] == 0:
        return
    _HOLD[0] -= 1
    if _HOLD[0] == 0 and _HOLD[1]:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _HOLD[1] = False


@contextmanager
def deferred_signals():
    """Block SIGINT and SIGTERM while a world cleans up (so a second Ctrl-C cannot cut the cleanup short); a signal
    that arrived meanwhile is delivered when the block ends."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    except (AttributeError, OSError, ValueError):
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextmanager
def ignoring_sigint():
    """Ignore SIGINT while rank processes are spawned: a spawned process inherits an ignored SIGINT through
    ``exec`` and Python keeps it ignored, so a Ctrl-C during a rank's start-up prints no traceback there."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGINT, old)


@contextmanager
def command_signals():
    """For a command (the ``tritonep`` CLI): SIGINT and SIGTERM raise :class:`WorldInterrupted` once (later ones
    are ignored while the command unwinds and cleans up); the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame):  # noqa: ARG001
        if fired:
            return
        fired.append(signum)
        raise WorldInterrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
