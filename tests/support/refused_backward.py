"""A backward call refused on one rank (``EPBuffer.dispatch_backward`` / ``combine_backward`` with a bad input, or
its ``cancel_*``): what each rank's part comes to, and the one check of it that tests/ep/test_backward_refused.py and
tests/ep/test_combine_backward_refused.py share (docs/protocols.md, host protocol rule: the refused rank takes part
in its peers' launches and collectives; the refusal is raised on every rank, once)."""

from __future__ import annotations

from typing import Callable

from tests.support.outcomes import verdict

__all__ = ["OWN", "check_refused_backward", "refused_call_outcomes"]

# the refused rank's own verdict of the call, by how its input is refused (message=False)
OWN = {"dtype": ("InputError",), "rows": ("InputError",), "handle": ("ConfigError",), "cancel": ("ok", "cancelled")}


def refused_call_outcomes(call: Callable, buf, read: str, redispatch: Callable) -> dict:
    """One rank's ``{"call", "read", "check_again"}`` verdicts (tests/support/outcomes.py).

    ``call``: this rank's part of the refused call (the refused rank's own InputError / ConfigError come as their
    type name); ``read``: ``"check"`` (``buf.check()``) or ``"dispatch"`` (``redispatch()``, the next synced
    dispatch: its launches run on every rank, then it raises on every rank) -- the read that raises the refusal;
    ``check_again``: a second ``buf.check()`` (the refusal is raised once).
    """
    from tritonep.errors import ConfigError, InputError

    out = {"call": verdict(call, InputError, ConfigError, message=False)}
    out["read"] = verdict(buf.check) if read == "check" else verdict(lambda: redispatch() and None)
    out["check_again"] = verdict(buf.check)
    return out


def check_refused_backward(res: list, how: str, backend: str, sync_checks) -> None:
    """Assert each rank's record (:func:`refused_call_outcomes` plus ``same``: a later backward gives the bits of
    the one before the refusal, ``finite``: no NaN after it) of a world whose last rank's input was refused ``how``.

    The refused rank: its own error (``OWN``); the peers: ``("ok", "NaN")`` (the world's check that the outputs
    are NaN where the backend promises), or, with strict sync checks on triton, PeerInputError naming the refused
    rank in the call itself; the read: that PeerInputError on every rank (``("ok", None)`` where the call raised
    it); a second check: nothing. Raises AssertionError naming the rank and its record."""
    W = len(res)
    in_call = sync_checks == "strict" and backend == "triton"  # the peers' strict end-of-call check raises it
    refused = ("PeerInputError", [W - 1])
    for r, out in enumerate(res):
        exp = {"call": OWN[how] if r == W - 1 else (refused if in_call else ("ok", "NaN")),
               "read": ("ok", None) if in_call else refused, "check_again": ("ok", None),
               "same": True, "finite": True}
        assert out == exp, (r, out)
