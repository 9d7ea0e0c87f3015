"""Device status word -> typed host errors, and wait bounds for GPU (ns) and interpreter (polls).

Every EPBuffer owns ``status`` int64 ``[8]``: ``[code, wait_id, peer, errors_seen, needed_rows, 0, 0, 0]``
written by the kernels (:mod:`tritonep.kernels.signal`).
"""

from __future__ import annotations

import time

import torch

from .. import envs
from ..errors import CapacityError, PeerTimeoutError
from ..kernels import signal as _sig

STATUS_OK, STATUS_TIMEOUT, STATUS_CAPACITY = (int(_sig.STATUS_OK.value), int(_sig.STATUS_TIMEOUT.value),
                                            int(_sig.STATUS_CAPACITY.value))

__all__ = ["WAIT_NAMES", "raise_for_status", "wait_bound"]

WAIT_NAMES = {0: "dispatch.counts", 1: "dispatch.data", 2: "dispatch.ack", 3: "combine.data", 4: "combine.ack"}

_POLLS_PER_S: float | None = None


def _interp_polls_per_s() -> float:
    """Polls per second of the interpreter's wait loop, measured once (so the CPU bound is in seconds too)."""
    global _POLLS_PER_S
    if _POLLS_PER_S is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _poll_bench(p, n):
            offs = tl.arange(0, 8)
            acc = tl.zeros((), dtype=tl.int64)
            for _ in range(n):
                v = tl.atomic_add(p + offs, 0, sem="acquire", scope="sys")
                acc += tl.sum(v, 0)
            tl.store(p + 8, acc)

        buf = torch.zeros(16, dtype=torch.int64)
        n = 200
        t0 = time.perf_counter()
        _poll_bench[(1,)](buf, n)
        dt = max(time.perf_counter() - t0, 1e-6)
        _POLLS_PER_S = n / dt
    return _POLLS_PER_S


def wait_bound(device: torch.device) -> int:
    """The ``timeout`` argument of the kernels: nanoseconds on GPU, a poll count in the interpreter."""
    s = envs.timeout_s()
    if device.type == "cuda":
        return int(s * 1e9)
    return max(1, int(s * _interp_polls_per_s()))


def raise_for_status(status_host: torch.Tensor, rank: int, max_recv: int, what: str):
    """Raise the typed error a status word holds (``status_host``: int64 ``[8]`` on the host), else return."""
    code = int(status_host[0])
    if code == STATUS_OK:
        return
    if code == STATUS_TIMEOUT:
        wait = WAIT_NAMES.get(int(status_host[1]), f"wait#{int(status_host[1])}")
        peer = int(status_host[2])
        raise PeerTimeoutError(
            f"{what}: rank {rank} timed out after {envs.timeout_s():.0f} s in wait {wait!r} for peer {peer} "
            f"(TRITONEP_TIMEOUT_S); the buffer is now unusable", wait=wait, peer=peer, rank=rank)
    if code == STATUS_CAPACITY:
        needed = int(status_host[4])
        raise CapacityError(
            f"{what}: rank {int(status_host[2])} would receive {needed} rows but max_recv_tokens={max_recv}; "
            f"nothing was sent", needed=needed, available=max_recv)
    raise PeerTimeoutError(f"{what}: unknown device status code {code}", rank=rank)
