"""MoE layer with virtual experts (balance="virtual") against the dense single-process reference.

Every test runs the balanced layer for a few steps in a CPU world and checks, per rank and step, the output and
every gradient (x, topk_weights, every native w1 / w2) against :func:`tritonep.reference.moe_dense_reference` over
ALL ranks' tokens with the layers' own initial weights (fp32, autograd): ``max|got - ref| <= 3e-2 * max|ref|`` (bf16
weights and activations; the gradient of a native expert includes its replicas' contributions pulled back from the
peers). The balanced per-rank work must be the plan's capacity (max - min <= 1) and cover every valid route. Every
CPU world also checks the host protocol (docs/protocols.md (host protocol rule)): all ranks launch the same signalling kernels and collectives.

Plans covered: real FLAME / OLMoE routing (W=4); hand-made W=2 and W=4 steps where one rank has T=0, the sender uses
no slot while its experts run elsewhere, receivers hold migrated experts while none of their own is held, and a
bystander rank neither uses a slot nor has an expert held; a hand-made W=3 world (one rank with two slots and no native
rows, one with two slots after native rows, a step where nothing moves) plus the torch.compile path (plan, push and
split run inside the custom op) against eager on the same inputs; the split run on its own (bit-equal to one run over
concatenated weights).
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.errors import InputError
from tritonep.moe.experts import expert_ffn, expert_ffn_parts
from tritonep.testing import run_cpu_world

H, I = 64, 32
TOL = 3e-2


def _rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    if b.numel() == 0:
        return 0.0 if a.shape == b.shape else float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


def _hand_routing(totals, sizes, seed):
    """Tokens with 2 distinct experts each realising ``totals`` (route count per expert, even sum, no expert above
    half of it), split over ranks by ``sizes`` (+ one masked token on rank 0)."""
    flat = torch.repeat_interleave(torch.arange(len(totals)), torch.tensor(totals))
    n = flat.numel() // 2
    idx = torch.stack([flat[:n], flat[n:]], 1)  # no expert has more than n routes: the two ids differ
    g = torch.Generator().manual_seed(seed)
    idx = idx[torch.randperm(n, generator=g)]
    w = torch.rand(n, 2, generator=g) + 0.1
    parts, lo = [], 0
    for r, t in enumerate(sizes):
        i, ww = idx[lo:lo + t], w[lo:lo + t]
        if r == 0:
            i, ww = torch.cat([i, torch.full((1, 2), -1)]), torch.cat([ww, torch.ones(1, 2)])
        parts.append((i, ww))
        lo += t
    return parts


def _data_routing(kind, W, T, K, E):
    from tritonep.data import (load_flame_trace, load_olmoe_histogram, sample_routing, scale_histogram_to_experts,
                               split_across_ranks)

    if kind == "flame":
        idx, w = load_flame_trace(3, renormalize=True)
        idx = idx[: T * W] % E
        return split_across_ranks(idx, w[: T * W], W, uneven=True)
    hist = scale_histogram_to_experts(load_olmoe_histogram("github", 0), E)
    idx, w = sample_routing(hist, T * W, K, generator=5)
    return split_across_ranks(idx, w, W)


def _step_routing(case, step, W):
    """Every rank's ``(topk_idx, topk_weights)`` of one step (identical in every rank and in the parent)."""
    st = case["steps"][step]
    if "totals" in st:
        return _hand_routing(st["totals"], st["sizes"], st["seed"])
    return _data_routing(st["kind"], W, st["T"], case["K"], case["E"])


def _step_inputs(case, step, W):
    """Every rank's ``(x bf16 [T, H], topk_idx, topk_weights, grad_y fp32 [T, H])`` of one step."""
    out = []
    for r, (idx, w) in enumerate(_step_routing(case, step, W)):
        g = torch.Generator().manual_seed(100 * step + r)
        x = torch.randn(idx.shape[0], H, generator=g).bfloat16()
        out.append((x, idx, w, torch.randn(idx.shape[0], H, generator=g)))
    return out


def _virtual_world(group, case):
    """Rank body: the virtual layer over ``case["steps"]`` (fwd + bwd each); with ``case["compile"]`` also step 0
    again through ``torch.compile`` (the custom-op path). Returns this rank's initial native weights and per-step
    outputs, gradients and plan facts (slots used, native rows, rows run)."""
    from tritonep.moe import MoEGeometry, MoELayer, MoERecipe

    rank, W = dist.get_rank(), dist.get_world_size()
    steps = [_step_inputs(case, s, W)[rank] for s in range(len(case["steps"]))]
    tmax = max(max(a[0].shape[0] for a in _step_inputs(case, s, W)) for s in range(len(case["steps"])))
    geo = MoEGeometry(hidden=H, intermediate=I, num_experts=case["E"], topk=case["K"], max_tokens_per_rank=max(tmax, 1))
    recipe = MoERecipe(balance="virtual", combine=case.get("combine", "push"), expert_alignment=case.get("A", 1))
    layer = MoELayer(recipe, geo, group, seed=case["seed"], record_stats=True, timeout_s=120,
                     backend=case.get("backend", "auto"))
    assert layer.allocated_bytes == MoELayer.required_bytes(recipe, geo, W, device_type=layer.device.type,
                                                            backend=layer.buffer.backend)
    dev = layer.device
    out = dict(w1=layer.w1.detach().cpu().clone(), w2=layer.w2.detach().cpu().clone(), steps=[])
    L = case["E"] // W

    def run(fn, x, idx, w, gy):
        xx = x.clone().to(dev).requires_grad_(True)
        tw = w.clone().to(dev).requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = fn(xx, topk_idx=idx.to(dev), topk_weights=tw)
        (y.float() * gy.to(dev)).sum().backward()
        return dict(y=y.detach().cpu(), gx=xx.grad.cpu(), gtw=tw.grad.cpu(), gw1=layer.w1.grad.float().cpu(),
                    gw2=layer.w2.grad.float().cpu())

    for x, idx, w, gy in steps:
        res = run(layer, x, idx, w, gy)
        st = layer.last_stats
        res.update(used=st["slots_used"], native=sum(st["num_tokens_per_expert"][:L]),
                   load=sum(st["num_tokens_per_expert"]))
        out["steps"].append(res)
    if case.get("compile"):
        assert not layer._stash  # eager calls go through the same op: state consumed by the backward
        out["compiled"] = run(torch.compile(layer, backend="aot_eager"), *steps[0])
        assert next(layer._tickets) == len(steps) + 1 and not layer._stash  # one op call per step + the compiled one
    layer.close()
    return out


def _dense_reference(case, res, W):
    """Per step: the dense fp32 reference over every rank's tokens with the layers' initial weights; returns
    per-rank ``y, gx, gtw`` and the global ``gw1 [E, H, 2I], gw2 [E, I, H]``."""
    from tritonep.reference import moe_dense_reference

    w1 = torch.cat([r["w1"] for r in res]).float()
    w2 = torch.cat([r["w2"] for r in res]).float()
    refs = []
    for step in range(len(case["steps"])):
        ins = _step_inputs(case, step, W)
        sizes = [a[0].shape[0] for a in ins]
        x = torch.cat([a[0] for a in ins]).float().requires_grad_(True)
        tw = torch.cat([a[2] for a in ins]).float().requires_grad_(True)
        a1, a2 = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        y = moe_dense_reference(x, torch.cat([a[1] for a in ins]), tw, a1, a2)
        (y * torch.cat([a[3] for a in ins])).sum().backward()
        refs.append(dict(y=y.detach().split(sizes), gx=x.grad.split(sizes), gtw=tw.grad.split(sizes), gw1=a1.grad,
                         gw2=a2.grad, routes=int((torch.cat([a[1] for a in ins]) >= 0).sum())))
    return refs


def _check_dense(case, res):
    W = len(res)
    L = case["E"] // W
    refs = _dense_reference(case, res, W)
    for step, ref in enumerate(refs):
        for r in range(W):
            got = res[r]["steps"][step]
            for key in ("y", "gx", "gtw"):
                assert _rel(got[key], ref[key][r]) <= TOL, (step, r, key, _rel(got[key], ref[key][r]))
            for key in ("gw1", "gw2"):
                want = ref[key][r * L:(r + 1) * L]
                assert _rel(got[key], want) <= TOL, (step, r, key, _rel(got[key], want))
        loads = [res[r]["steps"][step]["load"] for r in range(W)]
        assert max(loads) - min(loads) <= 1 and sum(loads) == ref["routes"], (step, loads)
    if case.get("compile"):
        for r in range(W):
            a, b = res[r]["compiled"], res[r]["steps"][0]
            assert max(_rel(a[k], b[k]) for k in ("y", "gx", "gtw", "gw1", "gw2")) <= 1e-3, r
    return refs


def _facts(res, key, step):
    return [r["steps"][step][key] for r in res]


# ------------------------------------------------------------------------------------------------ real routing
@pytest.mark.parametrize("kind,K", [("flame", 6), ("olmoe", 8)])
def test_virtual_real_routing_matches_dense_reference(kind, K):
    case = dict(E=16, K=K, seed=7, steps=[dict(kind=kind, T=12)])  # repeated steps: the hand-made tests below
    res = run_cpu_world(4, _virtual_world, case, timeout_s=600)
    _check_dense(case, res)
    assert any(_facts(res, "used", 0))  # some routes ran in virtual slots


# ------------------------------------------------------------------------------------------------ hand-made plans
# W=2, E=8: step 0 rank 0's experts are hot and rank 1 has no token: rank 1 runs two of rank 0's experts in its
# slots (all its rows are slot rows), rank 0 uses no slot; step 1 the reverse, with uneven T.
_W2_STEPS = [dict(totals=[10, 10, 10, 10, 0, 0, 0, 2], sizes=[21, 0], seed=1),
             dict(totals=[0, 1, 0, 1, 8, 8, 8, 8], sizes=[5, 12], seed=2)]
# W=4, E=16 (capacity 17, 17, 16, 16 in step 0): rank 2 is the only sender (uses no slot, its experts are held),
# ranks 0 and 1 receive (rank 1 with T=0), rank 3 sits exactly at capacity (no slot, nothing held). Step 1: rank 1
# sends to ranks 0 and 2 (rank 2 with T=0), rank 3 again a bystander.
_W4_STEPS = [dict(totals=[3, 2, 1, 0, 0, 0, 0, 0, 12, 12, 10, 10, 4, 4, 4, 4], sizes=[10, 0, 14, 9], seed=3),
             dict(totals=[1, 1, 0, 0, 9, 9, 0, 0, 0, 0, 0, 0, 6, 0, 0, 0], sizes=[4, 6, 0, 3], seed=4)]


def test_virtual_w2_empty_rank_and_idle_sender_match_dense_reference():
    case = dict(E=8, K=2, seed=5, steps=_W2_STEPS, A=2)
    res = run_cpu_world(2, _virtual_world, case, timeout_s=300)
    _check_dense(case, res)
    assert _facts(res, "used", 0) == [0, 2] and _facts(res, "native", 0) == [21, 2]
    assert _facts(res, "used", 1)[1] == 0 and _facts(res, "used", 1)[0] > 0


def test_virtual_w4_bystander_and_empty_ranks_match_dense_reference():
    case = dict(E=16, K=2, seed=6, steps=_W4_STEPS)
    res = run_cpu_world(4, _virtual_world, case, timeout_s=600)
    _check_dense(case, res)
    used0, used1 = _facts(res, "used", 0), _facts(res, "used", 1)
    assert used0[2] == 0 and used0[3] == 0 and used0[0] > 0 and used0[1] > 0, used0
    assert used1[1] == 0 and used1[3] == 0 and used1[0] > 0 and used1[2] > 0, used1
    assert _facts(res, "native", 0)[3] == 16 and _facts(res, "native", 1)[2] == 0


@pytest.mark.gpu
def test_gpu_split_run_matches_one_grouped_run():
    g = torch.Generator().manual_seed(4)
    w1 = (torch.randn(6, 256, 256, generator=g) / 16).bfloat16().cuda()
    w2 = (torch.randn(6, 128, 256, generator=g) / 11).bfloat16().cuda()
    offs = torch.tensor([40, 40, 104, 160, 232, 256], dtype=torch.int32, device="cuda")
    x = torch.randn(256, 256, generator=g).bfloat16().cuda()
    gy = torch.randn(256, 256, generator=g).bfloat16().cuda()
    ref_w1, ref_w2, xr = w1.clone().requires_grad_(), w2.clone().requires_grad_(), x.clone().requires_grad_()
    ref = expert_ffn(xr, offs, ref_w1, ref_w2)
    (ref.float() * gy.float()).sum().backward()
    ws1, ws2 = [w1[:4].clone().requires_grad_(), w1[4:].clone().requires_grad_()], \
        [w2[:4].clone().requires_grad_(), w2[4:].clone().requires_grad_()]
    xs = x.clone().requires_grad_()
    y = expert_ffn_parts(xs, [0, 160, 256], (offs[:4], offs[4:] - 160), ws1, ws2)
    (y.float() * gy.float()).sum().backward()
    import tritonep.moe.experts as ex

    assert ("cuda", torch.bfloat16) not in ex._GROUPED_REFUSED, "torch._grouped_mm refused bf16"
    assert _rel(y, ref) < 1e-2 and _rel(xs.grad, xr.grad) < 1e-2
    assert _rel(torch.cat([w.grad for w in ws1]), ref_w1.grad) < 1e-2
    assert _rel(torch.cat([w.grad for w in ws2]), ref_w2.grad) < 1e-2


# ------------------------------------------------------------------------------------------------ split run
def test_split_run_equals_one_run_over_concatenated_weights():
    from tritonep.balance.transport import used_slot_count

    g = torch.Generator().manual_seed(3)
    w1 = (torch.randn(6, H, 2 * I, generator=g) / 8).bfloat16()
    w2 = (torch.randn(6, I, H, generator=g) / 6).bfloat16()
    # 4 "native" experts (the second empty), then 2 "slots"; 3 rows past the last segment end
    offs = torch.tensor([5, 5, 12, 17, 25, 30], dtype=torch.int32)
    R = 33
    x = torch.randn(R, H, generator=g).bfloat16()
    x[30:] = 0
    gy = torch.randn(R, H, generator=g).bfloat16()
    cases = [  # (bounds, offsets per part, experts per part)
        ([0, 17, R], (offs[:4], offs[4:] - 17), ((0, 4), (4, 6))),
        ([0, 17, 25, R], (offs[:4], offs[4:5] - 17, offs[5:] - 25), ((0, 4), (4, 5), (5, 6))),
        ([0, 0, R], (offs[:0], offs), ((0, 0), (0, 6))),  # a part with no rows and no experts first
    ]
    ref_w1, ref_w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    ref = expert_ffn(xr, offs, ref_w1, ref_w2)
    (ref.float() * gy.float()).sum().backward()
    for bounds, po, ranges in cases:
        ws1 = [w1[a:b].clone().requires_grad_() for a, b in ranges]
        ws2 = [w2[a:b].clone().requires_grad_() for a, b in ranges]
        xs = x.clone().requires_grad_()
        out = torch.full((R, H), 7.0, dtype=torch.bfloat16)
        y = expert_ffn_parts(xs, bounds, po, ws1, ws2, out=out)
        assert y.data_ptr() == out.data_ptr() and torch.equal(y, ref) and not y[30:].any()
        (y.float() * gy.float()).sum().backward()
        assert torch.equal(xs.grad, xr.grad)
        assert torch.equal(torch.cat([w.grad for w in ws1]), ref_w1.grad)
        assert torch.equal(torch.cat([w.grad for w in ws2]), ref_w2.grad)
    with pytest.raises(InputError, match="bounds"):
        expert_ffn_parts(x, [0, 40, R], cases[0][1], [w1[:4], w1[4:]], [w2[:4], w2[4:]])
    with pytest.raises(InputError, match="per part"):
        expert_ffn_parts(x, [0, 17, R], cases[0][1], [w1[:4]], [w2[:4], w2[4:]])
    assert used_slot_count([-1, -1]) == 0 and used_slot_count([3, 5, -1]) == 2 and used_slot_count([-1, 4]) == 2


# per-expert route totals of the skewed step (E=12, W=3, L=4, capacity 26): rank 0's experts are hot, rank 1's idle.
# The plan (tritonep.balance.place_torch) runs experts 0 and 2 on rank 1 (slots 0, 1; no native rows there), experts
# 1 and 3 on rank 2 (slots 0, 1, after 6 native rows: the slot offsets must be shifted), and rank 0 uses no slot
# (zero slot rows) while all four of its experts also run elsewhere. The balanced step moves nothing.
_W3_STEPS = [dict(totals=[18, 18, 18, 18, 0, 0, 0, 0, 6, 0, 0, 0], sizes=[20, 12, 7], seed=1),
             dict(totals=[5, 5, 0, 0, 10, 0, 0, 0, 2, 2, 2, 4], sizes=[3, 7, 5], seed=2)]


# the GPU test's hand-made plans per world size: (E, steps, check of the slots used in the first hand-made step)
_GPU_PLANS = {2: (8, _W2_STEPS, lambda u: u == [0, 2]), 3: (12, _W3_STEPS, lambda u: u == [0, 2, 2]),
              4: (16, _W4_STEPS, lambda u: u[2] == 0 and u[3] == 0 and u[0] > 0 and u[1] > 0)}


@pytest.mark.gpu
def test_gpu_virtual_matches_dense_reference_grouped_gemm(gpu_world, gpu_world_size):
    W = gpu_world_size
    if W not in _GPU_PLANS:
        pytest.skip(f"hand-made plans exist for worlds of {sorted(_GPU_PLANS)} ranks, not {W}")
    E, steps, used_ok = _GPU_PLANS[W]
    case = dict(E=E, K=2, seed=7, steps=[dict(kind="olmoe", T=64)] + steps, A=8)
    res = gpu_world(W, _virtual_world, case, timeout_s=600)
    _check_dense(case, res)
    assert any(_facts(res, "used", 0)) and used_ok(_facts(res, "used", 1)), _facts(res, "used", 1)


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_virtual_split_hand_made_world_and_compile():
    case = dict(E=12, K=2, seed=11, steps=_W3_STEPS, A=4, compile=True)
    res = run_cpu_world(3, _virtual_world, case, timeout_s=300)
    _check_dense(case, res)
    assert _facts(res, "used", 0) == [0, 2, 2]
    assert _facts(res, "native", 0) == [26, 0, 6]
    assert _facts(res, "load", 0) == [26, 26, 26]
    assert _facts(res, "used", 1) == [0, 0, 0]


# ------------------------------------------------------------------------------------------------ either backend
def _backends_equal(world, W, steps, **kw):
    """Run the virtual layer on the triton and the nccl backend; check both against the dense reference and each
    other: outputs and gradients of x, w1 (with the pulled replica gradients), w2 bit for bit, routing-weight
    gradients to fp32 rounding (fp32 dot products over H: the triton kernel reduces in its tile order, as in
    test_nccl_backend). Returns the nccl run."""
    out = {}
    for backend in ("triton", "nccl"):
        case = dict(steps=steps, backend=backend, **kw)
        out[backend] = world(W, _virtual_world, case, timeout_s=600)
        _check_dense(case, out[backend])
    for r in range(W):
        t, n = out["triton"][r], out["nccl"][r]
        for step, (a, b) in enumerate(zip(t["steps"], n["steps"])):
            for k in ("y", "gx", "gw1", "gw2"):
                assert torch.equal(a[k], b[k]), (r, step, k)
            assert torch.equal(a["gtw"] == 0, b["gtw"] == 0), (r, step)
            torch.testing.assert_close(a["gtw"], b["gtw"], rtol=1e-5, atol=1e-5)
            assert (a["used"], a["native"], a["load"]) == (b["used"], b["native"], b["load"]), (r, step)
    return out["nccl"]


def test_virtual_on_nccl_equals_virtual_on_triton():
    """balance='virtual' over the nccl backend (gloo here: counts by all_gather, weights and gradients by
    all_to_all) equals it over the triton backend (see :func:`_backends_equal`), forward and backward: W=2 with a
    rank at T=0 whose slots run the other rank's experts, then the reverse."""
    res = _backends_equal(run_cpu_world, 2, _W2_STEPS, E=8, K=2, seed=5, A=2, combine="push")
    assert _facts(res, "used", 0) == [0, 2]


@pytest.mark.gpu
def test_gpu_virtual_on_nccl_equals_virtual_on_triton(gpu_world):
    """The same on 2 GPUs (NCCL all_gather / all_to_all against symmetric memory + Triton kernels)."""

    def world(W, fn, *args, timeout_s=600):
        return gpu_world(W, fn, *args, timeout_s=timeout_s, nccl=True)

    res = _backends_equal(world, 2, [dict(kind="olmoe", T=64)] + _W2_STEPS, E=8, K=2, seed=7, A=8)
    assert _facts(res, "used", 1) == [0, 2]
