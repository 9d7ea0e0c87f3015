"""Sync checks off (``TRITONEP_SYNC_CHECKS=0``, the graph-capture mode): nothing reads the host during a call,
refused calls leave zero weights, rows past ``expert_offsets[-1]`` carry zero weights, ``buf.check()`` raises the
recorded refusal on every rank (the bad rank naming its value) once, and the next call pairs; both backends."""

import pytest
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import check_calls, diff, expected, run_call, set_env
from tests.support.outcomes import outcome

H = 64


def _nosync_world(group, geometry):
    set_env(TRITONEP_SYNC_CHECKS="0", TRITONEP_GEOMETRY=geometry)
    rank = dist.get_rank(group)
    E, K = 8, 2
    buf = tep.EPBuffer(group, E, H, 8, K, backend="triton", expert_alignment=4)
    out = {}
    # call 1: rank 1's bad id passes the front door (found on the device): no one raises now
    x, idx, w = make_rank_inputs(rank, 5, H, E, K, seed=41)
    if rank == 1:
        idx[4, 0] = 99
    d = buf.dispatch(x, idx, w)
    out["refused_w_zero"] = bool((d.weights == 0).all())
    # call 2: valid; its rows past expert_offsets[-1] have zero weights
    x2, idx2, w2 = make_rank_inputs(rank, 6, H, E, K, seed=42)
    d2 = buf.dispatch(x2, idx2, w2)
    end = int(d2.expert_offsets[-1])
    out["tail_w_zero"] = bool((d2.weights[end:] == 0).all())
    out["rows"] = (d2.x.shape[0], end)
    got = dict(x=d2.x[:end].clone(), w=d2.weights[:end].clone())
    # the deferred report of call 1 (every rank's check names rank 1; rank 1 should name its value)
    out["check"] = outcome(lambda: buf.check())[:4]
    out["check_again"] = outcome(lambda: buf.check())[:2]
    buf.close()
    return out, (x2, idx2, w2), got


@pytest.fixture(scope="module")
def nosync():
    """``nosync(geometry)``: the 2-rank world of :func:`_nosync_world`, run once per geometry for this module."""
    runs = {}

    def get(geometry):
        if geometry not in runs:
            runs[geometry] = run_cpu_world(2, _nosync_world, geometry, timeout_s=120)
        return runs[geometry]

    return get


@pytest.mark.parametrize("geometry", [None, "fs=1,fe=1"])
def test_sync_off_weights_past_the_end_are_zero(nosync, geometry):
    res = nosync(geometry)
    for r in range(2):
        out = res[r][0]
        assert out["refused_w_zero"] and out["tail_w_zero"], out
        assert out["rows"][0] == 2 * 8 * 2 + 4 * 3  # max_recv_tokens rows when the host does not read
    want = expected([r[1] for r in res], 8, 4)
    for r in range(2):
        assert diff(res[r][2], want[r], ("x", "w")) == [], f"rank {r}"
    assert res[0][0]["check"][0] == "peer" and res[0][0]["check"][3] == [1], res[0][0]["check"]
    assert res[0][0]["check_again"] == ("ok", None) and res[1][0]["check_again"] == ("ok", None)


def test_sync_off_check_after_a_later_call_names_the_bad_value(nosync):
    chk = nosync(None)[1][0]["check"]
    assert chk[0] == "own" and chk[1] == "InputError" and "99" in chk[2], chk


def _identity(x):
    return x


def _nccl_nosync_world(group):
    set_env(TRITONEP_SYNC_CHECKS="0")
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, H, 8, 2, backend="nccl")
    call = make_rank_inputs(rank, 4, H, 4, 2, seed=2)
    rec = run_call(buf, *call, fn=_identity, out_buffer=False)
    buf.close()
    return call, rec


def test_nccl_backend_with_sync_checks_off():
    res = run_cpu_world(2, _nccl_nosync_world, timeout_s=60)
    assert [tuple(r[1]["y"].shape) for r in res] == [(4, H), (4, H)]
    check_calls(dict(E=4), [[r[0]] for r in res], [[r[1]] for r in res])
