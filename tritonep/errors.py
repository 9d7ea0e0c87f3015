"""Typed exceptions of tritonep.

Every error the library raises on purpose is a subclass of :class:`TritonEPError`, so callers can catch
the whole family at once. Messages always name the offending value (and rank / peer where one exists).
"""

from __future__ import annotations

__all__ = [
    "TritonEPError",
    "ConfigError",
    "InputError",
    "PeerInputError",
    "PeerConfigError",
    "CountRoutingError",
    "CapacityError",
    "PeerTimeoutError",
    "TimeoutError",
    "LayoutError",
    "HeapError",
    "BufferStateError",
    "RankError",
    "DataError",
    "BackendError",
    "WireError",
    "PlanError",
]


class TritonEPError(RuntimeError):
    """Base class of every error tritonep raises on purpose."""


class ConfigError(TritonEPError, ValueError):
    """A static configuration (buffer arguments, recipe, geometry, world) is invalid or differs across ranks."""


class PeerConfigError(ConfigError):
    """Another rank's configuration of the same collective object (EPBuffer, MoELayer, ...) was refused, so the
    construction failed on every rank.

    Raised on the ranks whose own arguments were fine; the rank whose arguments were refused raises its own error
    (ConfigError, WireError, ...) naming the value. The verdicts travel in the constructor's first collective, so no
    rank waits on a peer that already failed, and nothing is allocated anywhere.

    Attributes:
        bad_ranks: the ranks whose configuration was refused (ascending).
    """

    def __init__(self, message: str, bad_ranks=()):
        super().__init__(message)
        self.bad_ranks = list(bad_ranks)


class InputError(TritonEPError, ValueError):
    """A tensor passed to a call has the wrong dtype, device, shape, contiguity or values.

    Raised before any peer memory is touched.
    """


class PeerInputError(InputError):
    """Another rank's input to the same collective call was invalid, so this call failed on every rank.

    Raised on the ranks whose own input was fine; the rank with the bad input raises the :class:`InputError` (or
    :class:`CapacityError`) that names its value. The flag travels with the call's counts exchange (docs/protocols.md (host protocol rule)):
    no rows moved, the buffer stays usable and the next call pairs correctly on every rank.

    Attributes:
        bad_ranks: the ranks whose input was refused (ascending).
        rank: the rank that raises.
    """

    def __init__(self, message: str, bad_ranks=(), rank: int = -1):
        super().__init__(message)
        self.bad_ranks = list(bad_ranks)
        self.rank = rank


class CountRoutingError(PeerInputError):
    """The ranks passed different count routings to the same dispatch (``EPBuffer.dispatch(count_ids=,
    count_experts=)``, a per-call argument every rank must pass alike): some ranks passed ``count_ids`` and others
    not, or they passed different ``count_experts``, or some carried it with the rows (``count_weights``) and others
    not, or carried routings of different widths. Every rank's stamp of the call travels with its counts exchange,
    so every rank refuses the call and raises this error (no rows moved, no sums were published, the buffer stays
    usable and the next agreeing call works).

    Attributes:
        bad_ranks: the lowest rank whose count routing differs from rank 0's (a list of one).
        counting: the ranks that passed ``count_ids`` (ascending).
        count_experts: ``{rank: count_experts}`` of the ranks the message names (0: no ``count_ids``): rank 0 and
            the lowest rank that differs from it.
        rank: the rank that raises.
    """

    def __init__(self, message: str, bad_ranks=(), rank: int = -1, counting=(), count_experts=None):
        super().__init__(message, bad_ranks=bad_ranks, rank=rank)
        self.counting = list(counting)
        self.count_experts = dict(count_experts or {})


class CapacityError(TritonEPError):
    """A call needs more rows than the buffer holds (``max_tokens_per_rank`` or ``max_recv_tokens``).

    Attributes:
        needed: rows the call needed.
        available: rows the buffer has.
    """

    def __init__(self, message: str, needed: int | None = None, available: int | None = None):
        super().__init__(message)
        self.needed = needed
        self.available = available


class PeerTimeoutError(TritonEPError):
    """A bounded wait inside a kernel gave up: a peer never raised the signal it was waited for.

    Attributes:
        wait: name of the wait that gave up (e.g. ``"dispatch.counts"``).
        peer: the rank that never arrived (-1 if unknown).
        rank: the rank that waited.
    """

    def __init__(self, message: str, wait: str = "", peer: int = -1, rank: int = -1):
        super().__init__(message)
        self.wait = wait
        self.peer = peer
        self.rank = rank


# docs/protocols.md calls it ``tep.TimeoutError``; both names refer to the same class.
TimeoutError = PeerTimeoutError  # noqa: A001


class LayoutError(TritonEPError, ValueError):
    """A symmetric region layout does not fit the space it must live in."""


class HeapError(TritonEPError):
    """The symmetric heap cannot serve a request (world too large, out of space, wrong device)."""


class BufferStateError(TritonEPError):
    """A buffer is closed, or unusable after an earlier failure (e.g. a peer timeout)."""


class RankError(TritonEPError):
    """A rank of a multi-process world failed; the message carries its rank and traceback."""


class DataError(TritonEPError, ValueError):
    """A packaged trace or histogram is missing or does not hold what was asked (e.g. a layer)."""


class BackendError(TritonEPError):
    """A backend cannot serve the request (e.g. CUDA-graph capture on the nccl backend, mixed backends)."""


class WireError(TritonEPError, ValueError):
    """An unsupported wire format or a hidden size the wire format cannot take."""


class PlanError(TritonEPError, ValueError):
    """A virtual-expert planning input is inconsistent (histogram sums, world size, stale weights)."""
