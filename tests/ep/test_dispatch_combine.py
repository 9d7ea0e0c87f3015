"""EPBuffer dispatch -> expert -> combine in the multi-rank CPU world against the reference oracles.

Cases: several calls in a row (epochs), uneven tokens with 0 on a rank, alignment up to 128 and hidden 2880, odd
shapes (duplicate experts in a row, K > E, L = 1, odd hidden, int32 ids), two handles in flight combined in reverse
order, two buffers used alternately, NaN / inf / negative weights, bf16 subnormals, every token on one rank or on the
same experts, a real routing trace, the global counts, and the allocation size.

Tolerances: dispatch rows, counts, offsets and weights are bit-exact (torch.equal). Combine equals the reference
that reduces in the kernels' order (``combine_reference_partial``: fp32 sums, bf16 partials, RNE) bit for bit, and
the plain fp32 reference within 2 bf16 ulps of the result (|err| <= 2**-7 * max(1, |y|)).
"""

import os

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.harness import BF16, calls_world, check_calls, make_calls, open_buffer, record, run_call


@pytest.mark.parametrize("W,ntokens,A,kind", [
    (2, [13, 7], 1, "push"),
    (3, [9, 0, 16], 4, "pull"),
    (4, [5, 16, 0, 11], 1, "push"),
    (1, [13], 1, "push"),  # world 1: the partial kernel stores the output rows (DIRECT)
    (1, [11], 2, "pull"),
])
def test_dispatch_combine_matches_reference(W, ntokens, A, kind):
    cfg = dict(E=4 * W, H=96, Tmax=16, K=3, A=A, kind=kind, repeat=True)
    calls = make_calls(W, cfg, ntokens, seeds=[1, 2, 3, 4, 5])  # 5 calls in a row: epochs
    res = run_cpu_world(W, calls_world, cfg, calls, timeout_s=240)
    check_calls(cfg, calls, res, fp32=True)


@pytest.mark.parametrize("kind,geometry", [("push", None), ("pull", None), ("push", "fs=1,fe=1,fc=1"),
                                           ("push", "bt=2,dec=2")])
def test_world1_tokens_without_routes_combine_to_zeros(kind, geometry, monkeypatch):
    """World 1 (the push combine's partial kernel, the one-launch combine's partial role with ``fc=1``, or the decode
    combine's partial step with ``dec``, stores the output rows itself): equal to the reference over several calls on one buffer (the first combined twice), and
    tokens with every route masked get zero rows, also where an earlier call's output left other values in the
    reused memory."""
    if geometry:
        monkeypatch.setenv("TRITONEP_GEOMETRY", geometry)
    cfg = dict(E=8, H=128, Tmax=32, K=2, A=1, kind=kind, out_buffer=False, repeat=True)
    calls = make_calls(1, cfg, [32], seeds=[11, 12, 13, 14], mask_frac=0.6)
    assert any(bool((c[1] < 0).all(1).any()) for c in calls[0])  # some token has no route
    res = run_cpu_world(1, calls_world, cfg, calls, timeout_s=240)
    check_calls(cfg, calls, res, fp32=True)
    for (_, idx, _), rec in zip(calls[0], res[0]):
        assert (rec["y"][(idx < 0).all(1)] == 0).all()


def test_alignment_128_and_hidden_2880():
    W = 2
    cfg = dict(E=4, H=2880, Tmax=8, K=2, A=128, repeat=True)
    calls = make_calls(W, cfg, [8, 5], seeds=[7])
    res = run_cpu_world(W, calls_world, cfg, calls, timeout_s=240)
    check_calls(cfg, calls, res, fp32=True)
    for r in range(W):
        offs = res[r][0]["offs"]
        assert int(offs[-1]) % 128 == 0


def _identity(x):
    return x


def test_real_flame_trace_over_4_ranks():
    from tritonep.data import load_flame_trace, split_across_ranks

    idx, w = load_flame_trace(3)
    parts = split_across_ranks(idx[:128], w[:128], 4)
    calls = [[(torch.randn(i.shape[0], 64, generator=torch.Generator().manual_seed(r)).bfloat16(), i, wr)]
             for r, (i, wr) in enumerate(parts)]
    cfg = dict(E=64, H=64, Tmax=32, K=6, fn=_identity, out_buffer=False)
    res = run_cpu_world(4, calls_world, cfg, calls, timeout_s=300)
    check_calls(cfg, calls, res)
    assert sum(int(r[0]["ntpe"].sum()) for r in res) == 128 * 6  # every route arrives exactly once


@pytest.mark.parametrize("count_columns,count_topk,align,tiles", [(0, 0, 4, None), (4, 0, 4, None),
                                                                  (4, 3, 1, "dec=2"), (4, 3, 1, None)])
def test_required_bytes_equals_allocation(count_columns, count_topk, align, tiles):
    """Also with ``count_columns`` (the second count matrix of ``dispatch(count_ids=...)``) and ``count_topk`` (the
    carried routing's region, on the decode tiles only), which the compat Buffer's lanes use."""
    def world(group):
        buf = tep.EPBuffer(group, 8, 64, 16, 2, expert_alignment=align, count_columns=count_columns,
                           count_topk=count_topk, tiles=tiles)
        got = buf.allocated_bytes
        buf.close()
        return got

    want = tep.EPBuffer.required_bytes(world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=16, topk=2,
                                       expert_alignment=align, device_type="cpu", count_columns=count_columns,
                                       count_topk=count_topk, tiles=tiles)
    got = run_cpu_world(2, world, timeout_s=60)
    assert got == [want, want]
    if count_topk and tiles:  # the region is there: 2 * count_topk int32 words per (source rank, token)
        plain = tep.EPBuffer.required_bytes(world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=16, topk=2,
                                            device_type="cpu", count_columns=count_columns, tiles=tiles)
        assert want >= plain + 2 * 16 * 2 * count_topk * 4, (want, plain)


def _cases_world(group, cases):
    """One buffer per case, one call each (the expert output a plain tensor)."""
    rank = dist.get_rank(group)
    out = []
    for cfg, calls in cases:
        buf = open_buffer(group, cfg)
        out.append(run_call(buf, *calls[rank], kind=cfg.get("kind"), out_buffer=False))
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
    res = run_cpu_world(W, _cases_world, cases, timeout_s=240)
    for i, (cfg, calls) in enumerate(cases):
        check_calls(cfg, [[c] for c in calls], [[res[r][i]] for r in range(W)])


def _inflight_world(group, c1, c2, kind):
    from tests.support.harness import expert

    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 6, 64, 8, 2)
    d1 = buf.dispatch(*c1[rank])
    d2 = buf.dispatch(*c2[rank])
    e1, e2 = expert(d1.x), expert(d2.x)
    y2 = buf.combine(e2, d2.handle, kind=kind)  # combines in the reverse order of the dispatches
    y1 = buf.combine(e1, d1.handle, kind=kind)
    y1b = buf.combine(e1, d1.handle, kind=kind)
    buf.close()
    return [dict(record(d1, e1, y1), y2=y1b.clone()), record(d2, e2, y2)]


@pytest.mark.parametrize("kind", ["push", "pull"])
def test_two_handles_in_flight_combined_in_reverse_order(kind):
    W = 3
    c1 = [make_rank_inputs(r, [8, 5, 2][r], 64, 6, 2, seed=1) for r in range(W)]
    c2 = [make_rank_inputs(r, [3, 8, 0][r], 64, 6, 2, seed=2) for r in range(W)]
    res = run_cpu_world(W, _inflight_world, c1, c2, kind, timeout_s=240)
    check_calls(dict(E=6), [[a, b] for a, b in zip(c1, c2)], res)  # y2: the first handle combined again


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


def _equal_nan(a, b):
    return torch.equal(a, b) or bool(torch.isclose(a.float(), b.float(), rtol=0, atol=0, equal_nan=True).all())


@pytest.mark.parametrize("backend,kind", [("triton", "push"), ("triton", "pull"), ("nccl", None)])
def test_nan_inf_negative_weights_match_reference(backend, kind):
    W = 2
    cfg = dict(E=4, H=64, Tmax=8, K=3, backend=backend, kind=kind, out_buffer=False)
    calls = [[_nan_inputs(r)] for r in range(W)]
    res = run_cpu_world(W, calls_world, cfg, calls, timeout_s=120)
    check_calls(cfg, calls, res, equal=_equal_nan)
    for r in range(W):
        assert bool(torch.isfinite(res[r][0]["y"][3].float()).all())  # NaN weight on a masked slot: no leak
        assert not bool(res[r][0]["y"][5].any())  # every slot masked: zeros


def _two_buffers_world(group, calls):
    from tests.support.harness import expert

    rank = dist.get_rank(group)
    a, b = tep.EPBuffer(group, 4, 64, 8, 2), tep.EPBuffer(group, 4, 64, 8, 2)
    out = []
    for i, c in enumerate(calls[rank]):
        p, q = (a, b) if i % 2 == 0 else (b, a)
        dp, dq = p.dispatch(*c), q.dispatch(*c)  # both buffers in flight at once
        yq = q.combine(expert(dq.x), dq.handle)
        out.append(dict(record(dp, expert(dp.x), p.combine(expert(dp.x), dp.handle)), y2=yq.clone()))
    a.close()
    b.close()
    return out


def test_two_buffers_used_alternately():
    W = 2
    calls = [[make_rank_inputs(r, 8, 64, 4, 2, seed=s) for s in range(3)] for r in range(W)]
    res = run_cpu_world(W, _two_buffers_world, calls, timeout_s=120)
    check_calls(dict(E=4), calls, res)  # y2: the other buffer's combine of the same call


def _subnormal_world(group, kind):
    buf = tep.EPBuffer(group, 2, 8, 4, 1)
    bits = torch.tensor([[0x0001, 0x8001, 0x0040, 0x007F, 0x0080, 0x3F80, 0x8000, 0x0000]] * 4, dtype=torch.int32)
    x = bits.to(torch.int16).view(BF16).clone()
    idx, w = torch.tensor([[0], [1], [0], [1]]), torch.ones(4, 1)
    rec = run_call(buf, x, idx, w, kind=kind, fn=_identity, out_buffer=False)
    buf.close()
    return (x, idx, w), rec


def test_combine_subnormal_bf16_is_bitwise():
    res = run_cpu_world(2, _subnormal_world, "push", timeout_s=60)
    check_calls(dict(E=2), [[r[0]] for r in res], [[r[1]] for r in res])


def _rank0_only_world(group, reps):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    E, H, Tm, K = 2 * W, 64, 8, 2
    buf = tep.EPBuffer(group, E, H, Tm, K)
    g = torch.Generator().manual_seed(1234 + rank)
    bad, seen = [], []
    for i in range(reps):
        T = int(torch.randint(1 if rank == 0 else 0, Tm + 1, (1,), generator=g))
        if i < 2:  # the edges first: rank 0 at capacity with the others empty, then 1 token against full -1 rows
            T = (Tm, 1)[i] if rank == 0 else (0, Tm)[i]
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
        seen.append(T)
    buf.close()
    return bad, seen


def test_only_rank0_has_tokens_12_calls():
    """12 calls on one buffer prove what the 100 of the soak step do: each of the counts exchange's two alternating
    matrices (call parity) is reused 6 times, the device-side call numbers and epochs advance every call (they
    never wrap: int64), and the first two calls are the edges (rank 0 at capacity with the others empty, then one
    token against full -1 rows) before random counts."""
    res = run_cpu_world(3, _rank0_only_world, 12, timeout_s=300)
    assert [bad for bad, _ in res] == [[], [], []]
    seen = [set(s) for _, s in res]
    assert {1, 8} <= seen[0] and all({0, 8} <= s and len(s) >= 4 for s in seen[1:]), seen


@pytest.mark.soak
def test_only_rank0_has_tokens_100_calls():
    assert [bad for bad, _ in run_cpu_world(3, _rank0_only_world, 100, timeout_s=300)] == [[], [], []]


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_every_token_picks_the_same_experts(backend):
    W, cfg = 2, dict(E=8, H=64, Tmax=8, K=3, A=2, backend=backend)
    same = torch.tensor([6, 4, 5])  # all on rank 1, unsorted
    calls = []
    for r, T in enumerate([8, 5]):
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(r)).to(BF16)
        calls.append([(x, same.expand(T, 3).clone(), torch.rand(T, 3, generator=torch.Generator().manual_seed(9)))])
    res = run_cpu_world(W, calls_world, cfg, calls, timeout_s=120)
    check_calls(cfg, calls, res)
    assert res[1][0]["ntpe"].tolist() == [13, 13, 13, 0] and res[1][0]["offs"].tolist() == [14, 28, 42, 42]
    assert res[0][0]["x"].shape == (0, 64) and res[0][0]["ntpe"].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_counts_are_global_and_identical(backend):
    W, cfg = 3, dict(E=6, H=64, Tmax=8, K=2, backend=backend)
    calls = [[] for _ in range(W)]
    for s, Ts in enumerate([[8, 3, 5], [0, 8, 2], [4, 0, 0]]):
        for r, a in enumerate(make_calls(W, cfg, Ts, [60 + s], mask_frac=0.25)):
            a = a[0]
            if Ts[r] > 1:
                a[1][0] = torch.tensor([r, r])  # one token picks the same expert twice: two routes
            calls[r].append(a)
    res = run_cpu_world(W, calls_world, cfg, calls, timeout_s=180)
    check_calls(cfg, calls, res)  # includes counts == reference counts on every rank
    for i in range(3):
        c = res[0][i]["counts"]
        assert c.dtype == torch.int32 and c.shape == (W, 6)
        assert all(torch.equal(res[r][i]["counts"], c) for r in range(W)), f"call {i}: counts differ across ranks"
        valid = sum(int((calls[r][i][1] >= 0).sum()) for r in range(W))
        assert int(c.sum()) == valid
        for r in range(W):  # row r = routes of source rank r; column sums = rows every expert received
            assert torch.equal(c[r], torch.bincount(calls[r][i][1][calls[r][i][1] >= 0], minlength=6).int())
            assert torch.equal(c.sum(0)[2 * r:2 * r + 2].int(), res[r][i]["ntpe"])


@pytest.mark.parametrize("kind", ["push", "pull"])
def test_world1_two_handles_in_flight_combined_in_reverse_order(kind):
    """World 1 (the push combine's partial kernel stores the output rows itself): each handle's combine gives its
    own call's rows for its own token count, also where the later dispatch had fewer tokens than the earlier one."""
    c1 = [make_rank_inputs(0, 8, 64, 6, 2, seed=1)]
    c2 = [make_rank_inputs(0, 3, 64, 6, 2, seed=2)]
    res = run_cpu_world(1, _inflight_world, c1, c2, kind, timeout_s=240)
    check_calls(dict(E=6), [[c1[0], c2[0]]], res)


def _backward_world(group, geometry):
    """World 1: a dispatch, then its backward without weight gradients (the unweighted combine of the row
    gradients) twice, on the buffer of ``geometry``; the gradients and the reference's."""
    from tritonep.reference import dispatch_backward_reference, dispatch_reference

    os.environ["TRITONEP_GEOMETRY"] = geometry
    buf = tep.EPBuffer(group, 8, 128, 32, 2)
    del os.environ["TRITONEP_GEOMETRY"]
    out = []
    for seed in (31, 32):
        x, idx, w = make_rank_inputs(0, 32, 128, 8, 2, seed=seed, mask_frac=0.6)
        d = buf.dispatch(x, idx, w)
        g = torch.randn(d.x.shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        gx, gw = buf.dispatch_backward(g, None, d.handle)
        ref = dispatch_backward_reference([g], dispatch_reference([x], [idx], [w], 8, 1), [idx], [32])[0]
        out.append((gx.clone(), gw, ref, idx))
    buf.close()
    return out


@pytest.mark.parametrize("geometry", ["dec=0,fs=0,fe=0,fc=0", "bt=2,dec=2"])
def test_world1_dispatch_backward_without_weight_gradients(geometry):
    """World 1, the dispatch backward without weight gradients (an unweighted push combine, whose partial step stores
    the output rows itself on the two-kernel and decode paths): equal to the reference bit for bit (one bf16
    rounding of the fp32 sum), tokens without a route zero."""
    for gx, gw, ref, idx in run_cpu_world(1, _backward_world, geometry, timeout_s=240)[0]:
        assert gw is None
        assert torch.equal(gx, ref.to(gx.dtype)), (gx - ref.to(gx.dtype)).abs().max()
        assert (gx[(idx < 0).all(1)] == 0).all()
