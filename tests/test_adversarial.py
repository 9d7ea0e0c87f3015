"""Adversarial probes of EPBuffer / MoELayer in the multi-rank CPU world (real Triton kernels, interpreter).

The second half ("bugs") holds the reproducers of the nine bugs an adversarial review found (non-bf16 dtypes
rounded, foreign handles accepted, capacity errors poisoning graph-mode buffers, a counts race after a refused
dispatch, a data timeout raised one call late, geometry / num_sms not checked across ranks, stale expert outputs
in MoELayer backward, bf16 subnormals flushed by the interpreter); all fixed, kept as regression tests. The first
half covers cases no other test file exercised.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import CapacityError, ConfigError
from tritonep.reference import combine_reference_partial, dispatch_reference
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs

BF16 = torch.bfloat16


def _eo(x):
    return (x.float() * 0.5 + 1.0).to(BF16)


def _dc(buf, x, idx, w, kind=None):
    d = buf.dispatch(x, idx, w)
    eo = _eo(d.x)
    y = buf.combine(eo, d.handle, kind=kind)
    return dict(x=d.x.clone(), ntpe=d.num_tokens_per_expert.clone(), offs=d.expert_offsets.clone(),
                w=d.weights.clone(), eo=eo, y=y.clone())


def _bad(W, E, A, calls, outs, equal=torch.equal):
    """Compare every rank's outputs of one call with the reference; returns the list of mismatches."""
    xs, idxs, ws = ([calls[r][j] for r in range(W)] for j in range(3))
    ref = dispatch_reference(xs, idxs, ws, E, W, expert_alignment=A)
    yp = combine_reference_partial([outs[r]["eo"] for r in range(W)], ref, idxs, ws, [len(x) for x in xs])
    bad = []
    for r in range(W):
        for k, want in (("ntpe", ref[r].num_tokens_per_expert), ("offs", ref[r].expert_offsets),
                        ("x", ref[r].x), ("w", ref[r].weights), ("y", yp[r].to(BF16))):
            if not equal(outs[r][k], want):
                bad.append((r, k))
    return bad


# ================================================================================================ passing probes
def _odd_shapes_world(group, cases):
    rank = dist.get_rank(group)
    out = []
    for cfg, calls in cases:
        buf = tep.EPBuffer(group, cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"], expert_alignment=cfg.get("A", 1))
        out.append(_dc(buf, *calls[rank], kind=cfg.get("kind")))
        buf.close()
    return out


def test_odd_shapes_match_reference():
    """Duplicate experts in a row, K > E, E == W (L = 1), odd hidden sizes, alignment > rows, int32 ids."""
    W = 2
    g = torch.Generator().manual_seed(0)
    dup = torch.tensor([[1, 1, 1], [0, 0, 3], [2, 2, -1], [3, -1, 3], [-1, -1, -1], [0, 1, 0]])
    cases = [
        (dict(E=4, H=64, Tmax=8, K=3, A=3, kind="pull"),
         [(torch.randn(6, 64, generator=g).to(BF16), dup, torch.rand(6, 3, generator=g)) for _ in range(W)]),
        (dict(E=2, H=100, Tmax=8, K=5), [make_rank_inputs(r, 5, 100, 2, 5, seed=1) for r in range(W)]),
        (dict(E=2, H=17, Tmax=8, K=1, kind="pull"), [make_rank_inputs(r, 7, 17, 2, 1, seed=2, mask_frac=0.3)
                                                      for r in range(W)]),
        (dict(E=4, H=64, Tmax=8, K=2, A=64), [make_rank_inputs(r, 3, 64, 4, 2, seed=3) for r in range(W)]),
        (dict(E=4, H=64, Tmax=19, K=2), [tuple(t.to(torch.int32) if i == 1 else t for i, t in
                                               enumerate(make_rank_inputs(r, 19, 64, 4, 2, seed=4)))
                                         for r in range(W)]),
    ]
    res = run_cpu_world(W, _odd_shapes_world, cases, timeout_s=240)
    for i, (cfg, calls) in enumerate(cases):
        assert _bad(W, cfg["E"], cfg.get("A", 1), calls, [res[r][i] for r in range(W)]) == [], cfg


def _inflight_world(group, c1, c2, kind):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 6, 64, 8, 2)
    d1 = buf.dispatch(*c1[rank])
    d2 = buf.dispatch(*c2[rank])
    e1, e2 = _eo(d1.x), _eo(d2.x)
    y2 = buf.combine(e2, d2.handle, kind=kind)  # combines in the reverse order of the dispatches
    y1 = buf.combine(e1, d1.handle, kind=kind)
    y1b = buf.combine(e1, d1.handle, kind=kind)
    buf.close()
    return [dict(x=d1.x, ntpe=d1.num_tokens_per_expert, offs=d1.expert_offsets, w=d1.weights, eo=e1, y=y1),
            dict(x=d2.x, ntpe=d2.num_tokens_per_expert, offs=d2.expert_offsets, w=d2.weights, eo=e2, y=y2), y1b]


@pytest.mark.parametrize("kind", ["push", "pull"])
def test_two_handles_in_flight_combined_in_reverse_order(kind):
    W = 3
    c1 = [make_rank_inputs(r, [8, 5, 2][r], 64, 6, 2, seed=1) for r in range(W)]
    c2 = [make_rank_inputs(r, [3, 8, 0][r], 64, 6, 2, seed=2) for r in range(W)]
    res = run_cpu_world(W, _inflight_world, c1, c2, kind, timeout_s=240)
    assert _bad(W, 6, 1, c1, [res[r][0] for r in range(W)]) == []
    assert _bad(W, 6, 1, c2, [res[r][1] for r in range(W)]) == []
    assert all(torch.equal(res[r][2], res[r][0]["y"]) for r in range(W))


def _nan_world(group, calls, backend, kind):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 3, backend=backend)
    out = _dc(buf, *calls[rank], kind=kind)
    buf.close()
    return out


def _nan_inputs(rank):
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(8, 64, generator=g).to(BF16)
    x[0, 3], x[1, :], x[2, 5] = float("nan"), float("inf"), -float("inf")
    idx = torch.tensor([[0, 1, 2], [3, 2, -1], [1, 1, 0], [2, -1, -1], [0, 3, 1], [-1, -1, -1], [2, 3, 0], [1, 0, 3]])
    w = torch.rand(8, 3, generator=g)
    w[4, 0], w[4, 1], w[6, 2], w[7, 1] = float("nan"), -2.5, float("inf"), 0.0
    w[3, 1] = w[5, 0] = float("nan")  # NaN weights on masked slots must not leak
    w[1, 0] = 0.0  # 0 * inf row
    return x, idx, w


@pytest.mark.parametrize("backend,kind", [("triton", "push"), ("triton", "pull"), ("nccl", None)])
def test_nan_inf_negative_weights_match_reference(backend, kind):
    W = 2
    calls = [_nan_inputs(r) for r in range(W)]
    res = run_cpu_world(W, _nan_world, calls, backend, kind, timeout_s=120)

    def eq(a, b):
        return a.shape == b.shape and (torch.equal(a, b) or bool(torch.isclose(
            a.float(), b.float(), rtol=0, atol=0, equal_nan=True).all()))

    assert _bad(W, 4, 1, calls, res, equal=eq) == []
    for r in range(W):
        assert bool(torch.isfinite(res[r]["y"][3].float()).all())  # NaN weight on a masked slot: no leak
        assert not bool(res[r]["y"][5].any())  # every slot masked: zeros


def _two_buffers_world(group, calls):
    rank = dist.get_rank(group)
    a, b = tep.EPBuffer(group, 4, 64, 8, 2), tep.EPBuffer(group, 4, 64, 8, 2)
    out = []
    for i, c in enumerate(calls[rank]):
        p, q = (a, b) if i % 2 == 0 else (b, a)
        dp, dq = p.dispatch(*c), q.dispatch(*c)  # both buffers in flight at once
        yq = q.combine(_eo(dq.x), dq.handle)
        out.append(dict(x=dp.x, ntpe=dp.num_tokens_per_expert, offs=dp.expert_offsets, w=dp.weights, eo=_eo(dp.x),
                        y=p.combine(_eo(dp.x), dp.handle), yq=yq))
    a.close()
    b.close()
    return out


def test_two_buffers_used_alternately():
    W = 2
    calls = [[make_rank_inputs(r, 8, 64, 4, 2, seed=s) for s in range(3)] for r in range(W)]
    res = run_cpu_world(W, _two_buffers_world, calls, timeout_s=120)
    for i in range(3):
        outs = [res[r][i] for r in range(W)]
        assert _bad(W, 4, 1, [calls[r][i] for r in range(W)], outs) == []
        assert all(torch.equal(o["yq"], o["y"]) for o in outs)


# ================================================================================================ bugs (fixed)
def _dtype_refused_world(group, dtype, backend):
    try:
        tep.EPBuffer(group, 4, 64, 4, 1, dtype=dtype, backend=backend)
        return "no error"
    except ConfigError as e:
        return str(e)


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_bf16_dtype_is_refused(dtype, backend):
    # was: float32/float16 accepted and silently rounded through bf16 rows (triton backend); now refused by name
    for msg in run_cpu_world(2, _dtype_refused_world, dtype, backend, timeout_s=60):
        assert f"dtype={dtype}" in msg and "bfloat16" in msg


def _foreign_handle_world(group):
    rank = dist.get_rank(group)
    a = tep.EPBuffer(group, 4, 64, 8, 2)
    b = tep.EPBuffer(group, 8, 64, 8, 2)  # differs only in num_experts
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=1)
    d = a.dispatch(x, idx, w)
    try:
        b.combine(d.x, d.handle)
        out = "no error"
    except ConfigError as e:
        out = str(e)
    b.close()
    a.close()
    return out


def test_handle_from_another_buffer_is_refused():
    for msg in run_cpu_world(2, _foreign_handle_world, timeout_s=60):
        assert msg != "no error"


def _nosync_capacity_world(group):
    os.environ["TRITONEP_SYNC_CHECKS"] = "0"  # graph-capture mode: errors are recorded, buf.check() raises them
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2, max_recv_tokens=9)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank)).to(BF16)
    buf.dispatch(x, torch.tensor([[0, 1]] * 5 + [[2, 3]] * 3), torch.ones(8, 2))  # rank 0 would get 20 > 9 rows
    try:
        buf.check()
        first = "no error"
    except CapacityError:
        first = "CapacityError"
    d = buf.dispatch(x[:4], torch.tensor([[0, 2]] * 2 + [[3, -1]] * 2), torch.ones(4, 2))  # fits
    y = buf.combine(d.x, d.handle)
    try:
        buf.check()
        second = "no error"
    except CapacityError:
        second = "CapacityError"
    want = torch.cat([(x[:2].float() * 2).to(BF16), x[2:4]])
    buf.close()
    return first, second, torch.equal(y, want)


def test_capacity_error_without_sync_checks_then_usable():
    for first, second, y_ok in run_cpu_world(2, _nosync_capacity_world, timeout_s=60):
        assert first == "CapacityError"
        assert second == "no error" and y_ok


def _capacity_race_world(group):
    os.environ["TRITONEP_TIMEOUT_S"] = "3"
    rank = dist.get_rank(group)
    if rank == 1:  # a peer delayed between the counts wait and reading the counts (any GPU block can be)
        import tritonep.kernels.layout as lay

        orig = lay.wait_all_ge

        def slow(*a, **k):
            r = orig(*a, **k)
            time.sleep(0.5)
            return r

        lay.wait_all_ge = slow
    buf = tep.EPBuffer(group, 4, 64, 8, 2, max_recv_tokens=20)
    log = []
    for idx in (torch.tensor([[0, 1]] * 8), torch.tensor([[2, 3]])):  # 32 rows > 20 on rank 0, then 4 rows
        try:
            buf.dispatch(torch.ones(idx.shape[0], 64, dtype=BF16), idx, torch.ones(idx.shape[0], 2))
            log.append("ok")
        except CapacityError:
            log.append("capacity")
        except Exception as e:  # noqa: BLE001
            log.append(type(e).__name__)
            break
    buf.close()
    return log


def test_capacity_error_seen_by_every_rank_with_a_slow_peer():
    assert run_cpu_world(2, _capacity_race_world, timeout_s=120) == [["capacity", "ok"]] * 2


def _combine_env_world(group):
    rank = dist.get_rank(group)
    os.environ["TRITONEP_COMBINE"] = ["push", "pull"][rank]
    try:
        buf = tep.EPBuffer(group, 4, 64, 8, 2)
    except ConfigError:
        return "ConfigError"
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=1)
    out = _dc(buf, x, idx, w)
    buf.close()
    return (x, idx, w), out


def test_geometry_mismatch_across_ranks_is_refused_or_harmless():
    res = run_cpu_world(2, _combine_env_world, timeout_s=60)
    if res != ["ConfigError", "ConfigError"]:
        calls = [r[0] for r in res]
        assert _bad(2, 4, 1, calls, [r[1] for r in res]) == []


def _num_sms_world(group):
    try:
        tep.EPBuffer(group, 4, 64, 8, 2, num_sms=1 + dist.get_rank(group)).close()
        return "no error"
    except ConfigError as e:
        return str(e)


def test_num_sms_mismatch_is_refused():
    for msg in run_cpu_world(2, _num_sms_world, timeout_s=60):
        assert "num_sms" in msg


def _moe_two_forwards_world(group, interleave):
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    rank = dist.get_rank(group)
    geo = MoEGeometry(hidden=64, intermediate=32, num_experts=4, topk=2, max_tokens_per_rank=8)
    layer = MoELayer(MoERecipe(), geo, group, seed=3)
    g = torch.Generator().manual_seed(rank)
    xa = torch.randn(8, 64, generator=g).to(BF16).requires_grad_(True)
    xb = torch.randn(8, 64, generator=g).to(BF16).requires_grad_(True)
    ya = layer(xa)
    if interleave:
        layer(xb)  # a second forward (next micro-batch / recompute) before the first backward
    try:
        ya.float().sum().backward()
    except RuntimeError:
        layer.close()
        return "error"  # a loud refusal would be acceptable
    out = (xa.grad.clone(), layer.router.weight.grad.clone())
    layer.close()
    return out


def test_moe_second_forward_before_backward_is_correct_or_refused():
    ref = run_cpu_world(2, _moe_two_forwards_world, False, timeout_s=120)
    got = run_cpu_world(2, _moe_two_forwards_world, True, timeout_s=120)
    for r in range(2):
        if got[r] != "error":
            assert torch.equal(got[r][0], ref[r][0]) and torch.equal(got[r][1], ref[r][1])


def _subnormal_world(group, kind):
    buf = tep.EPBuffer(group, 2, 8, 4, 1)
    bits = torch.tensor([[0x0001, 0x8001, 0x0040, 0x007F, 0x0080, 0x3F80, 0x8000, 0x0000]] * 4, dtype=torch.int32)
    x = bits.to(torch.int16).view(BF16).clone()
    idx, w = torch.tensor([[0], [1], [0], [1]]), torch.ones(4, 1)
    d = buf.dispatch(x, idx, w)
    y = buf.combine(d.x, d.handle, kind=kind)
    buf.close()
    return (x, idx, w), dict(x=d.x, ntpe=d.num_tokens_per_expert, offs=d.expert_offsets, w=d.weights, eo=d.x, y=y)


def test_combine_subnormal_bf16_is_bitwise():
    res = run_cpu_world(2, _subnormal_world, "push", timeout_s=60)
    assert _bad(2, 2, 1, [r[0] for r in res], [r[1] for r in res]) == []


def _dispatch_data_timeout_world(group):
    os.environ["TRITONEP_TIMEOUT_S"] = "2"
    os.environ["TRITONEP_SYNC_CHECKS"] = "1"  # strict: a peer lost mid-call raises in that call
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2)
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=1)
    if rank == 0:  # takes part in the counts exchange, then never sends (a peer that dies mid-dispatch)
        ks = buf._impl.k  # the backend's bound launches (tritonep.ep.triton.calls.KernelSet)
        ks.send = lambda *a: None
        ks.expand = lambda kq: (lambda *a: None)
        ks.fused = lambda kq: (lambda *a: None)  # the one-launch dispatch (geometry with fused_send > 0)
    try:
        buf.dispatch(x, idx, w)
        return "returned normally"
    except tep.errors.PeerTimeoutError as e:
        return (e.wait, e.peer)


def test_dispatch_data_timeout_raises_in_the_same_call():
    res = run_cpu_world(2, _dispatch_data_timeout_world, timeout_s=60, check_protocol=False)  # rank 0 skips on purpose
    assert res[1] == ("dispatch.data", 0)
