"""GPU rank functions for the one-launch decode paths (geometry ``dec=G``). Module-level so spawned ranks can import
them; the tests are ``tests/backends/triton/test_decode_gpu.py``."""

from __future__ import annotations

import os

__all__ = ["decode_soak_world"]


def decode_soak_world(group, geometry: str, E: int, H: int, Tmax: int, K: int, replays: int, graph: bool = True):
    """:func:`tests.support.gpu_checks.graph_soak_world` with ``TRITONEP_GEOMETRY=geometry`` for both of its
    buffers: every CUDA-graph replay of the one-launch dispatch + combine (whose call counters advance inside the
    kernels) is checked bit for bit against an eager call and, periodically, the host oracles. Returns what
    ``graph_soak_world`` returns: ``(replays done, [(replay, what differed), ...])``. ``graph=False``: eager calls
    instead of replays (runs in a CPU world)."""
    from .gpu_checks import graph_soak_world

    os.environ["TRITONEP_GEOMETRY"] = geometry
    return graph_soak_world(group, E, H, Tmax, K, replays, oracle_every=1 if not graph else 100, graph=graph)
