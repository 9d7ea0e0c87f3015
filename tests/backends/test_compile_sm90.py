"""Every kernel launched by a CPU-world run must also compile for the GPU (sm_90), checked without a GPU.

The interpreter accepts code the compiler refuses; this test records the interpreted launches of a run that touches
every EP path (push/pull combine, alignment padding, backward) and compiles each one for sm_90 offline.
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.testing import run_cpu_world
from tritonep.bench.cases import make_rank_inputs
from tests.support.compile_check import compile_recorded, record_launches, usage_recorded
from tests.support.hooks import backend_of

pytestmark = pytest.mark.compile  # CI's second step (.ci/run); minutes on a cold Triton cache


def _ep_paths(group):
    rank = dist.get_rank()
    recs = []
    with record_launches(recs):
        buf = tep.EPBuffer(group, 8, 64, 16, 2, expert_alignment=4, count_columns=4)
        x, idx, w = make_rank_inputs(rank, 9, 64, 8, 2, seed=1)
        x.requires_grad_(True)
        w.requires_grad_(True)
        d = buf.dispatch(x, idx, w)
        y = buf.combine(d.x * 1, d.handle, kind="push")
        y2 = buf.combine(d.x * 1, d.handle, kind="pull")
        (y.float().sum() + y2.float().sum()).backward()
        buf.dispatch(x.detach(), idx, w.detach(), count_ids=idx, count_experts=8)  # the exchange's count routing
        buf.close()
        for dw, cw in (("fp8", "fp8"), ("mxfp4", "mxfp4")):
            qb = tep.EPBuffer(group, 8, 128, 16, 2, dispatch_wire=dw, combine_wire=cw)
            xq, iq, wq = make_rank_inputs(rank, 9, 128, 8, 2, seed=2)
            dq = qb.dispatch(xq, iq, wq)
            qb.combine(dq.x, dq.handle)
            qb.dispatch(xq, iq, wq, keep_quantized=True)
            qb.close()
        os.environ["TRITONEP_GEOMETRY"] = "bt=2,grid=2"  # the GPU table's small-batch tiles (two kernels)
        try:
            sb = tep.EPBuffer(group, 8, 128, 16, 2)
            xs, is_, ws = make_rank_inputs(rank, 9, 128, 8, 2, seed=4)
            xs.requires_grad_(True)
            ws.requires_grad_(True)
            ds = sb.dispatch(xs, is_, ws)
            sb.combine(ds.x * 1, ds.handle).float().sum().backward()
            sb.close()
        finally:
            del os.environ["TRITONEP_GEOMETRY"]
        os.environ["TRITONEP_GEOMETRY"] = "fs=1,fe=1,fc=1"  # the fused (one-launch) dispatch and combine, every wire
        try:
            for dw in ("bf16", "fp8", "mxfp4"):
                fb = tep.EPBuffer(group, 8, 128, 16, 2, dispatch_wire=dw, combine_wire=dw, expert_alignment=4)
                xq, iq, wq = make_rank_inputs(rank, 9, 128, 8, 2, seed=3)
                fd = fb.dispatch(xq, iq, wq)
                fb.combine(fd.x, fd.handle)  # the fused (one-launch) push combine
                if dw != "bf16":
                    fb.dispatch(xq, iq, wq, keep_quantized=True)
                fb.close()
        finally:
            del os.environ["TRITONEP_GEOMETRY"]
        os.environ["TRITONEP_GEOMETRY"] = "bt=2,dec=3"  # the one-launch decode dispatch and combine, every wire
        try:
            for dw in ("bf16", "fp8", "mxfp4"):
                db = tep.EPBuffer(group, 8, 128, 16, 2, dispatch_wire=dw, combine_wire=dw, expert_alignment=4,
                                  count_columns=4)
                xq, iq, wq = make_rank_inputs(rank, 9, 128, 8, 2, seed=5)
                if dw == "bf16":  # the count routing's variant (the compat Buffer's rows lanes), and carried
                    db.dispatch(xq, iq, wq, count_ids=iq, count_experts=8)
                    cb = tep.EPBuffer(group, 8, 128, 16, 2, count_columns=4, count_topk=2)
                    cb.dispatch(xq, iq, wq, count_ids=iq, count_experts=8, count_weights=wq.float())
                    # the compat Buffer's rows lane: a bool rank mask as the routing (top-k = W = 2), carried top-k
                    cb.dispatch(xq, iq >= 4, wq, count_ids=iq, count_experts=8, count_weights=wq.float())
                    cb.close()
                if dw == "bf16":  # the backward too: the decode combine's unweighted variant with the wgrad return
                    xq.requires_grad_(True)
                    wq.requires_grad_(True)
                    dd = db.dispatch(xq, iq, wq)
                    db.combine(dd.x * 1, dd.handle).float().sum().backward()
                    xq, wq = xq.detach(), wq.detach()
                dd = db.dispatch(xq, iq, wq)
                db.combine(dd.x, dd.handle)
                if dw != "bf16":
                    db.dispatch(xq, iq, wq, keep_quantized=True)
                db.close()
        finally:
            del os.environ["TRITONEP_GEOMETRY"]
    return recs


def _transport_paths(group):
    from tritonep.balance import place_torch
    from tritonep.balance.transport import PushWeights
    from tritonep.backends.triton.expert_transport import ExpertTransport

    recs = []
    with record_launches(recs):
        tr = ExpertTransport(group, 4, {"w1": (8, 8)}, dtype=torch.bfloat16, device="cpu")
        pl = place_torch(torch.tensor([[9, 1, 1, 1], [9, 1, 1, 1]]))
        w = torch.ones(2, 8, 8, dtype=torch.bfloat16, requires_grad=True)
        (s,) = PushWeights.apply(tr, pl, ("w1",), w)
        s.float().sum().backward()
        tr.close()
    return recs


def test_transport_kernels_compile_for_sm90():
    recs = run_cpu_world(2, _transport_paths, timeout_s=120)[0]
    assert {"barrier_kernel", "push_weights_kernel", "pull_grads_kernel"} <= {r.get("name") for r in recs}
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)


def test_ep_kernels_compile_for_sm90():
    recs = run_cpu_world(2, _ep_paths, timeout_s=120)[0]
    names = {r.get("name") for r in recs}
    assert {"chunk_hist_kernel", "exchange_kernel", "dispatch_send_kernel", "dispatch_expand_kernel",
            "combine_partial_kernel", "combine_out_kernel", "dispatch_decode_kernel",
            "combine_decode_kernel"} <= names, names
    assert any(r.get("name") == "combine_decode_kernel" and r["constexprs"].get("WGRAD")
               and not r["constexprs"].get("WEIGHTED") for r in recs), "the decode dispatch backward was not recorded"
    for name in ("dispatch_decode_kernel", "exchange_kernel"):
        assert any(r.get("name") == name and r["constexprs"].get("CK") for r in recs), \
            f"the count routing of {name} was not recorded"
        assert any(r.get("name") == name and r["constexprs"].get("XC") and not r["constexprs"].get("CK")
                   for r in recs), f"the count stamps of {name} without a count routing were not recorded"
    assert any(r.get("name") == "dispatch_decode_kernel" and r["constexprs"].get("CARRY") for r in recs), \
        "the carried top-k of the decode dispatch was not recorded"
    assert any(r.get("name") == "dispatch_decode_kernel" and r["signature"].get("topk_idx_ptr") == "*i1"
               for r in recs), \
        "the decode dispatch of a bool rank mask was not recorded"
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)


def _virtual_layer_paths(group):
    from tests.support.variant_paths import virtual_layer_step

    recs = []
    with record_launches(recs):
        virtual_layer_step(group)
    return recs


def test_virtual_expert_kernels_compile_for_sm90():
    """The planner (tl.gather-heavy), the counts exchange and the transport as the MoE layer launches them."""
    recs = run_cpu_world(2, _virtual_layer_paths, timeout_s=180)[0]
    assert {"plan_kernel", "exchange_kernel", "push_weights_kernel", "pull_grads_kernel"} <= {r.get("name")
                                                                                            for r in recs}
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)


def _peer_kernel_paths(group):
    from tritonep.memory import Region, get_heap
    from tests.support.probe_heap import peer_wait_kernel, peer_write_kernel

    rank, W = dist.get_rank(), dist.get_world_size()
    recs = []
    with record_launches(recs):
        buf = get_heap(group, "cpu").allocate([Region("data", (W, 8), torch.int64), Region("flags", (W,), torch.int64),
                                               Region("calls", (1,), torch.int64), Region("status", (8,), torch.int64)])
        buf.local("calls").add_(1)
        peer_write_kernel[(1,)](buf.ptr_table("data"), buf.ptr_table("flags"), buf.local("calls"), N=8, rank=rank,
                                W=W, WB=2)
        peer_wait_kernel[(1,)](buf.local("flags"), buf.local("calls"), buf.local("status"), 10**9, W=W, WB=2,
                               HAS_TIMER=False)
        buf.close()
    return recs


def test_heap_test_kernels_compile_for_sm90():
    """The kernels of the GPU heap test (tests.support.gpu_checks.heap_peer_write_world)."""
    failures = compile_recorded(run_cpu_world(2, _peer_kernel_paths, timeout_s=60)[0])
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)


@contextlib.contextmanager
def _geometry(geo: str):
    """TRITONEP_GEOMETRY set to ``geo`` inside the block (a forked rank's own environment), removed after."""
    os.environ["TRITONEP_GEOMETRY"] = geo
    try:
        yield
    finally:
        del os.environ["TRITONEP_GEOMETRY"]


def _combine_tile_paths(group):
    """The GPU's large-batch combine geometry (KernelTiles.cbt 8 / cwarps 32, select_tiles at >= 1024 tokens) on
    every wire, two-kernel push / pull and the fused combine, BH 1024 as on the GPU; E = 96 (counts exchange grid
    4, the arrival ticket)."""
    rank = dist.get_rank()
    recs = []
    with record_launches(recs):
        for geo in ("cbt=8,cwarps=32", "cbt=8,cwarps=32,fs=1,fe=1,fc=1"):
            with _geometry(geo):
                for dw in ("bf16", "fp8", "mxfp4"):
                    b = tep.EPBuffer(group, 96, 1024, 16, 2, dispatch_wire=dw, combine_wire=dw)
                    x, i, w = make_rank_inputs(rank, 9, 1024, 96, 2, seed=6)
                    d = b.dispatch(x, i, w)
                    b.combine(d.x, d.handle)
                    if "fc" not in geo:
                        b.combine(d.x, d.handle, kind="pull")
                    b.close()
    return recs


def test_combine_tile_32_warps_compile_for_sm90():
    recs = run_cpu_world(2, _combine_tile_paths, timeout_s=300)[0]
    combine = [r for r in recs if r.get("name") in ("combine_partial_kernel", "combine_out_kernel",
                                                    "combine_fused_kernel")]
    assert combine and all(r["options"].get("num_warps") == 32 and r["constexprs"]["BT"] == 8 for r in combine)
    assert {"combine_fused_kernel", "exchange_kernel"} <= {r.get("name") for r in recs}
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)


def _world1_combine_paths(group):
    """World 1 at the GPU's large-batch combine geometry, bf16, BH 1024: the push combine and the dispatch backward
    whose partial kernel stores the output rows (DIRECT), the pull combine (two passes), and the one-launch push
    combine and the decode combine (and its dispatch backward) whose partial step stores them (DIRECT)."""
    recs = []
    x, i, w = make_rank_inputs(0, 9, 1024, 96, 2, seed=6)
    with record_launches(recs), _geometry("cbt=8,cwarps=32"):
        b = tep.EPBuffer(group, 96, 1024, 16, 2)
        x.requires_grad_(True)
        d = b.dispatch(x, i, w)
        b.combine(d.x.detach(), d.handle, kind="pull")
        (d.x * 1).float().sum().backward()  # the dispatch backward: an unweighted combine
        b.combine(d.x.detach(), d.handle)
        b.close()
    with record_launches(recs), _geometry("cbt=8,cwarps=32,fs=8,fe=8,fc=1"):
        b = tep.EPBuffer(group, 96, 1024, 16, 2)
        d = b.dispatch(x.detach(), i, w)
        b.combine(d.x, d.handle)
        b.close()
    with record_launches(recs), _geometry("bt=2,dec=2"):  # the decode combine and its dispatch backward
        b = tep.EPBuffer(group, 96, 1024, 16, 2)
        d = b.dispatch(x.detach(), i, w)
        b.dispatch_backward(d.x, None, d.handle)  # the dispatch backward without weight gradients
        b.dispatch_backward(d.x, d.weights, d.handle)  # ... and with them
        b.combine(d.x.detach(), d.handle)
        b.close()
    return recs


def test_world1_direct_combine_compiles_for_sm90():
    recs = run_cpu_world(1, _world1_combine_paths, timeout_s=300)[0]
    out = [r for r in recs if r.get("name") == "combine_out_kernel"]
    assert {r["constexprs"].get("DIRECT") for r in out} == {True, False}  # push direct; pull, weight grads not
    fused = [r["constexprs"] for r in recs if r.get("name") == "combine_fused_kernel"]
    assert fused and all(c["DIRECT"] for c in fused)
    decode = {(c["WEIGHTED"], c["WGRAD"], c["DIRECT"]) for r in recs if r.get("name") == "combine_decode_kernel"
              for c in (r["constexprs"],)}
    assert decode == {(True, False, True), (False, False, True), (False, True, False)}  # weight gradients: staged
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)


def _nccl_paths(group):
    """The nccl backend's GPU path (``use_triton``): every kernel and variant (padding, kept quantized rows, two
    sources, backward passes) at a small shape and the DeepSeek-V3 shape (H 7168, 256 experts, top-8)."""
    rank = dist.get_rank()
    recs = []
    with record_launches(recs):
        for E, H, K, T, A, wire in ((8, 64, 2, 9, 4, "bf16"), (8, 128, 2, 9, 4, "fp8"), (8, 128, 2, 9, 1, "mxfp4"),
                                    (256, 7168, 8, 20, 1, "bf16")):
            os.environ["TRITONEP_NCCL_SYNC_FREE"] = "gather"  # (a forked rank: its own environment)
            try:
                b = tep.EPBuffer(group, E, H, 32, K, backend="nccl", dispatch_wire=wire, combine_wire=wire,
                                 expert_alignment=A)
            finally:
                os.environ.pop("TRITONEP_NCCL_SYNC_FREE", None)
            backend_of(b).use_triton = True
            x, i, w = make_rank_inputs(rank, T, H, E, K, seed=7)
            x.requires_grad_(True)
            w.requires_grad_(True)
            d = b.dispatch(x, i, w)
            b.combine(d.x * 1, d.handle).float().sum().backward()
            if wire != "bf16":
                b.dispatch(x.detach(), i, w.detach(), keep_quantized=True)
            # the sync-free dispatch: the device plan and the slot-masked unpack variants
            f = b.dispatch(x.detach(), i, w.detach(), sync_free=True)
            b.combine(f.x * 1, f.handle)
            if wire != "bf16":
                b.dispatch(x.detach(), i, w.detach(), keep_quantized=True, sync_free=True)
            b.check()
            b.close()
            if wire == "bf16":  # the one-hop sync-free mode (send / receive launches, the status-word merge)
                os.environ["TRITONEP_NCCL_SYNC_FREE"] = "onehop"
                try:
                    b = tep.EPBuffer(group, E, H, 32, K, backend="nccl", expert_alignment=A)
                finally:
                    os.environ.pop("TRITONEP_NCCL_SYNC_FREE", None)
                backend_of(b).use_triton = True
                f = b.dispatch(x.detach(), i, w.detach(), sync_free=True)
                b.combine(f.x * 1, f.handle)
                b.check()
                b.close()
    return recs


def test_nccl_kernels_compile_for_sm90():
    """Every variant compiles; at the DeepSeek-V3 shape none spills registers (ptxas -v: tile sizes and warps of
    :mod:`tritonep.backends.nccl.route` / ``unpack`` were chosen by this, e.g. the pack kernel spilled 628 bytes with
    128-route pairwise tiles and 2K-element row tiles)."""
    recs = run_cpu_world(2, _nccl_paths, timeout_s=600)[0]
    assert {"route_count_kernel", "route_pack_kernel", "route_unpack_kernel", "partials_kernel", "sum_kernel",
            "pack_rows_kernel", "grad_expand_kernel", "sync_free_plan_kernel", "onehop_send_kernel",
            "onehop_recv_kernel"} <= {r.get("name") for r in recs}
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)
    big = [r for r in recs if 7168 in (r["constexprs"].get("H"), r["constexprs"].get("N0"), r["constexprs"].get("N"))
           or r["constexprs"].get("E") == 256]
    usage = usage_recorded(big)
    assert len(usage) == len(big) and not [u for u in usage if "error" in u], usage
    spilled = [u for u in usage if u["spill_stores"] or u["spill_loads"]]
    assert not spilled, spilled


def _backward_tile_paths(group, tokens):
    """The combine backward at the DeepSeek-V3 shape (H 7168, 256 experts, top-8, alignment 16) with the GPU table's
    geometry for ``tokens`` per rank (its bbt / bwarps tile, select_tiles), world 1."""
    from tests.support.tiles import tiles_of

    g = tiles_of("cuda", 1, 7168, tokens, 8)
    geo = f"bt={g.bt},bh={g.bh},warps={g.num_warps},cbt={g.cbt},cwarps={g.cwarps},bbt={g.bbt},bwarps={g.bwarps}"
    recs = []
    os.environ["TRITONEP_GEOMETRY"] = geo
    try:
        with record_launches(recs):
            b = tep.EPBuffer(group, 256, 7168, 16, 8, expert_alignment=16)
            x, i, w = make_rank_inputs(0, 9, 7168, 256, 8, seed=8)
            d = b.dispatch(x, i, w)
            b.combine_backward(x, d.x, d.handle)
            b.dispatch_backward(d.x, d.weights, d.handle)
            b.close()
    finally:
        del os.environ["TRITONEP_GEOMETRY"]
    return recs, (g.bbt, g.bwarps)


@pytest.mark.parametrize("tokens", [4096, 128])
def test_backward_tiles_do_not_spill_for_sm90(tokens):
    """The combine backward's expand (SCALE + DOT: K expert-output tiles in flight for the weight gradient) in the
    GPU table's own backward tile (KernelTiles.bbt / bwarps) uses no spill memory at the DeepSeek-V3 shape (ptxas -v;
    the dispatch's 16-token x 8-warp tile spilled 2956 / 2592 bytes, 255 registers); the dispatch backward's
    kernels neither."""
    recs, (bbt, bwarps) = run_cpu_world(1, _backward_tile_paths, tokens, timeout_s=300)[0]
    bwd = [r for r in recs if r.get("name") == "dispatch_expand_kernel" and r["constexprs"].get("DOT")]
    assert bwd and all(r["constexprs"]["BT"] == bbt and r["options"]["num_warps"] == bwarps for r in bwd), bwd
    wgrad = [r for r in recs if r.get("constexprs", {}).get("SEND_WGRAD") or r.get("constexprs", {}).get("RECV_WGRAD")]
    assert len(wgrad) == 2, [r.get("name") for r in recs]
    usage = usage_recorded([dict(r, constexprs=dict(r["constexprs"], HAS_TIMER=True)) for r in bwd + wgrad])
    assert len(usage) == 3 and not [u for u in usage if "error" in u], usage
    spilled = [u for u in usage if u["spill_stores"] or u["spill_loads"]]
    assert not spilled, spilled


def _mxfp4_expand_paths(group, tokens):
    """The world-1 mxfp4 dispatch (rows decoded, then kept quantized) at the DeepSeek-V3 shape with the GPU table's
    geometry for ``tokens`` per rank (select_tiles: its token tile and warps)."""
    from tests.support.tiles import tiles_of

    g = tiles_of("cuda", 1, 7168, tokens, 8, wire="mxfp4")
    recs = []
    os.environ["TRITONEP_GEOMETRY"] = f"bt={g.bt},bh={g.bh},warps={g.num_warps}"
    try:
        with record_launches(recs):
            b = tep.EPBuffer(group, 256, 7168, 16, 8, dispatch_wire="mxfp4", expert_alignment=16)
            x, i, w = make_rank_inputs(0, 9, 7168, 256, 8, seed=9)
            b.dispatch(x, i, w)
            b.dispatch(x, i, w, keep_quantized=True)
            b.close()
    finally:
        del os.environ["TRITONEP_GEOMETRY"]
    return recs, (g.bt, g.num_warps)


def test_mxfp4_expander_does_not_spill_for_sm90():
    """The mxfp4 expander (own rows encoded, peers' decoded: the codec stages no own rows) in the GPU table's
    large-batch tile (8 tokens x 16 warps at 4096 tokens) uses no spill memory (ptxas -v, sm_90a, the GPU variant:
    HAS_TIMER), decoded and kept quantized."""
    recs, (bt, warps) = run_cpu_world(1, _mxfp4_expand_paths, 4096, timeout_s=300)[0]
    assert (bt, warps) == (8, 16)
    ex = [r for r in recs if r.get("name") == "dispatch_expand_kernel"]
    assert len(ex) == 2 and all(r["constexprs"]["BT"] == bt and r["options"]["num_warps"] == warps for r in ex), ex
    usage = usage_recorded([dict(r, constexprs=dict(r["constexprs"], HAS_TIMER=True)) for r in ex])
    assert len(usage) == 2 and not [u for u in usage if "error" in u], usage
    spilled = [u for u in usage if u["spill_stores"] or u["spill_loads"]]
    assert not spilled, spilled
