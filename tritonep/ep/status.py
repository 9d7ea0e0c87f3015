"""Device status word -> typed host errors, and wait bounds for GPU (ns) and interpreter (polls).

Every EPBuffer owns ``status`` int64 ``[8]``: ``[code, wait_id, peer, errors_seen, needed_rows, skip_call,
bad_rank_mask, waited]`` (indices ``ST_*`` of :mod:`tritonep.kernels.protocol`) written by the kernels (:mod:`tritonep.kernels.signal`, :mod:`tritonep.kernels.layout`):
``skip_call`` is the dispatch number whose data kernels skip their rows (capacity or input error),
``bad_rank_mask`` has bit r set when rank r's input was refused, ``waited`` is the measured length of the wait
that gave up (nanoseconds on GPU, polls in the interpreter).
"""

from __future__ import annotations

import time

import torch

from .. import envs
from ..errors import CapacityError, PeerInputError, PeerTimeoutError
from ..kernels import protocol as P

STATUS_OK, STATUS_TIMEOUT, STATUS_CAPACITY, STATUS_BAD_INPUT = (
    P.v(P.STATUS_OK), P.v(P.STATUS_TIMEOUT), P.v(P.STATUS_CAPACITY), P.v(P.STATUS_BAD_INPUT))
_CODE, _WAIT_ID, _PEER, _NEEDED, _BAD_MASK, _WAITED = (P.v(n) for n in (
    P.ST_CODE, P.ST_WAIT_ID, P.ST_PEER, P.ST_NEEDED_ROWS, P.ST_BAD_RANK_MASK, P.ST_WAITED))

__all__ = ["WAIT_NAMES", "raise_for_status", "wait_bound", "bad_ranks", "resolve_timeout"]

WAIT_NAMES = P.wait_names()  # wait id -> name (kernels/protocol.py WAIT_*)

_POLLS_PER_S: float | None = None


def _interp_polls_per_s() -> float:
    """Polls per second of the interpreter's wait loop, measured once (so the CPU bound is in seconds too)."""
    global _POLLS_PER_S
    if _POLLS_PER_S is None:
        from ..kernels.signal import poll_bench_kernel

        buf = torch.zeros(16, dtype=torch.int64)
        n = 200
        t0 = time.perf_counter()
        poll_bench_kernel[(1,)](buf, n)
        dt = max(time.perf_counter() - t0, 1e-6)
        _POLLS_PER_S = n / dt
    return _POLLS_PER_S


def resolve_timeout(timeout_s: float | None) -> float:
    """The wait bound in seconds: ``timeout_s`` if given, else TRITONEP_TIMEOUT_S (default 300 s).

    Raises:
        ConfigError: a bound that is not a positive number.
    """
    from ..errors import ConfigError

    s = envs.timeout_s() if timeout_s is None else timeout_s
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
        raise ConfigError(f"timeout_s must be a positive number of seconds, got {s!r}")
    return float(s)


def wait_bound(device: torch.device, timeout_s: float | None = None) -> int:
    """The ``timeout`` argument of the kernels for a bound of ``timeout_s`` seconds (default: TRITONEP_TIMEOUT_S):
    nanoseconds on GPU, a poll count in the interpreter (calibrated once to the interpreter's polls per second)."""
    s = resolve_timeout(timeout_s)
    if device.type == "cuda":
        return int(s * 1e9)
    return max(1, int(s * _interp_polls_per_s()))


def bad_ranks(status_host: torch.Tensor) -> list:
    """Ranks whose input the last counts exchange refused (bits of ``status[ST_BAD_RANK_MASK]``)."""
    mask = int(status_host[_BAD_MASK])
    return [r for r in range(64) if (mask >> r) & 1]


def _waited(status_host, device_type: str | None) -> str:
    v = int(status_host[_WAITED])
    if device_type == "cuda":
        return f"after waiting {v / 1e9:.1f} s"
    if device_type == "cpu":
        return (f"after {v} polls (~{v / _interp_polls_per_s():.1f} s: the interpreter bounds waits in poll "
                f"counts calibrated to seconds)")
    return "after its bound"


def raise_for_status(status_host: torch.Tensor, rank: int, max_recv: int, what: str,
                     timeout_s: float | None = None, device_type: str | None = None):
    """Raise the typed error a status word holds (``status_host``: int64 ``[8]`` on the host), else return.

    Raises:
        PeerTimeoutError: a wait gave up (message: the wait, the peer, the measured wait and the bound).
        CapacityError: a rank would receive more rows than ``max_recv``.
        PeerInputError: some rank's input was refused (``bad_ranks`` from the status bitmask).
    """
    code = int(status_host[_CODE])
    if code == STATUS_OK:
        return
    if code == STATUS_TIMEOUT:
        wait = WAIT_NAMES.get(int(status_host[_WAIT_ID]), f"wait#{int(status_host[_WAIT_ID])}")
        peer = int(status_host[_PEER])
        bound = resolve_timeout(timeout_s)
        raise PeerTimeoutError(
            f"{what}: rank {rank} timed out in wait {wait!r} for peer {peer} {_waited(status_host, device_type)} "
            f"(bound {bound:g} s: timeout_s / TRITONEP_TIMEOUT_S); the buffer is now unusable",
            wait=wait, peer=peer, rank=rank)
    if code == STATUS_BAD_INPUT:
        bad = bad_ranks(status_host)
        raise PeerInputError(
            f"{what}: the input of rank(s) {bad} was refused, so this call failed on every rank (rank {rank} "
            f"raises this; the bad rank raises the error naming its value); nothing was sent", bad_ranks=bad,
            rank=rank)
    if code == STATUS_CAPACITY:
        needed = int(status_host[_NEEDED])
        raise CapacityError(
            f"{what}: rank {int(status_host[_PEER])} would receive {needed} rows but max_recv_tokens={max_recv}; "
            f"nothing was sent", needed=needed, available=max_recv)
    raise PeerTimeoutError(f"{what}: unknown device status code {code}", rank=rank)
