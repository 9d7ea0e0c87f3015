"""What a call came to on a rank, as a value the host compares across ranks: the refusal tests' one way to catch.

A rank body runs a collective call and returns what it came to instead of raising (a raise would stop the rank
before the calls that follow, and its peers would wait for it); the test then checks each rank's outcome against the
promised one (docs/protocols.md, host protocol rule: a refused input fails the call on every rank).

* :func:`verdict` -- ``("ok", value)`` / ``("PeerInputError", sorted bad ranks)`` / this rank's own error as
  ``(type name, message)`` (or ``(type name,)``): compared whole with ``==``.
* :func:`timeout_verdict` -- :func:`verdict`, with a PeerTimeoutError as ``("PeerTimeoutError", wait, peer, message)``
  (or without the message): the bounded-wait tests' one way to catch a lost peer.
* :func:`refusal` -- a refused call in one word (``"no error"`` / ``"peer"`` / ``"peer-config"`` / ``"own"``), for the
  compat tests that compare word lists.
* :func:`outcome` -- the full record ``(kind, type name, message, bad ranks)`` for tests that read the messages.

Errors outside the ones named propagate (a test never turns an unexpected error into a value).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["outcome", "refusal", "timeout_verdict", "verdict"]


def _caught(fn: Callable, own: tuple) -> tuple:
    """``("ok", value)`` / ``("peer", the PeerInputError)`` / ``("own", the error of a type in own)``."""
    from tritonep.errors import PeerInputError

    try:
        return "ok", fn()
    except PeerInputError as e:  # first: it is an InputError too
        return "peer", e
    except own as e:
        return "own", e


def verdict(fn: Callable, *own: type, message: bool = True) -> tuple:
    """Run ``fn()`` on a rank and say what it came to.

    Returns:
        ``("ok", value)``: ``fn`` returned ``value`` (pass a function that returns a plain value, or None, where the
        ranks' results are compared); ``("PeerInputError", sorted(bad_ranks))``: a peer's input to the call was
        refused; ``(type name, message)`` for an error of one of the types ``own`` (this rank's own: InputError,
        ConfigError, the RuntimeError a failing step raised ...), or ``(type name,)`` with ``message=False``. Any
        other error propagates.
    """
    kind, got = _caught(fn, own)
    if kind == "ok":
        return ("ok", got)
    if kind == "peer":
        return ("PeerInputError", sorted(got.bad_ranks))
    return (type(got).__name__, str(got)) if message else (type(got).__name__,)


def timeout_verdict(fn: Callable, *own: type, message: bool = True) -> tuple:
    """Run ``fn()`` on a rank and say what it came to, naming the wait a lost peer broke.

    Returns:
        What :func:`verdict` returns (``own`` and ``message`` as there), except that a
        :class:`tritonep.errors.PeerTimeoutError` comes as ``("PeerTimeoutError", wait, peer, message)`` -- the wait
        that gave up (``"dispatch.counts"``, ``"combine.data"``, ``"peer.gave_up"`` ...), the peer it waited for
        (-1 where none is named), the error's text -- or ``("PeerTimeoutError", wait, peer)`` with ``message=False``.
    """
    from tritonep.errors import PeerTimeoutError

    if PeerTimeoutError in own:
        raise TypeError("timeout_verdict catches PeerTimeoutError itself: do not name it in own")
    try:
        return verdict(fn, *own, message=message)
    except PeerTimeoutError as e:
        return ("PeerTimeoutError", e.wait, e.peer) + ((str(e),) if message else ())


def refusal(fn: Callable, *says: str) -> str:
    """Run ``fn()`` on a rank and say in one word how the call came out.

    Returns:
        ``"no error"`` (``fn`` returned), ``"peer"`` (PeerInputError: a peer's input was refused), ``"peer-config"``
        (PeerConfigError: the ranks could agree on no lane), ``"own"`` (this rank's InputError, its message holding
        every string in ``says``), or the message of an InputError that does not (so a wrong reason shows). Other
        errors propagate.
    """
    from tritonep.errors import InputError, PeerConfigError

    got = verdict(lambda: fn() and None, InputError, PeerConfigError)
    if got[0] in ("ok", "PeerInputError", "PeerConfigError"):
        return {"ok": "no error", "PeerInputError": "peer", "PeerConfigError": "peer-config"}[got[0]]
    return "own" if all(s in got[1] for s in says) else got[1]


def outcome(fn: Callable) -> tuple:
    """Run ``fn()`` on a rank; ``("ok", value)``, or for a refused call ``("peer", type name, message, bad_ranks)``
    (PeerInputError: another rank's input was refused) / ``("own", type name, message, None)`` (this rank's
    InputError or CapacityError). Other errors propagate."""
    from tritonep.errors import CapacityError, InputError

    kind, got = _caught(fn, (InputError, CapacityError))
    if kind == "ok":
        return ("ok", got)
    return (kind, type(got).__name__, str(got), list(got.bad_ranks) if kind == "peer" else None)
