"""Where the ranks of a GPU world run, and what each rank's process is told (pure logic, tested on a CPU).

Ranks are placed round-robin over the visible GPUs: rank ``r`` on device ``r % num_devices``. With one rank per GPU
the world keeps an NCCL group. When some GPU holds more than one rank (fewer GPUs than ranks) the ranks *share*:

* the group is gloo (NCCL refuses two ranks on one device);
* torch symmetric memory is told that ranks overlap on a device (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``,
  as the xformers tests do); the project's own heap needs nothing else;
* without MPS the ranks' CUDA contexts time-slice: correct, with every cross-rank wait costing a time slice
  (2.5 ms per flag round trip at 2 ranks, 4.5 ms at 4 on an H200, docs/platform.md);
* with MPS (``mps=True``, a private daemon per world) they run at once, so each rank gets an equal share of the
  SMs: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 // ranks_per_device`` (the shares sum to <= 100, NVSHMEM's rule)
  and ``TRITONEP_MAX_PROGRAMS`` = that share of the chip's SMs (rounded down to whole TPCs of 2 SMs), so every
  waiting kernel of every rank fits on the chip at once (the FlashInfer / TRT-LLM one-GPU tests cap SMs per rank
  the same way).

Timings of shared ranks measure nothing about NVLink: :meth:`GpuWorldInfo.timing_note` says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..errors import ConfigError

__all__ = ["GpuWorldInfo", "MAX_RANKS_PER_DEVICE", "place_ranks", "plan_world", "mps_thread_percentage",
           "programs_per_rank", "rank_environment", "without_mps", "MULTICAST_OFF"]

MAX_RANKS_PER_DEVICE = 8
"""Most ranks one device may hold (each rank is a CUDA context of ~0.5 GB; time-slicing 8 is already slow)."""

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Every rank runs with multicast off (docs/platform.md: multicast can take the host's GPUs out of service)."""

MODES = ("exclusive", "time-sliced", "mps")


@dataclass(frozen=True)
class GpuWorldInfo:
    """How a GPU world runs (what :func:`tritonep.testing.run_gpu_world` returns as ``.info`` and every rank reads
    with :func:`tritonep.testing.gpu_world_info`).

    Attributes:
        world_size: ranks.
        devices: the device of each rank (``"cuda:0"``, ...), indexed by rank.
        num_devices: distinct devices the ranks use.
        ranks_per_device: the most ranks any one device holds (1: one rank per GPU).
        mode: ``"exclusive"`` (one rank per GPU), ``"time-sliced"`` (shared, no MPS) or ``"mps"`` (shared, one MPS
            daemon for the world).
        backend: the process group's backend: ``"nccl"`` (exclusive CUDA) or ``"gloo"``.
        active_thread_percentage: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of every rank (0: not set).
        max_programs: ``TRITONEP_MAX_PROGRAMS`` of every rank (0: no cap); known once the ranks read their GPU.
        note: why MPS was not used when it was asked for (``mps="auto"``), else "".
    """

    world_size: int
    devices: tuple
    num_devices: int
    ranks_per_device: int
    mode: str
    backend: str
    active_thread_percentage: int = 0
    max_programs: int = 0
    note: str = ""

    @property
    def shared(self) -> bool:
        """True when some device holds more than one rank."""
        return self.ranks_per_device > 1

    def describe(self) -> str:
        """One line: ``4 ranks on 1 GPU (4 per GPU, time-sliced, gloo group)``."""
        kind = "GPU" if self.devices and str(self.devices[0]).startswith("cuda") else "device"
        per = f"{self.ranks_per_device} per {kind}" if self.shared else f"one per {kind}"
        how = {"exclusive": "", "time-sliced": ", time-sliced",
               "mps": f", MPS with {self.active_thread_percentage}% of the SMs per rank"
                      + (f", waiting kernels capped at {self.max_programs} programs" if self.max_programs else "")
               }[self.mode]
        s = "" if self.num_devices == 1 else "s"
        return (f"{self.world_size} rank{'s' if self.world_size != 1 else ''} on {self.num_devices} {kind}{s} "
                f"({per}{how}, {self.backend} group)")

    def timing_note(self) -> str:
        """"" for one rank per GPU; else one line saying that timings measure nothing about NVLink."""
        if not self.shared:
            return ""
        return (f"{self.describe()}: ranks share a GPU, so timings measure nothing about NVLink (time a world of "
                f"one rank per GPU for that)")

    def as_dict(self) -> dict:
        """JSON-serialisable fields plus ``shared`` and ``timing_note``."""
        d = asdict(self)
        d["devices"] = list(self.devices)
        d.update(shared=self.shared, timing_note=self.timing_note())
        return d


def place_ranks(world_size: int, num_devices: int) -> list:
    """Device index of every rank: round-robin, ``rank % num_devices`` (``[0, 1, 0]`` for 3 ranks on 2 GPUs).

    Raises:
        ConfigError: ``world_size < 1`` or ``num_devices < 1``.
    """
    if world_size < 1:
        raise ConfigError(f"world_size={world_size}: a world needs at least one rank")
    if num_devices < 1:
        raise ConfigError("no device to place ranks on: run_gpu_world needs a CUDA GPU (run_cpu_world runs ranks on "
                          "a CPU)")
    return [r % num_devices for r in range(world_size)]


def mps_thread_percentage(ranks_per_device: int) -> int:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of each of ``ranks_per_device`` ranks: ``100 // n`` (sum <= 100)."""
    return max(1, 100 // max(1, ranks_per_device))


def programs_per_rank(num_sms: int, ranks_per_device: int) -> int:
    """Programs one rank's waiting kernel may use when ``ranks_per_device`` ranks run at once on ``num_sms`` SMs:
    the rank's MPS share of the SMs rounded down to whole TPCs (2 SMs), at least 1. H200 (132 SMs): 66 / 42 / 32 /
    14 at 2 / 3 / 4 / 8 ranks. (If MPS already reports the share as the device's SM count, this is smaller than
    needed, never larger.)"""
    share = num_sms * mps_thread_percentage(ranks_per_device) // 100
    return max(1, share // 2 * 2)


def plan_world(world_size: int, devices: list, mps: bool) -> GpuWorldInfo:
    """The placement and mode of a world before it starts (``max_programs`` is filled in by the ranks).

    Args:
        world_size: ranks.
        devices: the visible devices, e.g. ``["cuda:0"]`` (``["cpu"]`` runs the world machinery alone: its tests).
        mps: run ranks that share a device under MPS (the caller starts the daemon).

    Raises:
        ConfigError: no device, ``world_size < 1``, or more than :data:`MAX_RANKS_PER_DEVICE` ranks on a device.
    """
    where = place_ranks(world_size, len(devices))
    per = max(where.count(d) for d in set(where))
    if per > MAX_RANKS_PER_DEVICE:
        raise ConfigError(f"world_size={world_size} on {len(devices)} device(s) puts {per} ranks on one device; at "
                          f"most {MAX_RANKS_PER_DEVICE} may share one")
    devs = tuple(str(devices[d]) for d in where)
    cuda = devs[0].startswith("cuda")
    shared = per > 1
    mode = "exclusive" if not shared else ("mps" if mps else "time-sliced")
    return GpuWorldInfo(world_size=world_size, devices=devs, num_devices=len(set(where)), ranks_per_device=per,
                        mode=mode, backend="nccl" if cuda and not shared else "gloo",
                        active_thread_percentage=mps_thread_percentage(per) if mode == "mps" else 0)


def without_mps(info: GpuWorldInfo, why: str) -> GpuWorldInfo:
    """``info`` fallen back from MPS to time-slicing (``mps="auto"`` and the daemon did not start), ``why`` kept."""
    return replace(info, mode="time-sliced" if info.shared else info.mode, active_thread_percentage=0, note=why)


def rank_environment(info: GpuWorldInfo, mps_env: dict | None = None) -> dict:
    """Environment variables every rank sets before it touches CUDA (the same for every rank of the world).

    Multicast off always; ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` when ranks share a device; under MPS the
    daemon's ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` (``mps_env``) and
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``. ``TRITONEP_MAX_PROGRAMS`` is set by each rank once it knows its GPU's SM
    count (:func:`programs_per_rank`).
    """
    env = dict(MULTICAST_OFF)
    if info.shared:
        env["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    if info.mode == "mps":
        env.update(mps_env or {})
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(info.active_thread_percentage)
    return env
