"""Test and CLI support: multi-rank CPU world (forked ranks + interpreter, launch-sequence recorder), GPU world."""

from .protocol import ProtocolMismatch
from .world import WorldTimeout, run_cpu_world, run_gpu_world

__all__ = ["run_cpu_world", "run_gpu_world", "WorldTimeout", "ProtocolMismatch"]
