"""The one-hop sync-free nccl dispatch (:mod:`tritonep.backends.nccl.onehop`): kernels = twins bit for bit (interpreter),
rows = the layout reference, and in gloo worlds rows / weights / ntpe / offs / combine = the synced
``EPBuffer(backend="nccl")`` of the same input; capacity and bad-id verdicts identical on every rank with nothing
written.

Stale packets: every exchange first sends a larger call through the same persistent buffers, so a receiver that
read past a block's packet count would pick up the earlier call's packets.
"""

from types import SimpleNamespace

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from tritonep.backends.layout import layout_torch, route_rows_torch
from tritonep.backends.nccl.onehop import OneHopDispatch, onehop_layout, onehop_recv_torch, onehop_send_torch
from tritonep.backends.nccl.pack import cdiv, h_split, pow2
from tritonep.backends.nccl.route import count_row_torch
from tritonep.ep.config import build_config
from tritonep.runtime.launch import Launch
from tritonep.runtime.status import STATUS_BAD_INPUT, STATUS_CAPACITY, STATUS_OK
from tritonep.backends.nccl.kernels.onehop import onehop_send_kernel
from tritonep.testing import run_cpu_world
from tritonep.wire.formats import get_wire
from tests.support.hooks import backend_of


def _inputs(T, E, K, H, seed, idx_dtype=torch.int64, mask_frac=0.25, bad=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    idx = idx.long()
    if T > 2:
        idx[1, -1] = idx[1, 0]  # one expert twice in a token
        idx[2] = -1  # a token without routes
    idx[torch.rand(T, K, generator=g) < mask_frac] = -1
    if bad and T:
        idx[T // 2, 0] = E + 3
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    w = torch.rand(T, K, generator=g) + 0.05
    return x, idx.to(idx_dtype).contiguous(), w.float()


def _oh(W, E, K, H, Tcap, A=1, maxr=None, rank=0, use_triton=False, target=7, status_word=None):
    """A dispatcher without a group (the tests drive its steps); target 7: uneven column splits of the rows."""
    cfg = build_config(world_size=W, num_experts=E, hidden=H, max_tokens_per_rank=Tcap, topk=K, expert_alignment=A,
                       max_recv_tokens=maxr, device_type="cpu", check_kernels=False)
    return OneHopDispatch(cfg, group=None, rank=rank, use_triton=use_triton, target=target, status_word=status_word)


SEND_CASES = {  # W, E, K, H, Tcap, T, idx dtype, bad ids
    "w2_int64_tiles": (2, 8, 4, 600, 40, 37, torch.int64, False),  # BT 2: 19 tiles (prefix scans over 16-token
    # steps), 2 column splits of 512 (target 40)
    "w3_int32_k3": (3, 6, 3, 10, 20, 20, torch.int32, False),  # KB 4, hidden odd-sized tiles
    "w2_t0": (2, 4, 2, 16, 8, 0, torch.int64, False),
    "w4_bad_ids": (4, 8, 2, 16, 50, 45, torch.int64, True),
}


@pytest.mark.parametrize("name", sorted(SEND_CASES))
def test_send_kernel_equals_twin(name):
    W, E, K, H, Tcap, T, dt, bad = SEND_CASES[name]
    x, idx, w = _inputs(T, E, K, H, 1, dt, bad=bad)
    oh = _oh(W, E, K, H, Tcap, use_triton=True, target=40)
    got = {}
    for ut in (False, True):
        oh.send.fill_(0xAB)
        pkt = torch.full((T, K), -7, dtype=torch.int32)
        if ut:  # the block's fields the send launch writes (routing copies, packets): sentinels first
            blk, ic = oh.outputs(T, idx.dtype)
            v = oh.views(blk, T)
            ic.fill_(-5)
            v["w_c"].fill_(-5.0)
            v["pkt"].fill_(-7)
            nc = max(1, cdiv(T, oh.BT))
            hs, hc = h_split(nc, H, oh._send_bh, oh.target)
            assert hs > 1 or name != "w2_int64_tiles", "the case must split rows"
            oh._send_k((nc, hs), idx, w, x, blk, ic, T, 0, hc)
            pkt = v["pkt"]
            assert torch.equal(ic, idx) and torch.equal(v["w_c"], w), "routing copies"
        else:
            pkt = onehop_send_torch(x, None, idx, w, False, E, W, Tcap, oh.send, oh.lay)
        got[ut] = (oh.send.clone(), pkt)
    assert torch.equal(got[True][0], got[False][0]), "send buffers differ"
    assert torch.equal(got[True][1], got[False][1]), "pkt differs"
    send, pkt = got[False]
    hdr = send.view(torch.int32)[0::1 + Tcap, :E + W + 2]
    assert torch.equal(hdr, count_row_torch(idx, E, W, False).expand(W, -1)), "headers = the counts row"
    if T:  # lr = the layout twin's rank inside the expert (send_base 0); slots in token order per block
        ok = (idx >= 0) & (idx < E)
        lr = send.view(torch.int32)[pkt.clamp(min=0).long(), oh.lay.mo // 4 + torch.arange(K)[None, :]]
        want = route_rows_torch(torch.where(ok, idx, -1), torch.zeros(E, dtype=torch.int32))
        assert torch.equal(torch.where(ok, lr, -1), want)


def test_send_kernel_quantized_sources():
    """fp8 payload + scale bytes (two sources) through the kernel = twin."""
    W, E, K, H, Tcap, T = 2, 8, 2, 128, 20, 19
    fmt = get_wire("fp8")
    lay = onehop_layout(fmt.row_bytes(H), K, E, W)
    x, idx, w = _inputs(T, E, K, H, 2)
    q, sb = fmt.quantize_bytes(x)
    q, sb = q.contiguous(), sb.contiguous()
    pb, nb = fmt.payload_bytes(H), fmt.scale_bytes(H)
    bt = max(1, 64 // pow2(K))
    bk = Launch("cpu", record=False, max_programs=0).bind(onehop_send_kernel, dict(
        K=K, KB=pow2(K), E=E, L=E // W, W=W, EB=pow2(E), WB=pow2(W), BT=bt, TCAP=Tcap, N0=pb, ROW0=lay.width,
        N1=nb, ROW1=lay.width, COL1=pb, META=lay.mo // 4, ROW32=lay.width // 4, BH=64),
        ("idx_ptr", "w_ptr", "src0_ptr", "src1_ptr", "send_ptr", "pkt_ptr", "idx_copy_ptr", "w_copy_ptr", "T",
         "refused", "HC"))
    sends = {}
    for ut in (False, True):
        s = torch.full((W * (1 + Tcap), lay.width), 0x3C, dtype=torch.uint8)
        if ut:
            pkt = torch.empty(T, K, dtype=torch.int32)
            bk((cdiv(T, bt), 2), idx, w, q, sb, s, pkt, torch.empty_like(idx), torch.empty_like(w), T, 1, 64)
        else:
            pkt = onehop_send_torch(q, sb, idx, w, True, E, W, Tcap, s, lay)
        sends[ut] = (s, pkt)
    assert torch.equal(sends[True][0], sends[False][0]) and torch.equal(sends[True][1], sends[False][1])


def _expected(ins, d, E, W, A):
    """Rows of rank d from the layout reference: (out rows [R, H], weights [R], ntpe, offs)."""
    counts = torch.stack([count_row_torch(i[1], E, W, False)[:E] for i in ins])
    lay = layout_torch(counts, d, A)
    R = int(lay["rows_needed"][d])
    L = E // W
    out = torch.zeros(R, ins[0][0].shape[1], dtype=torch.bfloat16)
    ow = torch.zeros(R)
    for s, (x, idx, w) in enumerate(ins):
        rows = route_rows_torch(idx, layout_torch(counts, s, A)["send_base"])
        here = (idx >= 0) & (idx // L == d)
        t, k = torch.nonzero(here, as_tuple=True)
        out[rows[t, k].long()] = x[t]
        ow[rows[t, k].long()] = w[t, k]
    return out, ow, lay["num_tokens_per_expert"], lay["expert_offsets"]


def _exchange(W, E, K, H, Tcap, Ts, A=1, maxr=None, bad_rank=None, use_triton=False, flood=False):
    """Every rank's send buffer (twin) after a larger earlier call (stale packets), then rank d's receive block."""
    ohs = [_oh(W, E, K, H, Tcap, A, maxr, rank=r, use_triton=use_triton) for r in range(W)]
    ins = []
    for r, oh in enumerate(ohs):
        big = _inputs(Tcap, E, K, H, 100 + r, mask_frac=0.0)
        onehop_send_torch(big[0], None, big[1], big[2], False, E, W, Tcap, oh.send, oh.lay)
        x, idx, w = _inputs(Ts[r], E, K, H, 10 + r, bad=r == bad_rank)
        if flood and r == 0:  # every route of rank 0 to rank W-1's experts
            idx = (E - 1 - torch.arange(K)).expand(Ts[r], K).contiguous()
        onehop_send_torch(x, None, idx, w, False, E, W, Tcap, oh.send, oh.lay)
        ins.append((x, idx, w))
    blk = 1 + Tcap
    for d, oh in enumerate(ohs):
        oh.recv.copy_(torch.cat([ohs[s].send[d * blk:(d + 1) * blk] for s in range(W)]))
    return ohs, ins


def _receive(oh, ut):
    """Outputs of the receive step (kernel or twin) from sentinel-filled tensors."""
    blk, _ = oh.outputs(0, torch.int64)
    o = oh.views(blk, 0)
    for n, v in dict(out_w=5.0, rr=-9, rw=9.0, ntpe=-3, offs=-3, status=-1, counts=-4).items():
        o[n].fill_(v)
    o["out"] = torch.full((oh.maxr, oh.H), 7.0, dtype=torch.bfloat16)
    args = [o[k] for k in ("out", "out_w", "rr", "rw", "ntpe", "offs", "status", "counts")]
    if ut:  # the block's fields at their static offsets: the launch takes the rows and the block
        oh._recv_k(oh._recv_grid, o["out"], blk)
    else:
        onehop_recv_torch(oh.recv, *args[:7], oh.rank, oh.E, oh.W, oh.Tcap, oh.A, oh.maxr, oh.lay,
                          oh.lay.width // 2, args[7], oh._st)
    return o


RECV_CASES = {  # W, E, K, H, Tcap, Ts, A
    "w2_a1": (2, 8, 4, 72, 12, [11, 5], 1),  # 3 column splits
    "w3_a4_k3": (3, 6, 3, 20, 9, [9, 0, 4], 4),
    "w2_all_empty_a4": (2, 4, 2, 16, 6, [0, 0], 4),
}


@pytest.mark.parametrize("name", sorted(RECV_CASES))
def test_recv_kernel_equals_twin_and_layout(name):
    W, E, K, H, Tcap, Ts, A = RECV_CASES[name]
    ohs, ins = _exchange(W, E, K, H, Tcap, Ts, A, use_triton=True)
    assert ohs[0]._recv_grid[1] > 1 or name != "w2_a1", "the case must split rows"
    for d, oh in enumerate(ohs):
        k, t = _receive(oh, True), _receive(oh, False)
        R = int(t["offs"][-1])
        for n in ("out_w", "rr", "rw", "ntpe", "offs", "status", "counts"):
            assert torch.equal(k[n], t[n]), f"rank {d}: {n} differs from the twin"
        assert torch.equal(k["out"][:R].view(torch.int16), t["out"][:R].view(torch.int16)), f"rank {d}: rows"
        assert torch.equal(k["out"][R:], t["out"][R:]) and bool((t["out"][R:] == 7.0).all()), "tail untouched"
        out, ow, ntpe, offs = _expected(ins, d, E, W, A)
        assert int(t["status"][0]) == STATUS_OK
        assert torch.equal(t["ntpe"], ntpe) and torch.equal(t["offs"], offs)
        assert torch.equal(t["out"][:R].view(torch.int16), out.view(torch.int16)), f"rank {d}: rows vs layout"
        assert torch.equal(t["out_w"][:R], ow) and bool((t["out_w"][R:] == 0).all()), f"rank {d}: weights"
        assert int((t["rr"] >= 0).sum()) == int(ntpe.sum()), f"rank {d}: one received route per real row"
        want = torch.stack([count_row_torch(idx, E, W, False)[:E] for _, idx, _ in ins])
        assert torch.equal(t["counts"], want), f"rank {d}: counts snapshot"


def test_status_word_merge_equals_gather_plan():
    """``MERGE``: the receive launch (kernel and twin) merges each verdict into the backend's status word exactly
    as the gather mode's device plan does on the same counts matrix (the W headers): ok, capacity, then bad ids
    (the first refusal's code / rank / rows kept, refusals counted, flags gathered)."""
    from tritonep.backends.nccl.plan import device_plan_torch, sf_plan_size, status_size

    W, E, K, H, Tcap, Ts, A, maxr = 3, 6, 2, 16, 8, [8, 3, 5], 2, 10
    words = {(d, n): torch.zeros(status_size(W), dtype=torch.int32) for d in range(W) for n in ("k", "t", "plan")}
    for kw in (dict(), dict(flood=True), dict(bad_rank=1)):
        ohs, _ = _exchange(W, E, K, H, Tcap, Ts, A, maxr=maxr, **kw)
        for d, oh in enumerate(ohs):
            for n, ut in (("k", True), ("t", False)):
                m = _oh(W, E, K, H, Tcap, A, maxr, rank=d, use_triton=True, status_word=words[d, n])
                m.recv.copy_(oh.recv)
                _receive(m, ut)
            mat = oh.recv.view(torch.int32)[0::1 + Tcap, :E + W + 2].reshape(-1).clone()
            device_plan_torch(mat, d, W, E, A, Tcap, maxr, torch.empty(sf_plan_size(W, E), dtype=torch.int32),
                              words[d, "plan"], (STATUS_CAPACITY, STATUS_BAD_INPUT))
            assert torch.equal(words[d, "k"], words[d, "t"]), (d, kw, words[d, "k"], words[d, "t"])
            assert torch.equal(words[d, "t"], words[d, "plan"]), (d, kw, words[d, "t"], words[d, "plan"])
    st = words[0, "plan"].tolist()
    assert st[0] == STATUS_CAPACITY and st[1] == 2 and st[2] == 2 and st[4:4 + W] == [0, 1, 0], st


@pytest.mark.parametrize("kind", ["capacity", "bad_id"])
def test_refused_verdict_same_everywhere_nothing_written(kind):
    W, E, K, H, Tcap, Ts, A = 3, 6, 2, 16, 8, [8, 3, 5], 2
    if kind == "capacity":  # every route of rank 0 to rank 2's experts: rank 2 needs >= 16 rows
        ohs, ins = _exchange(W, E, K, H, Tcap, Ts, A, maxr=10, use_triton=True, flood=True)
    else:
        ohs, ins = _exchange(W, E, K, H, Tcap, Ts, A, bad_rank=1, use_triton=True)
    words = []
    for d, oh in enumerate(ohs):
        for ut in (True, False):
            o = _receive(oh, ut)
            words.append(o["status"].tolist())
            assert bool((o["out"] == 7.0).all()), f"rank {d}: a row was written"
            assert bool((o["out_w"] == 0).all()) and bool((o["rr"] == -1).all()) and bool((o["rw"] == 0).all())
            assert bool((o["ntpe"] == 0).all()) and bool((o["offs"] == 0).all())
    assert all(wd == words[0] for wd in words), words
    if kind == "capacity":
        assert words[0][0] == STATUS_CAPACITY and words[0][1] == 0 and words[0][2] >= 16 and words[0][3] == 2
    else:
        assert words[0][0] == STATUS_BAD_INPUT and words[0][1] == 0b10


# ------------------------------------------------------------------------------------------------ gloo worlds
def _world(group, W, E, K, H, Tcap, A, Ts, use_triton):
    from tritonep.ep import EPBuffer

    rank = dist.get_rank(group)
    buf = EPBuffer(group, E, H, Tcap, K, expert_alignment=A, backend="nccl", device="cpu")
    cfg = backend_of(buf).cfg
    oh = OneHopDispatch(cfg, group=group, rank=rank, device="cpu", use_triton=use_triton, target=5)
    res = []
    for call, T in enumerate([Tcap, Ts[rank]]):  # a full call first: its packets are stale in the second
        x, idx, w = _inputs(T, E, K, H, 1000 * call + rank)
        d = buf.dispatch(x, idx, w)
        eo = (d.x.float() * 1.5 + 0.25).to(torch.bfloat16)
        y = buf.combine(eo, d.handle)
        o = oh(x, idx, w)
        R = int(o.offs[-1])
        eo1 = torch.zeros(cfg.max_recv_tokens, H, dtype=torch.bfloat16)
        eo1[:R] = eo
        hd = SimpleNamespace(num_tokens=T, send_splits=oh.splits, recv_splits=oh.splits, num_send=oh.nslot,
                             num_recv=oh.nslot, recv_rows=o.rr, recv_w=o.rw, pkt=o.pkt)
        be = backend_of(buf)
        y1, _ = be._combine.combine(eo1, hd, True, be.use_triton, wire=cfg.combine_wire)
        res.append(dict(R=R, R0=d.x.shape[0], x=torch.equal(o.out[:R].view(torch.int16), d.x.view(torch.int16)),
                        w=torch.equal(o.out_w[:R], d.weights), tail=bool((o.out_w[R:] == 0).all()),
                        ntpe=torch.equal(o.ntpe, d.num_tokens_per_expert),
                        offs=torch.equal(o.offs, d.expert_offsets), status=o.status.tolist(),
                        y=torch.equal(y1.view(torch.int16), y.view(torch.int16)),
                        copies=torch.equal(o.idx_c, idx) and torch.equal(o.w_c, w)))
    # refusals: rank 1 sends a bad id; rank 0 floods rank W-1's experts past max_recv_tokens = Tcap; the front door
    # refused rank W-1's input (it joins with T = 0 and the flag)
    for case in ("bad", "cap", "refused"):
        oh2 = OneHopDispatch(replace(cfg, max_recv_tokens=Tcap if case == "cap" else cfg.max_recv_tokens),
                             group=group, rank=rank, use_triton=use_triton)
        x, idx, w = _inputs(Tcap, E, K, H, 7 + rank, bad=case == "bad" and rank == 1)
        if case == "cap" and rank == 0:
            idx = (E - 1 - torch.arange(K)).expand(Tcap, K).contiguous()
        refused = case == "refused" and rank == W - 1
        if refused:
            x, idx, w = x[:0], idx[:0], w[:0]
        o = oh2(x, idx, w, refused)
        res.append(dict(status=o.status.tolist(), nothing=bool((o.out_w == 0).all() and (o.rr == -1).all()
                                                               and (o.offs == 0).all() and (o.ntpe == 0).all())))
    buf.close()
    return res


@pytest.mark.parametrize("W,use_triton", [(2, True), (3, False)])
def test_world_equals_synced_dispatch_and_combine(W, use_triton):
    E, K, H, Tcap, A = 3 * W, 4, 80, 20, 2  # BT = 16 tokens: two send tiles; rows split in column ranges
    Ts = [19, 0, 7][:W]
    res = run_cpu_world(W, _world, W, E, K, H, Tcap, A, Ts, use_triton, timeout_s=120)
    for r, calls in enumerate(res):
        for c in calls[:2]:
            assert c["status"][0] == STATUS_OK, (r, c)
            for k in ("x", "w", "tail", "ntpe", "offs", "y", "copies"):
                assert c[k], f"rank {r}: {k} differs from the synced nccl dispatch ({c})"
            assert c["R"] == c["R0"]
    bad = [calls[2] for calls in res]
    cap = [calls[3] for calls in res]
    assert all(b == bad[0] for b in bad) and bad[0]["status"][0] == STATUS_BAD_INPUT
    assert bad[0]["status"][1] == 0b10 and bad[0]["nothing"]
    assert all(c == cap[0] for c in cap) and cap[0]["status"][0] == STATUS_CAPACITY and cap[0]["nothing"]
    assert cap[0]["status"][2] >= 3 * Tcap and cap[0]["status"][3] == W - 1, "rows the worst rank needs, that rank"
    ref = [calls[4] for calls in res]
    assert all(c == ref[0] for c in ref) and ref[0]["status"][:2] == [STATUS_BAD_INPUT, 1 << (W - 1)]
    assert ref[0]["nothing"]


@pytest.mark.compile
def test_onehop_kernels_compile_for_sm90():
    """Both launches (int32 and int64 ids, one and two sources, column splits, the receive launch with and without
    the status-word merge) compile for sm_90 offline: the interpreter accepts code the compiler refuses."""
    from tests.support.compile_check import compile_recorded, record_launches

    recs = []
    with record_launches(recs):
        test_send_kernel_equals_twin("w3_int32_k3")
        test_send_kernel_equals_twin("w2_int64_tiles")
        test_send_kernel_quantized_sources()
        test_recv_kernel_equals_twin_and_layout("w2_a1")
        test_status_word_merge_equals_gather_plan()  # MERGE: the backend's sync-free one-hop mode
    names = {r.get("name") for r in recs}
    assert names == {"onehop_send_kernel", "onehop_recv_kernel"}, names
    failures = compile_recorded(recs)
    assert not failures, "\n\n".join(f"{n}: {e}" for n, e in failures)
