"""The single-process oracles against hand-worked cases, autograd, and real routing traces."""

import pytest
import torch

from tritonep.data import load_flame_trace, split_across_ranks
from tritonep.errors import ConfigError, InputError
from tritonep.reference import (
    combine_backward_reference,
    combine_reference,
    combine_reference_partial,
    dispatch_backward_reference,
    dispatch_reference,
    moe_dense_reference,
)

I32 = torch.int32

# --- hand-worked case: world 2, E = 4 (L = 2; experts 0,1 on rank 0 and 2,3 on rank 1), K = 2, H = 2 -------------
IDX0 = torch.tensor([[1, 2], [3, -1], [0, 2], [-1, -1]])  # token 3 has no route
W0 = torch.tensor([[0.5, 0.25], [1.0, 0.75], [0.125, 0.375], [1.0, 1.0]])
X0 = torch.tensor([[1.0, 2], [3, 4], [5, 6], [11, 12]])
IDX1 = torch.tensor([[2, 0], [-1, 1]], dtype=torch.int32)
W1 = torch.tensor([[0.5, 0.5], [0.25, 2.0]])
X1 = torch.tensor([[7.0, 8], [9, 10]])


def _t(v, dtype=torch.float32):
    return torch.tensor(v, dtype=dtype)


def _check(d, x, ntpe, offs, sr, st, sk, w):
    assert torch.equal(d.x, _t(x)), d.x
    assert torch.equal(d.num_tokens_per_expert, _t(ntpe, I32))
    assert torch.equal(d.expert_offsets, _t(offs, I32))
    assert torch.equal(d.src_rank, _t(sr, I32)) and torch.equal(d.src_token, _t(st, I32))
    assert torch.equal(d.src_k, _t(sk, I32)) and torch.equal(d.weights, _t(w))
    assert torch.equal(d.counts, _t([[1, 1, 2, 1], [1, 1, 1, 0]], I32))


def test_dispatch_hand_alignment_1():
    d0, d1 = dispatch_reference([X0, X1], [IDX0, IDX1], [W0, W1], num_experts=4, world_size=2)
    # rank 0: expert 0 <- (r0,t2,k0), (r1,t0,k1); expert 1 <- (r0,t0,k0), (r1,t1,k1)
    _check(d0, [[5, 6], [7, 8], [1, 2], [9, 10]], [2, 2], [2, 4],
           [0, 1, 0, 1], [2, 0, 0, 1], [0, 1, 0, 1], [0.125, 0.5, 0.5, 2.0])
    # rank 1: expert 2 <- (r0,t0,k1), (r0,t2,k1), (r1,t0,k0); expert 3 <- (r0,t1,k0)
    _check(d1, [[1, 2], [5, 6], [7, 8], [3, 4]], [3, 1], [3, 4],
           [0, 0, 1, 0], [0, 2, 0, 1], [1, 1, 0, 0], [0.25, 0.375, 0.5, 1.0])


def test_dispatch_hand_alignment_4():
    d0, d1 = dispatch_reference([X0, X1], [IDX0, IDX1], [W0, W1], 4, 2, expert_alignment=4)
    z, m = [0, 0], -1
    _check(d0, [[5, 6], [7, 8], z, z, [1, 2], [9, 10], z, z], [2, 2], [4, 8],
           [0, 1, m, m, 0, 1, m, m], [2, 0, m, m, 0, 1, m, m], [0, 1, m, m, 0, 1, m, m],
           [0.125, 0.5, 0, 0, 0.5, 2.0, 0, 0])
    _check(d1, [[1, 2], [5, 6], [7, 8], z, [3, 4], z, z, z], [3, 1], [4, 8],
           [0, 0, 1, m, 0, m, m, m], [0, 2, 0, m, 1, m, m, m], [1, 1, 0, m, 0, m, m, m],
           [0.25, 0.375, 0.5, 0, 1.0, 0, 0, 0])


def test_dispatch_rank_with_zero_tokens_and_empty_expert():
    idx1 = torch.zeros(0, 2, dtype=torch.int64)
    d0, d1 = dispatch_reference([X0, torch.zeros(0, 2)], [IDX0, idx1], [W0, torch.zeros(0, 2)], 4, 2, 4)
    # rank 0 receives only from rank 0: expert 0 <- (t2,k0); expert 1 <- (t0,k0)
    z, m = [0, 0], -1
    assert torch.equal(d0.x, _t([[5, 6], z, z, z, [1, 2], z, z, z]))
    assert torch.equal(d0.num_tokens_per_expert, _t([1, 1], I32)) and torch.equal(d0.expert_offsets, _t([4, 8], I32))
    assert torch.equal(d0.src_token, _t([2, m, m, m, 0, m, m, m], I32))
    assert torch.equal(d1.num_tokens_per_expert, _t([2, 1], I32))
    assert torch.equal(d1.counts, _t([[1, 1, 2, 1], [0, 0, 0, 0]], I32))
    # a rank whose experts get nothing: zero rows
    e, f = dispatch_reference([X1, X1], [torch.tensor([[0, 1], [1, -1]])] * 2, [W1, W1], 4, 2)
    assert e.x.shape == (6, 2) and f.x.shape == (0, 2)
    assert torch.equal(f.expert_offsets, _t([0, 0], I32)) and f.src_rank.shape == (0,)
    assert torch.equal(e.src_rank, _t([0, 1, 0, 0, 1, 1], I32))  # (rank, token, k) order inside expert 1


def test_dispatch_keeps_dtype_bits():
    xb = [torch.randn(3, 5).to(torch.bfloat16), torch.randn(2, 5).to(torch.bfloat16)]
    idx = [torch.tensor([[0, 3], [1, 2], [3, -1]]), torch.tensor([[2, 1], [0, 0]])]
    w = [torch.rand(3, 2), torch.rand(2, 2)]
    out = dispatch_reference(xb, idx, w, 4, 2)
    for d in out:
        assert d.x.dtype == torch.bfloat16
        real = d.src_rank >= 0
        expect = torch.stack([xb[r][t] for r, t in zip(d.src_rank.tolist(), d.src_token.tolist())])
        assert torch.equal(d.x[real], expect)
    # a token picking the same expert twice gives two rows (rank 1 token 1 -> expert 0 twice)
    assert out[0].src_token[out[0].src_rank == 1].tolist() == [1, 1, 0]
    assert out[0].src_k[out[0].src_rank == 1].tolist() == [0, 1, 1]


def test_combine_hand():
    disp = dispatch_reference([X0, X1], [IDX0, IDX1], [W0, W1], 4, 2, expert_alignment=4)
    eo = [d.x for d in disp]
    y0 = _t([[0.75, 1.5], [3, 4], [2.5, 3], [0, 0]])  # 0.5*x0+0.25*x0, 1*x1, (0.125+0.375)*x2, no route
    y1 = _t([[7, 8], [18, 20]])  # (0.5+0.5)*x0, 2*x1
    for fn in (combine_reference, combine_reference_partial):
        y = fn(eo, disp, [IDX0, IDX1], [W0, W1], [4, 2])
        assert torch.equal(y[0], y0) and torch.equal(y[1], y1)
        assert y[0].dtype == torch.float32
    # padding rows of expert_out are never read, even when they hold NaN
    eo_nan = [e.clone() for e in eo]
    for e, d in zip(eo_nan, disp):
        e[d.src_rank < 0] = float("nan")
    assert torch.equal(combine_reference(eo_nan, disp, [IDX0, IDX1], [W0, W1], [4, 2])[0], y0)


def test_combine_partial_rounds_per_rank():
    disp = dispatch_reference([X0, X1], [IDX0, IDX1], [W0, W1], 4, 2)
    eo = [torch.zeros(4, 2), torch.zeros(4, 2)]
    # rank 1 token 0: k0 -> expert 2 (rank 1 row 2), k1 -> expert 0 (rank 0 row 1); both weights 0.5
    eo[0][1] = 2 + 2**-7  # 0.5 * . = 1 + 2^-8: half a bf16 ulp, rounds (to even) to 1.0
    eo[1][2] = 4 + 2**-5  # 0.5 * . = 2 + 2^-6: exact in bf16
    exact = combine_reference(eo, disp, [IDX0, IDX1], [W0, W1], [4, 2])[1][0, 0]
    part = combine_reference_partial(eo, disp, [IDX0, IDX1], [W0, W1], [4, 2])[1][0, 0]
    fp32 = combine_reference_partial(eo, disp, [IDX0, IDX1], [W0, W1], [4, 2], partial_dtype=None)[1][0, 0]
    assert exact.item() == 3 + 2**-6 + 2**-8 == fp32.item()
    assert part.item() == 3 + 2**-6


def _random_world(seed, world, num_experts, tokens, k, hidden, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for t in tokens:
        xs.append(torch.randn(t, hidden, generator=g).to(dtype))
        idx = torch.randint(-1, num_experts, (t, k), generator=g)
        idxs.append(idx)
        ws.append(torch.rand(t, k, generator=g))
    return xs, idxs, ws


def test_combine_of_dispatched_x_is_weighted_sum():
    xs, idxs, ws = _random_world(0, 3, 12, [7, 0, 5], 3, 16)
    disp = dispatch_reference(xs, idxs, ws, 12, 3, expert_alignment=8)
    ys = combine_reference([d.x for d in disp], disp, idxs, ws, [7, 0, 5])
    for x, idx, w, y in zip(xs, idxs, ws, ys):
        expect = ((w * (idx >= 0)).sum(1, keepdim=True)) * x
        torch.testing.assert_close(y, expect, rtol=1e-6, atol=1e-6)
    assert ys[1].shape == (0, 16)


def test_backward_identities_against_autograd():
    xs, idxs, ws = _random_world(1, 2, 8, [6, 4], 3, 8)
    xs = [x.requires_grad_() for x in xs]
    ws = [w.requires_grad_() for w in ws]
    disp = dispatch_reference(xs, idxs, ws, 8, 2, expert_alignment=4)
    mats = [torch.randn(8, 8, generator=torch.Generator().manual_seed(d)) for d in range(2)]
    eo = [torch.tanh(d.x @ m) for d, m in zip(disp, mats)]  # differentiable "experts"
    eo_leaf = [e.detach().requires_grad_() for e in eo]
    ys = combine_reference(eo_leaf, disp, idxs, ws, [6, 4])
    gys = [torch.randn_like(y) for y in ys]
    torch.autograd.backward(ys, gys)
    g_eo, g_w = combine_backward_reference(gys, eo_leaf, disp, idxs, ws)
    for a, b in zip(g_eo, eo_leaf):
        torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-6)
    for a, w in zip(g_w, ws):
        torch.testing.assert_close(a, w.grad, rtol=1e-5, atol=1e-6)
    for d, a in zip(disp, g_eo):
        assert (a[d.src_rank < 0] == 0).all()  # padding rows get no gradient
    # through dispatch: d loss / d xs = dispatch_backward(d loss / d rows)
    g_out = [e.grad for e in eo_leaf]
    g_rows = torch.autograd.grad(eo, [d.x for d in disp], g_out, retain_graph=True)
    torch.autograd.backward(eo, g_out)
    g_xs = dispatch_backward_reference(g_rows, disp, idxs, [6, 4])
    for a, x in zip(g_xs, xs):
        torch.testing.assert_close(a, x.grad, rtol=1e-5, atol=1e-6)


def test_masked_grad_weights_are_zero():
    disp = dispatch_reference([X0, X1], [IDX0, IDX1], [W0, W1], 4, 2)
    g_eo, g_w = combine_backward_reference([torch.ones(4, 2), torch.ones(2, 2)], [d.x for d in disp], disp,
                                           [IDX0, IDX1], [W0, W1])
    # <1, row>: token 0 rows [1,2] -> 3 for both k; masked slots 0
    assert torch.equal(g_w[0], _t([[3, 3], [7, 0], [11, 11], [0, 0]]))
    assert torch.equal(g_w[1], _t([[15, 15], [0, 19]]))
    assert torch.equal(g_eo[1], _t([[0.25, 0.25], [0.375, 0.375], [0.5, 0.5], [1, 1]]))


def test_real_trace_dispatch_invariants():
    idx, w = load_flame_trace(5)
    parts = split_across_ranks(idx, w, 4, num_tokens=256, empty_rank=1, uneven=True)
    idxs, ws = [p[0] for p in parts], [p[1] for p in parts]
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(i.shape[0], 24, generator=g).to(torch.bfloat16) for i in idxs]
    disp = dispatch_reference(xs, idxs, ws, 64, 4, expert_alignment=16)
    hist = torch.bincount(idx[:256].flatten(), minlength=64)
    assert torch.equal(torch.cat([d.num_tokens_per_expert for d in disp]).long(), hist)
    for r, d in enumerate(disp):
        assert torch.equal(d.counts.sum(0).long(), hist)
        assert (torch.diff(d.expert_offsets, prepend=torch.zeros(1, dtype=I32)) % 16 == 0).all()
        starts = torch.cat([torch.zeros(1, dtype=I32), d.expert_offsets[:-1]])
        for j in range(16):
            s, n = int(starts[j]), int(d.num_tokens_per_expert[j])
            key = d.src_rank[s : s + n].long() * 10**6 + d.src_token[s : s + n].long() * 10 + d.src_k[s : s + n]
            assert (key.diff() > 0).all()  # (rank, token, k) ascending
            e = idxs[0].new_tensor([idxs[a][b, c] for a, b, c in zip(*(t[s : s + n].tolist() for t in
                                                                         (d.src_rank, d.src_token, d.src_k)))])
            assert (e == r * 16 + j).all()
    ys = combine_reference_partial([d.x for d in disp], disp, idxs, ws, [i.shape[0] for i in idxs])
    for x, wr, y in zip(xs, ws, ys):
        torch.testing.assert_close(y, wr.sum(1, keepdim=True) * x.float(), rtol=2e-2, atol=1e-3)


def test_moe_dense_reference():
    g = torch.Generator().manual_seed(5)
    t, h, i, e, k = 9, 8, 6, 4, 2
    x = torch.randn(t, h, generator=g)
    idx = torch.randint(-1, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    w1, w2 = torch.randn(e, h, 2 * i, generator=g), torch.randn(e, i, h, generator=g)
    y = moe_dense_reference(x, idx, w, w1, w2)
    for tt in range(t):
        expect = torch.zeros(h)
        for kk in range(k):
            ex = int(idx[tt, kk])
            if ex >= 0:
                gate, up = x[tt] @ w1[ex, :, :i], x[tt] @ w1[ex, :, i:]
                expect += w[tt, kk] * ((gate * torch.sigmoid(gate) * up) @ w2[ex])
        torch.testing.assert_close(y[tt], expect, rtol=1e-5, atol=1e-5)
    # gate/up order: zero "up" half -> zero output; zero "gate" half -> silu(0) = 0 as well, but swapped halves differ
    w1z = w1.clone()
    w1z[:, :, i:] = 0
    assert torch.equal(moe_dense_reference(x, idx, w, w1z, w2), torch.zeros(t, h))
    assert not torch.allclose(moe_dense_reference(x, idx, w, w1.roll(i, dims=2), w2), y)
    # the EP composition (dispatch -> per-expert FFN -> combine) equals the dense reference
    xs, idxs, ws = [x[:5], x[5:]], [idx[:5], idx[5:]], [w[:5], w[5:]]
    disp = dispatch_reference(xs, idxs, ws, e, 2, expert_alignment=4)
    eo = []
    for r, d in enumerate(disp):
        out = torch.zeros_like(d.x)
        ends = d.expert_offsets.tolist()
        for j in range(2):
            s = 0 if j == 0 else ends[j - 1]
            hh = d.x[s : ends[j]] @ w1[r * 2 + j]
            out[s : ends[j]] = (torch.nn.functional.silu(hh[:, :i]) * hh[:, i:]) @ w2[r * 2 + j]
        eo.append(out)
    ys = combine_reference(eo, disp, idxs, ws, [5, 4])
    torch.testing.assert_close(torch.cat(ys), y, rtol=1e-5, atol=1e-5)


def test_errors():
    with pytest.raises(InputError, match="min -4"):
        dispatch_reference([X0, X1], [IDX0 - 3, IDX1], [W0, W1], 4, 2)
    with pytest.raises(InputError, match=r"\[-1, 4\).*max 4"):
        dispatch_reference([X0, X1], [IDX0, IDX1 + 2], [W0, W1], 4, 2)
    with pytest.raises(ConfigError, match="num_experts=5"):
        dispatch_reference([X0, X1], [IDX0, IDX1], [W0, W1], 5, 2)
    with pytest.raises(ConfigError, match="expert_alignment"):
        dispatch_reference([X0, X1], [IDX0, IDX1], [W0, W1], 4, 2, expert_alignment=0)
    with pytest.raises(InputError, match="world_size=2"):
        dispatch_reference([X0], [IDX0, IDX1], [W0, W1], 4, 2)
    with pytest.raises(InputError, match="rank 1"):
        dispatch_reference([X0, X1[:1]], [IDX0, IDX1], [W0, W1], 4, 2)
    with pytest.raises(InputError, match="float"):
        dispatch_reference([X0, X1], [IDX0, IDX1], [W0, W1.long()], 4, 2)
    with pytest.raises(InputError, match="K"):
        dispatch_reference([X0, X1], [IDX0, IDX1[:, :1]], [W0, W1[:, :1]], 4, 2)
    disp = dispatch_reference([X0, X1], [IDX0, IDX1], [W0, W1], 4, 2)
    eo = [d.x for d in disp]
    with pytest.raises(InputError, match="num_tokens=3"):
        combine_reference(eo, disp, [IDX0, IDX1], [W0, W1], [3, 2])
    with pytest.raises(InputError, match="expert rows"):
        combine_reference([eo[0][:3], eo[1]], disp, [IDX0, IDX1], [W0, W1], [4, 2])
    with pytest.raises(InputError, match="does not match"):
        combine_reference(eo, disp, [IDX0, IDX1.flip(1)], [W0, W1], [4, 2])
    with pytest.raises(InputError):
        moe_dense_reference(X0, IDX0, W0, torch.zeros(4, 3, 4), torch.zeros(4, 2, 2))
