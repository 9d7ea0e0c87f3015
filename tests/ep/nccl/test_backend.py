"""The nccl (torch.distributed) backend of EPBuffer against the triton backend and the reference, bit for bit.

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
from tritonep.testing.harness import check_calls, diff, expected, record


# ------------------------------------------------------------------------------------------- inputs
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


# ------------------------------------------------------------------------------------------- rank bodies
def _run_backend(group, case, backend, device, nccl_triton=False):
    rank = dist.get_rank(group)
    x0, idx, w0, gy = (t.to(device) for t in case["inputs"][rank])
    buf = EPBuffer(group, case["E"], case["H"], case["Tm"], case["K"], expert_alignment=case["A"],
                   backend=backend, device=device)
    assert buf.backend == backend
    if backend == "nccl" and nccl_triton:
        buf._impl.use_triton = True  # the combine's Triton sums (here in the interpreter) instead of the torch twins
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
    out = {"backend": buf.backend, "reason": buf.backend_reason, "impl": buf._impl.name}
    # sync=False (TRITONEP_SYNC_CHECKS=0) cannot drop the split-size read: the backend reads anyway (graph capture
    # itself is refused with BackendError on a CUDA stream; no CUDA here)
    out["nosync_rows"] = buf._impl.dispatch_fwd(x, idx, w, False)[0].shape[0]
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


# ------------------------------------------------------------------------------------------- checks
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


# ------------------------------------------------------------------------------------------- GPU
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



# ------------------------------------------------------------------------------------------- host plan
def test_host_plan_matches_layout_torch():
    """The numpy layout of the nccl backend equals the shared torch twin (send_base, segments, capacity), and the
    packet starts / split sizes are the counts matrix's packet columns."""
    import numpy as np

    from tritonep.ep.layout import layout_torch
    from tritonep.ep.nccl.plan import host_plan, plan_size

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


# ------------------------------------------------------------------------------------------- bad input (issue 14)
_BE, _BH, _BT, _BK = 8, 64, 8, 1


def _step_inputs(rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    T = (3, 5)[rank] if step == 1 else (6, 4)[rank]
    idx = torch.randint(0, _BE, (T, _BK), generator=gen)
    if step == 2:
        idx[1, 0] = -1
    x = torch.randn(T, _BH, generator=gen).to(torch.bfloat16)
    w = torch.rand(T, _BK, generator=gen) + 0.1
    return x, idx, w


def _bad_body(group, mode):
    """Step 1 with a bad input somewhere (NcclEP called directly: the front door passes ``bad_input``), then a
    valid step 2 through EPBuffer on every rank."""
    rank = dist.get_rank(group)
    buf = EPBuffer(group, _BE, _BH, _BT, _BK, backend="nccl", device="cpu")
    moved = [0]
    orig = dist.all_to_all_single

    def counted(*a, **k):
        moved[0] += 1
        return orig(*a, **k)

    dist.all_to_all_single = counted
    try:
        x, idx, w = _step_inputs(rank, 1)
        bad_input = False
        if mode in ("ids", "both") and rank == (1 if mode == "ids" else 0):
            idx[3 if rank == 1 else 1, 0] = 99
        if mode == "neg" and rank == 1:
            idx[2, 0] = -2
        if (mode == "refused" and rank == 1) or (mode == "both" and rank == 1):
            x, idx, w = (torch.empty(0, _BH, dtype=torch.bfloat16), torch.empty(0, _BK, dtype=torch.int64),
                         torch.empty(0, _BK))
            bad_input = True
        err = None
        try:
            buf._impl.dispatch_fwd(x, idx, w.float(), True, bad_input=bad_input)
        except TritonEPError as e:
            err = (type(e).__name__, str(e), getattr(e, "bad_ranks", None), getattr(e, "rank", None))
        moved_1 = moved[0]
        x2, idx2, w2 = _step_inputs(rank, 2)
        d = buf.dispatch(x2, idx2, w2)
        eo = (d.x.float() * 0.75 + 0.5).to(torch.bfloat16)
        y = buf.combine(eo, d.handle)
        return dict(record(d, eo, y), err=err, moved_1=moved_1)
    finally:
        dist.all_to_all_single = orig
        buf.close()


def _check_step2(res):
    for r in range(2):
        assert res[r]["moved_1"] == 0, f"rank {r}: rows moved in the failed call"
    check_calls(dict(E=_BE), [[_step_inputs(r, 2)] for r in range(2)], [[res[r]] for r in range(2)])


@pytest.mark.parametrize("mode", ["ids", "neg"])
def test_bad_expert_id_raises_on_every_rank_and_next_call_pairs(mode):
    res = run_cpu_world(2, _bad_body, mode, timeout_s=120)
    name, msg, _, _ = res[1]["err"]
    assert name == "InputError", res[1]["err"]
    bad_val, pos = ("99", "topk_idx[3, 0]") if mode == "ids" else ("-2", "topk_idx[2, 0]")
    assert bad_val in msg and pos in msg, msg
    name, msg, bad_ranks, rank = res[0]["err"]
    assert name == "PeerInputError" and bad_ranks == [1] and rank == 0, res[0]["err"]
    assert "rank(s) [1]" in msg and "no rows moved" in msg
    _check_step2(res)


def test_refused_input_flag_raises_on_every_rank_and_next_call_pairs():
    res = run_cpu_world(2, _bad_body, "refused", timeout_s=120)
    for r in range(2):
        name, msg, bad_ranks, rank = res[r]["err"]
        assert name == "PeerInputError" and bad_ranks == [1] and rank == r, res[r]["err"]
        assert "rank(s) [1]" in msg and "refused" in msg
    _check_step2(res)


def test_bad_ids_and_refused_input_on_different_ranks():
    res = run_cpu_world(2, _bad_body, "both", timeout_s=120)
    name, msg, _, _ = res[0]["err"]
    assert name == "InputError" and "99" in msg and "topk_idx[1, 0]" in msg, res[0]["err"]
    name, msg, bad_ranks, rank = res[1]["err"]
    assert name == "PeerInputError" and bad_ranks == [0, 1] and rank == 1, res[1]["err"]
    _check_step2(res)


def test_timeout_comes_from_the_config():
    from tritonep.ep.config import build_config
    from tritonep.ep.nccl.backend import NcclEP

    cfg = build_config(world_size=2, num_experts=8, hidden=64, max_tokens_per_rank=4, topk=2, backend="nccl",
                       device_type="cpu", timeout_s=7.5)
    ep = NcclEP(cfg, group=None, rank=0, device=torch.device("cpu"))
    assert ep.timeout_s == 7.5 and ep.cfg is cfg


# ------------------------------------------------------------------------------------------- expert_out with spare rows
def _spare_rows(group):
    rank = dist.get_rank(group)
    x, idx, w = _step_inputs(rank, 2)
    buf = EPBuffer(group, _BE, _BH, _BT, _BK, backend="nccl", device="cpu", expert_alignment=2)
    out = {}
    for spare in (0, 3):
        d = buf.dispatch(x, idx, w)
        R = d.x.shape[0]
        eo = torch.cat([(d.x.float() * 0.5).to(torch.bfloat16), torch.full((spare, _BH), 7.0).to(torch.bfloat16)])
        eo.requires_grad_()
        y = buf.combine(eo, d.handle)
        y.float().sum().backward()
        out[spare] = dict(y=y.detach(), g=eo.grad, R=R)
    buf.close()
    return out


def test_combine_accepts_spare_expert_out_rows_with_backward():
    for r in run_cpu_world(2, _spare_rows):
        a, b = r[0], r[3]
        assert torch.equal(a["y"], b["y"])
        assert b["g"].shape[0] == a["R"] + 3
        assert torch.equal(b["g"][:a["R"]], a["g"]) and not b["g"][a["R"]:].any()


# ------------------------------------------------------------------------------------------- host reads
def _reads(group):
    rank = dist.get_rank(group)
    x, idx, w = _step_inputs(rank, 2)
    buf = EPBuffer(group, _BE, _BH, _BT, _BK, backend="nccl", device="cpu", expert_alignment=2)
    impl = buf._impl
    x.requires_grad_()
    w.requires_grad_()
    reads = []
    for _ in range(2):
        n0 = impl.host_reads
        d = buf.dispatch(x, idx, w)
        n1 = impl.host_reads
        y = buf.combine((d.x.float() * 0.5).to(torch.bfloat16), d.handle)
        n2 = impl.host_reads
        y.float().sum().backward()
        reads.append((n1 - n0, n2 - n1, impl.host_reads - n2))
    buf.close()
    return reads


def test_host_reads_per_call():
    """One host read per dispatch (the counts matrix), none in combine or either backward."""
    for reads in run_cpu_world(2, _reads):
        assert reads == [(1, 0, 0), (1, 0, 0)], reads


# ------------------------------------------------------------------------------------------- GPU: host reads
def _host_syncs(group):
    import warnings

    rank = dist.get_rank(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    E, H, Tm, K = 64, 512, 128, 4
    buf = EPBuffer(group, E, H, Tm, K, backend="nccl", device=dev, expert_alignment=4)
    impl = buf._impl
    gen = torch.Generator().manual_seed(rank)
    idx, w = _routing(100 + 7 * rank, E, K, gen, neg_frac=0.1)
    x = torch.randn(idx.shape[0], H, generator=gen).to(torch.bfloat16).to(dev)
    idx, w = idx.to(dev), w.to(dev)

    def calls(count):
        out, out_w, _, _, h = impl.dispatch_fwd(x, idx, w, True)
        count("dispatch")
        eo = (out.float() * 0.5).to(torch.bfloat16)
        impl.combine_fwd(eo, h)
        count("combine")
        impl.dispatch_bwd(eo, out_w.clone(), h)
        count("dispatch_bwd")
        impl.combine_bwd(x, eo, h)
        count("combine_bwd")

    calls(lambda what: None)  # warm-up: compiles the kernels, creates the communicators
    torch.cuda.synchronize()
    seen = {}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            def count(what):
                seen[what] = sum("synchroniz" in str(m.message) for m in rec) - sum(seen.values())
            calls(count)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    buf.close()
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("W", [1, 2])
def test_gpu_nccl_host_reads(gpu_world, W):
    """Dispatch reads the host once (the counts matrix); combine and both backward passes never."""
    for r in gpu_world(W, _host_syncs, nccl=True):
        assert r == {"dispatch": 1, "combine": 0, "dispatch_bwd": 0, "combine_bwd": 0}, r
