"""Device status word -> typed host errors, and wait bounds (wall-clock nanoseconds on GPU and in the interpreter).

Every EPBuffer owns ``status`` int64 ``[8]``: ``[code, wait_id, peer, errors_seen, needed_rows, skip_call,
bad_rank_mask, waited]`` (indices ``ST_*`` of :mod:`tritonep.device.protocol`) written by the kernels (:mod:`tritonep.device.signal`, :mod:`tritonep.backends.triton.kernels.layout`):
``skip_call`` is the dispatch number whose data kernels skip their rows (capacity or input error; a dispatch's own
read compares it with its number, ``status[ST_THIS_CALL]`` after the 8 words, to say whose refusal it raises),
``bad_rank_mask`` has bit r set when rank r's input was refused, ``waited`` is the measured length of the wait
that gave up in nanoseconds (``%globaltimer`` on GPU, the host's monotonic clock in the interpreter). Refusals
nobody read yet (sync-free calls, sync checks off, graph replays) pile up until the next read, which clears the
word: code, peer and rows needed are the first one's, ``errors_seen`` counts them, ``skip_call`` is the latest
refused call's and ``bad_rank_mask`` gathers every one's bad ranks.
"""

from __future__ import annotations

import torch

from .. import envs
from ..errors import CapacityError, CountRoutingError, PeerInputError, PeerTimeoutError
from ..device import protocol as P

STATUS_OK, STATUS_TIMEOUT, STATUS_CAPACITY, STATUS_BAD_INPUT, STATUS_COMBINE_REFUSED, STATUS_COUNT_MISMATCH = (
    P.v(P.STATUS_OK), P.v(P.STATUS_TIMEOUT), P.v(P.STATUS_CAPACITY), P.v(P.STATUS_BAD_INPUT),
    P.v(P.STATUS_COMBINE_REFUSED), P.v(P.STATUS_COUNT_MISMATCH))
# the codes of a refused call (reported once by the next read, which clears the word; the buffer stays usable)
REFUSAL_CODES = (STATUS_CAPACITY, STATUS_BAD_INPUT, STATUS_COMBINE_REFUSED, STATUS_COUNT_MISMATCH)
_CODE, _WAIT_ID, _PEER, _SEEN, _NEEDED, _SKIP_CALL, _BAD_MASK, _WAITED = (P.v(n) for n in (
    P.ST_CODE, P.ST_WAIT_ID, P.ST_PEER, P.ST_ERRORS_SEEN, P.ST_NEEDED_ROWS, P.ST_SKIP_CALL, P.ST_BAD_RANK_MASK,
    P.ST_WAITED))
_STAMP_CARRIED = P.v(P.STAMP_CARRIED)  # a count stamp's carried mark (count_weights)
_STAMP_TOPK = P.v(P.STAMP_TOPK)  # ... above which a carried stamp holds its routing's width
_GAVE_UP = P.v(P.WAIT_PEER_GAVE_UP)  # recorded by a rank whose peer's wait gave up (device/signal.py peers_alive)

__all__ = ["WAIT_NAMES", "REFUSAL_CODES", "raise_for_status", "wait_bound", "bad_ranks", "resolve_timeout",
           "count_mismatch_error"]

WAIT_NAMES = P.wait_names()  # wait id -> name (device/protocol.py WAIT_*)


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
    nanoseconds of wall time on every device (:func:`tritonep.device.signal.now_ns`). ``device`` is kept so every
    caller states where the kernels run; the unit no longer depends on it."""
    return int(resolve_timeout(timeout_s) * 1e9)


def bad_ranks(status_host: torch.Tensor) -> list:
    """Ranks whose input a refused call since the last read held (bits of ``status[ST_BAD_RANK_MASK]``)."""
    mask = int(status_host[_BAD_MASK])
    return [r for r in range(64) if (mask >> r) & 1]


def _waited(status_host, device_type: str | None = None) -> str:
    """The measured wait of a timeout (``status[ST_WAITED]``, ns on every device) in seconds."""
    return f"after waiting {int(status_host[_WAITED]) / 1e9:.2f} s"


def _refused_call(status_host, this_call: int | None) -> str:
    """Which call a refusal skipped, for the message: this call's own (nothing was sent), or an earlier dispatch's
    that nobody read (sync-free, sync checks off, a graph replay), raised by the first read after it although this
    call's rows moved. ``this_call``: the number of the dispatch whose read found the refusal (``status[ST_THIS_CALL]``
    as its verdict launch published it), None for a read outside a dispatch (:meth:`EPBuffer.check`, the MoE
    layer's counts exchange). Numbers count the buffer's dispatches and combine backwards (``calls[CALL_DISPATCH]``)."""
    skip = int(status_host[_SKIP_CALL])
    if this_call is None or skip <= 0:
        return "the refused call moved no rows on any rank"
    seen = int(status_host[_SEEN])
    if seen > 1:  # refusals nobody read piled up: the code is the first one's, ST_SKIP_CALL the latest one's
        this = (f"this call (call {int(this_call)}) was refused too: nothing was sent" if skip == int(this_call) else
                f"the latest was call {skip}; this call's rows were sent, but it raises the refusal as the first "
                f"read after them, so its outputs are not returned")
        return (f"{seen} refusals were recorded since the last read and this one is the first, an earlier "
                f"dispatch's that nobody read (sync_free=True, TRITONEP_SYNC_CHECKS=0 or a graph replay), and moved "
                f"no rows; {this}")
    if skip == int(this_call):
        return "nothing was sent"
    return (f"the refusal is an earlier dispatch's that nobody read (sync_free=True, TRITONEP_SYNC_CHECKS=0 or a "
            f"graph replay; call {skip} of this buffer, this is call {int(this_call)}, counting dispatches and "
            f"combine backwards): that call moved no rows; this call's rows were sent, but it raises the refusal as "
            f"the first read after it, so its outputs are not returned")


def _count_routing(stamp: int) -> str:
    """A count stamp in words (``count_experts``, plus ``STAMP_CARRIED`` and the width ``CK * STAMP_TOPK`` for a
    routing carried with the rows; 0: no count routing)."""
    if not stamp:
        return "no count_ids"
    if stamp < _STAMP_CARRIED:
        return f"count_ids with count_experts={stamp}"
    ck = (stamp - _STAMP_CARRIED) // _STAMP_TOPK
    return (f"count_ids with count_experts={_stamp_experts(stamp)} carried (count_weights, {ck} "
            f"id{'' if ck == 1 else 's'} a token)")


def _stamp_experts(stamp: int) -> int:
    """The ``count_experts`` of a count stamp (:func:`_count_routing`)."""
    return stamp % _STAMP_TOPK if stamp >= _STAMP_CARRIED else stamp


def count_mismatch_error(what: str, rank: int, stamps: dict, counting: list, tail: str) -> CountRoutingError:
    """The :class:`CountRoutingError` of a dispatch whose ranks passed different count routings. ``stamps``: ``{rank:
    count_experts}`` (0: no ``count_ids``) of the ranks to name, rank 0 first; ``counting``: the ranks that passed
    ``count_ids``; ``tail``: what moved (the refusal's call)."""
    first = min(stamps)
    odd = [r for r in sorted(stamps) if stamps[r] != stamps[first]]
    names = "; ".join(f"rank {r}: {_count_routing(s)}" for r, s in sorted(stamps.items()))
    return CountRoutingError(
        f"{what}: the ranks passed different count routings to one dispatch ({names}; ranks passing count_ids: "
        f"{counting}); count_ids / count_experts is a per-call argument every rank passes alike, so the call was "
        f"refused on every rank (rank {rank} raises this) and no count sums were published; {tail}",
        bad_ranks=odd, rank=rank, counting=counting,
        count_experts={r: _stamp_experts(s) for r, s in stamps.items()})


def raise_for_status(status_host: torch.Tensor, rank: int, max_recv: int, what: str,
                     timeout_s: float | None = None, device_type: str | None = None, this_call: int | None = None):
    """Raise the typed error a status word holds (``status_host``: int64 ``[8]`` on the host), else return.

    ``this_call``: a dispatch's own read passes its number (``status[ST_THIS_CALL]``), so a refusal's message says
    whether that call's rows were sent (an earlier call's refusal nobody read) or not (its own); None elsewhere.

    Raises:
        PeerTimeoutError: a wait gave up (message: the wait, the peer, the measured wait and the bound), or a peer's
            did and this rank learned it from the peer's mark (``wait`` ``"peer.gave_up"``, ``peer`` that rank).
        CapacityError: a rank would receive more rows than ``max_recv``.
        PeerInputError: some rank's input was refused (``bad_ranks`` from the status bitmask), or some rank took
            part in a combine or a backward pass as refused (STATUS_COMBINE_REFUSED).
        CountRoutingError: the ranks passed different count routings to a dispatch (STATUS_COUNT_MISMATCH: rank 0's
            and the lowest differing rank's ``count_experts`` from ``needed_rows``, the ranks passing ``count_ids``
            from ``waited``).
    """
    code = int(status_host[_CODE])
    if code == STATUS_OK:
        return
    if code == STATUS_TIMEOUT:
        wait = WAIT_NAMES.get(int(status_host[_WAIT_ID]), f"wait#{int(status_host[_WAIT_ID])}")
        peer = int(status_host[_PEER])
        bound = resolve_timeout(timeout_s)
        if int(status_host[_WAIT_ID]) == _GAVE_UP:
            raise PeerTimeoutError(
                f"{what}: peer {peer} gave up waiting for rank {rank} (its wait timed out: this rank reached a call "
                f"more than the bound {bound:g} s after it, or a rank that did made it give up), so the data it "
                f"skipped was not taken here: the outputs of this rank's calls since then are NaN (combine) or "
                f"unspecified (dispatch rows); the buffer is now unusable: close it and build a new EPBuffer on every "
                f"rank", wait=wait, peer=peer, rank=rank)
        raise PeerTimeoutError(
            f"{what}: rank {rank} timed out in wait {wait!r} for peer {peer} {_waited(status_host, device_type)} "
            f"(bound {bound:g} s: timeout_s / TRITONEP_TIMEOUT_S); the buffer is now unusable: close it and build "
            f"a new EPBuffer on every rank",
            wait=wait, peer=peer, rank=rank)
    if code == STATUS_BAD_INPUT:
        bad = bad_ranks(status_host)
        raise PeerInputError(
            f"{what}: the input of rank(s) {bad} was refused, so this call failed on every rank (rank {rank} "
            f"raises this; the bad rank raises the error naming its value, or, when its buffer timed out earlier, "
            f"PeerTimeoutError: rebuild the buffers then); {_refused_call(status_host, this_call)}",
            bad_ranks=bad, rank=rank)
    if code == STATUS_COUNT_MISMATCH:
        pair = int(status_host[_NEEDED])
        peer = int(status_host[_PEER])
        mask = int(status_host[_WAITED])
        stamps = {0: (pair >> 32) & 0xFFFFFFFF, peer: pair & 0xFFFFFFFF}
        raise count_mismatch_error(what, rank, stamps, [r for r in range(64) if (mask >> r) & 1],
                                   _refused_call(status_host, this_call))
    if code == STATUS_COMBINE_REFUSED:
        bad = bad_ranks(status_host)
        late = "" if this_call is None else (
            "; it was an earlier call's, which nobody read (a backward pass reads nothing, nor does a sync-free "
            "combine): this dispatch's rows were sent, but it raises the refusal as the first read after it, so its "
            "outputs are not returned")
        raise PeerInputError(
            f"{what}: rank(s) {bad} took part in a combine or a backward pass as refused (its input was refused, or "
            f"its code failed before the call and cancelled it: EPBuffer.cancel_combine / cancel_combine_backward / "
            f"cancel_dispatch_backward), so that call failed on every rank (rank {rank} raises this; a refused rank "
            f"raises the error naming its input) and its outputs are NaN; the buffer stays usable{late}",
            bad_ranks=bad, rank=rank)
    if code == STATUS_CAPACITY:
        needed = int(status_host[_NEEDED])
        bad = bad_ranks(status_host)  # a later refused call's bad inputs (the code is the first refusal's)
        also = f"; the input of rank(s) {bad} was refused too (the bad rank names its value)" if bad else ""
        raise CapacityError(
            f"{what}: rank {int(status_host[_PEER])} would receive {needed} rows but max_recv_tokens={max_recv}; "
            f"{_refused_call(status_host, this_call)}{also}", needed=needed, available=max_recv)
    raise PeerTimeoutError(f"{what}: unknown device status code {code}", rank=rank)
