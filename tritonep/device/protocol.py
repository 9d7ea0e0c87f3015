"""The symmetric-memory protocol's numbers, named once for kernels and host (docs/protocols.md).

Every name is a ``tl.constexpr`` global: @triton.jit code reads it directly (compiled mode refuses plain
globals) and the host reads ``int(NAME.value)`` (or :func:`v`). A new kernel variant takes its flag row, counter,
wait id and status fields from here instead of remembering numbers across files.

Flag rows. A buffer's ``flags`` region is int64 ``[NUM_FLAG_ROWS, W]``: row ``r`` holds one monotonic counter per
source rank. Kernels address row ``r`` of their own flags as ``flags_ptr + r * W`` and a peer's copy through the
pointer table plus the byte offset :func:`flag_row_bytes` (``r * W * 8``).

- ``FLAG_COUNTS``: the counts exchange's "my row of the counts matrix is written" signal.
- ``FLAG_DATA``: dispatch send -> expand ("the staged rows of chunk c are written").
- ``FLAG_ACK``: dispatch expand -> send ("the stage is read, it may be overwritten").
- ``FLAG_CDATA``: combine partial -> out ("the partial sums are written").
- ``FLAG_CACK``: combine out -> partial ("the combine stage is read").
- ``FLAG_DEAD``: not a counter: ``flags[FLAG_DEAD, r]`` becomes nonzero (and stays so) when rank r's buffer timed out
  (a wait of r gave up): from then on r's kernels skip their rows but still signal, so before any signal of a call
  whose rows it skipped r marks itself here in every peer (:func:`tritonep.device.signal.mark_dead`), and a peer
  that acquired one of r's signals checks the row before it uses r's data (:func:`tritonep.device.signal.
  peers_alive`): it records ``STATUS_TIMEOUT`` with ``WAIT_PEER_GAVE_UP`` and peer r, skips like a timed-out rank
  (NaN combine output), and marks itself in turn. So a rank that arrives after its peers gave up on it never takes
  the rows or partials they skipped.

Call counters. ``calls`` is int64 ``[NUM_CALLS]``, advanced on the device (never reset):
``CALL_DISPATCH`` (dispatches, forward and combine backward), ``CALL_COMBINE`` (combines, forward and dispatch
backward), ``CALL_EXCHANGE`` (counts exchanges). ``DONE_EXCHANGE``: programs of the counts exchange that
finished their expert blocks (an arrival ticket: the last one of a launch signals and lays out; never reset, every
launch adds its grid). ``DONE_DECODE_DISPATCH`` / ``DONE_DECODE_COMBINE``: programs of
the one-launch decode kernels that finished (:mod:`tritonep.backends.triton.kernels.decode_dispatch`); the last program of a launch
advances the call counters, so no separate launch does. ``DONE_COMBINE_OUT`` / ``DONE_COMBINE_FUSED`` /
``DONE_EXPAND_BWD``: the same tickets for the last launch of a two-kernel combine, of a fused combine, and of a
combine backward (send + expand): their last program advances ``CALL_COMBINE`` / ``CALL_DISPATCH`` (every program
of the call read "counter + 1" as its number), so no host op advances a counter (one ticket counter per kernel:
the modulo test needs one grid per counter). The combine backward's last expand program also adds the forward's
``grid_expand`` to ``FLAG_ACK`` in every source at once (:func:`tritonep.device.signal.ack_on_last`), so that
expand may run its own grid (``KernelTiles.bgrid``) while the senders keep counting ``grid_expand`` acks per call.

Status word. ``status`` is int64 ``[STATUS_WORDS]`` (errors) plus ``ST_ROWS_RECEIVED`` and ``ST_THIS_CALL`` after
it (the host reads them at once: a dispatch's verdict launch, the counts exchange's last program or the decode
dispatch's program 0, publishes them with a ticket into pinned host memory,
:func:`tritonep.device.signal.publish_host_status`):
``[code, wait_id, peer, errors_seen, needed_rows, skip_call, bad_rank_mask, waited, rows_received, this_call]``.
Codes are ``STATUS_*``; ``STATUS_COMBINE_REFUSED``: some rank took part in a combine or a backward pass as refused
(its input was refused, or it cancelled the call), ``peer`` the lowest such rank, their bits in ``bad_rank_mask``;
the ``cbad`` region (int64 ``[W]`` per rank) carries it for combine-like calls (a combine, a dispatch backward): a
refused rank stores the combine's number ``m`` into ``cbad[rank]`` of every peer before it signals, and every rank's
output side compares ``cbad[r] == m``; a combine backward (dispatch-like) carries it in the token count its send
writes anyway: ``ntok[rank] = -1`` in every rank, which the expand reads after the data signals.
``STATUS_COUNT_MISMATCH``: the ranks passed different count routings to a dispatch (``count_ids`` on some ranks
only, or different ``count_experts``; the stamps column of the ``xcounts`` region, a buffer with
``count_columns``): ``peer`` is the lowest rank whose stamp differs from rank 0's, ``needed_rows`` holds
``rank 0's stamp << 32 | that rank's`` and ``waited`` the bitmask of the ranks that passed ``count_ids`` (stamp
``count_experts``, 0 without); the call is refused as a bad input is (``skip_call``).
``skip_call`` is the number (``calls[CALL_DISPATCH]``) of the dispatch a refusal skipped;
``this_call`` the number of the dispatch whose verdict launch published last: equal, the refusal is that call's
own; ``skip_call`` lower, it is an earlier call's that nobody read (sync-free, sync checks off, a graph replay) and
this call's rows moved.

Wait ids (recorded in ``status[ST_WAIT_ID]`` by a wait that gave up): ``WAIT_COUNTS`` .. ``WAIT_CACK`` for the
EP rows above, ``WAIT_PEER_GAVE_UP`` when no wait of this rank gave up but a peer's did (``FLAG_DEAD``),
``WAIT_RENDEZVOUS + i`` for the expert transport's rendezvous ``i`` (0..3).

The planner (:mod:`tritonep.balance.kernels.planner`, one launch, no peer) keeps a persistent state of its own: a packed
arrival ticket word (``call number << TICKET_CALL_SHIFT | arrivals``, :func:`tritonep.device.signal.take_ticket`)
and local flags marked with the call number (:func:`tritonep.device.signal.publish_mark` /
:func:`tritonep.device.signal.wait_all_eq`). Its status is one int32 per program, OR of the bits ``PLAN_*``.
"""

import triton.language as tl

# status codes (status[ST_CODE])
STATUS_OK = tl.constexpr(0)
STATUS_TIMEOUT = tl.constexpr(1)
STATUS_CAPACITY = tl.constexpr(2)
STATUS_BAD_INPUT = tl.constexpr(3)
STATUS_COMBINE_REFUSED = tl.constexpr(4)  # a rank refused (or cancelled) a combine: its outputs are NaN everywhere
STATUS_COUNT_MISMATCH = tl.constexpr(5)  # the ranks' count stamps of a dispatch differ (count_ids / count_experts)
STAMP_CARRIED = tl.constexpr(1 << 30)  # added to a count stamp whose routing is carried with the rows (count_weights)
STAMP_TOPK = tl.constexpr(1 << 20)  # a carried stamp: CE + CK * STAMP_TOPK + STAMP_CARRIED (CE < 2**20, CK < 2**10:
# the ranks must carry the same width, or a receiver reads words past a sender's ids of an earlier call)

# flag rows of an EPBuffer's flags region
FLAG_COUNTS = tl.constexpr(0)
FLAG_DATA = tl.constexpr(1)
FLAG_ACK = tl.constexpr(2)
FLAG_CDATA = tl.constexpr(3)
FLAG_CACK = tl.constexpr(4)
FLAG_DEAD = tl.constexpr(5)  # a mark, not a counter: rank r's buffer timed out
NUM_FLAG_ROWS = tl.constexpr(6)

# call counters (calls region)
CALL_DISPATCH = tl.constexpr(0)
CALL_COMBINE = tl.constexpr(1)
CALL_EXCHANGE = tl.constexpr(2)
DONE_EXCHANGE = tl.constexpr(3)
DONE_DECODE_DISPATCH = tl.constexpr(4)
DONE_DECODE_COMBINE = tl.constexpr(5)
DONE_COMBINE_OUT = tl.constexpr(6)
DONE_COMBINE_FUSED = tl.constexpr(7)
DONE_EXPAND_BWD = tl.constexpr(8)
NUM_CALLS = tl.constexpr(9)

# status word fields
ST_CODE = tl.constexpr(0)
ST_WAIT_ID = tl.constexpr(1)
ST_PEER = tl.constexpr(2)
ST_ERRORS_SEEN = tl.constexpr(3)
ST_NEEDED_ROWS = tl.constexpr(4)
ST_SKIP_CALL = tl.constexpr(5)
ST_BAD_RANK_MASK = tl.constexpr(6)
ST_WAITED = tl.constexpr(7)
ST_ROWS_RECEIVED = tl.constexpr(8)
ST_THIS_CALL = tl.constexpr(9)  # the number of the forward dispatch whose verdict launch wrote the words last
STATUS_WORDS = tl.constexpr(8)  # the error part of the word (what raise_for_status reads)

# wait ids
WAIT_COUNTS = tl.constexpr(0)
WAIT_DATA = tl.constexpr(1)
WAIT_ACK = tl.constexpr(2)
WAIT_CDATA = tl.constexpr(3)
WAIT_CACK = tl.constexpr(4)
WAIT_PEER_GAVE_UP = tl.constexpr(5)  # a peer's wait gave up (its FLAG_DEAD mark), not one of this rank's
WAIT_RENDEZVOUS = tl.constexpr(10)  # + rendezvous index (0..3) of the expert transport
NUM_RENDEZVOUS = 4

# the planner's arrival ticket word (int64): call number in the high bits, arrivals of this call in the low 32
TICKET_CALL_SHIFT = tl.constexpr(32)
TICKET_ARRIVALS = tl.constexpr(0xFFFFFFFF)

# the planner's status bits (status[program], int32; the host ORs them: tritonep.balance.planner.check_plan_status)
PLAN_NEGATIVE_COUNT = tl.constexpr(1)  # a negative entry in counts (the placement program)
PLAN_HISTOGRAM_MISMATCH = tl.constexpr(2)  # this rank's topk_idx histogram differs from counts[rank]
PLAN_BAD_EXPERT_ID = tl.constexpr(4)  # an expert id outside [-1, E) in topk_idx
PLAN_WAIT_GAVE_UP = tl.constexpr(8)  # an internal wait of the planner gave up (TRITONEP_TIMEOUT_S)
PLAN_COUNT_OVERFLOW = tl.constexpr(16)  # counts whose total does not fit int32 (an entry past it too)


def v(name) -> int:
    """Host value of a protocol constant (``v(FLAG_ACK) == 2``)."""
    return int(getattr(name, "value", name))


def flag_row_bytes(row, world_size: int) -> int:
    """Byte offset of flag row ``row`` inside a rank's flags region of ``world_size`` counters per row."""
    return v(row) * world_size * 8


def wait_names() -> dict:
    """Wait id -> readable name, for the host's timeout messages."""
    names = {v(WAIT_COUNTS): "dispatch.counts", v(WAIT_DATA): "dispatch.data", v(WAIT_ACK): "dispatch.ack",
             v(WAIT_CDATA): "combine.data", v(WAIT_CACK): "combine.ack",
             v(WAIT_PEER_GAVE_UP): "peer.gave_up"}
    for i in range(NUM_RENDEZVOUS):
        names[v(WAIT_RENDEZVOUS) + i] = f"transport.rendezvous{i}"
    return names
