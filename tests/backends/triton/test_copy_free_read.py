"""The two-kernel and fused dispatches read their status word without a device-to-host copy.

The counts exchange's last program publishes ``status[:ST_HOST]`` and the call's ticket into the pinned host tensor
(:func:`tritonep.backends.triton.kernels.layout.exchange_kernel`, ``HOST_ST``); the host's one read of a synced dispatch is
:meth:`tritonep.runtime.host_status.HostStatus.read` of that ticket. Checked here on a CPU world, kernels
interpreted and run for real: per synced dispatch exactly one ``HostStatus.read`` of the ticket the exchange
launch carried, no host torch op touches the status region (except a refused call's ``zero_``, a write) and a good
call makes no copy / item / tolist at all; the two-kernel path still queues its send launch before the host waits;
CapacityError / InputError + PeerInputError / PeerTimeoutError come out as before, and the calls after a refusal
pair.
"""

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

import tritonep as tep
from tritonep.runtime.bound import BoundKernel
from tritonep.runtime.host_status import HostStatus
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import set_env
from tests.support.outcomes import outcome, timeout_verdict
from tests.support.hooks import backend_of

H, E, K, TM = 64, 4, 2, 8
_READS = frozenset(("tolist", "item", "cpu", "numpy", "copy_", "to", "__int__", "__index__", "__float__",
                    "__bool__", "_local_scalar_dense"))


class _Watch(TorchFunctionMode):
    """Every torch function called on the host (kernel launches excluded: they run with the modes off) as
    ``(name, touches the status region)``."""

    def __init__(self, status):
        super().__init__()
        self.lo, self.hi = status.data_ptr(), status.data_ptr() + status.numel() * status.element_size()
        self.ops = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        hit = any(isinstance(t, torch.Tensor) and t.numel() and self.lo <= t.data_ptr() < self.hi for t in flat)
        self.ops.append((getattr(func, "__name__", str(func)), hit))
        return func(*args, **(kwargs or {}))


def _instrument(events):
    """Patch BoundKernel launches and HostStatus.read to log ``("launch", name, ticket)`` / ``("read", ticket)``
    in order; launches run outside every torch function mode (the interpreter's own tensor work is not the host
    path). Returns the undo function."""
    launch, read = BoundKernel.__call__, HostStatus.read

    def spy_launch(self, *dyn):
        events.append(("launch", self.name, self.arg("ticket", dyn) if "ticket" in self._dyn else None))
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            return launch(self, *dyn)

    def spy_read(self, ticket):
        events.append(("read", ticket))
        return read(self, ticket)

    BoundKernel.__call__, HostStatus.read = spy_launch, spy_read

    def undo():
        BoundKernel.__call__, HostStatus.read = launch, read
    return undo


def _call(buf, fn):
    """``(outcome, events, host ops)`` of one dispatch."""
    events = []
    undo = _instrument(events)
    try:
        with _Watch(backend_of(buf).status) as w:
            res = outcome(fn)
    finally:
        undo()
    if res[0] == "ok":
        d = res[1]
        res = ("ok", int(d.x.shape[0]), int(d.expert_offsets[-1]))
    return res, events, w.ops


def _sequence_world(group, geometry, E):
    set_env(TRITONEP_GEOMETRY=geometry or None)
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, E, H, TM, K, max_recv_tokens=2 * TM * K - 1)
    grid = backend_of(buf).k.exchange.grid[0]
    out = []
    for i, how in enumerate(["ok", "cap", "id", "ok"]):
        x, idx, w = make_rank_inputs(rank, TM if how == "cap" else 5 + rank, H, E, K, seed=40 + i)
        if how == "cap":  # every route of both ranks to expert 0: rank 0 would receive 2 * TM * K rows
            idx = torch.zeros_like(idx)
        if how == "id" and rank == 1:
            idx[1, 0] = 99
        out.append(_call(buf, lambda: buf.dispatch(x, idx, w)))
    buf.close()
    return grid, out


def _check_read(events, fused, raised_at_read=False):
    """One HostStatus.read, of the exchange's ticket, after the exchange (and after the send on two kernels);
    ``raised_at_read``: the read raised (a timeout), so no data launch follows it."""
    names = [e[1] if e[0] == "launch" else "READ" for e in events]
    tickets = [e[2] for e in events if e[0] == "launch" and e[1] == "exchange_kernel"]
    reads = [e[1] for e in events if e[0] == "read"]
    assert len(tickets) == 1 and reads == tickets, events
    data = ["dispatch_fused_kernel"] if fused else ["dispatch_send_kernel", "READ", "dispatch_expand_kernel"]
    want = ["chunk_hist_kernel", "exchange_kernel"] + (["READ"] + data if fused else data)
    assert names == (want[:-1] if raised_at_read else want), names


@pytest.mark.parametrize("geometry,E", [("", 4), ("", 64), ("fs=1,fe=1,fc=1", 64)])
def test_two_kernel_and_fused_dispatch_read_without_a_copy(geometry, E):
    """E = 64: an exchange grid of 2 programs (the last to arrive publishes; its arrival ticket is not the host's)."""
    res = run_cpu_world(2, _sequence_world, geometry, E, timeout_s=300)
    for rank, (grid, calls) in enumerate(res):
        assert grid == (1 if E == 4 else 2), grid
        for i, (got, events, ops) in enumerate(calls):
            _check_read(events, bool(geometry))
            assert not [n for n, hit in ops if hit and n != "zero_"], (rank, i, ops)  # the status is never read
            if i in (0, 3):
                assert got[0] == "ok" and got[1] == got[2] > 0, (rank, i, got)
                assert not [n for n, _ in ops if n in _READS], (rank, i, ops)  # no copy, item or tolist at all
            elif i == 1:
                assert got[:2] == ("own", "CapacityError") and str(2 * TM * K) in got[2], (rank, got)
            elif rank == 1:
                assert got[:2] == ("own", "InputError") and "99" in got[2], got
            else:
                assert got[0] == "peer" and got[3] == [1], got


def _timeout_world(group, geometry):
    set_env(TRITONEP_GEOMETRY=geometry or None)
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, E, H, TM, K, timeout_s=1.0)
    if rank == 1:  # never dispatches: rank 0's counts wait gives up, and the exchange still publishes
        return None
    x, idx, w = make_rank_inputs(rank, 5, H, E, K, seed=7)
    events = []
    undo = _instrument(events)
    try:
        with _Watch(backend_of(buf).status) as wt:
            err = timeout_verdict(lambda: buf.dispatch(x, idx, w) and None, message=False)
    finally:
        undo()
    return err, events, wt.ops


@pytest.mark.parametrize("geometry", ["", "fs=1,fe=1,fc=1"])
def test_copy_free_read_raises_peer_timeout(geometry):
    err, events, ops = run_cpu_world(2, _timeout_world, geometry, timeout_s=120, check_protocol=False)[0]
    assert err == ("PeerTimeoutError", "dispatch.counts", 1), err
    _check_read(events, bool(geometry), raised_at_read=True)
    assert not [n for n, hit in ops if hit], ops


def _stale_world(group, geometry, how):
    """A call refused without a read (``how``: ``sync_free``; with sync checks off a call of the triton backend takes
    the same path, ``dispatch_fwd(sync=0)``), then two synced good calls; every expand / fused launch is logged with
    its output rows and the rows its layout writes."""
    set_env(TRITONEP_GEOMETRY=geometry or None)
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, E, H, TM, K, max_recv_tokens=2 * TM * K - 1)
    writes = []
    launch = BoundKernel.__call__

    def spy(self, *dyn):
        out = launch(self, *dyn)
        if self.name in ("dispatch_expand_kernel", "dispatch_fused_kernel"):
            writes.append((int(self.arg("out_ptr", dyn).shape[0]), int(self.arg("offs_ptr", dyn).tensor()[-1])))
        return out

    x, idx, w = make_rank_inputs(rank, TM, H, E, K, seed=3)
    idx = torch.zeros_like(idx)  # every route to expert 0: rank 0 would receive 2 * TM * K rows
    first = outcome(lambda: buf.dispatch(x, idx, w, sync_free=how == "sync_free"))
    out = [first[:2] if first[0] != "ok" else ("ok",)]
    BoundKernel.__call__ = spy
    try:
        for seed in (4, 5):
            x, idx, w = make_rank_inputs(rank, 5 + rank, H, E, K, seed=seed)
            got = outcome(lambda: buf.dispatch(x, idx, w))
            out.append(got[:3] if got[0] != "ok" else ("ok", int(got[1].x.shape[0]), int(got[1].expert_offsets[-1])))
    finally:
        BoundKernel.__call__ = launch
    buf.close()
    return out, writes


@pytest.mark.parametrize("geometry,how", [("", "sync_free"), ("fs=1,fe=1,fc=1", "sync_free")])
def test_unread_refusal_raised_by_the_next_read_without_writing_past_its_rows(geometry, how):
    """A refusal nobody read (sync-free / sync checks off) is raised by the next synced call, which is itself a good
    call: its data kernels move its rows, so its outputs must hold them (they were allocated with 0 rows: the
    expand wrote past them, a segmentation fault in the interpreter, an out-of-bounds write on the GPU). Its message
    says so (it said "nothing was sent"): the refused call is dispatch 1, this one dispatch 2, whose rows were sent."""
    res = run_cpu_world(2, _stale_world, geometry, how, timeout_s=300)
    for rank, (calls, writes) in enumerate(res):
        assert calls[0] == ("ok",), (rank, calls)  # not read: nobody raises in the refused call
        assert calls[1][:2] == ("own", "CapacityError") and str(2 * TM * K) in calls[1][2], (rank, calls)
        msg = calls[1][2]
        assert "call 1 of this buffer, this is call 2" in msg and "this call's rows were sent" in msg, msg
        assert "nothing was sent" not in msg, msg
        assert calls[2][0] == "ok" and calls[2][1] == calls[2][2] > 0, (rank, calls)
        assert len(writes) == 2 and all(rows >= used for rows, used in writes), (rank, writes)


def _stale_timeout_world(group, geometry):
    set_env(TRITONEP_GEOMETRY=geometry or None)
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, E, H, TM, K, max_recv_tokens=2 * TM * K - 1, timeout_s=1.0)
    x, idx, w = make_rank_inputs(rank, TM, H, E, K, seed=3)
    buf.dispatch(x, torch.zeros_like(idx), w, sync_free=True)  # refused on every rank (capacity), nobody reads it
    if rank == 1:  # then never dispatches again: rank 0's next counts wait gives up
        return None
    out = []
    for seed in (4, 5):
        x, idx, w = make_rank_inputs(rank, 5, H, E, K, seed=seed)
        out.append(timeout_verdict(lambda: buf.dispatch(x, idx, w) and None, tep.errors.InputError,
                                   tep.errors.CapacityError, tep.errors.BufferStateError, message=False))
    return out


@pytest.mark.parametrize("geometry", ["", "fs=1,fe=1,fc=1", "dec=1"])
def test_timeout_after_an_unread_refusal_is_raised_not_masked(geometry):
    """A peer lost after a refusal nobody read: the timeout is the error of the next read (PeerTimeoutError naming
    the peer, then BufferStateError). The first recorded error used to win, so the stale refusal hid the timeout:
    the read raised CapacityError, the buffer stayed usable, and the expand of the two-kernel / fused path wrote the
    rows of a layout the timed-out exchange never completed (a segmentation fault in the interpreter)."""
    out = run_cpu_world(2, _stale_timeout_world, geometry, timeout_s=120, check_protocol=False)[0]
    assert out == [("PeerTimeoutError", "dispatch.counts", 1), ("BufferStateError",)], out


def _stale_bad_id_world(group, geometry):
    set_env(TRITONEP_GEOMETRY=geometry or None)
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, E, H, TM, K)
    x, idx, w = make_rank_inputs(rank, 5, H, E, K, seed=6)
    if rank == 1:
        idx[2, 1] = 99  # found on the device only: a sync-free call raises nowhere
    first = outcome(lambda: buf.dispatch(x, idx, w, sync_free=True))[0]
    x, idx, w = make_rank_inputs(rank, 5, H, E, K, seed=7)
    got = outcome(lambda: buf.dispatch(x, idx, w))
    if rank == 1:
        idx[0, 0] = 77  # now a synced call refused for its own input
    own = outcome(lambda: buf.dispatch(x, idx, w))
    buf.close()
    return first, got[:2], got[2], own[:3]


@pytest.mark.parametrize("geometry", ["", "dec=1"])
def test_unread_bad_id_named_by_the_bad_rank_at_the_next_read(geometry):
    """The next synced dispatch raises an unread refusal as :meth:`EPBuffer.check` does: the bad rank InputError
    naming its value (it raised PeerInputError naming itself, "the bad rank raises the error naming its value"),
    the others PeerInputError naming it, and saying whose refusal it is: the earlier call's (this call's rows were
    sent), then, for a synced call refused for its own input, this call's (nothing was sent)."""
    res = run_cpu_world(2, _stale_bad_id_world, geometry, timeout_s=300)
    assert res[0][:2] == ("ok", ("peer", "PeerInputError")) and "rank(s) [1]" in res[0][2], res[0]
    assert "an earlier dispatch's that nobody read" in res[0][2] and "this call's rows were sent" in res[0][2], res[0]
    assert res[1][:2] == ("ok", ("own", "InputError")) and "99" in res[1][2], res[1]
    assert res[0][3][:2] == ("peer", "PeerInputError") and res[0][3][2].endswith("nothing was sent"), res[0][3]
    assert res[1][3][:2] == ("own", "InputError") and "77" in res[1][3][2], res[1][3]
