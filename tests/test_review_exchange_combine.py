"""Review of the multi-program counts exchange (arrival ticket ``calls[DONE_EXCHANGE]``), the combine's own tile
(Geometry.cbt / cwarps), the chunk-major partial items with their source rotation and the send / decode-combine
rotations: adversarial CPU worlds (W = 3 / 5, E not a multiple of 32 so one exchange program has no expert, uneven T
including 0 on a rank and on every rank, refused calls and capacity errors between good calls, push / pull /
fused / decode combines and both backwards alternating on one buffer), every good call checked bit for bit against
the reference, the host protocol recorder on.
"""

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


def _eo(x):
    return (x.float() * 0.5 + 1.0).to(BF16)


def _script_world(group, cfg, steps):
    """Run ``steps`` on one buffer: ("ok", seed, Ts, kind) dispatches + combines (kind None / push / pull /
    "grad": autograd through both, dispatch backward = unweighted combine, combine backward = dispatch);
    ("bad", seed, Ts, bad_rank) gives ``bad_rank`` an expert id E; ("cap", seed, Ts) exceeds max_recv."""
    os.environ["TRITONEP_SYNC_CHECKS"] = "1"
    if cfg.get("geometry"):
        os.environ["TRITONEP_GEOMETRY"] = cfg["geometry"]
    rank = dist.get_rank(group)
    E, H, Tm, K, A = cfg["E"], cfg["H"], cfg["Tmax"], cfg["K"], cfg.get("A", 1)
    buf = tep.EPBuffer(group, E, H, Tm, K, expert_alignment=A, max_recv_tokens=cfg.get("max_recv"))
    os.environ.pop("TRITONEP_GEOMETRY", None)
    out = []
    for step in steps:
        what, seed, Ts = step[:3]
        x, idx, w = make_rank_inputs(rank, Ts[rank], H, E, K, seed=seed, mask_frac=0.15)
        if what == "bad" and rank == step[3] and Ts[rank] > 0:
            idx = idx.clone()
            idx[-1, 0] = E
        if what == "cap":
            idx = torch.zeros_like(idx)  # every route to expert 0: rank 0 receives more than max_recv rows
        if what != "ok":
            try:
                buf.dispatch(x, idx, w)
                out.append("no error")
            except (InputError, PeerInputError, CapacityError) as e:
                out.append(type(e).__name__)
            continue
        kind = step[3]
        if kind == "grad":
            xr = x.clone().requires_grad_(True)
            wr = w.clone().requires_grad_(True)
            d = buf.dispatch(xr, idx, wr)
            y = buf.combine(_eo(d.x), d.handle)
            g = torch.randn(Ts[rank], H, generator=torch.Generator().manual_seed(seed + rank)).to(BF16)
            (y.float() * g.float()).sum().backward()
            out.append(dict(x=d.x.detach().clone(), ntpe=d.num_tokens_per_expert.clone(),
                            offs=d.expert_offsets.clone(), w=d.weights.detach().clone(), y=y.detach().clone(),
                            gx=xr.grad.clone(), gw=wr.grad.clone(), g=g))
        else:
            d = buf.dispatch(x, idx, w)
            y = buf.combine(_eo(d.x), d.handle, kind=kind)
            out.append(dict(x=d.x.clone(), ntpe=d.num_tokens_per_expert.clone(), offs=d.expert_offsets.clone(),
                            w=d.weights.clone(), y=y.clone()))
    geo = buf.geometry
    buf.close()
    return out + [(geo.bt, geo.cbt, geo.decode, geo.fused_combine, geo.grid_partial)]


def _check_script(W, cfg, steps, res, geo=None):
    """Every rank's results of ``steps`` against the reference; ``geo``: the expected (bt, cbt, decode,
    fused_combine, grid_partial) of the buffer."""
    E, H, K, A = cfg["E"], cfg["H"], cfg["K"], cfg.get("A", 1)
    if geo is not None:
        assert all(res[r][-1] == geo for r in range(W)), [res[r][-1] for r in range(W)]
    for i, step in enumerate(steps):
        what, seed, Ts = step[:3]
        if what == "bad":
            got = [res[r][i] for r in range(W)]
            want = ["InputError" if r == step[3] and Ts[r] > 0 else "PeerInputError" for r in range(W)]
            assert got == want, (i, got)
            continue
        if what == "cap":
            assert [res[r][i] for r in range(W)] == ["CapacityError"] * W, (i, [res[r][i] for r in range(W)])
            continue
        ins = [make_rank_inputs(r, Ts[r], H, E, K, seed=seed, mask_frac=0.15) for r in range(W)]
        xs, idxs, ws = ([t[j] for t in ins] for j in range(3))
        ref = dispatch_reference(xs, idxs, ws, E, W, expert_alignment=A)
        eos = [_eo(ref[r].x) for r in range(W)]
        yp = combine_reference_partial(eos, ref, idxs, ws, Ts)
        for r in range(W):
            got = res[r][i]
            for k, want in (("ntpe", ref[r].num_tokens_per_expert), ("offs", ref[r].expert_offsets),
                            ("x", ref[r].x), ("w", ref[r].weights), ("y", yp[r].to(BF16))):
                assert torch.equal(got[k], want), (i, r, k, step)
        if step[3] == "grad":
            _check_grads(W, cfg, ins, [res[r][i] for r in range(W)], i)


def _check_grads(W, cfg, ins, got, i):
    """x.grad / w.grad of the autograd step against torch autograd through the fp32 reference (dispatch is a
    permutation, so x.grad = 0.5 * g * sum of the valid routes' weights, up to the kernels' bf16 roundings: 2e-2;
    w.grad against autograd through the fp32 reference within 1e-2)."""
    from tritonep.reference import combine_reference

    E = cfg["E"]
    xs = [t[0].float().requires_grad_(True) for t in ins]
    ws = [t[2].float().requires_grad_(True) for t in ins]
    idxs = [t[1] for t in ins]
    ref = dispatch_reference([x.detach().to(BF16) for x in xs], idxs, [w.detach() for w in ws], E, W,
                             expert_alignment=cfg.get("A", 1))
    eos = [_eo(ref[r].x) for r in range(W)]
    ys = combine_reference(eos, ref, idxs, ws, [len(x) for x in xs])
    loss = sum((ys[r] * got[r]["g"].float()).sum() for r in range(W))
    loss.backward()
    for r in range(W):
        gw_ref = ws[r].grad
        assert torch.allclose(got[r]["gw"], gw_ref, rtol=1e-2, atol=1e-2), (i, r, "gw")
        wsum = torch.where(idxs[r] >= 0, ins[r][2].float(), 0.0).sum(1, keepdim=True)
        gx_ref = 0.5 * wsum * got[r]["g"].float()  # d/dx of sum_k w_k * (0.5 x + 1) . g
        assert torch.allclose(got[r]["gx"].float(), gx_ref, rtol=2e-2, atol=2e-2), (i, r, "gx")


_STEPS3 = [("ok", 1, [16, 0, 7], "push"), ("ok", 2, [0, 0, 0], "pull"), ("bad", 3, [5, 9, 16], 1),
           ("ok", 4, [3, 16, 0], None), ("cap", 5, [16, 16, 16]), ("ok", 6, [16, 16, 16], "pull"),
           ("ok", 7, [9, 1, 4], "push")]


@pytest.mark.parametrize("geometry,want", [(None, (16, 16, 0, False, 1)), ("bt=2,cbt=1,grid=6", (2, 1, 0, False, 6)),
                                           ("bt=1,cbt=4,fs=3,fe=2,fc=1", (1, 4, 0, True, 3))])
def test_w3_e_not_multiple_of_32_many_calls(geometry, want):
    """W = 3, E = 99 (EB 128: exchange grid 4, one program with no expert), refused + capacity calls between
    good ones, T = 0 on one rank and on every rank, push / pull / default combines; the fused combine with GS = 3
    (the partial sources rotate) and a combine tile (4) wider than the dispatch tile (1)."""
    from tritonep.kernels.layout import exchange_tiles

    assert exchange_tiles(8, 99)[0] == 4
    W = 3
    cfg = dict(E=99, H=64, Tmax=16, K=4, A=2, max_recv=180, geometry=geometry)
    res = run_cpu_world(W, _script_world, cfg, _STEPS3, timeout_s=600)
    _check_script(W, cfg, _STEPS3, res, geo=want)


def test_w5_exchange_grid_and_backward():
    """W = 5, E = 70 (EB 128: exchange grid 4), autograd steps (unweighted combine with weight gradients, scaled
    dispatch) between forward calls; grid 10 (a multiple of W: rotated partial sources)."""
    W = 5
    cfg = dict(E=70, H=32, Tmax=8, K=3, A=1, geometry="bt=2,cbt=1,grid=10")
    steps = [("ok", 11, [8, 0, 3, 8, 1], "grad"), ("ok", 12, [0, 5, 0, 0, 8], "pull"),
             ("bad", 13, [2, 2, 2, 2, 2], 4), ("ok", 14, [8, 8, 8, 8, 8], "grad")]
    res = run_cpu_world(W, _script_world, cfg, steps, timeout_s=600)
    _check_script(W, cfg, steps, res, geo=(2, 1, 0, False, 10))


def test_w3_decode_buffer_with_own_combine_tile():
    """W = 3 decode buffer (dec=3: one-launch dispatch and push combine, tile 1) whose two-kernel combines (pull,
    dispatch backward) use a combine tile of 2 and grid 3 (rotated partial sources), alternating on one buffer."""
    W = 3
    cfg = dict(E=48, H=32, Tmax=8, K=3, A=2, geometry="bt=1,cbt=2,dec=3")
    steps = [("ok", 21, [8, 0, 5], "grad"), ("ok", 22, [1, 8, 0], "pull"), ("ok", 23, [0, 0, 0], None),
             ("bad", 24, [3, 3, 3], 0), ("ok", 25, [8, 8, 8], "grad"), ("ok", 26, [2, 7, 3], "pull")]
    res = run_cpu_world(W, _script_world, cfg, steps, timeout_s=600)
    _check_script(W, cfg, steps, res, geo=(1, 2, 3, False, 3))


def _counts_world(group, E, Tm, K, Ts):
    from tritonep.ep.triton.counts import CountsExchange

    rank = dist.get_rank(group)
    cx = CountsExchange(group, E, Tm, K, "cpu")
    out = []
    for i, T in enumerate(Ts):
        idx = make_rank_inputs(rank, max(T[rank], 0), 8, E, K, seed=30 + i, mask_frac=0.2)[1]
        if T[rank] < 0:  # refused on this rank: more tokens than max_tokens_per_rank
            idx = torch.zeros(Tm + 1, K, dtype=torch.int64)
        try:
            out.append(cx.gather(idx).clone())
        except CapacityError:
            out.append("CapacityError")
        try:
            cx.check()
        except PeerInputError as e:
            out.append(("PeerInputError", tuple(e.bad_ranks)))
        except Exception as e:  # noqa: BLE001 (recorded, compared by the test)
            out.append((type(e).__name__, str(e)[:80]))
    cx.close()
    return out


def test_counts_exchange_several_programs_w3():
    """The virtual experts' CountsExchange with E = 72 (EB 128: exchange grid 4 with a program of no expert),
    W = 3, T = 0 on some ranks, a refused call on rank 2 between good ones: every rank's check() reports it once,
    and the later calls' checks are clean (the status word used to keep the refusal forever, as EPBuffer.check
    does not, and masked a later timeout: the first recorded error wins)."""
    from tritonep.kernels.layout import exchange_tiles

    E, Tm, K, W = 72, 20, 3, 3
    assert exchange_tiles(2, E)[0] == 4
    Ts = [[20, 0, 7], [0, 0, 0], [5, 9, -1], [3, 20, 20], [0, 1, 0]]
    res = run_cpu_world(W, _counts_world, E, Tm, K, Ts, timeout_s=300)
    for r in range(W):
        seq = list(res[r])
        for i, T in enumerate(Ts):
            got = seq.pop(0)
            if any(t < 0 for t in T):  # rank 2 refused: its gather raises, every rank's check() names it once
                assert got == "CapacityError" if T[r] < 0 else isinstance(got, torch.Tensor), (r, i, got)
                assert seq.pop(0) == ("PeerInputError", (2,)), (r, i)
                continue
            want = torch.stack([torch.bincount(make_rank_inputs(s, T[s], 8, E, K, seed=30 + i, mask_frac=0.2)[1]
                                               .flatten().clamp_min(-1).add(1), minlength=E + 1)[1:]
                                for s in range(W)]).to(torch.int32)
            assert torch.equal(got, want), (r, i)
        assert seq == [], (r, seq)


def _any_grid_world(group, cfg, steps, grid):
    import tritonep.ep.triton.calls as tb  # where the backend binds its exchange launch

    real = tb.exchange_tiles
    used = []

    def tiles(nc, e):  # the docstring's claim: any grid >= 1 is correct
        used.append(real(nc, e))
        return grid, real(nc, e)[1]

    tb.exchange_tiles = tiles
    try:
        out = _script_world(group, cfg, steps)
    finally:
        tb.exchange_tiles = real
    assert used == [(4, dict(NCB=1, EBLK=32))], used
    return out


@pytest.mark.parametrize("grid", [1, 3, 7])
def test_exchange_any_grid(grid):
    """E = 128 (4 expert blocks of 32) with 1 program walking every block, 3 (one walks two) and 7 (three with
    none): same rows, and the ticket (never reset) keeps electing the last program over 4 calls."""
    W = 2
    cfg = dict(E=128, H=32, Tmax=16, K=4, A=1)
    steps = [("ok", 41, [16, 0], "push"), ("bad", 42, [3, 4], 0), ("ok", 43, [5, 16], "pull"),
             ("ok", 44, [0, 0], None)]
    res = run_cpu_world(W, _any_grid_world, cfg, steps, grid, timeout_s=300)
    _check_script(W, cfg, steps, res)
