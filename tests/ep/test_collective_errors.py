"""The collective input-error contract (docs/protocols.md, host protocol rule): a refused input on one rank fails
the call on EVERY rank (InputError / CapacityError on the bad rank naming its value, PeerInputError naming the bad
ranks on the others) and the next call pairs; long mixed refused / ok sequences on both backends, wires and
geometries; refusals of different kinds on different ranks; a live handle used after a refused call."""

import os

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import CapacityError, InputError, PeerInputError
from tritonep.reference import combine_reference_partial, dispatch_reference
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs

BF16 = torch.bfloat16


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
    _env(TRITONEP_GEOMETRY=cfg.get("geometry"), TRITONEP_SYNC_CHECKS=cfg.get("sync"))
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    E, K, Tm, A, H = cfg["E"], cfg["K"], cfg["Tmax"], cfg["A"], cfg.get("H", 64)
    buf = tep.EPBuffer(group, E, H, Tm, K, backend=cfg["backend"], expert_alignment=A,
                       dispatch_wire=cfg.get("dwire", "bf16"), combine_wire=cfg.get("cwire", "bf16"),
                       max_recv_tokens=cfg.get("max_recv"))
    res = []
    for i, plan in enumerate(SEQ):
        T = [5, 0, 7, 3][(i + rank) % 4] if isinstance(plan, dict) else Tm
        how = plan.get(rank) if isinstance(plan, dict) else "recv"
        x, idx, w = _make_call(rank, W, i, how, E, K, Tm, T, H)
        if plan == "recv+id" and rank == 1:  # over capacity AND a bad id: the input error wins on every rank
            idx[2, 0] = 99
        xg = x.detach().clone().requires_grad_(True) if how is None else x
        gy = torch.randn(x.shape[0], H, generator=torch.Generator().manual_seed(i * 10 + rank))

        def run():
            d = buf.dispatch(xg, idx, w)
            eo = (d.x.float() * 0.5 + 1.0).to(BF16)
            y = buf.combine(eo, d.handle)
            (y.float() * gy).sum().backward()  # a dense grad_y (the stride-0 case has its own test)
            return dict(x=d.x.detach().clone(), offs=d.expert_offsets.clone(), wts=d.weights.detach().clone(),
                        eo=eo, y=y.detach().clone(), gx=xg.grad.clone(), gy=gy)

        out = _outcome(run)
        res.append((out, x, idx, w))
    buf.close()
    return res


def _check_seq(W, cfg, res):
    E, A, H = cfg["E"], cfg["A"], cfg.get("H", 64)
    for i, plan in enumerate(SEQ):
        kinds = [res[r][i][0] for r in range(W)]
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
        xs, idxs, ws = ([res[r][i][j] for r in range(W)] for j in (1, 2, 3))
        ref = dispatch_reference(xs, idxs, ws, E, W, expert_alignment=A) if A > 1 else \
            dispatch_reference(xs, idxs, ws, E, W)
        eos = [kinds[r][1]["eo"] for r in range(W)]
        yp = combine_reference_partial(eos, ref, idxs, ws, [len(x) for x in xs])
        for r in range(W):
            got = kinds[r][1]
            if cfg.get("dwire", "bf16") == "bf16":
                assert torch.equal(got["x"], ref[r].x), f"call {i} rank {r}: rows"
            assert torch.equal(got["offs"], ref[r].expert_offsets), f"call {i} rank {r}: offsets"
            assert torch.equal(got["wts"], ref[r].weights), f"call {i} rank {r}: weights"
            if cfg.get("dwire", "bf16") == "bf16" and cfg.get("cwire", "bf16") == "bf16":
                assert torch.equal(got["y"], yp[r].to(BF16)), f"call {i} rank {r}: y"
            # grad_x[t] = sum_k 0.5 * w[t,k] * gy[t] over valid routes (bf16 rounding aside)
            want_g = 0.5 * (ws[r] * (idxs[r] >= 0)).sum(1, keepdim=True) * got["gy"]
            assert torch.allclose(got["gx"].float(), want_g, atol=5e-2, rtol=3e-2), f"call {i} rank {r}: grad"


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
    cfg = dict(SEQ_CASES[case])
    W = cfg.pop("W")
    cfg.update(E=4 * W, K=2, Tmax=8, max_recv=W * 8 * 2 - 1)  # only "recv" (all routes to expert 0) is over it
    res = run_cpu_world(W, _seq_world, cfg, timeout_s=300)
    _check_seq(W, cfg, res)


def _live_handle_world(group, backend, geometry):
    _env(TRITONEP_GEOMETRY=geometry)
    rank = dist.get_rank(group)
    E, K = 8, 2
    buf = tep.EPBuffer(group, E, H, 8, K, backend=backend, expert_alignment=2)
    x, idx, w = make_rank_inputs(rank, 6 - 3 * rank, H, E, K, seed=21)
    x.requires_grad_(True)
    d1 = buf.dispatch(x, idx, w)
    eo1 = (d1.x.float() * 0.25 - 1).to(BF16)
    # call 2 refused (rank 0: bad id found on the device, rank 1: wrong dtype refused at the front door)
    x2, idx2, w2 = make_rank_inputs(rank, 4, H, E, K, seed=22)
    if rank == 0:
        idx2[1, 1] = E
    else:
        x2 = x2.float()
    second = _outcome(lambda: buf.dispatch(x2, idx2, w2))
    y1 = buf.combine(eo1, d1.handle)  # the earlier handle still pairs
    gy = torch.randn(y1.shape, generator=torch.Generator().manual_seed(rank)).to(BF16)
    (y1.float() * gy.float()).sum().backward()
    # and a third, valid call after all that
    x3, idx3, w3 = make_rank_inputs(rank, 3 + rank, H, E, K, seed=23)
    d3 = buf.dispatch(x3, idx3, w3)
    y3 = buf.combine(d3.x, d3.handle)
    buf.close()
    return dict(second=second[:2], x=x.detach(), idx=idx, w=w, eo1=eo1, y1=y1.detach(), gx=x.grad,
                gy=gy, x3=x3, idx3=idx3, w3=w3, d3=d3.x, y3=y3)


@pytest.mark.parametrize("backend,geometry", [("triton", None), ("triton", "fs=1,fe=1,fc=1"), ("nccl", None)])
def test_refused_call_between_dispatch_and_combine_of_a_live_handle(backend, geometry):
    res = run_cpu_world(2, _live_handle_world, backend, geometry, timeout_s=120)
    assert res[0]["second"] == ("own", "InputError") and res[1]["second"] == ("own", "InputError"), \
        [r["second"] for r in res]
    xs, idxs, ws = ([r[k] for r in res] for k in ("x", "idx", "w"))
    ref = dispatch_reference(xs, idxs, ws, 8, 2, expert_alignment=2)
    yp = combine_reference_partial([r["eo1"] for r in res], ref, idxs, ws, [len(x) for x in xs])
    for r in range(2):
        assert torch.equal(res[r]["y1"], yp[r].to(BF16)), f"rank {r}: y of the earlier handle"
        want = (0.25 * (ws[r] * (idxs[r] >= 0)).sum(1, keepdim=True) * res[r]["gy"].float())
        assert torch.allclose(res[r]["gx"].float(), want, atol=3e-2, rtol=3e-2), f"rank {r}: grad"
    xs, idxs, ws = ([r[k] for r in res] for k in ("x3", "idx3", "w3"))
    ref = dispatch_reference(xs, idxs, ws, 8, 2, expert_alignment=2)
    yp = combine_reference_partial([r["d3"] for r in res], ref, idxs, ws, [len(x) for x in xs])
    for r in range(2):
        assert torch.equal(res[r]["d3"], ref[r].x) and torch.equal(res[r]["y3"], yp[r].to(BF16)), f"rank {r}"


def _odd_ids_world(group, backend, how):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
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
    out = [_outcome(lambda: buf.dispatch(x, idx, w))[:4]]
    x, idx, w = make_rank_inputs(rank, 2, H, E, K, seed=32)
    d = buf.dispatch(x, idx, w)
    out.append((x, idx, w, d.x))
    buf.close()
    return out


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
    xs, idxs, ws, got = zip(*[r[1] for r in res])
    ref = dispatch_reference(list(xs), list(idxs), list(ws), 6, 3)
    for r in range(3):
        assert torch.equal(got[r], ref[r].x), f"rank {r}: the call after the refused one"


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


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("how", ["id", "shape", "capacity"])
def test_bad_input_on_one_rank_fails_every_rank_then_pairs(backend, how):
    res = run_cpu_world(2, _bad_input_world, backend, how, True, timeout_s=120)
    # step 1: rank 1 names its own value, rank 0 names rank 1
    kind, name, text = res[1][1]
    assert kind == "own", res[1][1]
    if how == "id":
        assert name == "InputError" and "99" in text and "topk_idx[1, 0]" in text, text
    elif how == "shape":
        assert name == "InputError" and "65" in text, text
    else:
        assert name == "CapacityError" and "9" in text, text
    assert res[0][1][0] == "peer" and res[0][1][1] == [1] and "rank(s) [1]" in res[0][1][2], res[0][1]
    # steps 0 and 2 pair correctly on every rank (nothing of the refused step leaks into the next one)
    for step in (0, 2):
        xs, idxs, ws = ([res[r][step][j] for r in range(2)] for j in (1, 2, 3))
        ref = dispatch_reference(xs, idxs, ws, 8, 2)
        yp = combine_reference_partial([res[r][step][4] for r in range(2)], ref, idxs, ws, [len(x) for x in xs])
        for r in range(2):
            assert res[r][step][0] == "ok"
            assert torch.equal(res[r][step][4], ref[r].x), f"step {step} rank {r}: rows"
            assert torch.equal(res[r][step][5], yp[r].to(BF16)), f"step {step} rank {r}: y"
