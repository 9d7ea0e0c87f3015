"""The static configuration of one EPBuffer: built once, checked across ranks once, handed whole to the backend.

:class:`EPConfig` holds everything a buffer's static configuration decides (experts, hidden, tokens, top-k, wires,
alignment, capacity, SM cap, timeout, device type, kernel tiles, and the host options: sync checks, program cap, launch
path, output pool, sync-free mode). :func:`build_config` validates the arguments and derives the rest
(``max_recv_tokens``'s default, the kernel tiles through the backend registry, the wait bound); it is the one place a
buffer's options are read from the environment (:mod:`tritonep.envs`: an argument left None takes its ``TRITONEP_*``
variable), once, when the buffer is built; nothing below the front door reads the environment, recomputes or renames
a field. :func:`agree` is the constructor's one
collective: every rank contributes its config (or the error its arguments raised) and its view of peer access, so an
invalid configuration on ANY rank is an error on EVERY rank (the bad rank raises its own error naming the value, the
others :class:`tritonep.errors.PeerConfigError` naming the bad rank and its message), and configurations that differ
raise :class:`tritonep.errors.ConfigError` naming the field and each rank's value (docs/protocols.md, host protocol
rule: no rank leaves the first collective alone).

Idea: DeepEP's ``Config`` (one static object per buffer) and pplx-kernels' ``AllToAll`` parameters (sizes fixed at
construction); the "verdict in the first collective" follows torch.distributed's own ``monitored_barrier``-style
error reporting so that no rank waits on a peer that already failed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .. import envs
from ..errors import ConfigError, PeerConfigError, TritonEPError

__all__ = ["EPConfig", "build_config", "agree", "COMPARED_FIELDS"]


@dataclass(frozen=True)
class EPConfig:
    """What one EPBuffer's static configuration decides (frozen; every backend takes it whole).

    Attributes:
        world_size: W, ranks of the EP group.
        num_experts: E (a multiple of W); ``num_local_experts`` L = E / W.
        hidden: H, row width (elements).
        max_tokens_per_rank: Tmax, static capacity of T on every rank.
        topk: K, experts per token.
        dispatch_wire / combine_wire: registered wire names (:data:`tritonep.wire.WIRES`).
        expert_alignment: A, every expert segment starts at a multiple of A (padding rows are zero).
        max_recv_tokens: rows a rank can receive (default ``W*Tmax*K + L*(A-1)``, the worst case).
        backend: the requested backend (``"auto"`` | a registered name); the chosen one is EPBuffer's ``backend``.
        dtype: element type of x and expert outputs (torch.bfloat16).
        device_type: ``"cuda"`` or ``"cpu"`` (a CPU buffer runs the kernels in Triton's interpreter).
        num_sms: the cap on communication kernels' programs (0: none, the tile table's grids).
        timeout_s: bound of every in-kernel wait, seconds.
        tiles: the kernel tiles of the backend that has them (the triton backend's
            :class:`tritonep.backends.triton.tiles.KernelTiles`; None when no registered backend has tiles).
        sync_checks: host reads of eager calls, ``tritonep.envs.SYNC_NONE`` / ``SYNC_DEFERRED`` / ``SYNC_STRICT``
            (:func:`tritonep.envs.sync_checks`).
        max_programs: the cap on the programs of every kernel that waits on a peer (0: none; ranks that share a
            GPU under MPS).
        launch: how bound launches reach the GPU (:data:`tritonep.envs.LAUNCH_MODES`: packed, direct, triton).
        output_pool: sets of per-call outputs a buffer reuses per stream (0: every call allocates).
        sync_free_mode: how a sync-free dispatch exchanges its counts on a backend with two ways (``"onehop"`` |
            ``"gather"`` | ``""``: the backend's rule, :func:`tritonep.backends.nccl.sync_free.sync_free_mode`): a
            field so that every rank agrees on it (ranks in different modes would run different collectives).
        count_columns: room for a second count matrix the triton backend's one-launch decode dispatch may exchange
            with its counts (``EPBuffer.dispatch(count_ids=...)``: a second routing whose routes per (destination,
            local expert) are exchanged and summed over the sources, at most ``count_columns`` local experts per
            rank); 0: none.
        count_topk: room for a count routing of the tokens themselves (``dispatch(count_ids=topk_idx,
            count_weights=...)``, at most this many ids a token) whose ids and weights travel with the rows: every
            received row gets its token's ids local to the receiver and weights (DeepEP's ``recv_topk_idx`` /
            ``recv_topk_weights``) in the triton backend's one-launch decode dispatch; 0: none.
    """

    world_size: int
    num_experts: int
    hidden: int
    max_tokens_per_rank: int
    topk: int
    dispatch_wire: str
    combine_wire: str
    expert_alignment: int
    max_recv_tokens: int
    backend: str
    dtype: torch.dtype
    device_type: str
    num_sms: int
    timeout_s: float
    tiles: object
    sync_checks: int
    max_programs: int
    launch: str
    output_pool: int
    sync_free_mode: str = ""
    count_columns: int = 0
    count_topk: int = 0

    FRONT = ("world_size", "num_experts", "num_local_experts", "hidden", "max_tokens_per_rank", "topk",
             "dispatch_wire", "combine_wire", "expert_alignment", "max_recv_tokens", "dtype", "timeout_s")
    """The fields an :class:`tritonep.EPBuffer` shows as its own read-only attributes (``buf.hidden``, ...)."""

    @property
    def num_local_experts(self) -> int:
        """L = E / W experts per rank."""
        return self.num_experts // self.world_size

    def compared(self) -> dict:
        """The fields every rank must agree on, as plain values (dtype and tiles as text)."""
        d = asdict(self)
        d["dtype"] = str(self.dtype)
        d["tiles"] = repr(self.tiles)
        return d


COMPARED_FIELDS = tuple(EPConfig.__dataclass_fields__)


def _positive_int(name, v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"{name} must be a positive int, got {v!r}")


def build_config(*, world_size: int, num_experts: int, hidden: int, max_tokens_per_rank: int, topk: int,
                 dispatch_wire: str = "bf16", combine_wire: str = "bf16", expert_alignment: int = 1,
                 max_recv_tokens: int | None = None, backend: str = "auto", dtype: torch.dtype = torch.bfloat16,
                 device_type: str = "cuda", num_sms: int | None = None, timeout_s: float | None = None,
                 tiles=None, sync_checks=None, max_programs: int | None = None, launch: str | None = None,
                 output_pool: int | None = None, sync_free_mode: str | None = None, count_columns: int = 0,
                 count_topk: int = 0, check_kernels: bool = True) -> EPConfig:
    """Validate an EPBuffer's arguments, read what they leave to the environment and derive the rest; no collective,
    no allocation.

    Args: as :class:`tritonep.EPBuffer` (``device_type`` instead of a device). An option left None takes its
    ``TRITONEP_*`` variable (:mod:`tritonep.envs`): ``num_sms`` (TRITONEP_NUM_SMS), ``timeout_s``
    (TRITONEP_TIMEOUT_S), ``tiles`` (TRITONEP_GEOMETRY; with TRITONEP_COMBINE), ``sync_checks``
    (TRITONEP_SYNC_CHECKS), ``max_programs`` (TRITONEP_MAX_PROGRAMS), ``launch`` (TRITONEP_FAST_LAUNCH /
    TRITONEP_PACKED_LAUNCH), ``output_pool`` (TRITONEP_OUTPUT_POOL), ``sync_free_mode`` (TRITONEP_NCCL_SYNC_FREE).
    ``check_kernels``: also check that tritonep's kernels were imported for this device type (interpreter on CPU,
    compiled on CUDA).

    Raises:
        ConfigError: a size that is not a positive int, ``num_experts`` not divisible by ``world_size``, a bad
            ``max_recv_tokens`` / ``num_sms`` / ``timeout_s`` / dtype / backend name / option / environment value,
            kernels built for another device (each message names the value), tiles (``bh``) narrower than a
            quantized wire's scale block.
        WireError: an unknown wire or a ``hidden`` the wire's block does not divide.
    """
    from ..backends import check_backend_name, kernel_tiles
    from ..runtime.status import resolve_timeout
    from ..wire.formats import check_wire, get_wire

    for name, v in (("world_size", world_size), ("num_experts", num_experts), ("hidden", hidden),
                    ("max_tokens_per_rank", max_tokens_per_rank), ("topk", topk),
                    ("expert_alignment", expert_alignment)):
        _positive_int(name, v)
    if num_experts % world_size:
        raise ConfigError(f"num_experts={num_experts} is not divisible by world_size={world_size}")
    if not isinstance(count_columns, int) or isinstance(count_columns, bool) or count_columns < 0:
        raise ConfigError(f"count_columns must be an int >= 0, got {count_columns!r}")
    if not isinstance(count_topk, int) or isinstance(count_topk, bool) or count_topk < 0:
        raise ConfigError(f"count_topk must be an int >= 0, got {count_topk!r}")
    if count_topk >= 1024:
        raise ConfigError(f"count_topk={count_topk} must be below 1024 (a carried routing's width rides in its count "
                          f"stamp)")
    if count_topk and not count_columns:
        raise ConfigError(f"count_topk={count_topk} needs count_columns > 0 (the carried ids are a count routing)")
    if count_topk and expert_alignment != 1:
        raise ConfigError(f"count_topk={count_topk} needs expert_alignment=1, got {expert_alignment} (a padding row "
                          f"carries no token's ids)")
    if max_recv_tokens is not None and (not isinstance(max_recv_tokens, int) or isinstance(max_recv_tokens, bool)
                                        or max_recv_tokens < 1):
        raise ConfigError(f"max_recv_tokens must be a positive int or None, got {max_recv_tokens!r}")
    check_backend_name(backend)
    check_wire(dispatch_wire, hidden, "dispatch_wire")
    check_wire(combine_wire, hidden, "combine_wire")
    if dtype != torch.bfloat16:
        raise ConfigError(f"dtype={dtype} is not supported: x and expert outputs travel as torch.bfloat16 "
                          f"(quantized wires: dispatch_wire / combine_wire)")
    if device_type not in ("cuda", "cpu"):
        raise ConfigError(f"device type {device_type!r} is not 'cuda' or 'cpu'")
    if check_kernels:
        from ..device.common import check_kernel_mode

        check_kernel_mode(device_type)
    if max_recv_tokens is None:
        L = num_experts // world_size
        max_recv_tokens = world_size * max_tokens_per_rank * topk + L * (expert_alignment - 1)
    num_sms = envs.num_sms(num_sms)
    max_programs = envs.max_programs(max_programs)
    if tiles is None:
        override, source = envs.geometry_override(), "TRITONEP_GEOMETRY"
    elif isinstance(tiles, str):
        override, source = tiles, "tiles"
    else:
        override, source = tiles, "tiles"  # kernel tiles given whole: taken as they are
    tiles = kernel_tiles(device_type, world_size, hidden, max_tokens_per_rank, topk, dispatch_wire, num_sms=num_sms,
                         override=override, combine=envs.combine_kind(), max_programs=max_programs, source=source)
    bh = getattr(tiles, "bh", None)  # the triton tiles' hidden columns per tile (the nccl backend has none)
    for field, wire in (("dispatch_wire", dispatch_wire), ("combine_wire", combine_wire)):
        block = get_wire(wire).block
        if bh is not None and get_wire(wire).quantized and bh < block:  # a codec encodes whole blocks of a tile
            raise ConfigError(f"{source} gives bh={bh}, but {field}={wire!r} encodes blocks of {block} columns: "
                              f"a tile needs bh >= {block}")
    return EPConfig(world_size=world_size, num_experts=num_experts, hidden=hidden,
                    max_tokens_per_rank=max_tokens_per_rank, topk=topk, dispatch_wire=dispatch_wire,
                    combine_wire=combine_wire, expert_alignment=expert_alignment, max_recv_tokens=max_recv_tokens,
                    backend=backend, dtype=dtype, device_type=device_type, num_sms=num_sms,
                    timeout_s=resolve_timeout(timeout_s), tiles=tiles, sync_checks=envs.sync_checks(sync_checks),
                    max_programs=max_programs, launch=envs.launch(launch), output_pool=envs.output_pool(output_pool),
                    sync_free_mode=envs.nccl_sync_free(sync_free_mode), count_columns=count_columns,
                    count_topk=count_topk)


def agree(group, cfg: EPConfig | None, error: BaseException | None, extra: dict | None = None,
          what: str = "EPBuffer") -> list:
    """The constructor's one collective: exchange every rank's config (or error) and ``extra``; raise on every rank.

    Args:
        group: the EP group (every rank calls this, in the same order).
        cfg: this rank's config (an :class:`EPConfig`, or a dict of plain values for other collective objects such
            as the MoE layer), or None when its arguments were refused.
        error: the error this rank's arguments raised (re-raised here on this rank), or None.
        extra: small picklable per-rank facts to gather in the same collective (e.g. the peer-access report).
        what: the object named in messages.

    Returns:
        every rank's ``extra`` (list by rank) when every rank's config is valid and equal.

    Raises:
        the rank's own ``error``; :class:`PeerConfigError` on the other ranks when any rank's arguments were refused
        (naming each bad rank and its message); :class:`ConfigError` when the configs differ (naming the field and
        each rank's value).
    """
    import torch.distributed as dist

    compared = cfg if (cfg is None or isinstance(cfg, dict)) else cfg.compared()
    mine = dict(cfg=compared, extra=extra,
                error=None if error is None else f"{type(error).__name__}: {error}")
    ws = dist.get_world_size(group)
    gathered = [None] * ws
    dist.all_gather_object(gathered, mine, group=group)
    bad = {r: g["error"] for r, g in enumerate(gathered) if g["error"] is not None}
    if bad:
        if error is not None:
            raise error
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(bad.items()))
        raise PeerConfigError(f"{what}: the configuration of rank(s) {sorted(bad)} was refused ({lines}); every "
                              f"rank raises, nothing was allocated", bad_ranks=sorted(bad))
    for f in mine["cfg"]:
        vals = [g["cfg"].get(f) for g in gathered]
        if any(v != vals[0] for v in vals):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(vals))
            raise ConfigError(f"{what} field {f!r} differs across ranks ({per_rank})")
    return [g["extra"] for g in gathered]


def config_error(exc: BaseException) -> bool:
    """True for the errors a rank's own arguments can raise before the first collective (exchanged, not fatal
    alone)."""
    return isinstance(exc, TritonEPError)
