"""The test hook into an EPBuffer's backend: the one place tests reach past :class:`tritonep.EPBuffer`'s public API.

Backend-level tests (host-path budgets, output pools, bound launches, the status word, the nccl backend's GPU path
in the interpreter) read and drive the backend object behind a buffer: an :class:`tritonep.backends.EPBackend`
(its interface), plus the parts its own tests look into (the triton backend's ``call_status``, ``outputs``, ``k``,
``decode``; the nccl backend's ``use_triton`` switch, ``_sync_free``, ``_combine``). They get it here, never through
the buffer's private attribute (``tests/package/test_layering.py`` checks it).
"""

from __future__ import annotations

__all__ = ["backend_of"]


def backend_of(buf):
    """The backend object behind ``buf`` (an :class:`tritonep.EPBuffer`): an :class:`tritonep.backends.EPBackend`,
    the very object the buffer calls (changes made to it, e.g. the nccl backend's ``use_triton = True``, apply to
    the buffer's calls)."""
    return buf._backend
