"""Epoch signals and bounded waits shared by every communication kernel (docs/protocols.md).

Protocol: a signal is a monotonic int64 counter in the *receiver's* symmetric memory. Every sending program adds 1
with a release atomic at system scope after a block barrier (so all its stores are ordered before the flag); the
receiver waits until the counter reaches ``calls * programs_per_call``. Counters never need a reset, so CUDA-graph
replays stay correct as long as the call number lives in device memory.

Every wait is bounded in wall-clock nanoseconds (:func:`now_ns`): on GPU by ``%globaltimer``, in the interpreter
by the host's monotonic clock, so a bound of ``timeout_s`` seconds means the same on both (an earlier poll-count
bound, calibrated once, gave up after 1.7-2.8 s of a 6 s bound). A wait that gives up records (code,
wait id, peer, measured ns) in a local status word and returns 0, and the kernel skips the guarded work; the host
turns the status into :class:`tritonep.errors.PeerTimeoutError`.
"""

import time

import triton
import triton.language as tl

from .common import kernels_interpreted
from .protocol import (FLAG_DEAD, STATUS_BAD_INPUT, STATUS_CAPACITY, STATUS_COMBINE_REFUSED, STATUS_COUNT_MISMATCH,
                       STATUS_TIMEOUT, ST_ERRORS_SEEN, ST_PEER, ST_WAIT_ID, ST_WAITED, TICKET_ARRIVALS, TICKET_CALL_SHIFT,
                       WAIT_PEER_GAVE_UP)

if kernels_interpreted():
    _POLL_PAUSE_S = 1e-3  # a poll round of an interpreted wait sleeps this long first

    def _clock_ns():
        """The host's monotonic clock in ns (``time.monotonic_ns``) as an int64 scalar: the interpreter runs a kernel
        as Python, so a wait in a CPU world reads real time (every rank is a process of one host: one clock)."""
        return tl.full((), time.monotonic_ns(), tl.int64)

    def _poll_clock_ns():
        """:func:`_clock_ns` for a wait's poll round (a poll found a flag missing): sleep 1 ms first, so a waiting
        rank gives its core to the ranks it waits for instead of spinning. CPU worlds have more ranks than a CI
        machine has cores: the only-rank-0-has-tokens test (W = 3, 100 calls) took 29.6 s of CPU instead of
        55.8 s with it, 17 s instead of 30 s of wall time. A wait satisfied at its first poll never sleeps; the
        bound stays wall time."""
        time.sleep(_POLL_PAUSE_S)
        return tl.full((), time.monotonic_ns(), tl.int64)
else:
    @triton.jit
    def _clock_ns():
        """Compiled kernels: ``%globaltimer`` (ns), so a GPU launch with HAS_TIMER=False is still bounded in time."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    _poll_clock_ns = _clock_ns  # compiled: the same read (the pause is the interpreter's)


@triton.jit
def now_ns(HAS_TIMER: tl.constexpr):
    """Wall-clock nanoseconds: the global timer on GPU (HAS_TIMER), the host's monotonic clock in the interpreter.

    The HAS_TIMER branch is the only one the GPU compiler visits for GPU launches (a constexpr ``if``), so the GPU
    code is what it was; the other branch calls :func:`_clock_ns`, plain Python under the interpreter."""
    if HAS_TIMER:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)
    else:
        return _clock_ns()


@triton.jit
def poll_ns(HAS_TIMER: tl.constexpr):
    """:func:`now_ns` for the rounds of a wait's poll loop: the same code when compiled (GPU); in the interpreter
    it sleeps 1 ms before it reads the clock (:func:`_poll_clock_ns`)."""
    if HAS_TIMER:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)
    else:
        return _poll_clock_ns()


@triton.jit
def record_error(status_ptr, code, wait_id, peer):
    """Record the first error of this buffer: status = [code, wait_id, peer, count]; returns 1 if this call's error
    is the recorded one (the first), else 0. A timeout (fatal) also replaces a recorded refusal (STATUS_CAPACITY /
    STATUS_BAD_INPUT / STATUS_COMBINE_REFUSED / STATUS_COUNT_MISMATCH, reported once by the next read): a refusal
    nobody read must not hide a lost peer."""
    zero = tl.zeros((), dtype=tl.int64)
    old = tl.atomic_cas(status_ptr, zero, zero + code, sem="acq_rel", scope="gpu")
    if code == STATUS_TIMEOUT:
        # a timeout is fatal and replaces a refusal nobody read yet (sync-free, sync checks off, graph replays;
        # refusals are reported once, then cleared): kept, the refusal hid the timeout from the next read, which
        # then raised the refusal and let the call's data kernels run on a layout the timed-out wait never completed
        if ((old == STATUS_CAPACITY) | (old == STATUS_BAD_INPUT) | (old == STATUS_COMBINE_REFUSED)
                | (old == STATUS_COUNT_MISMATCH)):
            if tl.atomic_cas(status_ptr, old, zero + code, sem="acq_rel", scope="gpu") == old:
                old = zero
    if old == 0:
        tl.store(status_ptr + ST_WAIT_ID, zero + wait_id)
        tl.store(status_ptr + ST_PEER, zero + peer)
    tl.atomic_add(status_ptr + ST_ERRORS_SEEN, 1, sem="relaxed", scope="gpu")
    return old == 0


@triton.jit
def _wait_flags(flag_ptr, n, target, status_ptr, wait_id, peer, timeout, HAS_TIMER: tl.constexpr,
                WBLOCK: tl.constexpr, NAMED_PEER: tl.constexpr):
    """Body of :func:`wait_all_ge` / :func:`wait_ge`: on timeout the recorded peer is ``peer`` (NAMED_PEER) or the
    first missing index."""
    offs = tl.arange(0, WBLOCK)
    m = offs < n
    ok = tl.full((), 1, tl.int32)
    if tl.load(status_ptr) == STATUS_TIMEOUT:
        ok = 0
    else:
        t0 = now_ns(HAS_TIMER)
        v = tl.atomic_add(flag_ptr + offs, 0, mask=m, sem="acquire", scope="sys")
        missing = tl.sum(((v < target) & m).to(tl.int32), 0)
        while missing > 0:
            elapsed = poll_ns(HAS_TIMER) - t0
            if elapsed > timeout:
                if NAMED_PEER:
                    first = record_error(status_ptr, STATUS_TIMEOUT, wait_id, peer)
                else:
                    first = record_error(status_ptr, STATUS_TIMEOUT, wait_id,
                                         tl.min(tl.where((v < target) & m, offs, WBLOCK), 0))
                if first:
                    tl.store(status_ptr + ST_WAITED, elapsed)  # measured wait in ns (GPU and interpreter)
                ok = 0
                missing = 0
            else:
                v = tl.atomic_add(flag_ptr + offs, 0, mask=m, sem="acquire", scope="sys")
                missing = tl.sum(((v < target) & m).to(tl.int32), 0)
    tl.debug_barrier()
    return ok


@triton.jit
def wait_all_ge(flag_ptr, n, target, status_ptr, wait_id, timeout, HAS_TIMER: tl.constexpr,
                WBLOCK: tl.constexpr):
    """Wait until ``flag_ptr[i] >= target`` for every i < n (local int64 counters, acquire at system scope).

    ``timeout`` is in nanoseconds of wall time (:func:`now_ns`). Returns 1 when every flag
    arrived, 0 on timeout (after recording STATUS_TIMEOUT with the first missing index as the peer). A buffer that
    already timed out returns 0 at once, so a broken protocol never blocks a later call. Other recorded errors
    (capacity) keep the protocol running: kernels skip the data but still signal and wait.
    """
    return _wait_flags(flag_ptr, n, target, status_ptr, wait_id, 0, timeout, HAS_TIMER, WBLOCK, False)


@triton.jit
def mark_dead(flags_tab, status_ptr, W: tl.constexpr, rank, WB: tl.constexpr):
    """Whether this rank's buffer timed out (``status`` holds STATUS_TIMEOUT: a wait of this or an earlier call gave
    up, or a peer's did, :func:`peers_alive`); if so, also ``flags[FLAG_DEAD, rank] = 1`` in every other rank
    (``flags_tab``: every rank's flags region). A timed-out rank's kernels skip their rows but still signal, so every
    sender of rows, partials or counts calls this after its own waits and before its first signal: a peer that
    acquires one of the signals sees the mark (plain stores, ordered by the signal's block barrier + release, as
    ``mark_refused``) and never takes the skipped data. The mark is never cleared (a timed-out buffer is rebuilt)."""
    dead = tl.load(status_ptr, volatile=True) == STATUS_TIMEOUT
    if dead:
        offs = tl.arange(0, WB)
        msk = (offs < W) & (offs != rank)
        bases = tl.load(flags_tab + offs, mask=msk, other=0)
        tl.store(bases.to(tl.pointer_type(tl.int64)) + FLAG_DEAD * W + rank, tl.full([WB], 1, tl.int64), mask=msk)
    return dead


@triton.jit
def peers_alive(flags_ptr, status_ptr, W: tl.constexpr, WB: tl.constexpr):
    """1 when no peer marked itself timed out in this rank's ``flags[FLAG_DEAD]`` row (``flags_ptr``: this rank's
    flags region), else 0 after recording STATUS_TIMEOUT with ``WAIT_PEER_GAVE_UP`` and the lowest such peer: a
    receiver calls it after acquiring its peers' signals and before it uses their data, so data a timed-out peer
    skipped (:func:`mark_dead`) is never taken; the call then skips like a timed-out one (its outputs NaN or
    unspecified) and the host's next read raises :class:`tritonep.errors.PeerTimeoutError` naming that peer."""
    offs = tl.arange(0, WB)
    v = tl.load(flags_ptr + FLAG_DEAD * W + offs, mask=offs < W, other=0, volatile=True)
    hit = (offs < W) & (v != 0)
    alive = tl.sum(hit.to(tl.int32), 0) == 0
    if alive == 0:
        record_error(status_ptr, STATUS_TIMEOUT, WAIT_PEER_GAVE_UP, tl.min(tl.where(hit, offs, WB), 0))
    return alive.to(tl.int32)


@triton.jit
def signal_peers(ptr_table, offset_bytes, n, index, WBLOCK: tl.constexpr, value=1):
    """Add ``value`` (default 1; release, system scope) to ``counter[index]`` in each of the first n ranks' memory.

    ``ptr_table[r] + offset_bytes`` is rank r's int64 counter array. Call after the stores it publishes; it issues
    the block barrier itself so every thread's stores are ordered before the flag. A ``value`` > 1 stands for that
    many programs: only signal it when all of them have finished (e.g. from the last program of a launch).
    """
    tl.debug_barrier()
    offs = tl.arange(0, WBLOCK)
    m = offs < n
    bases = tl.load(ptr_table + offs, mask=m, other=0) + offset_bytes
    ptrs = bases.to(tl.pointer_type(tl.int64)) + index
    tl.atomic_add(ptrs, value, mask=m, sem="release", scope="sys")


@triton.jit
def signal_one(ptr_table, offset_bytes, peer, index):
    """Add 1 (release, system scope) to ``counter[index]`` in rank ``peer``'s memory (after a block barrier)."""
    tl.debug_barrier()
    base = tl.load(ptr_table + peer) + offset_bytes
    tl.atomic_add(base.to(tl.pointer_type(tl.int64)) + index, 1, sem="release", scope="sys")


@triton.jit
def publish_epoch(ptr_table, n, index, value, WBLOCK: tl.constexpr):
    """Raise ``flag[index]`` to ``value`` (atomic max, release, system scope) in each of the first n ranks' int64
    flag array ``ptr_table[r]``, after a block barrier: the per-chunk arrival flag of the fused dispatch."""
    tl.debug_barrier()
    offs = tl.arange(0, WBLOCK)
    m = offs < n
    bases = tl.load(ptr_table + offs, mask=m, other=0)
    ptrs = bases.to(tl.pointer_type(tl.int64)) + index
    tl.atomic_max(ptrs, tl.zeros([WBLOCK], tl.int64) + value, mask=m, sem="release", scope="sys")


@triton.jit
def wait_ge(flag_ptr, target, status_ptr, wait_id, peer, timeout, HAS_TIMER: tl.constexpr):
    """Wait until the local int64 ``*flag_ptr >= target`` (acquire, system scope), bounded like
    :func:`wait_all_ge` (``timeout`` in ns of wall time); on timeout
    records (STATUS_TIMEOUT, wait_id, peer) and returns 0."""
    return _wait_flags(flag_ptr, 1, target, status_ptr, wait_id, peer, timeout, HAS_TIMER, 2, True)


@triton.jit
def publish_epoch_one(ptr_table, peer, index, value):
    """``flag[index] = max(flag[index], value)`` (release, system scope) in rank ``peer``'s int64 flag array
    ``ptr_table[peer]``, after a block barrier: :func:`publish_epoch` for one rank (the per-chunk arrival flag of
    the fused and decode combines)."""
    tl.debug_barrier()
    base = tl.load(ptr_table + peer)
    tl.atomic_max(base.to(tl.pointer_type(tl.int64)) + index, value, sem="release", scope="sys")


@triton.jit
def last_program(done_ptr):
    """Count this program done (``*done_ptr += 1``, acq_rel, after a block barrier) and return whether it is the
    launch's last: ``*done_ptr`` only ever advances by whole launches of one grid, so the program that sees
    ``old % G == G - 1`` is the last, and its acquire covers every other program's reads and stores (the shared
    step of :func:`finish_launch`, :func:`ack_on_last` and :func:`advance_on_last`)."""
    G = tl.num_programs(0)
    tl.debug_barrier()
    old = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    return old % G == G - 1


@triton.jit
def finish_launch(calls_ptr, DONE: tl.constexpr, CALL_A: tl.constexpr, a, CALL_B: tl.constexpr, b,
                  TWO: tl.constexpr, flags_tab, off_1, off_2, W: tl.constexpr, rank, WB: tl.constexpr):
    """Count this program done (``calls[DONE] += 1``, acq_rel); the last program of the launch stores the call
    numbers ``calls[CALL_A] = a`` (and ``calls[CALL_B] = b`` when TWO) and adds G (the grid) to the flag rows at
    byte offsets ``off_1`` and ``off_2`` (column ``rank``) in every rank: the two-kernel path's per-program counters
    (DATA/ACK, CDATA/CACK), signalled once for the whole grid when every program has finished (a G-weighted add
    from an unfinished grid would let a waiter pass early). Every program read the counters before it counts itself
    done, and ``calls[DONE]`` only ever advances by whole launches of the same grid, so the program that sees
    ``old % G == G - 1`` is the last. Returns whether this program was the last."""
    last = last_program(calls_ptr + DONE)
    if last:
        tl.store(calls_ptr + CALL_A, a)
        if TWO:
            tl.store(calls_ptr + CALL_B, b)
        G = tl.num_programs(0).to(tl.int64)
        signal_peers(flags_tab, off_1, W, rank, WB, G)
        signal_peers(flags_tab, off_2, W, rank, WB, G)
    return last


@triton.jit
def ack_on_last(calls_ptr, DONE: tl.constexpr, CALL: tl.constexpr, value, flags_tab, off, count: tl.constexpr,
                W: tl.constexpr, rank, WB: tl.constexpr):
    """:func:`advance_on_last`, and the last program adds ``count`` to the flag row at byte offset ``off`` (column
    ``rank``) in every rank, once every program of the launch has finished: a per-program counter (``FLAG_ACK``) whose
    waiters expect ``count`` programs per call from a launch of another grid (the combine backward's expand acks
    as the forward's ``grid_expand`` programs). As :func:`finish_launch`: every program counts itself done after
    its reads and stores (acq_rel), so the last one's release covers them."""
    if last_program(calls_ptr + DONE):
        tl.store(calls_ptr + CALL, value)
        signal_peers(flags_tab, off, W, rank, WB, tl.full((), count, tl.int64))


@triton.jit
def advance_on_last(calls_ptr, DONE: tl.constexpr, CALL: tl.constexpr, value):
    """Count this program done (``calls[DONE] += 1``, acq_rel); the last program of the launch stores
    ``calls[CALL] = value``. The call's kernels read "counter + 1" as their call number before this runs, and
    ``calls[DONE]`` only ever advances by whole launches of this kernel (one grid per counter), so the program that
    sees ``old % G == G - 1`` is the last: the counter advances on the device with no separate launch (the next
    call's kernels, later on the stream, see it)."""
    if last_program(calls_ptr + DONE):
        tl.store(calls_ptr + CALL, value)


@triton.jit
def wait_all_eq(flag_ptr, n, mark, timeout, HAS_TIMER: tl.constexpr, FB: tl.constexpr):
    """Wait until ``flag_ptr[i] == mark`` for every ``i < n`` (local int64 flags, acquire, gpu scope); 1 = arrived,
    0 = gave up after ``timeout`` ns of wall time.

    The in-grid wait of the planner (:mod:`tritonep.balance.kernels.planner`: programs of ONE launch on one GPU, flags
    set by :func:`publish_mark` to the mark of :func:`take_ticket`). How it differs from :func:`wait_all_ge`:
    a flag is compared for equality with this call's mark (flags are marked, not counted), at gpu scope (no
    peer GPU writes these flags); it records nothing in a status word and does not return early after an earlier
    timeout (the caller turns 0 into its own status bit, ``PLAN_WAIT_GAVE_UP``). ``FB``: a power of two >= n."""
    offs = tl.arange(0, FB)
    m = offs < n
    t0 = now_ns(HAS_TIMER)
    ok = tl.full((), 1, tl.int32)
    v = tl.atomic_add(flag_ptr + offs, 0, mask=m, sem="acquire", scope="gpu")
    missing = tl.sum(((v != mark) & m).to(tl.int32), 0)
    while missing > 0:
        elapsed = poll_ns(HAS_TIMER) - t0
        if elapsed > timeout:
            ok = 0
            missing = 0
        else:
            v = tl.atomic_add(flag_ptr + offs, 0, mask=m, sem="acquire", scope="gpu")
            missing = tl.sum(((v != mark) & m).to(tl.int32), 0)
    tl.debug_barrier()
    return ok


@triton.jit
def take_ticket(sync_ptr):
    """Take an arrival ticket from the packed int64 word at ``sync_ptr`` (``call << TICKET_CALL_SHIFT |
    arrivals``; acq_rel, gpu scope). Returns ``(role, mark)``: ``role`` = the arrivals before this program (int32,
    its role in the launch: 0 for the first to arrive), ``mark`` = call number + 1 (the value this call's flags
    take, :func:`publish_mark`). The last arrival of the launch (``role == num_programs - 1``) opens the next call
    (call + 1, no arrivals), so neither the word nor the flags ever need a reset (CUDA-graph replays stay
    correct). A program then only waits on lower roles, which arrived before it (decoupled look-back, Merrill &
    Garland 2016)."""
    ticket = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
    role = (ticket & TICKET_ARRIVALS).to(tl.int32)
    call = ticket >> TICKET_CALL_SHIFT
    if role == tl.num_programs(0) - 1:  # last arrival: every program has read the call number; open the next call
        tl.atomic_xchg(sync_ptr, (call + 1) << TICKET_CALL_SHIFT, sem="relaxed", scope="gpu")
    return role, call + 1


@triton.jit
def publish_mark(flag_ptr, mark):
    """``*flag_ptr = mark`` (local int64 flag; exchange, release, gpu scope) after a block barrier, so every
    thread's stores are ordered before it: the publish side of :func:`wait_all_eq`."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, mark, sem="release", scope="gpu")


@triton.jit
def publish_host_status(status_ptr, host_ptr, ticket, WORDS: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Copy ``status[:WORDS]`` into ``host_ptr[:WORDS]`` (a pinned host tensor: under unified addressing its host
    address is valid on the device) and then store ``host_ptr[WORDS] = ticket``: the host spins on that word for its
    call's ticket instead of a device-to-host copy + event + synchronize (one program calls this, after its own
    status stores). Compiled, a system-scope fence orders the words before the ticket for the host's reads; the
    interpreter runs stores in program order. WORDS <= 16. Idea: DeepEP's host-mapped receive counter
    (``moe_recv_counter_mapped``, its normal-mode dispatch layout)."""
    tl.debug_barrier()
    o = tl.arange(0, 16)
    v = tl.load(status_ptr + o, mask=o < WORDS, other=0, volatile=True)
    tl.store(host_ptr + o, v, mask=o < WORDS)
    tl.debug_barrier()
    if HAS_TIMER:  # compiled for the GPU (the interpreter has no inline asm)
        tl.inline_asm_elementwise("fence.sc.sys;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)
    tl.store(host_ptr + WORDS, ticket.to(tl.int64))
