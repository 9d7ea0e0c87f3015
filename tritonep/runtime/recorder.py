"""The process-wide recorder of protocol events (every backend reports to it; nothing records in production).

The CPU world (:mod:`tritonep.testing.world`) installs one in every rank and fails the test when the ranks'
sequences of (launch or collective, name, grid) differ: the host protocol rule (docs/protocols.md (host protocol
rule)). Every bound launch of a launch runtime made with ``record=True`` reports itself
(:mod:`tritonep.runtime.launch`: the triton backend, its counts exchange and expert transport); the nccl backend
reports the collectives the CPU world's wrapper does not see (:func:`tritonep.backends.nccl.collectives.all_gather_flat`).
"""

from __future__ import annotations

from typing import Callable

__all__ = ["set_recorder", "get_recorder", "record"]

_RECORDER: Callable[[tuple], None] | None = None


def set_recorder(fn: Callable[[tuple], None] | None):
    """Install (or with None remove) the process-wide recorder of protocol events.

    ``fn(event)`` is called with ``("launch", kernel_name, grid)`` for every recorded bound launch
    (:class:`tritonep.runtime.bound.BoundKernel`) and
    with whatever :func:`record` is given. Used by the CPU world; never set in production.
    """
    global _RECORDER
    _RECORDER = fn


def get_recorder():
    """The installed recorder or None."""
    return _RECORDER


def record(event: tuple):
    """Report a protocol event (e.g. ``("collective", "barrier")``) to the recorder, if one is installed."""
    if _RECORDER is not None:
        _RECORDER(event)
