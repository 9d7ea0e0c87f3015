"""What :class:`tritonep.EPBuffer` needs from a backend (:class:`EPBackend`), the two collective services virtual
experts need from it (:class:`CountsExchange`, :class:`ExpertTransport`), and what the registry knows of a backend
before one is built (:class:`BackendSpec`).

A backend moves the rows of one EP group: :class:`EPBackend` lists every method and attribute EPBuffer (and its
autograd functions, :mod:`tritonep.ep.autograd`) calls, its capabilities among them (``sync_free``, the services).
The front door asks a backend what it can do and never compares its name; it builds one with keyword arguments only
(:func:`tritonep.backends.build_backend`) and never probes it with ``hasattr``.

Virtual experts (:mod:`tritonep.balance`) need two more collective services per backend, built by the backend
itself (``EPBuffer.counts_exchange`` / ``EPBuffer.expert_transport``): a :class:`CountsExchange` (every rank's expert
histogram) and an :class:`ExpertTransport` (weights into peers' virtual slots, gradients back). Both give the same
bits on every backend; their torch twins are :func:`tritonep.backends.layout.counts_torch` and
:func:`tritonep.backends.slot_transport.pull_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, runtime_checkable

import torch

__all__ = ["EPBackend", "CountsExchange", "ExpertTransport", "BackendSpec"]


@runtime_checkable
class EPBackend(Protocol):
    """The interface of one rank's backend object (what EPBuffer calls; every call is collective over the group).

    Attributes (the backend's capabilities are among them: the front door asks, never compares names):
        name: the registry name; handles record it.
        sync_free: ``dispatch(sync_free=True)`` is supported (no host read; ``max_recv_tokens`` rows).
        host_reads: device->host reads the calls made so far (the eager budget: one per dispatch).
        allocated_bytes: symmetric bytes this rank holds (0 when the backend holds none).
        tiles: the kernel tiles (grids and tiles) or ``None`` when the backend has none.
        timeout_s: the bound of its waits in seconds (``None`` when it has no waits of its own).
    """

    name: str
    sync_free: bool
    host_reads: int

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes this rank holds."""
        ...

    @property
    def tiles(self):
        """Kernel tiles, or None."""
        ...

    def dispatch_fwd(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, sync: int,
                     keep_quantized: bool = False, bad_input: bool = False, sync_free: bool = False,
                     count=None) -> tuple:
        """Forward dispatch: ``(rows, row_weights, num_tokens_per_expert, expert_offsets, handle)``. ``sync``: the
        call's ``TRITONEP_SYNC_CHECKS`` mode from the front door (``tritonep.envs.SYNC_*``; 0 = no host read).
        ``sync_free``: ``dispatch(sync_free=True)`` (no host read, ``max_recv_tokens`` rows; ``sync`` is 0 with
        it); ``bad_input``: the front door refused this rank's input (empty tensors; the call still runs).
        ``count``: None or ``(count_ids, count_experts, Tc, CK)`` (:meth:`tritonep.EPBuffer.dispatch`): a backend that
        computes the sums sets ``handle.count_sums``; one that does not leaves it None. Either way the ranks' count
        routings (``count_experts``, or none) must agree: a backend refuses a call whose ranks disagree on every rank
        with :class:`tritonep.errors.CountRoutingError`, its stamp riding in the call's own exchange."""
        ...

    def combine_fwd(self, expert_out: torch.Tensor, handle, kind: str | None = None, read: bool = False
                    ) -> torch.Tensor:
        """Forward combine: ``y [T, H]``. ``read``: an eager combine (the front door decides: a synced handle,
        sync checks on, not capturing): the host reads the call's status once at its end and raises a peer's
        refusal (PeerInputError) or timeout on every rank; else a refused or lost peer leaves ``y`` NaN and the
        next :meth:`check` or synced dispatch raises it."""
        ...

    def combine_refused(self, kind: str | None = None, record_own: bool = True, handle=None) -> None:
        """Take part in this call's combine as refused (a refused combine input on this rank, or
        ``EPBuffer.cancel_combine``): the same launches / collectives as the peers' combine with no row, marking the
        call refused on every rank. ``record_own``: record it on this rank too (the peers do not read this call);
        ``handle``: this rank's handle of the call, or None (the backend's latest dispatch)."""
        ...

    def defer_refusal(self, error: Exception) -> None:
        """This rank's latest dispatch took part as refused (``bad_input``) and read nothing: the next read that
        finds the refusal raises ``error`` on this rank (its caller's own error naming the value, deferred by
        ``EPBuffer.refuse_dispatch``) instead of PeerInputError naming this rank."""
        ...

    def dispatch_bwd(self, grad_recv_x: torch.Tensor, grad_recv_w: torch.Tensor | None, handle) -> tuple:
        """Backward of dispatch: ``(grad_x [T, H], grad_topk_weights [T, K] or None)``."""
        ...

    def dispatch_bwd_refused(self, handle=None, with_weights: bool = False) -> None:
        """Take part in this call's dispatch backward as refused (a refused ``dispatch_backward`` input on this
        rank, or ``EPBuffer.cancel_dispatch_backward``): the same launches / collectives as the peers' dispatch
        backward (the weight-gradient variant with ``with_weights``) with no row, marking the call refused on every
        rank (recorded for the next read; a backward reads nothing on the host). ``handle``: this rank's handle of
        the dispatch, or None (the backend's latest dispatch).

        Raises:
            BackendError: the backend needs the dispatch's handle and has none (no dispatch yet)."""
        ...

    def combine_bwd(self, grad_y: torch.Tensor, expert_out: torch.Tensor, handle) -> tuple:
        """Backward of combine: ``(grad_expert_out [R', H], grad_recv_weights [R])``; a peer that took part as
        refused (:meth:`combine_bwd_refused`) leaves the outputs NaN (every row computed from its rows at least)
        and the refusal recorded for the next read."""
        ...

    def combine_bwd_refused(self, handle=None) -> None:
        """Take part in this call's combine backward as refused (a refused ``combine_backward`` input on this rank,
        or ``EPBuffer.cancel_combine_backward``): the same launches / collectives as the peers' combine backward
        with no row, marking the call refused on every rank (recorded for the next read, this rank's included; a
        backward reads nothing on the host). ``handle``: this rank's handle of the dispatch, or None (the backend's
        latest dispatch).

        Raises:
            BackendError: the backend needs the dispatch's handle and has none (no dispatch yet)."""
        ...

    def expert_out_buffer(self) -> torch.Tensor:
        """The ``[max_recv_tokens, H]`` tensor meant for the expert output (zero copy into combine)."""
        ...

    def counts_exchange(self, num_experts: int) -> "CountsExchange":
        """A new counts exchange of this backend over its group (collective: every rank builds it in the same
        order) for ``num_experts`` experts, the buffer's ``max_tokens_per_rank``, ``topk``, device and wait bound."""
        ...

    def expert_transport(self, num_experts: int, shapes: dict, dtype: torch.dtype) -> "ExpertTransport":
        """A new virtual-expert weight transport of this backend over its group (collective) for weights of
        ``num_experts`` experts of per-expert ``shapes`` (``name -> shape``) and ``dtype``."""
        ...

    def check(self, what: str = "EPBuffer") -> None:
        """Raise any error the device recorded (one host sync; a no-op when errors raise where they happen)."""
        ...

    def close(self) -> None:
        """Release what the backend holds; later calls raise BufferStateError."""
        ...


@runtime_checkable
class CountsExchange(Protocol):
    """One rank's counts exchange (collective): ``gather(topk_idx [T, K]) -> counts int32 [W, E]`` with
    ``counts[r, e]`` = routes of rank r to expert e (ids outside ``[0, E)`` not counted; outside ``[-1, E)``
    flagged for :meth:`check`). A refused ``topk_idx`` takes part with no routes and a flag, then raises
    InputError / CapacityError. No host read."""

    host_reads: int

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes this rank holds."""
        ...

    def gather(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """The ``[W, E]`` int32 matrix of this call."""
        ...

    def check(self) -> None:
        """Raise an error the exchange recorded (one host read)."""
        ...

    def status_words(self) -> torch.Tensor:
        """What :meth:`check` reads (int64 device tensor, no copy), for an owner that folds it into one host read."""
        ...

    def raise_status(self, values) -> None:
        """Raise what a host copy of :meth:`status_words` records (as :meth:`check`, without the read)."""
        ...

    def close(self) -> None:
        """Release what it holds (collective)."""
        ...


@runtime_checkable
class ExpertTransport(Protocol):
    """One rank's virtual-expert weight transport (collective); see :mod:`tritonep.backends.slot_transport`.

    ``push(weights, placement, experts_to_copy_host=None) -> {name: slots [L, *shape]}``;
    ``slot_views(num_used) -> {name: [num_used, *shape]}``; ``pull(slot_grads, placement, num_used=None, held=(),
    into=None, experts_to_copy_host=None) -> {name: [L, *shape]}`` (accumulates into ``into`` in place, or into
    zeros). ``experts_to_copy_host``: a host copy of ``placement.experts_to_copy`` for backends that need host
    split sizes (ignored by the others).
    """

    host_reads: int

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes this rank holds."""
        ...

    def push(self, weights: dict, placement, experts_to_copy_host=None) -> dict:
        """Owners' weights into every rank's slots."""
        ...

    def slot_views(self, num_used: int) -> dict:
        """Zero-copy views of the first ``num_used`` slots."""
        ...

    def pull(self, slot_grads: dict, placement, num_used=None, held=(), into=None, experts_to_copy_host=None) -> dict:
        """Slot gradients back to their owners' native gradients."""
        ...

    def check(self) -> None:
        """Raise an error the transport recorded (one host read)."""
        ...

    def status_words(self) -> torch.Tensor:
        """What :meth:`check` reads (int64 device tensor, no copy), for an owner that folds it into one host read."""
        ...

    def raise_status(self, values) -> None:
        """Raise what a host copy of :meth:`status_words` records (as :meth:`check`, without the read)."""
        ...

    def close(self) -> None:
        """Release what it holds (collective)."""
        ...


@dataclass(frozen=True)
class BackendSpec:
    """One registered backend.

    Attributes:
        name: the ``backend=`` value.
        build: ``build(cfg, group=, rank=, device=)`` -> :class:`EPBackend`, ``cfg`` the buffer's
            :class:`tritonep.ep.config.EPConfig` (handed whole: a backend reads its fields, never re-derives them).
        needs_peer_memory: usable only when every rank maps every peer's memory (one host, peer access).
        graph_capture: its calls can be captured in a CUDA graph.
        required_bytes: ``required_bytes(cfg)`` -> symmetric bytes one rank's backend allocates for that config (0
            for a backend that holds none).
        services_bytes: ``services_bytes(world_size=, num_experts=, max_tokens_per_rank=, shapes=, dtype=)`` ->
            symmetric bytes of the counts exchange and the expert transport a virtual-expert layer builds over the
            backend (:meth:`EPBackend.counts_exchange`, :meth:`EPBackend.expert_transport`).
        tiles: ``tiles(device_type, world_size, hidden, max_tokens_per_rank, topk, wire, *, num_sms, override,
            combine, max_programs, source)`` -> the kernel tiles of a static configuration, for a backend whose kernels have tiles chosen from a table (None: it
            has none). The configuration holds them (:class:`tritonep.ep.config.EPConfig`), so every rank agrees.
    """

    name: str
    build: Callable[..., EPBackend]
    needs_peer_memory: bool
    graph_capture: bool
    required_bytes: Callable[..., int]
    services_bytes: Callable[..., int]
    tiles: Optional[Callable[..., object]] = None
