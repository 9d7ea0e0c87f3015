"""The collective input-error contract (docs/protocols.md, host protocol rule): a refused input on one rank fails
the call on EVERY rank (InputError / CapacityError on the bad rank naming its value, PeerInputError naming the bad
ranks on the others) and the next call pairs; long mixed refused / ok sequences on both backends, wires and
geometries; refusals of different kinds on different ranks; a live handle used after a refused call."""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import (BF16, check_calls, check_grads, diff, expected, open_buffer, record, run_call,
                                      run_grad_call, set_env)
from tests.support.outcomes import outcome

H = 64


def _identity(x):
    return x


# per call: {rank: how} for the refused ranks; "id" (expert id 99), "neg" (-2), "cap" (T > Tmax), "dtype"
# (float32 x), "recv" (all ranks: more rows than max_recv_tokens)
SEQ = [{}, {1: "id"}, {}, {0: "cap", 1: "neg"}, "recv", {}, {0: "dtype"}, "recv+id", {}]


def _make_call(rank, W, i, how, E, K, Tm, T, H=H):
    x, idx, w = make_rank_inputs(rank, T, H, E, K, seed=300 + i, mask_frac=0.1)
    if how == "id":
        idx[T - 1, K - 1] = 99
    elif how == "neg":
        idx[0, 0] = -2
    elif how == "cap":
        x, idx, w = torch.zeros(Tm + 1, H, dtype=BF16), torch.zeros(Tm + 1, K, dtype=torch.int64), \
            torch.ones(Tm + 1, K)
    elif how == "dtype":
        x = x.float()
    elif how == "recv":  # every route of every rank to expert 0: rank 0 receives W*T*K rows
        idx = torch.zeros_like(idx)
    return x, idx, w


def _seq_world(group, cfg):
    """The SEQ calls on one buffer: a good call runs dispatch -> expert -> combine -> backward
    (:func:`run_grad_call`), a refused one the forward only (its inputs need no gradient)."""
    set_env(TRITONEP_GEOMETRY=cfg.get("geometry"), TRITONEP_SYNC_CHECKS=cfg.get("sync"))
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    E, K, Tm, H = cfg["E"], cfg["K"], cfg["Tmax"], cfg["H"]
    buf = open_buffer(group, cfg)
    res = []
    for i, plan in enumerate(SEQ):
        T = [5, 0, 7, 3][(i + rank) % 4] if isinstance(plan, dict) else Tm
        how = plan.get(rank) if isinstance(plan, dict) else "recv"
        x, idx, w = _make_call(rank, W, i, how, E, K, Tm, T, H)
        if plan == "recv+id" and rank == 1:  # over capacity AND a bad id: the input error wins on every rank
            idx[2, 0] = 99
        if how is None:  # a dense grad_y (the stride-0 case has its own test, in test_backward.py)
            res.append(outcome(lambda: run_grad_call(buf, x, idx, w, grad_seed=i * 10 + rank, bias=1.0)))
        else:
            res.append(outcome(lambda: run_call(buf, x, idx, w, out_buffer=False)))
    buf.close()
    return res


def _check_seq(W, cfg, res):
    wires = (cfg.get("dwire", "bf16"), cfg.get("cwire", "bf16"))
    fields = ("ntpe", "offs", "w", "counts") + (("x",) if wires[0] == "bf16" else ()) + \
        (("y",) if wires == ("bf16", "bf16") else ())
    for i, plan in enumerate(SEQ):
        kinds = [res[r][i] for r in range(W)]
        if plan == "recv":
            assert all(k[0] == "own" and k[1] == "CapacityError" for k in kinds), (i, kinds)
            continue
        if plan == "recv+id":
            assert kinds[1][:2] == ("own", "InputError") and "99" in kinds[1][2], kinds[1]
            assert all(kinds[r][0] == "peer" and kinds[r][3] == [1] for r in range(W) if r != 1), kinds
            continue
        if plan:
            bad = sorted(plan)
            for r in range(W):
                k = kinds[r]
                if r in plan:
                    want = "CapacityError" if plan[r] == "cap" else "InputError"
                    assert k[0] == "own" and k[1] == want, (i, r, k)
                    if plan[r] == "id":
                        assert "99" in k[2], k
                    if plan[r] == "neg":
                        assert "-2" in k[2], k
                else:
                    assert k[0] == "peer" and k[3] == bad, (i, r, k)
            continue
        assert all(k[0] == "ok" for k in kinds), (i, kinds)
        got = [k[1] for k in kinds]
        want = expected([(g["xin"], g["idx"], g["win"]) for g in got], cfg["E"], cfg["A"], eos=[g["eo"] for g in got])
        for r in range(W):
            assert diff(got[r], want[r], fields) == [], f"call {i} rank {r}"
        check_grads(cfg["E"], got, expert_alignment=cfg["A"], where=f"call {i}")


SEQ_CASES = {
    "triton-W2-A2": dict(W=2, backend="triton", A=2),
    "triton-W3": dict(W=3, backend="triton", A=1),
    "triton-W2-fused": dict(W=2, backend="triton", A=2, geometry="fs=1,fe=1,fc=1"),
    "triton-W2-fp8-strict": dict(W=2, backend="triton", A=1, dwire="fp8", cwire="fp8", sync="1", H=128),
    "triton-W2-decode": dict(W=2, backend="triton", A=2, geometry="bt=2,dec=3"),
    "triton-W3-decode-fp8-strict": dict(W=3, backend="triton", A=1, dwire="fp8", cwire="fp8", sync="1", H=128,
                                        geometry="bt=4,dec=2"),
    "nccl-W2-A2": dict(W=2, backend="nccl", A=2),
    "nccl-W3-mxfp4": dict(W=3, backend="nccl", A=1, dwire="mxfp4", cwire="mxfp4"),
}


@pytest.mark.parametrize("case", list(SEQ_CASES))
def test_mixed_refused_and_ok_sequence(case):
    cfg = dict(dict(H=64), **SEQ_CASES[case])
    W = cfg.pop("W")
    cfg.update(E=4 * W, K=2, Tmax=8, max_recv=W * 8 * 2 - 1)  # only "recv" (all routes to expert 0) is over it
    res = run_cpu_world(W, _seq_world, cfg, timeout_s=300)
    _check_seq(W, cfg, res)


def _live_handle_world(group, backend, geometry):
    set_env(TRITONEP_GEOMETRY=geometry)
    rank = dist.get_rank(group)
    E, K = 8, 2
    buf = tep.EPBuffer(group, E, H, 8, K, backend=backend, expert_alignment=2)
    x0, idx, w0 = make_rank_inputs(rank, 6 - 3 * rank, H, E, K, seed=21)
    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    d1 = buf.dispatch(x, idx, w)
    eo1 = (d1.x.float() * 0.25 - 1).to(BF16)
    eo1.retain_grad()
    # call 2 refused (rank 0: bad id found on the device, rank 1: wrong dtype refused at the front door)
    x2, idx2, w2 = make_rank_inputs(rank, 4, H, E, K, seed=22)
    if rank == 0:
        idx2[1, 1] = E
    else:
        x2 = x2.float()
    second = outcome(lambda: buf.dispatch(x2, idx2, w2))
    y1 = buf.combine(eo1, d1.handle)  # the earlier handle still pairs
    gy = torch.randn(y1.shape, generator=torch.Generator().manual_seed(rank)).to(BF16)
    (y1.float() * gy.float()).sum().backward()
    first = dict(record(d1, eo1, y1), g=gy, geo=eo1.grad.clone(), gx=x.grad.clone(), gw=w.grad.clone(), xin=x0,
                 idx=idx, win=w0)
    # and a third, valid call after all that
    third = (*make_rank_inputs(rank, 3 + rank, H, E, K, seed=23),)
    rec3 = run_call(buf, *third, fn=_identity, out_buffer=False)
    buf.close()
    return second[:2], first, third, rec3


@pytest.mark.parametrize("backend,geometry", [("triton", None), ("triton", "fs=1,fe=1,fc=1"), ("nccl", None)])
def test_refused_call_between_dispatch_and_combine_of_a_live_handle(backend, geometry):
    res = run_cpu_world(2, _live_handle_world, backend, geometry, timeout_s=120)
    assert [r[0] for r in res] == [("own", "InputError")] * 2, [r[0] for r in res]
    firsts = [r[1] for r in res]
    check_calls(dict(E=8, A=2), [[(f["xin"], f["idx"], f["win"])] for f in firsts], [[f] for f in firsts])
    check_grads(8, firsts, scale=0.25, expert_alignment=2, where="the earlier handle")
    check_calls(dict(E=8, A=2), [[r[2]] for r in res], [[r[3]] for r in res])


def _odd_ids_world(group, backend, how):
    rank = dist.get_rank(group)
    E, K = 6, 2
    buf = tep.EPBuffer(group, E, H, 4, K, backend=backend)
    T = 0 if rank == 2 else 3
    x, idx, w = make_rank_inputs(rank, T, H, E, K, seed=31)
    if rank == 0:
        if how == "huge":
            idx[2, 1] = 2 ** 40 + 1  # int64 that wraps into a valid int32 id
        elif how == "int32":
            idx = idx.to(torch.int32)
            idx[0, 1] = -(2 ** 31)
        elif how == "t0-dtype":  # a T=0 rank with a refused dtype
            x, idx, w = torch.zeros(0, H), torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K)
    if rank == 2 and how == "t0-dtype":
        x = torch.zeros(0, H)  # the T=0 rank's own input is refused too
    first = outcome(lambda: buf.dispatch(x, idx, w))[:4]
    nxt = make_rank_inputs(rank, 2, H, E, K, seed=32)
    rec = run_call(buf, *nxt, out_buffer=False)
    buf.close()
    return first, nxt, rec


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("how", ["huge", "int32", "t0-dtype"])
def test_odd_ids_and_empty_bad_ranks_fail_every_rank(backend, how):
    res = run_cpu_world(3, _odd_ids_world, backend, how, timeout_s=120)
    first = [r[0] for r in res]
    bad = [0, 2] if how == "t0-dtype" else [0]
    for r in range(3):
        if r in bad:
            assert first[r][0] == "own" and first[r][1] == "InputError", first[r]
        else:
            assert first[r][0] == "peer" and first[r][3] == bad, first[r]
    if how == "huge":
        assert str(2 ** 40 + 1) in first[0][2], first[0][2]
    if how == "int32":
        assert str(-(2 ** 31)) in first[0][2], first[0][2]
    check_calls(dict(E=6), [[r[1]] for r in res], [[r[2]] for r in res])  # the call after the refused one


def _bad_input_world(group, backend, how, sync, geometry=""):
    """Three calls (T = 1, 2, 3; K = 1, identity expert); in call 1 rank 1's input is bad (``how``)."""
    set_env(TRITONEP_SYNC_CHECKS="1" if sync else "0", TRITONEP_GEOMETRY=geometry or None)
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

        def call():
            rec = run_call(buf, x, idx, w, fn=_identity, out_buffer=False)
            if not sync:
                buf.check()
            return rec

        steps.append((outcome(call), (x, idx, w)))
    buf.close()
    return steps


def _check_steps_pair(res, steps, padded=False):
    """The given steps pair correctly on every rank (nothing of a refused step leaks into the next one);
    ``padded``: sync checks off (the calls return max_recv_tokens rows)."""
    for step in steps:
        assert [r[step][0][0] for r in res] == ["ok"] * len(res), step
        check_calls(dict(E=8), [[r[step][1]] for r in res], [[r[step][0][1]] for r in res], padded=padded)


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("how", ["id", "shape", "capacity"])
def test_bad_input_on_one_rank_fails_every_rank_then_pairs(backend, how):
    res = run_cpu_world(2, _bad_input_world, backend, how, True, timeout_s=120)
    # step 1: rank 1 names its own value, rank 0 names rank 1
    kind, name, text, _ = res[1][1][0]
    assert kind == "own", res[1][1][0]
    if how == "id":
        assert name == "InputError" and "99" in text and "topk_idx[1, 0]" in text, text
    elif how == "shape":
        assert name == "InputError" and "65" in text, text
    else:
        assert name == "CapacityError" and "9" in text, text
    peer = res[0][1][0]
    assert peer[0] == "peer" and peer[3] == [1] and "rank(s) [1]" in peer[2], peer
    _check_steps_pair(res, (0, 2))


@pytest.mark.parametrize("geometry", ["", "bt=2,dec=3"])
def test_bad_input_without_sync_checks_raises_on_every_rank(geometry):
    """Sync checks off: the bad rank raises at once, the peers at their check() of the same call; next call pairs
    (also with the one-launch decode dispatch, which flags the id on the device)."""
    res = run_cpu_world(2, _bad_input_world, "triton", "id", False, geometry, timeout_s=120)
    assert res[1][1][0][0] == "own" and "99" in res[1][1][0][2]
    assert res[0][1][0][0] == "peer" and res[0][1][0][3] == [1]
    _check_steps_pair(res, (2,), padded=True)
