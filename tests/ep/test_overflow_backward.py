"""An overflowing call that reads nothing on the host (sync-free, or sync checks off), then combine and both
backward passes: no kernel touches a row past the rows it was given, the refused call's layout is empty and
consistent (offsets, counts, row weights 0; combine and every gradient 0), ``check()`` raises CapacityError on every
rank, and the buffer is exact afterwards (rows, combine and gradients against :mod:`tritonep.reference`).

Before, the triton backend returned the refused layout's offsets with capacity-sized rows, and the combine
backward's expand wrote every route to its layout row in a gradient buffer of ``max_recv_tokens`` rows: heap
corruption in a CPU world, an out-of-bounds write on a GPU. Every path: two-kernel, fused, decode (triton), one-hop
and gather (nccl); also through ``MoERecipe(sync_free=True)`` and the torchtitan dispatcher.
"""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.errors import CapacityError
from tritonep.testing import run_cpu_world
from tests.support.harness import BF16, check_grads, open_buffer, run_grad_call, set_env
from tests.support.hooks import backend_of

# max_recv 10 rows: every route to expert 0 of W ranks x 6 tokens is 6W > 10 rows on rank 0
CFG = dict(H=64, Tmax=8, K=2, max_recv=10)
PATHS = {  # name -> (backend, TRITONEP_GEOMETRY, TRITONEP_NCCL_SYNC_FREE)
    "two_kernel": ("triton", "dec=0,fs=0,fe=0,fc=0", None),
    "fused": ("triton", "fs=1,fe=1,fc=1", None),
    "decode": ("triton", "bt=2,dec=2", None),
    "onehop": ("nccl", None, "onehop"),
    "gather": ("nccl", None, "gather"),
}


def _cfg(W, A=1):
    return dict(CFG, E=2 * W, A=A)


def _overflow_inputs(rank, W):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(6, CFG["H"], generator=g).to(BF16)
    idx = torch.zeros(6, CFG["K"], dtype=torch.int64)
    idx[:, 1] = torch.arange(6) % (2 * W - 1) + 1  # the second route anywhere else: no id twice per token
    return x, idx, torch.rand(6, CFG["K"], generator=g) + 0.1


def _good_inputs(rank, W, seed):
    from tritonep.bench.cases import make_rank_inputs

    return make_rank_inputs(rank, [3, 2, 1][rank % 3], CFG["H"], 2 * W, CFG["K"], seed=seed, mask_frac=0.2)


def _refused_step(buf, x, idx, w, sync_free):
    """dispatch (refused on every rank) -> expert -> combine -> backward, then both backward halves called
    directly with full-size inputs; what every output holds (on the buffer's device: CPU worlds and GPU ones)."""
    dev = buf.device
    xr, wr = x.to(dev).clone().requires_grad_(True), w.to(dev).clone().requires_grad_(True)
    idx = idx.to(dev)
    d = buf.dispatch(xr, idx, wr, sync_free=sync_free)
    M = buf.max_recv_tokens
    rec = dict(rows=d.x.shape[0], offs=d.expert_offsets.tolist(), ntpe=d.num_tokens_per_expert.tolist(),
               w_any=bool(d.weights.detach().any()))
    eo = (d.x.float() * 0.5 + 1.0).to(BF16)  # the rows of a refused call are unspecified: never read
    y = buf.combine(eo, d.handle)
    g = torch.ones_like(y, dtype=torch.float32)
    (y.float() * g).sum().backward()
    rec.update(y_zero=not y.any(), gx_zero=not xr.grad.any(), gw_zero=not wr.grad.any())
    gx, gtw = buf.dispatch_backward(torch.ones(M, CFG["H"], dtype=BF16, device=dev), torch.ones(M, device=dev),
                                    d.handle)
    geo, grw = buf.combine_backward(torch.ones(x.shape[0], CFG["H"], dtype=BF16, device=dev),
                                    torch.ones(M, CFG["H"], dtype=BF16, device=dev), d.handle)
    rec.update(halves_zero=not (gx.any() or gtw.any() or geo.any() or grw.any()), geo_rows=geo.shape[0])
    return rec


def _check(buf):
    try:
        buf.check()
        return "no error"
    except CapacityError as e:
        return f"CapacityError: {e}"


def _real_rows(rec):
    """A good call's record of a buffer whose eager calls read nothing (sync checks off): its rows are
    ``max_recv_tokens``, the real ones ``[0, expert_offsets[-1])``; the expert output's gradient is 0 past them and
    the record keeps the real rows (what a synced call returns)."""
    R = int(rec["offs"][-1])
    assert not rec["geo"][R:].any(), "a gradient past the real rows"
    rec["eo"], rec["geo"] = rec["eo"][:R], rec["geo"][:R]
    return rec


def _world(group, path, A, sync_free, repeat):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    backend, geometry, nccl_mode = PATHS[path]
    sync_free = sync_free or backend == "nccl"  # the nccl backend's eager dispatch always reads its split sizes
    # sync checks off (the buffer's option, read once): an eager call that reads nothing (what graph capture does)
    opts = {} if sync_free else dict(sync_checks="none")
    set_env(TRITONEP_GEOMETRY=geometry, TRITONEP_NCCL_SYNC_FREE=nccl_mode)
    buf = open_buffer(group, _cfg(W, A), backend=backend, **opts)
    set_env(TRITONEP_GEOMETRY=None, TRITONEP_NCCL_SYNC_FREE=None)
    out = dict(refused=[_refused_step(buf, *_overflow_inputs(rank, W), sync_free) for _ in range(repeat)])
    out["check"] = _check(buf)
    out["check_again"] = _check(buf)  # reported once
    out["good"] = [run_grad_call(buf, *_good_inputs(rank, W, s), grad_seed=s + rank, bias=1.0) for s in (1, 2)]
    if not sync_free:
        out["good"] = [_real_rows(rec) for rec in out["good"]]
    out["geometry"] = None if buf.geometry is None else (buf.geometry.decode, buf.geometry.fused_send)
    buf.close()
    return out


def _assert_world(res, path, A=1):
    W = len(res)
    for r, out in enumerate(res):
        for rec in out["refused"]:
            assert rec["rows"] in (0, CFG["max_recv"]), (r, rec)  # the rows the call returned (none, or capacity)
            assert rec["offs"] == [0, 0] and rec["ntpe"] == [0, 0] and not rec["w_any"], (r, rec)
            assert rec["y_zero"] and rec["gx_zero"] and rec["gw_zero"] and rec["halves_zero"], (r, rec)
            assert rec["geo_rows"] == CFG["max_recv"], (r, rec)
        assert out["check"].startswith("CapacityError") and f"max_recv_tokens={CFG['max_recv']}" in out["check"], out
        assert out["check_again"] == "no error", out
    if PATHS[path][0] == "triton":  # the geometry the path names really ran: (decode programs, fused senders)
        dec, fs = res[0]["geometry"]
        assert (dec > 0, fs > 0) == (path == "decode", path == "fused"), (path, res[0]["geometry"])
    for i in range(2):
        check_grads(2 * W, [out["good"][i] for out in res], expert_alignment=A, where=f"{path} good call {i}")


@pytest.mark.parametrize("W,path", [(2, "two_kernel"), (2, "decode"), (3, "onehop"), (2, "gather")])
def test_sync_free_overflow_then_backward_is_empty_and_raises_at_check(W, path):
    _assert_world(run_cpu_world(W, _world, path, 1, True, 1, timeout_s=240), path)


@pytest.mark.slow  # the other paths and world sizes: CI's second step
@pytest.mark.parametrize("W,path", [(3, "two_kernel"), (2, "fused"), (3, "fused"), (3, "decode"), (2, "onehop"),
                                    (3, "gather")])
def test_sync_free_overflow_then_backward_every_path(W, path):
    _assert_world(run_cpu_world(W, _world, path, 1, True, 1, timeout_s=240), path)


@pytest.mark.slow
@pytest.mark.parametrize("W,path", [(2, "fused")])
def test_overflow_with_aligned_segments_and_sync_checks_off(W, path):
    """An eager dispatch with sync checks off (it reads nothing either, as under graph capture) and padded segments
    (expert_alignment 4: the padding rows are zeroed only inside the rows given); two refused calls in a row pile up
    into one report."""
    _assert_world(run_cpu_world(W, _world, path, 4, False, 2, timeout_s=240), path, A=4)


@pytest.mark.slow
@pytest.mark.parametrize("W,path", [(3, "two_kernel"), (2, "decode"), (3, "gather")])
def test_overflow_with_aligned_segments_and_sync_checks_off_every_path(W, path):
    _assert_world(run_cpu_world(W, _world, path, 4, False, 2, timeout_s=240), path, A=4)


# ------------------------------------------------------------------------------------------------ MoE layer
def _moe_world(group, backend):
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    geo = tep.MoEGeometry(hidden=64, intermediate=32, num_experts=2 * W, topk=2, max_tokens_per_rank=8,
                          max_recv_tokens=10)
    layer = tep.MoELayer(tep.MoERecipe(sync_free=True), geo, group, seed=3, backend=backend)
    x, idx, w = _overflow_inputs(rank, W)
    x.requires_grad_(True)
    y = layer(x, idx, w)
    y.float().sum().backward()
    out = dict(y_zero=not y.any(), gx_zero=not x.grad.any(), g1_zero=not layer.w1.grad.any(),
               check=_check(layer.buffer))
    layer.zero_grad(set_to_none=True)
    xg, ig, wg = _good_inputs(rank, W, 5)
    y2 = layer(xg, ig, wg)
    out["y2"] = y2.detach().clone()
    layer.buffer.check()
    layer.close()
    return out, (xg, ig, wg)


def _moe_reference(W, inputs):
    """Dense reference of the good call: every token through its experts (the layer's seeded weights)."""
    from tritonep.reference import moe_dense_reference

    geo = tep.MoEGeometry(hidden=64, intermediate=32, num_experts=2 * W, topk=2, max_tokens_per_rank=8)
    w1, w2 = tep.MoELayer.init_expert_weights(geo, seed=3)
    return [moe_dense_reference(x, idx, w, w1, w2) for x, idx, w in inputs]


@pytest.mark.slow
@pytest.mark.parametrize("W,backend", [(2, "triton"), (3, "nccl")])
def test_moe_layer_sync_free_overflow(W, backend):
    res = run_cpu_world(W, _moe_world, backend, timeout_s=240)
    refs = _moe_reference(W, [inp for _, inp in res])
    for r, (out, _) in enumerate(res):
        assert out["y_zero"] and out["gx_zero"] and out["g1_zero"], (r, out)
        assert out["check"].startswith("CapacityError"), out
        assert torch.allclose(out["y2"].float(), refs[r].float(), rtol=2 ** -5, atol=2 ** -5), r


# ------------------------------------------------------------------------------------------------ torchtitan
def _titan_world(group):
    from torch.distributed.device_mesh import DeviceMesh

    from tritonep.integrations import torchtitan as tt

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    cfg = tt.TritonEPTokenDispatcher.Config(num_experts=2 * W, top_k=2, hidden_dim=64, num_max_tokens_per_rank=8,
                                            max_recv_tokens=10)
    disp = tt.TritonEPTokenDispatcher(cfg)
    disp.wire_meshes(ep_mesh=DeviceMesh("cpu", list(range(W))))
    disp.init_buffer()
    x, idx, w = _overflow_inputs(rank, W)
    x = x.float().requires_grad_(True)
    w.requires_grad_(True)
    rows, counts, meta = disp.dispatch(x, w, idx, None)
    y = disp.combine(rows.float() * 2.0, meta, x)
    y.sum().backward()
    out = dict(counts=counts.tolist(), y_zero=not y.any(), gx_zero=not x.grad.any(), gw_zero=not w.grad.any())
    try:
        disp.check()
        out["check"] = "no error"
    except CapacityError:
        out["check"] = "CapacityError"
    tt.close_buffers()
    return out


@pytest.mark.slow  # ~6 s (torchtitan's import): CI's second step
def test_torchtitan_dispatcher_sync_free_overflow():
    pytest.importorskip("torchtitan")
    for out in run_cpu_world(2, _titan_world, timeout_s=240):
        assert out == dict(counts=[0, 0], y_zero=True, gx_zero=True, gw_zero=True, check="CapacityError"), out


# ------------------------------------------------------------------------------------------------ bounds
def _bounds_world(group, path):
    """Kernels handed fewer rows than the layout holds (the host's view is cut short on purpose) write none past
    them: the forward expand into rows cut 2 short, the combine backward's expand into gradients cut 2 short; the
    rows in front of the cut equal the full call's."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    set_env(TRITONEP_GEOMETRY=PATHS[path][1])
    buf = open_buffer(group, _cfg(W), backend="triton")
    set_env(TRITONEP_GEOMETRY=None)
    impl, H = backend_of(buf), CFG["H"]
    from tritonep.bench.cases import make_rank_inputs

    x, idx, w = make_rank_inputs(rank, 4, H, 2 * W, CFG["K"], seed=7, mask_frac=0.0)  # 8 rows per rank on average
    full = buf.dispatch(x, idx, w)
    R = full.x.shape[0]
    ref_rows = full.x.clone()
    guard = 3.0
    big = torch.full((R + 4, H), guard, dtype=BF16)
    outs, status = impl.outputs, impl.call_status
    orig_verdict = status.verdict

    def short_verdict(st):  # the host's rows of this call, 2 short of the layout's
        code, refused, R_ = orig_verdict(st)
        return code, refused, max(R_ - 2, 0)

    status.verdict = short_verdict  # instance attributes over the parts' methods, removed after the call
    outs.alloc_rows = lambda n, kq: (big[:n], None, None)
    cut = buf.dispatch(x, idx, w)
    del outs.alloc_rows, status.verdict
    n = cut.x.shape[0]
    out = dict(R=R, n=n, fwd_guard=bool((big[n:].float() == guard).all()), fwd_rows=torch.equal(big[:n], ref_rows[:n]))
    # the combine backward's expand with outputs of n rows (inside guarded tensors) on the full call's handle
    gy = torch.randn(x.shape[0], H, generator=torch.Generator().manual_seed(rank)).to(BF16)
    eo = (ref_rows.float() * 0.5 + 1.0).to(BF16)
    geo_ref, gw_ref = buf.combine_backward(gy, eo, full.handle)
    g_eo = torch.full((R + 4, H), guard, dtype=BF16)
    g_w = torch.full((R + 4,), guard)
    impl.k.send_bwd(gy, full.handle.store, x.shape[0], -(-x.shape[0] // impl.cfg.tiles.bt))
    impl.k.expand_bwd(gy, g_eo, full.handle.store, eo, g_w, g_w, n)
    out.update(bwd_guard=bool((g_eo[n:].float() == guard).all() and (g_w[n:] == guard).all()),
               bwd_rows=torch.equal(g_eo[:n], geo_ref[:n]) and torch.equal(g_w[:n], gw_ref[:n]))
    buf.check()
    buf.close()
    return out


@pytest.mark.parametrize("path", ["two_kernel", pytest.param("fused", marks=pytest.mark.slow)])
def test_kernels_write_no_row_past_the_rows_given(path):
    for out in run_cpu_world(2, _bounds_world, path, timeout_s=240):
        assert out["n"] == max(out["R"] - 2, 0) and out["R"] > 2, out
        assert out["fwd_guard"] and out["fwd_rows"] and out["bwd_guard"] and out["bwd_rows"], out


def _nccl_bounds_world(group, use_triton):
    """The nccl backend's unpack handed 2 rows fewer than the packets address (its outputs cut short inside guarded
    tensors): no write past them, the rows in front equal the full call's."""
    from tritonep.bench.cases import make_rank_inputs

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    buf = open_buffer(group, _cfg(W), backend="nccl")
    impl, H = backend_of(buf), CFG["H"]
    impl.use_triton = use_triton  # the Triton kernel (in the interpreter) or its torch twin
    x, idx, w = make_rank_inputs(rank, 4, H, 2 * W, CFG["K"], seed=7, mask_frac=0.0)
    full = buf.dispatch(x, idx, w)
    R = full.x.shape[0]
    ref = full.x.clone()
    orig, seen = impl._unpacker.unpack, {}

    def short(recv, srcs, outs, widths, out_w, rr, rw, small, Nr, zero_row, ut, slots=(0, 0, 0), R=None):
        n = out_w.shape[0] - 2
        big = torch.full((n + 6, H), 3.0, dtype=outs[0].dtype)
        bw = torch.full((n + 6,), 3.0)
        orig(recv, srcs, [big[:n]], widths, bw[:n], rr, rw, small, Nr, zero_row, ut, slots, n)
        seen.update(n=n, guard=bool((big[n:].float() == 3.0).all() and (bw[n:] == 3.0).all()),
                    rows=torch.equal(big[:n], ref[:n]))

    impl._unpacker.unpack = short
    buf.dispatch(x, idx, w)
    impl._unpacker.unpack = orig
    buf.close()
    return dict(seen, R=R)


@pytest.mark.parametrize("use_triton", [True, False])
def test_nccl_unpack_writes_no_row_past_the_rows_given(use_triton):
    for out in run_cpu_world(2, _nccl_bounds_world, use_triton, timeout_s=240):
        assert out["R"] > 2 and out["n"] == out["R"] - 2 and out["guard"] and out["rows"], out
