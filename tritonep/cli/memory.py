"""Memory a ``tritonep run`` needs, checked before anything is allocated.

A run whose sizes cannot fit (``--hidden 100000000``, a routing file whose largest expert id makes ``E`` huge) is
refused with one line naming the sizes, what they need and what the machine has, instead of an allocator traceback
from a rank. The figures are lower bounds (the tensors the run certainly holds at once), so a refusal is never
wrong; a run that passes may still need more (allocator slack, Triton's scratch), which the ranks then report.

Per rank: the router weight (fp32, ``E x H``), the local experts' weights and gradients (bf16, ``L x 3 H I`` each)
and the fp32 gradient copies sent back for the check, the activations (a few ``T x H`` tensors) and the layer's
symmetric memory (:meth:`tritonep.MoELayer.required_bytes`). The dense reference check (one process, after the
ranks) holds every expert's weights and gradients in fp32 (``E x 3 H I`` each) plus the ranks' gradient copies, and
``T x K x H`` fp32 expert outputs.
"""

from __future__ import annotations

import os

__all__ = ["RunMemory", "run_memory", "available_host_bytes", "check_host_memory", "check_device_memory", "gib"]


def gib(n: float) -> str:
    """``n`` bytes as a short human figure (``"25.6 GB"``, decimal units)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


class RunMemory:
    """Lower bounds, in bytes, of what one ``tritonep run`` holds (see the module docstring).

    Attributes:
        router, experts, activations, symmetric: one rank's parts. rank: their sum.
        reference: the dense reference check's process (after the ranks; the parent on a CPU, ``cuda:0`` on a GPU).
        results: the ranks' results the parent holds (host memory) while it checks.
        what: the sizes, as a phrase naming the flags (``"--hidden 100000000, --intermediate 32, ..."``).
    """

    def __init__(self, s: dict, world_size: int, device_type: str):
        H, I, E, K = s["hidden"], s["intermediate"], s["num_experts"], s["topk"]
        T, N, W = s["tokens"], s["total_tokens"], world_size
        L = E // W if E >= W else 1
        check = s.get("check", True)  # --no-check: no gradient copies sent back, no reference
        self.router = 4 * E * H
        self.experts = 12 * L * H * I + (12 * L * H * I if check else 0)  # bf16 weights + grads, fp32 grad copies
        self.activations = 16 * T * H
        self.symmetric = _symmetric_bytes(s, W, device_type)
        self.rank = self.router + self.experts + self.activations + self.symmetric
        # fp32 weights + gradients, the expert outputs, x / y; every rank's fp32 expert gradients, outputs and inputs
        self.reference = 24 * E * H * I + 4 * N * K * H + 8 * N * H if check else 0
        self.results = 12 * L * H * I * W + 8 * N * H if check else 0
        self.what = (f"--hidden {H}, --intermediate {I}, {E} experts (--num-experts), top-{K}, {T} tokens per rank, "
                     f"{W} ranks")

    def parts(self) -> str:
        """The per-rank parts as a phrase."""
        return (f"router {gib(self.router)}, expert weights and gradients {gib(self.experts)}, activations "
                f"{gib(self.activations)}, symmetric buffers {gib(self.symmetric)}")


def _symmetric_bytes(s: dict, world_size: int, device_type: str) -> int:
    """The layer's symmetric bytes per rank, 0 when the sizes are too large for even the formula's integers to
    matter (the other parts then refuse the run)."""
    from ..moe import MoEGeometry, MoELayer, MoERecipe

    recipe = MoERecipe(dispatch_wire=s["dispatch_wire"], combine_wire=s["combine_wire"], combine=s["combine"],
                       balance=s["balance"], expert_alignment=s["expert_alignment"])
    geo = MoEGeometry(hidden=s["hidden"], intermediate=s["intermediate"], num_experts=s["num_experts"],
                      topk=s["topk"], max_tokens_per_rank=max(1, s["tokens"]))
    return int(MoELayer.required_bytes(recipe, geo, world_size, device_type))


def run_memory(s: dict, world_size: int, device_type: str) -> RunMemory:
    """:class:`RunMemory` of a run's settings ``s`` (the dict :func:`tritonep.cli.run` builds) at ``world_size``."""
    return RunMemory(s, world_size, device_type)


def available_host_bytes() -> int | None:
    """Bytes of host memory available to new allocations (Linux ``MemAvailable``; else free physical pages); None
    when the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(m: RunMemory, world_size: int, cpu_world: bool, available: int | None = None) -> None:
    """Refuse a run whose host memory cannot fit: in a CPU world every rank and then the reference check; on GPUs
    the ranks' results the parent holds.

    Raises:
        ConfigError: one line naming the sizes, the need and what is available.
    """
    from ..errors import ConfigError

    have = available_host_bytes() if available is None else available
    if have is None:
        return
    if cpu_world:
        ranks = world_size * m.rank
        if ranks > have:
            raise ConfigError(f"{m.what}: the ranks need at least {gib(m.rank)} each ({m.parts()}), "
                              f"{gib(ranks)} in all, and this machine has {gib(have)} of memory available: use "
                              f"smaller sizes (--hidden, --intermediate, --num-experts, --tokens) or fewer ranks")
        ref = m.reference + m.results
    else:
        ref = m.results
    if ref > have:
        raise ConfigError(f"{m.what}: the dense reference check needs at least {gib(ref)} of host memory (every "
                          f"expert's weights and gradients in fp32), and this machine has {gib(have)} available: use "
                          f"smaller sizes (--hidden, --intermediate, --num-experts, --tokens) or --no-check")


def check_device_memory(m: RunMemory, free: int, sharing: int, total: int | None = None) -> None:
    """Refuse, inside a GPU rank before it allocates, sizes its device cannot hold: the rank's bytes against the free
    memory divided among the ``sharing`` ranks placed on the device, and (``total`` given: rank 0, whose device
    runs the reference check after the ranks) the reference check against the device's total memory.

    Raises:
        ConfigError: one line naming the sizes, the need and what the device has.
    """
    from ..errors import ConfigError

    share = free // max(1, sharing)
    if m.rank > share:
        ranks = f" shared by {sharing} ranks" if sharing > 1 else ""
        raise ConfigError(f"{m.what}: each rank needs at least {gib(m.rank)} of GPU memory ({m.parts()}), and its GPU "
                          f"has {gib(free)} free{ranks}: use smaller sizes (--hidden, --intermediate, --num-experts, "
                          f"--tokens) or more GPUs")
    if total is not None and m.reference > total:
        raise ConfigError(f"{m.what}: the dense reference check needs at least {gib(m.reference)} of GPU memory "
                          f"(every expert's weights and gradients in fp32, on cuda:0), and the GPU has {gib(total)}: "
                          f"use smaller sizes or --no-check")
