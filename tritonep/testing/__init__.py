"""Test and CLI support: multi-rank CPU world (forked ranks + interpreter, launch-sequence recorder), GPU worlds of
any size on the GPUs present (ranks may share a GPU: time-sliced or under MPS), clean interrupts."""

from .gpu_world import GpuWorld, WorldResults, gpu_world_info, run_gpu_world
from .interrupts import WorldInterrupted
from .placement import GpuWorldInfo
from .protocol import ProtocolMismatch
from .world import WorldTimeout, run_cpu_world

__all__ = ["run_cpu_world", "run_gpu_world", "GpuWorld", "GpuWorldInfo", "WorldResults", "gpu_world_info",
           "WorldTimeout", "WorldInterrupted", "ProtocolMismatch"]
