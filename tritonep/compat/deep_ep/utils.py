"""``deep_ep.utils``: :class:`EventHandle` and :class:`EventOverlap`, DeepEP's stream-event wrappers.

DeepEP's V1 ``EventHandle`` (C++) records a CUDA event on the current stream when constructed and makes the current
stream wait for it in ``current_stream_wait()``; ``EventOverlap`` wraps one (or None) with the tensors an async call
must keep alive. tritonep's compat Buffer runs every call on the caller's current stream (there is no separate
communication stream), so an event it returns is recorded after the call's work on that stream; on a CPU (the CPU
worlds) events are no-ops. Same names, arguments and behaviour as DeepEP's (source: DeepEP ``deep_ep/utils.py`` and
``csrc/event.hpp`` at the V1 API; written anew).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

__all__ = ["EventHandle", "EventOverlap"]

# [torch.cuda.is_available as last asked, its answer]: asked on the first event, not at import (importing the compat
# Buffer touches no CUDA), and again only once the function is another one (a test's monkeypatch); a call of it
# costs ~0.6 us of every event's construction
_CUDA = [None, False]


def _cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked once per function object (see :data:`_CUDA`)."""
    f = torch.cuda.is_available
    if f is not _CUDA[0]:
        _CUDA[:] = [f, bool(f())]
    return _CUDA[1]


class EventHandle:
    """A CUDA event recorded on the current stream at construction (``torch.cuda.Event``); nothing on a CPU.

    Attributes:
        event: the ``torch.cuda.Event``, or None where CUDA is not available.
    """

    __slots__ = ("event",)

    def __init__(self):
        if _cuda_available():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())
        else:
            self.event = None

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the recorded event (no host wait; nothing on a CPU)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class EventOverlap:
    """DeepEP's event wrapper: ``event`` (an :class:`EventHandle` or None) and ``extra_tensors`` kept alive with it.

    ``with EventOverlap(...):`` runs the block, then makes the current stream wait for the event (as DeepEP's).

    Args:
        event: the captured event, or None (an event of a call made without ``async_finish``).
        extra_tensors: tensors to keep referenced until the event is waited for (DeepEP's stand-in for
            ``record_stream`` that also works under CUDA graphs).
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event.

        Raises:
            tritonep.errors.InputError: there is no event (as DeepEP's assertion: a call made without
                ``async_finish`` returns ``EventOverlap(None)``).
        """
        if self.event is None:
            from ...errors import InputError

            raise InputError("EventOverlap.current_stream_wait(): no event (the call was made without async_finish)")
        self.event.current_stream_wait()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
