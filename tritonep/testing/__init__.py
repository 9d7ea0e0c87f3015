"""Test and CLI support: multi-rank CPU world (forked ranks + interpreter), GPU world (one process per GPU)."""

from .world import WorldTimeout, run_cpu_world, run_gpu_world

__all__ = ["run_cpu_world", "run_gpu_world", "WorldTimeout"]
