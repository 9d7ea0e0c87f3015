"""EPBuffer dispatch / combine (triton backend) in the multi-rank CPU world against the reference oracles.

Tolerances: dispatch rows, counts, offsets and weights are bit-exact (torch.equal). Combine equals the reference
that reduces in the kernels' order (``combine_reference_partial``: fp32 sums, bf16 partials, RNE) bit for bit, and
the plain fp32 reference within 2 bf16 ulps of the result (|err| <= 2**-7 * max(1, |y|)).
"""

import os

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import CapacityError, ConfigError, InputError, PeerTimeoutError
from tritonep.reference import (combine_backward_reference, combine_reference, combine_reference_partial,
                                dispatch_backward_reference, dispatch_reference)
from tritonep.testing import run_cpu_world
from tritonep.testing.cases import make_rank_inputs


def _close_fp32(y, ref):
    err = (y.float() - ref).abs()
    return bool((err <= 2 ** -7 * ref.abs().clamp_min(1.0)).all())


def _dispatch_combine_world(group, cfg, calls):
    rank = dist.get_rank()
    buf = tep.EPBuffer(group, cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"], expert_alignment=cfg.get("A", 1),
                       max_recv_tokens=cfg.get("max_recv"))
    outs = []
    for i, (x, idx, w) in enumerate(calls[rank]):
        d = buf.dispatch(x, idx, w)
        # expert output: a deterministic function of the rows so combine checks real data
        eo = buf.expert_out_buffer(d.x.shape[0])
        eo.copy_((d.x.float() * 0.5 + 1.0).to(torch.bfloat16))
        y = buf.combine(eo, d.handle, kind=cfg.get("kind"))
        y2 = buf.combine(eo, d.handle, kind=cfg.get("kind")) if i == 0 else None
        outs.append(dict(x=d.x.clone(), ntpe=d.num_tokens_per_expert.clone(), offs=d.expert_offsets.clone(),
                         w=d.weights.clone(), eo=eo.clone(), y=y.clone(), y2=None if y2 is None else y2.clone()))
    buf.close()
    return outs


def _make_calls(W, cfg, ntokens, seeds, mask=0.1):
    return [[make_rank_inputs(r, ntokens[r], cfg["H"], cfg["E"], cfg["K"], seed=s, mask_frac=mask)
             for s in seeds] for r in range(W)]


def _check(W, cfg, calls, res):
    for i in range(len(calls[0])):
        xs = [calls[r][i][0] for r in range(W)]
        idxs = [calls[r][i][1] for r in range(W)]
        ws = [calls[r][i][2] for r in range(W)]
        ref = dispatch_reference(xs, idxs, ws, cfg["E"], W, expert_alignment=cfg.get("A", 1))
        for r in range(W):
            got = res[r][i]
            assert torch.equal(got["ntpe"], ref[r].num_tokens_per_expert), (r, i)
            assert torch.equal(got["offs"], ref[r].expert_offsets), (r, i)
            assert torch.equal(got["x"], ref[r].x), (r, i)
            assert torch.equal(got["w"], ref[r].weights), (r, i)
        eos = [res[r][i]["eo"] for r in range(W)]
        yp = combine_reference_partial(eos, ref, idxs, ws, [len(x) for x in xs])
        yf = combine_reference(eos, ref, idxs, ws, [len(x) for x in xs])
        for r in range(W):
            y = res[r][i]["y"]
            assert torch.equal(y, yp[r].to(torch.bfloat16)), (r, i)
            assert _close_fp32(y, yf[r]), (r, i)
            if res[r][i]["y2"] is not None:
                assert torch.equal(res[r][i]["y2"], y)  # bitwise reproducible


@pytest.mark.parametrize("W,ntokens,A,kind", [
    (2, [13, 7], 1, "push"),
    (3, [9, 0, 16], 4, "pull"),
    (4, [5, 16, 0, 11], 1, "push"),
])
def test_dispatch_combine_matches_reference(W, ntokens, A, kind):
    cfg = dict(E=4 * W, H=96, Tmax=16, K=3, A=A, kind=kind)
    calls = _make_calls(W, cfg, ntokens, seeds=[1, 2, 3, 4, 5])  # 5 calls in a row: epochs
    res = run_cpu_world(W, _dispatch_combine_world, cfg, calls, timeout_s=240)
    _check(W, cfg, calls, res)


@pytest.mark.parametrize("W,geometry", [(2, "bt=1,bh=32,grid=5"), (2, "bt=2,grid=3,combine=pull"),
                                        (2, "bt=2,fs=2,fe=3,fc=1"), (2, "fs=3,fe=1"), (2, "bt=4,dec=3"),
                                        # combine tile != dispatch tile; grids that are multiples of W rotate each
                                        # program's partial sources (kernels.combine.partial_item_source)
                                        (2, "bt=4,cbt=1,cwarps=2,grid=4,pf=1,bh=32"), (2, "bt=1,cbt=4,fs=2,fe=2,fc=1,pf=1"),
                                        (3, "bt=2,cbt=1,grid=6,combine=pull")])
def test_geometry_override_small_tiles(monkeypatch, W, geometry):
    """The GPU decode geometry uses tiny token tiles and many programs, the fused paths split the grid by role;
    every tile/grid/role choice gives the same bits (2 calls: the fused and two-kernel paths follow each other)."""
    monkeypatch.setenv("TRITONEP_GEOMETRY", geometry)
    cfg = dict(E=4 * W, H=96, Tmax=16, K=3, A=2, kind=None)
    calls = _make_calls(W, cfg, [11, 5, 9][:W], seeds=[3, 4])
    res = run_cpu_world(W, _dispatch_combine_world, cfg, calls, timeout_s=240)
    _check(W, cfg, calls, res)


def test_counts_exchange_with_several_programs():
    """128 experts: the counts exchange runs one program per 32-expert block (grid 4, kernels.layout
    exchange_tiles) and the last to arrive lays out; 4 calls in a row (the arrival ticket is never reset), a rank
    with no tokens, and the protocol recorder on."""
    from tritonep.kernels.layout import exchange_tiles

    assert exchange_tiles(1, 128)[0] == 4 and exchange_tiles(256, 256) == (8, dict(NCB=256, EBLK=32))
    W = 2
    cfg = dict(E=128, H=32, Tmax=16, K=4, A=1, kind="push")
    calls = _make_calls(W, cfg, [16, 0], seeds=[5, 6, 7, 8])
    res = run_cpu_world(W, _dispatch_combine_world, cfg, calls, timeout_s=240)
    _check(W, cfg, calls, res)


def test_geometry_override_errors(monkeypatch):
    from tritonep.ep.geometry import select_geometry
    from tritonep.errors import ConfigError

    monkeypatch.delenv("TRITONEP_GEOMETRY", raising=False)
    g = select_geometry("cuda", 2, 7168, 4096, 8)  # the table: fused dispatch at >= 1024 tokens, no SM cap
    assert (g.fused_send, g.fused_expand, g.grid_send, g.grid_expand, g.fused_combine) == (40, 88, 40, 88, False)
    g = select_geometry("cuda", 2, 7168, 4096, 8, num_sms=24)  # capped: two kernels
    assert (g.fused_send, g.grid_send) == (0, 24)
    assert select_geometry("cuda", 2, 7168, 128, 8).fused_send == 0  # decode: two kernels
    for wire in ("fp8", "mxfp4", "fp8_e5m2"):  # quantizing senders need the whole grid: two kernels (measured)
        g = select_geometry("cuda", 2, 7168, 4096, 8, wire=wire)
        assert (g.fused_send, g.grid_send, g.grid_expand) == (0, 132, 132), wire
    g = select_geometry("cuda", 2, 7168, 4096, 8)  # the combine's own tile: 8 tokens x 32 warps (measured)
    assert (g.bt, g.cbt, g.num_warps, g.cwarps) == (16, 8, 8, 32)
    g = select_geometry("cuda", 2, 7168, 4096, 8, wire="fp8", num_sms=24)  # capped fp8: 16 warps + prefetch
    assert (g.num_warps, g.prefetch, g.cwarps) == (16, True, 32)
    assert not select_geometry("cuda", 2, 7168, 4096, 8, num_sms=24).prefetch
    g = select_geometry("cuda", 2, 7168, 128, 8)  # decode: the dispatch's tiny tile
    assert (g.cbt, g.cwarps) == (g.bt, g.num_warps)
    assert select_geometry("cpu", 2, 96, 16, 3).cbt == select_geometry("cpu", 2, 96, 16, 3).bt
    monkeypatch.setenv("TRITONEP_GEOMETRY", "cbt=8,cwarps=16")
    g = select_geometry("cuda", 2, 7168, 4096, 8)
    assert (g.bt, g.cbt, g.num_warps, g.cwarps) == (16, 8, 8, 16)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "cbt=2")
    assert (select_geometry("cuda", 2, 7168, 4096, 8).cbt, select_geometry("cuda", 2, 7168, 4096, 8).cwarps) == (2, 32)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "fs=0,fe=0")
    assert select_geometry("cuda", 2, 7168, 4096, 8).fused_send == 0
    monkeypatch.setenv("TRITONEP_GEOMETRY", "bt=4,warps=8,grid=7")
    g = select_geometry("cuda", 2, 7168, 4096, 8)
    assert (g.bt, g.num_warps, g.grid_send, g.grid_out) == (4, 8, 7, 7)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "fs=40,fe=88")
    g = select_geometry("cuda", 2, 7168, 4096, 8)
    assert (g.grid_send, g.grid_expand, g.grid_partial, g.fused_combine) == (40, 88, 132, False)
    monkeypatch.setenv("TRITONEP_GEOMETRY", "fs=40,fe=88,fc=1")
    g = select_geometry("cuda", 2, 7168, 4096, 8, num_sms=24)  # the cap keeps the role split
    assert (g.fused_send, g.fused_expand, g.grid_send, g.grid_out) == (7, 17, 7, 17)
    for bad, what in (("bq=2", "unknown field"), ("bt=3", "power of two"), ("grid=0", "grid"),
                      ("combine=both", "push or pull"), ("bh=x", "not an integer"), ("fs=4", "both"),
                      ("fc=1", "needs fs"), ("fs=2,fe=2,fc=2", "0 or 1"), ("cbt=3", "power of two"),
                      ("cwarps=0", "power of two")):
        monkeypatch.setenv("TRITONEP_GEOMETRY", bad)
        with pytest.raises(ConfigError, match=what):
            select_geometry("cuda", 2, 7168, 128, 8)  # a shape whose table geometry is the two-kernel path


def test_alignment_128_and_hidden_2880():
    W = 2
    cfg = dict(E=4, H=2880, Tmax=8, K=2, A=128)
    calls = _make_calls(W, cfg, [8, 5], seeds=[7])
    res = run_cpu_world(W, _dispatch_combine_world, cfg, calls, timeout_s=240)
    _check(W, cfg, calls, res)
    for r in range(W):
        offs = res[r][0]["offs"]
        assert int(offs[-1]) % 128 == 0


def test_all_tokens_to_one_expert_and_exact_capacity():
    W, T, K = 2, 8, 1
    cfg = dict(E=4, H=64, Tmax=T, K=K, max_recv=2 * T)  # expert 1 gets exactly max_recv rows
    calls = []
    for r in range(W):
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(r)).bfloat16()
        calls.append([(x, torch.ones(T, K, dtype=torch.int64), torch.ones(T, K))])
    res = run_cpu_world(W, _dispatch_combine_world, cfg, calls, timeout_s=120)
    _check(W, cfg, calls, res)
    assert res[0][0]["ntpe"].tolist() == [0, 2 * T]


def _capacity_world(group):
    buf = tep.EPBuffer(group, 4, 64, 8, 2, max_recv_tokens=9)
    x = torch.randn(8, 64).bfloat16()
    hot = torch.tensor([[0, 1]] * 5 + [[2, 3]] * 3)  # rank 0 receives 10 rows from each rank -> 20 > 9
    msgs = []
    for _ in range(2):
        try:
            buf.dispatch(x, hot, torch.ones(8, 2))
            msgs.append("no error")
        except CapacityError as e:
            msgs.append((str(e), e.needed, e.available))
    ok = torch.tensor([[0, 2]] * 2 + [[3, -1]] * 2)  # fits: 4 rows per rank on rank 0
    d = buf.dispatch(x[:4], ok, torch.ones(4, 2))
    y = buf.combine(d.x, d.handle)
    big = torch.zeros(9, 64, dtype=torch.bfloat16)
    try:
        buf.dispatch(torch.zeros(9, 64).bfloat16(), torch.zeros(9, 2, dtype=torch.long), torch.ones(9, 2))
        over = "no error"
    except CapacityError as e:
        over = str(e)
    buf.close()
    return msgs, y, x[:4], over, big.shape


def test_capacity_error_then_usable():
    res = run_cpu_world(2, _capacity_world, timeout_s=120)
    for msgs, y, x, over, _ in res:
        for m in msgs:
            assert m != "no error"
            text, needed, available = m
            assert needed == 20 and available == 9 and "max_recv_tokens=9" in text
        # after the refused calls the buffer still works: tokens 0,1 -> experts 0 and 2 (w=1 each), 2,3 -> expert 3
        want = torch.cat([(x[:2].float() * 2).bfloat16(), x[2:]])
        assert torch.equal(y, want)
        assert "max_tokens_per_rank=8" in over


def _bad_input_world(group):
    buf = tep.EPBuffer(group, 8, 64, 8, 2)
    x = torch.randn(4, 64).bfloat16()
    idx = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    w = torch.ones(4, 2)
    errs = {}
    cases = {
        "dtype": (x.float(), idx, w),
        "shape": (x[:, :32], idx, w),
        "idx_dtype": (x, idx.float(), w),
        "topk": (x, idx[:, :1], w[:, :1]),
        "id_high": (x, torch.tensor([[0, 1], [2, 3], [4, 8], [6, 7]]), w),
        "id_low": (x, torch.tensor([[0, -2], [2, 3], [4, 5], [6, 7]]), w),
    }
    for name, args in cases.items():
        try:
            buf.dispatch(*args)
            errs[name] = None
        except InputError as e:
            errs[name] = str(e)
    # a transposed (non-contiguous) view gives the same result as the contiguous tensor
    xt = x.t().contiguous().t()
    a = buf.dispatch(x, idx, w).x.clone()
    b = buf.dispatch(xt, idx, w).x.clone()
    buf.close()
    return errs, torch.equal(a, b), xt.is_contiguous()


def test_bad_inputs_are_named_before_any_peer_is_touched():
    res = run_cpu_world(2, _bad_input_world, timeout_s=120)
    for errs, same, contig in res:
        assert not contig and same
        assert "bfloat16" in errs["dtype"]
        assert "hidden=64" in errs["shape"]
        assert "int32 or int64" in errs["idx_dtype"]
        assert "topk=2" in errs["topk"]
        assert "topk_idx[2, 1] = 8" in errs["id_high"]
        assert "topk_idx[0, 1] = -2" in errs["id_low"]


def _mismatch_world(group):
    rank = dist.get_rank()
    try:
        tep.EPBuffer(group, 6, 64, 8 + rank, 2)
        return "no error"
    except ConfigError as e:
        return str(e)


def test_config_mismatch_raises_on_every_rank():
    res = run_cpu_world(3, _mismatch_world, timeout_s=60)
    for msg in res:
        assert "max_tokens_per_rank" in msg and "rank 0: 8" in msg and "rank 2: 10" in msg


def _timeout_world(group):
    os.environ["TRITONEP_TIMEOUT_S"] = "2"
    rank = dist.get_rank()
    buf = tep.EPBuffer(group, 6, 64, 8, 2)
    x, idx, w = make_rank_inputs(rank, 8, 64, 6, 2, seed=3)
    if rank == 1:
        return "skipped"  # this rank never calls dispatch
    try:
        buf.dispatch(x, idx, w)
        return "no error"
    except PeerTimeoutError as e:
        err = (e.wait, e.peer, str(e))
    try:
        buf.dispatch(x, idx, w)
        after = "no error"
    except tep.errors.BufferStateError as e:
        after = str(e)
    return err, after


def test_missing_peer_raises_peer_timeout():
    res = run_cpu_world(3, _timeout_world, timeout_s=120, check_protocol=False)  # rank 1 skips on purpose
    for r in (0, 2):
        (wait, peer, text), after = res[r]
        assert wait == "dispatch.counts" and peer == 1, text
        assert "unusable" in after


def _grad_world(group, calls):
    rank = dist.get_rank()
    x, idx, w = calls[rank]
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    buf = tep.EPBuffer(group, 8, 64, 16, 3)
    d = buf.dispatch(x, idx, w)
    eo = (d.x.float() * 0.5).to(torch.bfloat16)  # differentiable expert "FFN"
    eo.retain_grad()
    y = buf.combine(eo, d.handle)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(99 + rank)).to(torch.bfloat16)
    (y.float() * g.float()).sum().backward()
    out = dict(gx=x.grad.clone(), gw=w.grad.clone(), geo=eo.grad.clone(), eo=eo.detach().clone(), g=g)
    buf.close()
    return out


@pytest.mark.parametrize("geometry", ["", "pf=1,bh=16"])
def test_gradients_match_reference(monkeypatch, geometry):
    """Both backwards; ``pf=1,bh=16``: the expander's next-tile prefetch in the combine backward (SCALE + DOT)."""
    monkeypatch.setenv("TRITONEP_GEOMETRY", geometry)
    W = 2
    calls = [make_rank_inputs(r, [11, 6][r], 64, 8, 3, seed=5) for r in range(W)]
    res = run_cpu_world(W, _grad_world, calls, timeout_s=240)
    xs, idxs, ws = [c[0] for c in calls], [c[1] for c in calls], [c[2] for c in calls]
    ref = dispatch_reference(xs, idxs, ws, 8, W)
    gys = [res[r]["g"] for r in range(W)]
    g_eo, g_w_ref = combine_backward_reference(gys, [res[r]["eo"] for r in range(W)], ref, idxs, ws)
    for r in range(W):
        assert torch.allclose(res[r]["geo"].float(), g_eo[r].float(), rtol=2 ** -7, atol=1e-6)
    # grad of recv rows = 0.5 * grad_eo; grad_x = sum over routes (dispatch backward)
    gx_ref = dispatch_backward_reference([0.5 * res[r]["geo"].float() for r in range(W)], ref, idxs,
                                         [len(x) for x in xs])
    for r in range(W):
        assert torch.allclose(res[r]["gx"].float(), gx_ref[r].float(), rtol=2 ** -6, atol=2 ** -6)
        assert torch.allclose(res[r]["gw"], g_w_ref[r].float(), rtol=1e-3, atol=1e-3)


def _flame_world(group, parts):
    rank = dist.get_rank()
    idx, w = parts[rank]
    x = torch.randn(idx.shape[0], 64, generator=torch.Generator().manual_seed(rank)).bfloat16()
    buf = tep.EPBuffer(group, 64, 64, 32, 6)
    d = buf.dispatch(x, idx, w)
    y = buf.combine(d.x, d.handle)
    out = (x, d.x.clone(), d.num_tokens_per_expert.clone(), y.clone())
    buf.close()
    return out


def test_real_flame_trace_over_4_ranks():
    from tritonep.data import load_flame_trace, split_across_ranks

    idx, w = load_flame_trace(3)
    parts = split_across_ranks(idx[:128], w[:128], 4)
    res = run_cpu_world(4, _flame_world, parts, timeout_s=300)
    xs = [r[0] for r in res]
    ref = dispatch_reference(xs, [p[0] for p in parts], [p[1] for p in parts], 64, 4)
    yp = combine_reference_partial([r.x for r in ref], ref, [p[0] for p in parts], [p[1] for p in parts],
                                   [len(x) for x in xs])
    for r in range(4):
        assert torch.equal(res[r][1], ref[r].x)
        assert torch.equal(res[r][2], ref[r].num_tokens_per_expert)
        assert torch.equal(res[r][3], yp[r].to(torch.bfloat16))
    assert sum(int(r[2].sum()) for r in res) == 128 * 6  # every route arrives exactly once


def test_required_bytes_equals_allocation():
    def world(group):
        buf = tep.EPBuffer(group, 8, 64, 16, 2, expert_alignment=4)
        got = buf.allocated_bytes
        buf.close()
        return got

    want = tep.EPBuffer.required_bytes(world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=16, topk=2,
                                       expert_alignment=4, device_type="cpu")
    assert run_cpu_world(2, world, timeout_s=60) == [want, want]
