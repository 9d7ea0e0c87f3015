"""The backends of :class:`tritonep.EPBuffer` and the registry ``backend=`` / ``"auto"`` choose from.

Every backend is one class that satisfies :class:`EPBackend` (:mod:`tritonep.backends.interface`) plus one
:class:`BackendSpec` passed to :func:`register_backend`. Registered today (in ``"auto"`` preference order):

* ``triton`` (:mod:`tritonep.backends.triton`, :class:`~tritonep.backends.triton.backend.TritonEP`): symmetric memory
  + Triton kernels; needs every rank to map every peer's memory (one host, peer access).
* ``nccl`` (:mod:`tritonep.backends.nccl`, :class:`~tritonep.backends.nccl.backend.NcclEP`): ``torch.distributed``
  collectives; works for any group.

Nothing outside this package names a backend or imports a backend's modules (``tests/package/test_layering.py``):
the front door (:mod:`tritonep.ep`) builds one (:func:`build_backend`), sizes it (:func:`required_bytes`,
:func:`services_bytes`), checks a ``backend=`` name (:func:`check_backend_name`), asks for the kernel tiles of a
configuration (:func:`kernel_tiles`) and asks the built backend what it can do (its attributes and methods).
``"auto"`` picks the first registered backend whose needs every rank meets
(:func:`tritonep.ep.backend_choice.choose_from_reports`); sized without a group, ``"auto"`` means the first registered
backend (what it picks on one host).
"""

from __future__ import annotations

from .handle import DispatchHandle
from .interface import BackendSpec, CountsExchange, EPBackend, ExpertTransport

__all__ = ["EPBackend", "CountsExchange", "ExpertTransport", "BackendSpec", "DispatchHandle", "BACKENDS",
           "register_backend", "build_backend", "backend_names", "check_backend_name", "required_bytes",
           "services_bytes", "kernel_tiles", "sized_backend"]


def _build_triton(cfg, *, group, rank, device) -> EPBackend:
    """The triton backend of one rank for a :class:`tritonep.ep.config.EPConfig` (handed whole)."""
    from .triton.backend import TritonEP

    return TritonEP(cfg, group=group, rank=rank, device=device)


def _build_nccl(cfg, *, group, rank, device) -> EPBackend:
    """The nccl backend of one rank for a :class:`tritonep.ep.config.EPConfig` (``num_sms`` does not apply)."""
    from .nccl.backend import NcclEP

    return NcclEP(cfg, group=group, rank=rank, device=device)


def _triton_bytes(cfg) -> int:
    """Symmetric bytes of one triton-backend rank: its region list through the allocation's layout function."""
    from ..memory import required_bytes as layout_bytes
    from .triton.regions import regions

    return layout_bytes(regions(cfg))


def _triton_services_bytes(*, world_size, num_experts, max_tokens_per_rank, shapes, dtype) -> int:
    """Symmetric bytes of the triton backend's counts exchange and expert transport (their region lists)."""
    from ..memory import required_bytes as layout_bytes
    from .triton.counts import counts_regions
    from .triton.expert_transport import transport_regions

    L = num_experts // world_size
    return (layout_bytes(counts_regions(world_size, num_experts, max_tokens_per_rank))
            + layout_bytes(transport_regions(world_size, L, shapes, dtype)))


def _triton_tiles(device_type, world_size, hidden, max_tokens_per_rank, topk, wire, **choices):
    """The triton backend's kernel tiles (:func:`tritonep.backends.triton.tiles.select_tiles`)."""
    from .triton.tiles import select_tiles

    return select_tiles(device_type, world_size, hidden, max_tokens_per_rank, topk, wire=wire, **choices)


def _no_bytes(cfg=None, **_) -> int:
    """The nccl backend holds no symmetric memory."""
    return 0


BACKENDS: dict[str, BackendSpec] = {}  # insertion order = "auto" preference order


def register_backend(spec: BackendSpec) -> None:
    """Add (or replace) a backend in the registry; a new one is preferred by ``"auto"`` after those before it."""
    BACKENDS[spec.name] = spec


register_backend(BackendSpec("triton", _build_triton, needs_peer_memory=True, graph_capture=True,
                             required_bytes=_triton_bytes, services_bytes=_triton_services_bytes,
                             tiles=_triton_tiles))
register_backend(BackendSpec("nccl", _build_nccl, needs_peer_memory=False, graph_capture=False,
                             required_bytes=_no_bytes, services_bytes=_no_bytes))


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
        from ..errors import ConfigError

        names = ", ".join(repr(n) for n in ("auto",) + backend_names())
        raise ConfigError(f"backend={backend!r} is not one of {names}")


def sized_backend(name: str) -> str:
    """The backend a size is asked of: ``name``, or for ``"auto"`` the first registered backend (what ``"auto"``
    picks on one host).

    Raises:
        ConfigError: not ``"auto"`` or a registered name.
    """
    check_backend_name(name)
    return next(iter(BACKENDS)) if name == "auto" else name


def required_bytes(name: str, cfg) -> int:
    """Symmetric bytes one rank of backend ``name`` (:func:`sized_backend`) allocates for ``cfg``."""
    return BACKENDS[sized_backend(name)].required_bytes(cfg)


def services_bytes(name: str, *, world_size: int, num_experts: int, max_tokens_per_rank: int, shapes: dict,
                   dtype) -> int:
    """Symmetric bytes one rank of backend ``name`` (:func:`sized_backend`) allocates for the counts exchange and the
    expert transport of ``num_experts`` experts with per-expert weight ``shapes`` of ``dtype``."""
    return BACKENDS[sized_backend(name)].services_bytes(world_size=world_size, num_experts=num_experts,
                                                        max_tokens_per_rank=max_tokens_per_rank, shapes=shapes,
                                                        dtype=dtype)


def kernel_tiles(device_type: str, world_size: int, hidden: int, max_tokens_per_rank: int, topk: int, wire: str,
                 *, num_sms: int = 0, override="", combine: str = "", max_programs: int = 0, source: str = "tiles"):
    """The kernel tiles of a static configuration: those of the first registered backend that chooses tiles (its
    :attr:`BackendSpec.tiles`), or None when none does. Every rank computes them from its agreed configuration.

    Args (keywords, resolved by the configuration: :func:`tritonep.ep.config.build_config`): ``num_sms`` (SM cap,
    0: none), ``override`` (an override string or tiles given whole; "": the table's), ``combine`` (a forced combine
    kind, ""), ``max_programs`` (program cap, 0: none), ``source`` (where ``override`` came from, for errors).

    Raises:
        ConfigError: what the backend's table refuses (a bad override entry).
    """
    for spec in BACKENDS.values():
        if spec.tiles is not None:
            return spec.tiles(device_type, world_size, hidden, max_tokens_per_rank, topk, wire, num_sms=num_sms,
                              override=override, combine=combine, max_programs=max_programs, source=source)
    return None
