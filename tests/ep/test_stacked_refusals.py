"""Two refusals before one read: an unread refusal (``sync_free=True``) and then a refused call that reads, or two
unread refusals and :meth:`EPBuffer.check`. The status word keeps the FIRST refusal's code (signal.record_error), so
the read raises the earlier call's error; but a rank whose own input was refused in any of those calls must still
raise the error naming its value (docs: "the bad rank raises the error naming its value"), and the peers' message
must not present the earlier call's refusal as this call's own ("nothing was sent").

The cases: a capacity refusal nobody read, then a synced call in which rank 1's ``topk_idx`` holds an id outside
``[-1, E)`` (found on the device) or is one column too wide (refused at the API entry): rank 1 must raise its own
error, not ``CapacityError: rank 0 would receive 36 rows ...; nothing was sent`` (call 1's refusal, told as call 3's
own). Likewise two unread bad-id calls of different ranks: each bad rank names its own value, not the other rank.
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import open_buffer, set_env
from tests.support.outcomes import outcome

CFG = dict(E=8, H=64, Tmax=8, K=3, max_recv=24)  # 6 tokens per rank, every route to expert 0: rank 0 needs 36


def _inputs(rank, T, seed, bad=None):
    x, idx, w = make_rank_inputs(rank, T, CFG["H"], CFG["E"], CFG["K"], seed=seed)
    if bad == "cap":
        idx = torch.zeros_like(idx)
    elif bad == "id":
        idx[-1, 0] = CFG["E"]  # found on the device, in the counts exchange
    elif bad == "shape":
        idx = torch.zeros(T, CFG["K"] + 1, dtype=idx.dtype)  # refused at the front door
    return x, idx, w


def _world(group, geometry):
    rank = dist.get_rank(group)
    set_env(TRITONEP_GEOMETRY=geometry or None)
    buf = open_buffer(group, CFG)
    out = []

    def call(seed, bad=None, bad_rank=None, **kw):
        x, idx, w = _inputs(rank, 6, seed, bad if bad == "cap" or rank == bad_rank else None)
        got = outcome(lambda: buf.dispatch(x, idx, w, **kw))
        out.append(got[:3] if got[0] != "ok" else ("ok",))

    for how in ("id", "shape"):
        call(1, "cap", sync_free=True)  # refused, nobody reads it
        call(2, sync_free=True)  # a good call, not read either
        call(3, how, bad_rank=1)  # refused itself (rank 1's input) and reads the earlier refusal
        call(4)  # the next call pairs
    call(5, "id", bad_rank=0, sync_free=True)  # two unread bad-id calls of different ranks, then check()
    call(6, "id", bad_rank=1, sync_free=True)
    got = outcome(buf.check)
    out.append(got[:4] if got[0] != "ok" else ("ok",))
    call(7)
    buf.close()
    return out


@pytest.mark.parametrize("geometry", ["", "dec=2"], ids=["two-kernel", "decode"])
def test_own_refusal_is_named_behind_an_unread_one(geometry):
    res = run_cpu_world(2, _world, geometry, timeout_s=300)
    for i, how in ((0, "id"), (4, "shape")):
        for rank in (0, 1):
            assert res[rank][i:i + 2] == [("ok",), ("ok",)], (how, rank, res[rank])
            assert res[rank][i + 3] == ("ok",), (how, rank, res[rank])
        kind, name, msg = res[1][i + 2]
        assert (kind, name) == ("own", "InputError"), (how, res[1][i + 2])  # rank 1 names its own value
        assert ("= 8 is outside" if how == "id" else "topk_idx") in msg, (how, msg)
        kind, name, msg = res[0][i + 2]
        assert (kind, name) == ("own", "CapacityError") and f"{2 * 6 * CFG['K']} rows" in msg, (how, msg)  # call 1
        assert "nothing was sent" not in msg or "2 refusals" in msg, msg  # not told as this call's own
        assert "this call (call" in msg and "was refused too" in msg, msg
        assert "rank(s) [1] was refused too" in msg, msg
    for rank in (0, 1):
        assert res[rank][8:10] == [("ok",), ("ok",)], res[rank]
        kind, name, msg = res[rank][10][:3]
        assert (kind, name) == ("own", "InputError") and "= 8 is outside" in msg, (rank, res[rank][10])
        assert res[rank][11] == ("ok",), res[rank]
