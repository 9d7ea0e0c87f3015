"""The nccl (torch.distributed) backend of EPBuffer against the triton backend and the reference, bit for bit
(forward and backward); ``auto`` picks it without peer access; ranks asking for different backends are refused; its
host plan equals the shared torch layout. Its call contract (refusals, timeouts, host reads) is in
test_call_contract.py.

CPU worlds use gloo and the Triton interpreter; the GPU test runs both backends over NCCL / symmetric memory.
"""

import os

import pytest
import torch
import torch.distributed as dist

from tritonep.data import load_flame_trace, split_across_ranks
from tritonep.ep import EPBuffer
from tritonep.errors import CapacityError, TritonEPError
from tritonep.reference import combine_backward_reference
from tritonep.testing import run_cpu_world
from tests.support.harness import diff, expected
from tests.support.hooks import backend_of


def _routing(T, E, K, gen, neg_frac=0.0, dup=False):
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else \
        torch.empty(0, K, dtype=torch.int64)
    if dup and T > 1:
        idx[::3, -1] = idx[::3, 0]  # the same expert twice in one token
    if neg_frac:
        idx[torch.rand(T, K, generator=gen) < neg_frac] = -1
    w = torch.rand(T, K, generator=gen) + 0.05
    return idx, w


def _case(W, E, H, K, Ts, A=1, seed=0, neg_frac=0.0, dup=False, routing=None):
    gen = torch.Generator().manual_seed(seed)
    inputs = []
    for r, T in enumerate(Ts):
        idx, w = routing[r] if routing is not None else _routing(T, E, K, gen, neg_frac, dup)
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
        gy = torch.randn(T, H, generator=gen)
        inputs.append((x, idx, w.float(), gy))
    scale = (torch.rand(H, generator=gen) + 0.5)
    return dict(W=W, E=E, H=H, K=K, A=A, Tm=max(max(Ts), 1), inputs=inputs, scale=scale)


def _run_backend(group, case, backend, device, nccl_triton=False):
    rank = dist.get_rank(group)
    x0, idx, w0, gy = (t.to(device) for t in case["inputs"][rank])
    buf = EPBuffer(group, case["E"], case["H"], case["Tm"], case["K"], expert_alignment=case["A"],
                   backend=backend, device=device)
    assert buf.backend == backend
    if backend == "nccl" and nccl_triton:
        backend_of(buf).use_triton = True  # the combine's Triton sums (here in the interpreter) instead of the torch twins
    x = x0.clone().requires_grad_()
    w = w0.clone().requires_grad_()
    d = buf.dispatch(x, idx, w)
    eo = (d.x.float() * case["scale"].to(device)).to(torch.bfloat16)
    eo.retain_grad()
    y = buf.combine(eo, d.handle)
    (y.float() * gy).sum().backward()
    out = dict(x=d.x.detach(), ntpe=d.num_tokens_per_expert, offs=d.expert_offsets, weights=d.weights.detach(),
               eo=eo.detach(), y=y.detach(), gx=x.grad, gw=w.grad, geo=eo.grad)
    buf.close()
    return {k: v.cpu() for k, v in out.items()}


def _both(group, case, backends=("triton", "nccl"), nccl_triton=False):
    gpu = torch.cuda.is_available() and dist.get_backend(group) == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    return {b: _run_backend(group, case, b, dev, nccl_triton) for b in backends}


def _auto_forced(group):
    os.environ["TRITONEP_FORCE_NO_P2P"] = "1"
    rank = dist.get_rank(group)
    buf = EPBuffer(group, 4, 32, 8, 2, backend="auto", device="cpu")
    x = torch.ones(3, 32, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 3], [1, -1], [2, 2]])
    w = torch.ones(3, 2)
    out = {"backend": buf.backend, "reason": buf.backend_reason, "impl": backend_of(buf).name}
    # sync=False (TRITONEP_SYNC_CHECKS=0) cannot drop the split-size read: the backend reads anyway (graph capture
    # itself is refused with BackendError on a CUDA stream; no CUDA here)
    out["nosync_rows"] = backend_of(buf).dispatch_fwd(x, idx, w, False)[0].shape[0]
    out["rows"] = buf.dispatch(x, idx, w).x.shape[0]
    buf.close()
    # capacity: each rank would receive 6 rows (3 tokens x 2 local experts) > max_recv_tokens=4
    small = EPBuffer(group, 4, 32, 8, 2, max_recv_tokens=4, backend="nccl", device="cpu")
    idx2 = torch.tensor([[2, 3], [2, 3], [2, 3]]) if rank == 1 else torch.tensor([[0, 1], [0, 1], [0, 1]])
    try:
        small.dispatch(x, idx2, w)
        out["capacity"] = None
    except CapacityError as e:
        out["capacity"] = (e.needed, e.available)
    small.close()
    return out


def _mixed(group):
    rank = dist.get_rank(group)
    try:
        EPBuffer(group, 4, 32, 8, 2, backend="triton" if rank == 0 else "nccl", device="cpu")
    except TritonEPError as e:
        return type(e).__name__, str(e)
    return None


def _check(case, res, backends=("triton", "nccl")):
    W = case["W"]
    idxs = [i[1] for i in case["inputs"]]
    ws = [i[2] for i in case["inputs"]]
    for r in range(W):
        if "triton" not in backends:
            break
        t, n = res[r]["triton"], res[r]["nccl"]
        for k in ("x", "ntpe", "offs", "weights", "y", "gx", "geo"):
            assert torch.equal(t[k], n[k]), f"rank {r}: {k} differs between backends"
        # weight gradients are fp32 dot products over H: the triton kernel reduces in its tile order, so they agree
        # to fp32 rounding only (same routes, same masked zeros)
        assert torch.equal(t["gw"] == 0, n["gw"] == 0)
        torch.testing.assert_close(t["gw"], n["gw"], rtol=1e-5, atol=1e-5)
    want = expected([i[:3] for i in case["inputs"]], case["E"], case["A"], eos=[res[r]["nccl"]["eo"] for r in range(W)])
    for r in range(W):
        n = res[r]["nccl"]
        assert diff(dict(n, w=n["weights"]), want[r], ("x", "ntpe", "offs", "w", "y")) == [], f"rank {r}"
    ref = [w["ref"] for w in want]
    gys = [i[3].to(torch.bfloat16) for i in case["inputs"]]  # grad of y (bf16) of the loss sum(y * gy)
    geos, gws = combine_backward_reference(gys, [res[r]["nccl"]["eo"] for r in range(W)], ref, idxs, ws)
    for r in range(W):
        assert torch.equal(res[r]["nccl"]["geo"], geos[r].to(torch.bfloat16)), f"rank {r}: grad expert_out"
        torch.testing.assert_close(res[r]["nccl"]["gw"], gws[r], rtol=1e-5, atol=1e-4)


CASES = {
    "w2_empty_rank_neg": dict(W=2, E=8, H=64, K=4, Ts=[20, 0], neg_frac=0.2, dup=True),
    "w3_align4_neg": dict(W=3, E=12, H=64, K=3, Ts=[10, 17, 5], A=4, neg_frac=0.15, dup=True, seed=1),
    "w2_all_masked": dict(W=2, E=4, H=32, K=2, Ts=[4, 3], neg_frac=1.0, seed=5),
    "w1": dict(W=1, E=4, H=32, K=2, Ts=[5], A=2, neg_frac=0.3, seed=6),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_nccl_matches_triton_and_reference(name):
    spec = dict(CASES[name])
    W = spec.pop("W")
    case = _case(W, **spec)
    _check(case, run_cpu_world(W, _both, case))


@pytest.mark.parametrize("name", ["w2_empty_rank_neg", "w3_align4_neg"])
def test_nccl_triton_sums_match_triton_and_reference(name):
    """The combine's Triton kernels (used on CUDA) give the torch twins' bits: same checks, kernels interpreted."""
    spec = dict(CASES[name])
    W = spec.pop("W")
    case = _case(W, **spec)
    _check(case, run_cpu_world(W, _both, case, ("triton", "nccl"), True))


def test_nccl_matches_triton_flame_trace():
    idx, w = load_flame_trace(5)
    parts = split_across_ranks(idx[:128], w[:128], 2)
    case = _case(2, 64, 64, 6, [p[0].shape[0] for p in parts], routing=parts, seed=2)
    _check(case, run_cpu_world(2, _both, case))


def test_auto_picks_nccl_without_p2p_and_reads_splits_without_sync(monkeypatch):
    monkeypatch.setenv("TRITONEP_FORCE_NO_P2P", "1")
    res = run_cpu_world(2, _auto_forced)
    for r in res:
        assert r["backend"] == "nccl" and r["impl"] == "nccl"
        assert "TRITONEP_FORCE_NO_P2P" in r["reason"]
        assert r["nosync_rows"] == r["rows"]
        assert r["capacity"] == (6, 4)
    assert [r["rows"] for r in res] == [4, 6]


def test_mixed_backends_raise_on_every_rank():
    res = run_cpu_world(2, _mixed, timeout_s=60)
    for r in res:
        assert r is not None, "a rank built a buffer although the ranks asked for different backends"
        assert "backend" in r[1]


def _deepseek_case():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2 * 512, 256, generator=gen) + torch.linspace(0, 2, 256)  # skewed load
    idx = logits.topk(8, dim=1).indices
    w = torch.softmax(logits.gather(1, idx), dim=1)
    parts = split_across_ranks(idx, w, 2)
    return _case(2, 256, 7168, 8, [512, 512], routing=parts, seed=4)


@pytest.mark.gpu
def test_gpu_nccl_matches_reference_deepseek_shape(gpu_world):
    case = _deepseek_case()
    _check(case, gpu_world(2, _both, case, ("nccl",), nccl=True), backends=("nccl",))


@pytest.mark.gpu
def test_gpu_nccl_matches_triton_deepseek_shape(gpu_world):
    case = _deepseek_case()
    _check(case, gpu_world(2, _both, case, nccl=True))


@pytest.mark.world1
@pytest.mark.gpu
@pytest.mark.parametrize("A,neg", [(1, 0.0), (4, 0.1)])
def test_gpu_nccl_world1_matches_reference(gpu_world, A, neg):
    """One GPU: the nccl backend's kernels (count, pack, unpack, partials, sums, backward) at the DeepSeek-V3 shape
    against the reference, bit for bit (weight gradients within fp32 rounding); with padding and masked slots."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(700, 256, generator=gen) + torch.linspace(0, 2, 256)
    idx = logits.topk(8, dim=1).indices
    w = torch.softmax(logits.gather(1, idx), dim=1)
    if neg:
        idx[torch.rand(idx.shape, generator=gen) < neg] = -1
        idx[::5, -1] = idx[::5, 0]  # one expert twice in a token
    case = _case(1, 256, 7168, 8, [700], A=A, routing=[(idx, w)], seed=12)
    _check(case, gpu_world(1, _both, case, ("nccl",), nccl=True), backends=("nccl",))


def test_host_plan_matches_layout_torch():
    """The numpy layout of the nccl backend equals the shared torch twin (send_base, segments, capacity), and the
    packet starts / split sizes are the counts matrix's packet columns."""
    import numpy as np

    from tritonep.backends.layout import layout_torch
    from tritonep.backends.nccl.plan import host_plan, plan_size

    gen = torch.Generator().manual_seed(7)
    for W, E, A in ((1, 4, 1), (2, 8, 1), (3, 12, 4), (4, 16, 3)):
        L = E // W
        for _ in range(5):
            counts = torch.randint(0, 6, (W, E), generator=gen)
            counts[torch.rand(W, E, generator=gen) < 0.3] = 0
            m = torch.zeros(W, E + W + 2, dtype=torch.int32)
            m[:, :E] = counts
            m[:, E:E + W] = torch.randint(0, 9, (W, W), generator=gen)
            for rank in range(W):
                lay = layout_torch(counts, rank, A)
                out = np.full(plan_size(W, E), -7, dtype=np.int32)
                need, ss, rs = host_plan(m.numpy(), rank, W, E, A, out)
                small = torch.from_numpy(out).long()
                assert torch.equal(torch.from_numpy(need), lay["rows_needed"].long())
                assert torch.equal(small[:E], lay["send_base"].long())
                pk = m[rank, E:E + W].long()
                assert torch.equal(small[E:E + W], torch.cumsum(pk, 0) - pk)
                o = E + W
                assert torch.equal(small[o:o + L], lay["num_tokens_per_expert"].long())
                assert torch.equal(small[o + L:o + 2 * L], lay["expert_offsets"].long())
                assert torch.equal(small[o + 2 * L:].view(W, E), counts)
                assert ss == tuple(pk.tolist()) and rs == tuple(m[:, E + rank].tolist())
