"""Sync checks off (``TRITONEP_SYNC_CHECKS=0``, the graph-capture mode): nothing reads the host during a call,
refused calls leave zero weights, rows past ``expert_offsets[-1]`` carry zero weights, ``buf.check()`` raises the
recorded refusal on every rank (the bad rank naming its value) once, and the next call pairs; both backends."""

import os

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import CapacityError, InputError, PeerInputError
from tritonep.reference import dispatch_reference
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs

H = 64


def _env(**kv):
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _outcome(fn):
    """Run fn(); return ("ok", value) or (kind, exception type name, message, bad_ranks)."""
    try:
        return ("ok", fn())
    except PeerInputError as e:
        return ("peer", type(e).__name__, str(e), list(e.bad_ranks))
    except (InputError, CapacityError) as e:
        return ("own", type(e).__name__, str(e), None)


def _nosync_world(group, geometry):
    _env(TRITONEP_SYNC_CHECKS="0", TRITONEP_GEOMETRY=geometry)
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
    ref_in = (x2, idx2, w2, d2.x[:end].clone(), d2.weights[:end].clone())
    # the deferred report of call 1 (every rank's check names rank 1; rank 1 should name its value)
    out["check"] = _outcome(lambda: buf.check())[:4]
    out["check_again"] = _outcome(lambda: buf.check())[:2]
    buf.close()
    return out, ref_in


@pytest.mark.parametrize("geometry", [None, "fs=1,fe=1"])
def test_sync_off_weights_past_the_end_are_zero(geometry):
    res = run_cpu_world(2, _nosync_world, geometry, timeout_s=120)
    for r in range(2):
        out = res[r][0]
        assert out["refused_w_zero"] and out["tail_w_zero"], out
        assert out["rows"][0] == 2 * 8 * 2 + 4 * 3  # max_recv_tokens rows when the host does not read
    xs, idxs, ws, rows, wts = zip(*[r[1] for r in res])
    ref = dispatch_reference(list(xs), list(idxs), list(ws), 8, 2, expert_alignment=4)
    for r in range(2):
        assert torch.equal(rows[r], ref[r].x) and torch.equal(wts[r], ref[r].weights), f"rank {r}"
    assert res[0][0]["check"][0] == "peer" and res[0][0]["check"][3] == [1], res[0][0]["check"]
    assert res[0][0]["check_again"] == ("ok", None) and res[1][0]["check_again"] == ("ok", None)


def test_sync_off_check_after_a_later_call_names_the_bad_value():
    res = run_cpu_world(2, _nosync_world, None, timeout_s=120)
    chk = res[1][0]["check"]
    assert chk[0] == "own" and chk[1] == "InputError" and "99" in chk[2], chk


def _nccl_nosync_world(group):
    _env(TRITONEP_SYNC_CHECKS="0")
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, H, 8, 2, backend="nccl")
    x, idx, w = make_rank_inputs(rank, 4, H, 4, 2, seed=2)
    d = buf.dispatch(x, idx, w)
    y = buf.combine(d.x, d.handle)
    buf.close()
    return y.shape


def test_nccl_backend_with_sync_checks_off():
    assert run_cpu_world(2, _nccl_nosync_world, timeout_s=60) == [(4, H), (4, H)]


BF16 = torch.bfloat16


def _bad_input_world(group, backend, how, sync, geometry=""):
    os.environ["TRITONEP_SYNC_CHECKS"] = "1" if sync else "0"
    if geometry:
        os.environ["TRITONEP_GEOMETRY"] = geometry
    rank = dist.get_rank(group)
    E, H, Tm, K = 8, 64, 8, 1
    buf = tep.EPBuffer(group, E, H, Tm, K, backend=backend)
    g = torch.Generator().manual_seed(7 + rank)
    steps = []
    for step in range(3):
        T = 1 + step
        x = torch.randn(T, H, generator=g).to(BF16)
        idx = torch.randint(0, E, (T, K), generator=g)
        w = torch.rand(T, K, generator=g)
        if step == 1 and rank == 1:
            if how == "id":
                idx[T - 1, 0] = 99
            elif how == "shape":
                x = torch.randn(T, H + 1, generator=g).to(BF16)
            else:  # "capacity": more tokens than max_tokens_per_rank
                x, idx, w = torch.zeros(Tm + 1, H, dtype=BF16), torch.zeros(Tm + 1, K, dtype=torch.int64), \
                    torch.ones(Tm + 1, K)
        try:
            d = buf.dispatch(x, idx, w)
            y = buf.combine(d.x, d.handle)
            if not sync:
                buf.check()
            steps.append(("ok", x, idx, w, d.x.clone(), y.clone()))
        except tep.errors.PeerInputError as e:
            steps.append(("peer", e.bad_ranks, str(e)))
        except (tep.errors.InputError, tep.errors.CapacityError) as e:
            steps.append(("own", type(e).__name__, str(e)))
    buf.close()
    return steps


@pytest.mark.parametrize("geometry", ["", "bt=2,dec=3"])
def test_bad_input_without_sync_checks_raises_on_every_rank(geometry):
    """Sync checks off: the bad rank raises at once, the peers at their check() of the same call; next call pairs
    (also with the one-launch decode dispatch, which flags the id on the device)."""
    res = run_cpu_world(2, _bad_input_world, "triton", "id", False, geometry, timeout_s=120)
    assert res[1][1][0] == "own" and "99" in res[1][1][2]
    assert res[0][1][0] == "peer" and res[0][1][1] == [1]
    assert res[0][2][0] == "ok" and res[1][2][0] == "ok"
