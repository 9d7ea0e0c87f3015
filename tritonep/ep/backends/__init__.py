"""What :class:`tritonep.EPBuffer` needs from a backend, and the registry ``backend=`` / ``"auto"`` choose from.

A backend moves the rows of one EP group: :class:`EPBackend` lists every method and attribute EPBuffer (and its
autograd functions, :mod:`tritonep.ep.autograd`) calls. A new backend (e.g. multi-host RDMA) is one class that
satisfies it plus one :class:`BackendSpec` passed to :func:`register_backend`; EPBuffer builds it with keyword
arguments only (:func:`build_backend`) and never probes it with ``hasattr``.

Virtual experts (:mod:`tritonep.balance`) need two more collective services per backend, built through its
:class:`BackendSpec` (``EPBuffer.counts_exchange`` / ``EPBuffer.expert_transport``): a :class:`CountsExchange`
(every rank's expert histogram) and an :class:`ExpertTransport` (weights into peers' virtual slots, gradients back).
Both give the same bits on every backend; their torch twins are :func:`tritonep.ep.layout.counts_torch` and
:func:`tritonep.ep.slot_transport.pull_torch`.

Registered today (in ``"auto"`` preference order):

* ``triton`` (:mod:`tritonep.ep.triton`: :class:`~tritonep.ep.triton.backend.TritonEP`,
  :class:`~tritonep.ep.triton.counts.CountsExchange`, :class:`~tritonep.ep.triton.expert_transport.ExpertTransport`):
  symmetric memory + Triton kernels; needs every rank to map every peer's memory (one host, peer access).
* ``nccl`` (:mod:`tritonep.ep.nccl`: :class:`~tritonep.ep.nccl.backend.NcclEP`,
  :class:`~tritonep.ep.nccl.counts.NcclCountsExchange`,
  :class:`~tritonep.ep.nccl.expert_transport.NcclExpertTransport`): ``torch.distributed`` collectives; works for
  any group.

The front door (:mod:`tritonep.ep.buffer`) reaches a backend only through this registry: it builds one
(:func:`build_backend`), sizes it (:func:`required_bytes`) and checks a ``backend=`` name
(:func:`check_backend_name`).

``"auto"`` picks the first registered backend whose needs every rank meets
(:func:`tritonep.ep.backend_choice.choose_backend`, one all_gather of per-rank reports).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

__all__ = ["EPBackend", "CountsExchange", "ExpertTransport", "BackendSpec", "BACKENDS", "register_backend",
           "build_backend", "backend_names", "check_backend_name", "required_bytes"]


@runtime_checkable
class EPBackend(Protocol):
    """The interface of one rank's backend object (what EPBuffer calls; every call is collective over the group).

    Attributes:
        name: the registry name (``"triton"``, ``"nccl"``); handles record it.
        host_reads: device->host reads the calls made so far (the eager budget: one per dispatch).
        allocated_bytes: symmetric bytes this rank holds (0 when the backend holds none).
        geometry: the kernel geometry (grids and tiles) or ``None`` when the backend has none.
        timeout_s: the bound of its waits in seconds (``None`` when it has no waits of its own).
    """

    name: str
    host_reads: int

    @property
    def allocated_bytes(self) -> int:
        """Symmetric bytes this rank holds."""
        ...

    @property
    def geometry(self):
        """Kernel geometry, or None."""
        ...

    def dispatch_fwd(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, sync: int,
                     keep_quantized: bool = False, bad_input: bool = False) -> tuple:
        """Forward dispatch: ``(rows, row_weights, num_tokens_per_expert, expert_offsets, handle)``. ``sync``: the
        call's ``TRITONEP_SYNC_CHECKS`` mode from the front door (``tritonep.envs.SYNC_*``; 0 = no host read)."""
        ...

    def combine_fwd(self, expert_out: torch.Tensor, handle, kind: str | None = None) -> torch.Tensor:
        """Forward combine: ``y [T, H]``."""
        ...

    def dispatch_bwd(self, grad_recv_x: torch.Tensor, grad_recv_w: torch.Tensor | None, handle) -> tuple:
        """Backward of dispatch: ``(grad_x [T, H], grad_topk_weights [T, K] or None)``."""
        ...

    def combine_bwd(self, grad_y: torch.Tensor, expert_out: torch.Tensor, handle) -> tuple:
        """Backward of combine: ``(grad_expert_out [R', H], grad_recv_weights [R])``."""
        ...

    def combine_refused(self, kind: str | None = None, record_own: bool = True, handle=None) -> None:
        """Take part in a combine as refused (:meth:`tritonep.EPBuffer.cancel_combine`)."""
        ...

    def dispatch_bwd_refused(self, handle=None, with_weights: bool = False) -> None:
        """Take part in a dispatch backward as refused (:meth:`tritonep.EPBuffer.cancel_dispatch_backward`)."""
        ...

    def expert_out_buffer(self) -> torch.Tensor:
        """The ``[max_recv_tokens, H]`` tensor meant for the expert output (zero copy into combine)."""
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
    """One rank's virtual-expert weight transport (collective); see :mod:`tritonep.ep.slot_transport`.

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
        counts_exchange: keyword-only constructor ``(group=, num_experts=, max_tokens_per_rank=, topk=, device=,
            timeout_s=)`` -> :class:`CountsExchange`.
        expert_transport: keyword-only constructor ``(group=, num_experts=, shapes=, dtype=, device=, timeout_s=)``
            -> :class:`ExpertTransport`.
        required_bytes: ``required_bytes(cfg)`` -> symmetric bytes one rank's backend allocates for that config (0
            for a backend that holds none).
    """

    name: str
    build: Callable[..., EPBackend]
    needs_peer_memory: bool
    graph_capture: bool
    counts_exchange: Callable[..., CountsExchange]
    expert_transport: Callable[..., ExpertTransport]
    required_bytes: Callable[..., int]


def _build_triton(cfg, *, group, rank, device) -> EPBackend:
    """The triton backend of one rank for a :class:`tritonep.ep.config.EPConfig` (handed whole)."""
    from ..triton.backend import TritonEP

    return TritonEP(cfg, group=group, rank=rank, device=device)


def _build_nccl(cfg, *, group, rank, device) -> EPBackend:
    """The nccl backend of one rank for a :class:`tritonep.ep.config.EPConfig` (``num_sms`` does not apply)."""
    from ..nccl.backend import NcclEP

    return NcclEP(cfg, group=group, rank=rank, device=device)


def _triton_counts(*, group, num_experts, max_tokens_per_rank, topk, device, timeout_s=None) -> CountsExchange:
    """Keyword-only constructor of the triton counts exchange (symmetric memory)."""
    from ..triton.counts import CountsExchange as TritonCounts

    return TritonCounts(group, num_experts, max_tokens_per_rank, topk, device, timeout_s=timeout_s)


def _triton_transport(*, group, num_experts, shapes, dtype, device, timeout_s=None) -> ExpertTransport:
    """Keyword-only constructor of the triton expert transport (symmetric memory)."""
    from ..triton.expert_transport import ExpertTransport as TritonTransport

    return TritonTransport(group, num_experts, shapes, dtype=dtype, device=device, timeout_s=timeout_s)


def _nccl_counts(*, group, num_experts, max_tokens_per_rank, topk, device, timeout_s=None) -> CountsExchange:
    """Keyword-only constructor of the nccl counts exchange (one all_gather)."""
    from ..nccl.counts import NcclCountsExchange

    return NcclCountsExchange(group, num_experts, max_tokens_per_rank, topk, device, timeout_s=timeout_s)


def _nccl_transport(*, group, num_experts, shapes, dtype, device, timeout_s=None) -> ExpertTransport:
    """Keyword-only constructor of the nccl expert transport (all_to_all)."""
    from ..nccl.expert_transport import NcclExpertTransport

    return NcclExpertTransport(group, num_experts, shapes, dtype=dtype, device=device, timeout_s=timeout_s)


def _triton_bytes(cfg) -> int:
    """Symmetric bytes of one triton-backend rank: its region list through the allocation's layout function."""
    from ...memory import required_bytes as layout_bytes
    from ..triton.regions import regions

    return layout_bytes(regions(cfg))


def _no_bytes(cfg) -> int:
    """The nccl backend holds no symmetric memory."""
    return 0


BACKENDS: dict[str, BackendSpec] = {}  # insertion order = "auto" preference order


def register_backend(spec: BackendSpec) -> None:
    """Add (or replace) a backend in the registry; a new one is preferred by ``"auto"`` after those before it."""
    BACKENDS[spec.name] = spec


register_backend(BackendSpec("triton", _build_triton, needs_peer_memory=True, graph_capture=True,
                             counts_exchange=_triton_counts, expert_transport=_triton_transport,
                             required_bytes=_triton_bytes))
register_backend(BackendSpec("nccl", _build_nccl, needs_peer_memory=False, graph_capture=False,
                             counts_exchange=_nccl_counts, expert_transport=_nccl_transport,
                             required_bytes=_no_bytes))


def backend_names() -> tuple:
    """Registered backend names in ``"auto"`` preference order."""
    return tuple(BACKENDS)


def build_backend(name: str, cfg, *, group, rank, device) -> EPBackend:
    """Build the registered backend ``name`` for ``cfg`` (:class:`tritonep.ep.config.EPConfig`, handed whole)."""
    return BACKENDS[name].build(cfg, group=group, rank=rank, device=device)


def check_backend_name(backend) -> None:
    """Check a ``backend=`` value: ``"auto"`` or a registered name.

    Raises:
        ConfigError: any other value (the message names it and lists the choices).
    """
    if backend != "auto" and backend not in BACKENDS:
        from ...errors import ConfigError

        names = ", ".join(repr(n) for n in ("auto",) + backend_names())
        raise ConfigError(f"backend={backend!r} is not one of {names}")


def required_bytes(name: str, cfg) -> int:
    """Symmetric bytes one rank of the registered backend ``name`` allocates for ``cfg``."""
    return BACKENDS[name].required_bytes(cfg)
