"""Reliability: no hang, no silent corruption, every bad input named -- one test family per failure kind.

Every CPU test runs the real Triton kernels (interpreter) in a forked multi-rank world (``run_cpu_world``), whose own
``timeout_s`` turns any hang into a failure. Data movement is checked bit for bit against
:func:`tritonep.reference.dispatch_reference`; combine against :func:`combine_reference_partial` (the kernels'
summation order) bit for bit; gradients with the tolerances of tests/ep/test_dispatch_combine.py.

| failure kind | test (here unless a file is named) |
|---|---|
| one rank has every token, the others pass only -1 rows (100 calls) | test_only_rank0_has_tokens_100_calls |
| every token of every rank picks the same K experts of one rank | test_every_token_picks_the_same_experts |
| a rank with T=0, forward and backward, every step | test_rank_with_zero_tokens_forward_and_backward |
| T = Tmax + 1; max_recv_tokens exceeded by skew on ONE rank; usable after | test_capacity_errors_then_usable |
| exact capacity; triton refusal then usable | test_ep.py::test_all_tokens_to_one_expert_and_exact_capacity, |
|  | test_ep.py::test_capacity_error_then_usable |
| ranks built with different max_tokens_per_rank, nccl backend | test_config_mismatch_nccl_raises_on_every_rank |
| ... triton backend; mixed backends | test_ep.py::test_config_mismatch_raises_on_every_rank, |
|  | test_nccl_backend.py::test_mixed_backends_raise_on_every_rank |
| expert id == E (an appended shared-expert column) | test_shared_expert_column_is_named |
| other bad dtypes / shapes / ids | test_ep.py::test_bad_inputs_are_named_before_any_peer_is_touched |
| non-contiguous x, topk_idx, topk_weights (both backends) | test_non_contiguous_inputs_equal_contiguous |
| production hidden sizes, bf16 and fp8 (fp8 refuses 2880) | test_hidden_sizes_bf16, test_hidden_sizes_fp8 |
| fp8 / mxfp4 bit exactness, bad wire names | test_ep_wires.py |
| quantized dispatch to a rank that receives 0 rows | test_quantized_dispatch_to_rank_with_no_rows |
| expert-load statistics ``handle.counts`` (both backends) | test_counts_are_global_and_identical |
| random routing soak: 30 calls (CI), 500 calls (``soak`` marker) | test_soak_30_calls, test_soak_500_calls |
| CUDA-graph soak: 1000 replays, each checked (GPU, ``soak`` marker) | test_gpu_graph_soak_1000_replays |
| a peer that skips dispatch | test_ep.py::test_missing_peer_raises_peer_timeout |
| a peer that skips combine (push, pull) / the backward | test_peer_skips_combine_raises_peer_timeout, |
|  | test_peer_skips_backward_raises_peer_timeout |
| a rank raising inside the world | test_memory.py::test_rank_exception_names_the_rank |
| virtual-expert weight push / grad pull under moving skew | test_balance_transport.py |
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.bench.soak import soak_world
from tritonep.errors import BufferStateError, CapacityError, ConfigError, InputError, PeerTimeoutError, WireError
from tritonep.reference import (combine_backward_reference, combine_reference_partial, dispatch_backward_reference,
                                dispatch_reference)
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs
from tritonep.wire import dequantize_fp8_torch, quantize_fp8_torch

BF16 = torch.bfloat16


def _eo(x):
    """The test's expert "FFN": a deterministic elementwise function of the received rows."""
    return (x.float() * 0.5 + 1.0).to(BF16)


# ------------------------------------------------------------------------------------------------ shared bodies
def _calls_world(group, cfg, calls):
    """Rank body: one buffer, every call of ``calls[rank]`` as dispatch -> _eo -> combine; returns the tensors."""
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"], expert_alignment=cfg.get("A", 1),
                       backend=cfg.get("backend", "auto"), dispatch_wire=cfg.get("dwire", "bf16"))
    outs = []
    for x, idx, w in calls[rank]:
        d = buf.dispatch(x, idx, w)
        eo = buf.expert_out_buffer(d.x.shape[0])
        eo.copy_(_eo(d.x))
        y = buf.combine(eo, d.handle)
        outs.append(dict(x=d.x.clone(), ntpe=d.num_tokens_per_expert.clone(), offs=d.expert_offsets.clone(),
                         w=d.weights.clone(), eo=eo.clone(), y=y.clone(), counts=d.handle.counts.clone()))
    buf.close()
    return outs


def _check_calls(W, cfg, calls, res, rows=None):
    """Every call of every rank against the reference; ``rows(ref_x)`` maps reference rows (wire rounding)."""
    for i in range(len(calls[0])):
        xs, idxs, ws = ([calls[r][i][j] for r in range(W)] for j in range(3))
        ref = dispatch_reference(xs, idxs, ws, cfg["E"], W, expert_alignment=cfg.get("A", 1))
        for r in range(W):
            got = res[r][i]
            want_x = ref[r].x if rows is None else rows(ref[r].x)
            for k, want in (("ntpe", ref[r].num_tokens_per_expert), ("offs", ref[r].expert_offsets),
                            ("x", want_x), ("w", ref[r].weights), ("counts", ref[r].counts)):
                assert torch.equal(got[k], want), f"call {i} rank {r}: {k} differs from the reference"
        yp = combine_reference_partial([res[r][i]["eo"] for r in range(W)], ref, idxs, ws, [len(x) for x in xs])
        for r in range(W):
            assert torch.equal(res[r][i]["y"], yp[r].to(BF16)), f"call {i} rank {r}: y differs from the reference"


def _inputs(W, cfg, ntokens, seed, mask=0.1):
    return [make_rank_inputs(r, ntokens[r], cfg["H"], cfg["E"], cfg["K"], seed=seed, mask_frac=mask)
            for r in range(W)]


# ------------------------------------------------------------------------------------------------ skewed routing
def _rank0_only_world(group, reps):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    E, H, Tm, K = 2 * W, 64, 8, 2
    buf = tep.EPBuffer(group, E, H, Tm, K)
    g = torch.Generator().manual_seed(1234 + rank)
    bad = []
    for i in range(reps):
        T = int(torch.randint(1 if rank == 0 else 0, Tm + 1, (1,), generator=g))
        x = torch.randn(T, H, generator=g).to(BF16)
        if rank == 0:
            idx, w = torch.tensor([0, 1]).expand(T, K).clone(), torch.ones(T, K)
        else:
            idx, w = torch.full((T, K), -1, dtype=torch.int64), torch.rand(T, K, generator=g)
        d = buf.dispatch(x, idx, w)
        y = buf.combine(d.x, d.handle)
        if rank == 0:  # experts 0 and 1 live here: rows [x; x], y = x + x exactly (a doubling is exact in bf16)
            ok = (d.num_tokens_per_expert.tolist() == [T, T] and torch.equal(d.x, torch.cat([x, x]))
                  and bool((d.weights == 1).all()) and torch.equal(y, x + x))
        else:
            ok = (tuple(d.x.shape) == (0, H) and d.num_tokens_per_expert.tolist() == [0, 0]
                  and tuple(y.shape) == (T, H) and y.dtype == BF16 and not bool(y.any()))
        if not ok:
            bad.append((i, T))
    buf.close()
    return bad


def test_only_rank0_has_tokens_100_calls():
    assert run_cpu_world(3, _rank0_only_world, 100, timeout_s=300) == [[], [], []]


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_every_token_picks_the_same_experts(backend):
    W, cfg = 2, dict(E=8, H=64, Tmax=8, K=3, A=2, backend=backend)
    same = torch.tensor([6, 4, 5])  # all on rank 1, unsorted
    calls = []
    for r, T in enumerate([8, 5]):
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(r)).to(BF16)
        calls.append([(x, same.expand(T, 3).clone(), torch.rand(T, 3, generator=torch.Generator().manual_seed(9)))])
    res = run_cpu_world(W, _calls_world, cfg, calls, timeout_s=120)
    _check_calls(W, cfg, calls, res)
    assert res[1][0]["ntpe"].tolist() == [13, 13, 13, 0] and res[1][0]["offs"].tolist() == [14, 28, 42, 42]
    assert res[0][0]["x"].shape == (0, 64) and res[0][0]["ntpe"].tolist() == [0, 0, 0, 0]


# ------------------------------------------------------------------------------------------------ T = 0
_ZERO_STEPS = [[6, 0, 3], [0, 0, 5], [4, 0, 0], [0, 0, 0]]  # rank 1 never has a token; one step nobody has


def _zero_tokens_world(group, steps):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 6, 64, 8, 2)
    outs = []
    for s, Ts in enumerate(steps):
        x, idx, w = make_rank_inputs(rank, Ts[rank], 64, 6, 2, seed=40 + s)
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        d = buf.dispatch(x, idx, w)
        eo = (d.x.float() * 0.5).to(BF16)
        eo.retain_grad()
        y = buf.combine(eo, d.handle)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(99 + rank + 7 * s)).to(BF16)
        (y.float() * g.float()).sum().backward()
        outs.append(dict(y=y.detach().clone(), eo=eo.detach().clone(), g=g, gx=x.grad, gw=w.grad,
                         geo=eo.grad if eo.grad is not None or eo.shape[0] else torch.zeros(eo.shape, dtype=BF16)))
    buf.close()
    return outs


def test_rank_with_zero_tokens_forward_and_backward():
    W = 3
    res = run_cpu_world(W, _zero_tokens_world, _ZERO_STEPS, timeout_s=240)
    for s, Ts in enumerate(_ZERO_STEPS):
        ins = [make_rank_inputs(r, Ts[r], 64, 6, 2, seed=40 + s) for r in range(W)]
        xs, idxs, ws = ([a[j] for a in ins] for j in range(3))
        ref = dispatch_reference(xs, idxs, ws, 6, W)
        got = [res[r][s] for r in range(W)]
        yp = combine_reference_partial([o["eo"] for o in got], ref, idxs, ws, Ts)
        g_eo, g_w = combine_backward_reference([o["g"] for o in got], [o["eo"] for o in got], ref, idxs, ws)
        gx = dispatch_backward_reference([0.5 * o["geo"].float() for o in got], ref, idxs, Ts)
        for r in range(W):
            o = got[r]
            assert None not in (o["gx"], o["gw"], o["geo"]), f"step {s} rank {r}: no gradient"
            assert o["gx"].shape == (Ts[r], 64) and o["gw"].shape == (Ts[r], 2), (s, r)
            assert torch.equal(o["y"], yp[r].to(BF16)), (s, r)
            assert torch.allclose(o["geo"].float(), g_eo[r].float(), rtol=2 ** -7, atol=1e-6), (s, r)
            assert torch.allclose(o["gx"].float(), gx[r].float(), rtol=2 ** -6, atol=2 ** -6), (s, r)
            assert torch.allclose(o["gw"], g_w[r].float(), rtol=1e-3, atol=1e-3), (s, r)


# ------------------------------------------------------------------------------------------------ capacity
def _capacity_world(group, backend):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2, max_recv_tokens=16, backend=backend)
    errs = []
    try:  # one token over max_tokens_per_rank
        buf.dispatch(torch.zeros(9, 64, dtype=BF16), torch.zeros(9, 2, dtype=torch.int64), torch.ones(9, 2))
        errs.append(None)
    except CapacityError as e:
        errs.append((str(e), e.needed, e.available))
    for _ in range(2):  # skew: rank 0 would receive 2 ranks * 8 tokens * 2 routes = 32 rows > 16; rank 1 gets 0
        try:
            buf.dispatch(torch.ones(8, 64, dtype=BF16), torch.tensor([[0, 1]] * 8), torch.ones(8, 2))
            errs.append(None)
        except CapacityError as e:
            errs.append((str(e), e.needed, e.available))
    x, idx, w = make_rank_inputs(rank, 4, 64, 4, 2, seed=5)  # <= 2 * 4 * 2 = 16 rows anywhere: fits
    d = buf.dispatch(x, idx, w)
    eo = buf.expert_out_buffer(d.x.shape[0])
    eo.copy_(_eo(d.x))
    y = buf.combine(eo, d.handle)
    out = dict(x=d.x.clone(), ntpe=d.num_tokens_per_expert.clone(), offs=d.expert_offsets.clone(),
               w=d.weights.clone(), eo=eo.clone(), y=y.clone(), counts=d.handle.counts.clone())
    buf.close()
    return errs, [out]


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_capacity_errors_then_usable(backend):
    res = run_cpu_world(2, _capacity_world, backend, timeout_s=120)
    for r, (errs, _) in enumerate(res):
        assert None not in errs, f"rank {r}: a call over capacity was not refused: {errs}"
        text, needed, available = errs[0]
        assert (needed, available) == (9, 8) and "9" in text and "max_tokens_per_rank=8" in text, text
        for text, needed, available in errs[1:]:  # raised on BOTH ranks, although only rank 0 overflows
            assert (needed, available) == (32, 16), (r, text)
            assert "32" in text and "max_recv_tokens=16" in text and "rank 0" in text, text
    cfg = dict(E=4, H=64, Tmax=8, K=2)
    calls = [[make_rank_inputs(r, 4, 64, 4, 2, seed=5)] for r in range(2)]
    _check_calls(2, cfg, calls, [o for _, o in res])


def _mismatch_world(group):
    try:
        tep.EPBuffer(group, 6, 64, 8 + dist.get_rank(group), 2, backend="nccl")
        return "no error"
    except ConfigError as e:
        return str(e)


def test_config_mismatch_nccl_raises_on_every_rank():
    for msg in run_cpu_world(3, _mismatch_world, timeout_s=60):
        assert "max_tokens_per_rank" in msg and "rank 0: 8" in msg and "rank 2: 10" in msg, msg


# ------------------------------------------------------------------------------------------------ bad / odd inputs
def _shared_column_world(group, backend):
    rank = dist.get_rank(group)
    E, K = 256, 4
    buf = tep.EPBuffer(group, E, 64, 4, K, backend=backend)
    x, idx, w = make_rank_inputs(rank, 3, 64, E, K - 1, seed=2)
    idx_shared = torch.cat([idx, torch.full((3, 1), E, dtype=idx.dtype)], 1)  # the shared expert as id E
    w4 = torch.cat([w, torch.ones(3, 1)], 1)
    try:
        buf.dispatch(x, idx_shared, w4)
        err = None
    except InputError as e:
        err = str(e)
    # nothing was touched: the next valid call works
    ok_idx = torch.cat([idx, torch.full((3, 1), -1, dtype=idx.dtype)], 1)
    d = buf.dispatch(x, ok_idx, w4)
    y = buf.combine(_eo(d.x), d.handle)
    buf.close()
    return err, y


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_shared_expert_column_is_named(backend):
    res = run_cpu_world(2, _shared_column_world, backend, timeout_s=120)
    ins = [make_rank_inputs(r, 3, 64, 256, 3, seed=2) for r in range(2)]
    ref = dispatch_reference([a[0] for a in ins], [a[1] for a in ins], [a[2] for a in ins], 256, 2)
    yp = combine_reference_partial([_eo(rr.x) for rr in ref], ref, [a[1] for a in ins], [a[2] for a in ins], [3, 3])
    for r, (err, y) in enumerate(res):
        assert err is not None and "topk_idx[0, 3] = 256" in err and "num_experts=256" in err, err
        assert torch.equal(y, yp[r].to(BF16)), r


def _noncontig_world(group, backend):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 8, 64, 8, 3, backend=backend)
    x, idx, w = make_rank_inputs(rank, 7, 64, 8, 3, seed=8)
    wide = torch.stack([x, torch.zeros_like(x)], 2).reshape(7, 128)  # x == wide[:, ::2], a strided view
    views = (wide[:, ::2], idx.t().contiguous().t(), w.t().contiguous().t())
    assert not any(v.is_contiguous() for v in views)
    outs = []
    for args in ((x, idx, w), views):
        d = buf.dispatch(*args)
        y = buf.combine(_eo(d.x), d.handle)
        outs.append((d.x.clone(), d.weights.clone(), d.expert_offsets.clone(), y.clone()))
    buf.close()
    return outs


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_non_contiguous_inputs_equal_contiguous(backend):
    for r, (a, b) in enumerate(run_cpu_world(2, _noncontig_world, backend, timeout_s=120)):
        assert all(torch.equal(u, v) for u, v in zip(a, b)), f"rank {r}: non-contiguous inputs changed the result"


# ------------------------------------------------------------------------------------------------ hidden sizes
HIDDEN_BF16 = [2048, 2880, 3072, 4096, 6144, 7168]
HIDDEN_FP8 = [2048, 3072, 4096, 6144, 7168]


def _hidden_world(group, hiddens, dwire):
    rank = dist.get_rank(group)
    res = {}
    for H in hiddens:
        cfg = dict(E=4, H=H, Tmax=3, K=2, dwire=dwire)
        calls = [[make_rank_inputs(r, [3, 2][r], H, 4, 2, seed=H)] for r in range(2)]
        out = _calls_world(group, cfg, calls)[0]
        if dwire != "bf16":
            buf = tep.EPBuffer(group, 4, H, 3, 2, dispatch_wire=dwire)
            dq = buf.dispatch(*calls[rank][0], keep_quantized=True)
            out["q"], out["s"] = dq.x.clone(), dq.x_scales.clone()
            buf.close()
        res[H] = out
    if dwire == "fp8":
        try:
            tep.EPBuffer(group, 4, 2880, 3, 2, dispatch_wire="fp8")
            res["2880"] = None
        except WireError as e:
            res["2880"] = str(e)
    return res


def _fp8_rows(x):
    q, s = quantize_fp8_torch(x)
    return dequantize_fp8_torch(q, s, torch.float32).to(BF16)


def test_hidden_sizes_bf16():
    res = run_cpu_world(2, _hidden_world, HIDDEN_BF16, "bf16", timeout_s=240)
    for H in HIDDEN_BF16:
        calls = [[make_rank_inputs(r, [3, 2][r], H, 4, 2, seed=H)] for r in range(2)]
        _check_calls(2, dict(E=4, H=H), calls, [[res[r][H]] for r in range(2)])


def test_hidden_sizes_fp8():
    res = run_cpu_world(2, _hidden_world, HIDDEN_FP8, "fp8", timeout_s=240)
    for H in HIDDEN_FP8:
        calls = [[make_rank_inputs(r, [3, 2][r], H, 4, 2, seed=H)] for r in range(2)]
        _check_calls(2, dict(E=4, H=H), calls, [[res[r][H]] for r in range(2)], rows=_fp8_rows)
        ref = dispatch_reference(*([c[0][j] for c in calls] for j in range(3)), 4, 2)
        for r in range(2):
            q, s = quantize_fp8_torch(ref[r].x)
            assert torch.equal(res[r][H]["q"], q.view(torch.uint8)) and torch.equal(res[r][H]["s"], s), (H, r)
    for r in range(2):
        assert res[r]["2880"] is not None and "2880" in res[r]["2880"] and "128" in res[r]["2880"]


def _empty_quantized_world(group, wire):
    rank = dist.get_rank(group)
    H = 256
    buf = tep.EPBuffer(group, 4, H, 4, 2, dispatch_wire=wire)
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(rank)).to(BF16)
    idx, w = torch.tensor([[0, 1]] * 4), torch.rand(4, 2, generator=torch.Generator().manual_seed(3))
    dq = buf.dispatch(x, idx, w, keep_quantized=True)  # experts 0, 1 live on rank 0: rank 1 receives nothing
    d = buf.dispatch(x, idx, w)
    y = buf.combine(buf.expert_out_buffer(d.x.shape[0]).copy_(d.x), d.handle)
    out = dict(q=(dq.x.dtype, tuple(dq.x.shape)), s=(dq.x_scales.dtype, tuple(dq.x_scales.shape)),
               x=(d.x.dtype, tuple(d.x.shape)), w=tuple(d.weights.shape), ntpe=d.num_tokens_per_expert.tolist(),
               y=y.clone(), rows=d.x.clone())
    buf.close()
    return out


@pytest.mark.parametrize("wire,q_cols,s_dtype,s_cols", [("fp8", 256, torch.float32, 2),
                                                        ("mxfp4", 128, torch.uint8, 8)])
def test_quantized_dispatch_to_rank_with_no_rows(wire, q_cols, s_dtype, s_cols):
    res = run_cpu_world(2, _empty_quantized_world, wire, timeout_s=120)
    e = res[1]
    assert e["q"] == (torch.uint8, (0, q_cols)) and e["s"] == (s_dtype, (0, s_cols)), (e["q"], e["s"])
    assert e["x"] == (BF16, (0, 256)) and e["w"] == (0,) and e["ntpe"] == [0, 0]
    assert res[0]["q"] == (torch.uint8, (16, q_cols)) and res[0]["ntpe"] == [8, 8]
    # y of both ranks: sum_k w * row, rows as received (wire-rounded), computed in the kernels' order
    x = [torch.randn(4, 256, generator=torch.Generator().manual_seed(r)).to(BF16) for r in range(2)]
    idx, w = [torch.tensor([[0, 1]] * 4)] * 2, [torch.rand(4, 2, generator=torch.Generator().manual_seed(3))] * 2
    ref = dispatch_reference(x, idx, w, 4, 2)
    yp = combine_reference_partial([res[0]["rows"], res[1]["rows"]], ref, idx, w, [4, 4])
    for r in range(2):
        assert torch.equal(res[r]["y"], yp[r].to(BF16)), r


# ------------------------------------------------------------------------------------------------ statistics
@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_counts_are_global_and_identical(backend):
    W, cfg = 3, dict(E=6, H=64, Tmax=8, K=2, backend=backend)
    calls = [[] for _ in range(W)]
    for s, Ts in enumerate([[8, 3, 5], [0, 8, 2], [4, 0, 0]]):
        for r, a in enumerate(_inputs(W, cfg, Ts, seed=60 + s, mask=0.25)):
            if Ts[r] > 1:
                a[1][0] = torch.tensor([r, r])  # one token picks the same expert twice: two routes
            calls[r].append(a)
    res = run_cpu_world(W, _calls_world, cfg, calls, timeout_s=180)
    _check_calls(W, cfg, calls, res)  # includes counts == reference counts on every rank
    for i in range(3):
        c = res[0][i]["counts"]
        assert c.dtype == torch.int32 and c.shape == (W, 6)
        assert all(torch.equal(res[r][i]["counts"], c) for r in range(W)), f"call {i}: counts differ across ranks"
        valid = sum(int((calls[r][i][1] >= 0).sum()) for r in range(W))
        assert int(c.sum()) == valid
        for r in range(W):  # row r = routes of source rank r; column sums = rows every expert received
            assert torch.equal(c[r], torch.bincount(calls[r][i][1][calls[r][i][1] >= 0], minlength=6).int())
            assert torch.equal(c.sum(0)[2 * r:2 * r + 2].int(), res[r][i]["ntpe"])


# ------------------------------------------------------------------------------------------------ soak
SOAK = dict(E=12, H=96, Tmax=12, K=3, A=2)


def test_soak_30_calls():
    res = run_cpu_world(3, soak_world, 30, SOAK, 1, timeout_s=300)
    assert res == [(30, [])] * 3, res


@pytest.mark.soak
def test_soak_500_calls():
    res = run_cpu_world(3, soak_world, 500, SOAK, 2, timeout_s=3600)
    assert res == [(500, [])] * 3, res


@pytest.mark.gpu
@pytest.mark.soak
def test_gpu_graph_soak_1000_replays(gpu_world):
    from tritonep.testing.gpu_checks import graph_soak_world

    res = gpu_world(2, graph_soak_world, 64, 512, 128, 8, 1000, timeout_s=1200)
    assert res == [(1000, []), (1000, [])], res


# ------------------------------------------------------------------------------------------------ missing peers
def _skip_combine_world(group, kind):
    os.environ["TRITONEP_TIMEOUT_S"] = "2"
    os.environ["TRITONEP_SYNC_CHECKS"] = "1"  # strict: a peer lost mid-call raises in that call
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 6, 64, 8, 2)
    x, idx, w = make_rank_inputs(rank, 8, 64, 6, 2, seed=3)
    d = buf.dispatch(x, idx, w)
    if rank == 1:
        return "skipped"  # this rank never calls combine
    t0 = time.monotonic()
    try:
        y = buf.combine(_eo(d.x), d.handle, kind=kind)
        err = "no error (silent result)", float(y.float().abs().sum())
    except PeerTimeoutError as e:
        err = (e.wait, e.peer, str(e))
    took = time.monotonic() - t0
    try:
        buf.dispatch(x, idx, w)
        after = "no error"
    except BufferStateError as e:
        after = str(e)
    return err, took, after


@pytest.mark.parametrize("kind", ["push", "pull"])
def test_peer_skips_combine_raises_peer_timeout(kind):
    res = run_cpu_world(3, _skip_combine_world, kind, timeout_s=120, check_protocol=False)  # a rank skips on purpose
    assert res[1] == "skipped"
    for r in (0, 2):
        err, took, after = res[r]
        assert err[:2] == ("combine.data", 1), err
        assert "combine" in err[2] and "peer 1" in err[2] and f"rank {r}" in err[2], err
        assert took < 30, f"rank {r} took {took:.1f} s to give up (TRITONEP_TIMEOUT_S=2)"
        assert "unusable" in after, after


def _skip_backward_world(group):
    os.environ["TRITONEP_TIMEOUT_S"] = "2"
    os.environ["TRITONEP_SYNC_CHECKS"] = "1"  # strict: a peer lost mid-call raises in that call
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 6, 64, 8, 2)
    x, idx, w = make_rank_inputs(rank, 8, 64, 6, 2, seed=4)
    x = x.clone().requires_grad_(True)
    d = buf.dispatch(x, idx, w)
    y = buf.combine((d.x.float() * 0.5).to(BF16), d.handle)
    if rank == 1:
        return "skipped"  # this rank never runs the backward
    try:
        y.float().sum().backward()
        err = "no error (silent gradient)", float(x.grad.float().abs().sum())
    except PeerTimeoutError as e:
        err = (e.wait, e.peer, str(e))
    try:
        buf.dispatch(x.detach(), idx, w)
        after = "no error"
    except BufferStateError as e:
        after = str(e)
    return err, after


def test_peer_skips_backward_raises_peer_timeout():
    res = run_cpu_world(3, _skip_backward_world, timeout_s=120, check_protocol=False)  # a rank skips on purpose
    for r in (0, 2):
        err, after = res[r]
        assert err[0] in ("dispatch.data", "dispatch.ack") and err[1] == 1, err
        assert "backward" in err[2], err
        assert "unusable" in after, after
