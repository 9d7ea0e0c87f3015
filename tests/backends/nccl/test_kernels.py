"""Every Triton kernel of the nccl backend against its torch twin, bit for bit, in one process (interpreter).

A W-rank exchange is simulated in process: each rank's counts row, the gathered matrix, the host plan, the packed
send rows, and the receive rows a real ``all_to_all_single`` would give (the sources' split ranges concatenated).
Cases: several chunks of tokens (the chunk prefixes and the last-program ticket), a rank without tokens, masked
slots, one expert twice in a token, every token to one expert, alignment padding, hidden not a power of two,
quantized sources (payload + scale bytes), repeated calls on one router (the ticket resets).
"""

import functools

import numpy as np
import pytest
import torch

from tritonep.backends.layout import route_rows_torch
from tritonep.backends.nccl.pack import local_partials, sum_partials, typed_rows
from tritonep.backends.nccl.plan import host_plan, plan_size
from tritonep.backends.nccl.route import Router, count_row_torch, send_layout
from tritonep.backends.nccl.unpack import Unpacker
from tritonep.runtime.launch import Launch
from tritonep.bench.cases import make_rank_inputs
from tritonep.wire.formats import get_wire


@functools.cache
def _launch() -> Launch:
    """The CPU launch runtime (made at first use, not at import: a GPU run collects this file without the
    interpreter, and a CPU runtime refuses to exist there)."""
    return Launch("cpu", record=False, max_programs=0)


def _inputs(W, E, K, H, Ts, seed, mode):
    out = []
    for r, T in enumerate(Ts):
        x, idx, w = make_rank_inputs(r, T, H, E, K, seed=seed, mask_frac=0.2)
        if T > 3:
            idx[1, -1] = idx[1, 0]  # one expert twice in a token
            idx[2] = -1  # a token without routes
        if mode == "one_expert" and T:
            idx[:] = E - 1
        out.append((x, idx, w.float()))
    return out


def _exchange(W, E, K, H, Ts, A=1, seed=0, mode="random", wire="bf16"):
    """Per rank: the twin's send rows and plan, both routers' outputs (kernel and twin) for the pack step."""
    fmt = get_wire(wire)
    es = 2
    if fmt.quantized:
        lay = send_layout(fmt.row_bytes(H), K)
        srcs = (1, fmt.payload_bytes(H)), (1, fmt.scale_bytes(H))
    else:
        lay = send_layout(H * es, K)
        srcs = (es, H), None
    ins = _inputs(W, E, K, H, Ts, seed, mode)
    Tm = max(max(Ts), 1)
    routers = {ut: [Router(W, E, K, Tm, "cpu", _launch(), lay, *srcs) for _ in range(W)] for ut in (False, True)}
    for ro in routers[True]:
        ro.target = 7  # several program columns per chunk (the GPU's split of long rows), uneven
    rows_of = {}
    for ut in (False, True):
        rows_of[ut] = torch.stack([routers[ut][r].count(ins[r][1], Ts[r], False, ut).clone() for r in range(W)])
    assert torch.equal(rows_of[True], rows_of[False]), "counts rows differ"
    m = rows_of[False].numpy()
    ranks = []
    for r in range(W):
        x, idx, w = ins[r]
        plan = np.zeros(plan_size(W, E), dtype=np.int32)
        need, ss, rs = host_plan(m, r, W, E, A, plan)
        planT = torch.from_numpy(plan.copy())
        res = {}
        for ut in (False, True):
            T = Ts[r]
            rows = torch.full((T, K), -5, dtype=torch.int32)
            pkt = torch.full((T, K), -5, dtype=torch.int32)
            send = torch.full((sum(ss), lay.width), 0xAB, dtype=torch.uint8)
            s0, s1 = fmt.quantize_bytes(x) if fmt.quantized else (x, None)
            if T:
                idx_c, w_c = torch.full_like(idx, -5), torch.full_like(w, -5.0)
                routers[ut][r].pack(s0, s1, idx, w, planT, send, rows, pkt, T, ut, idx_c, w_c)
                assert torch.equal(idx_c, idx) and torch.equal(w_c, w), "the routing copy differs"
            res[ut] = dict(rows=rows, pkt=pkt, send=send)
        ranks.append(dict(x=x, idx=idx, w=w, plan=planT, need=need, ss=ss, rs=rs, res=res))
    return ins, ranks, lay, fmt


def _recv(ranks, d, lay, extra_row=False):
    """The receive rows of rank d after the all_to_all (each source's split range for d, sources in order)."""
    parts = []
    for src in ranks:
        start = sum(src["ss"][:d])
        parts.append(src["res"][False]["send"][start:start + src["ss"][d]])
    recv = torch.cat(parts) if parts else torch.empty(0, lay.width, dtype=torch.uint8)
    if extra_row:
        recv = torch.cat([recv, torch.zeros(1, lay.width, dtype=torch.uint8)])
    return recv.contiguous()


CASES = {
    "w2_chunks": dict(W=2, E=8, K=8, H=40, Ts=[40, 17]),  # chunks of BT = 64 / KB = 8 tokens: five chunks
    "w3_empty_rank_k3": dict(W=3, E=12, K=3, H=33, Ts=[70, 0, 9], A=3),  # BT 16, hidden odd, padding
    "w1_one_expert": dict(W=1, E=4, K=2, H=16, Ts=[130], mode="one_expert"),  # BT 32, five chunks
    "w4_k1": dict(W=4, E=8, K=1, H=24, Ts=[200, 3, 0, 129], A=2),  # BT 64
    "w2_long_rows": dict(W=2, E=8, K=8, H=600, Ts=[40, 17], A=2),  # rows split over several program columns
}


def test_long_rows_are_split():
    """The split rule: enough program columns to reach the target, in BH multiples, one column for a large grid."""
    from tritonep.backends.nccl.pack import h_split

    assert h_split(3, 600, 256, 7) == (3, 256) and h_split(300, 600, 256, 7) == (1, 768)
    assert h_split(5, 600, 128, 7) == (2, 384) and h_split(8, 600, 64, 64) == (5, 128)


@pytest.mark.parametrize("name", sorted(CASES))
def test_count_and_pack_kernels_equal_twins(name):
    c = dict(CASES[name])
    W, E, K, H, Ts = c.pop("W"), c.pop("E"), c.pop("K"), c.pop("H"), c.pop("Ts")
    ins, ranks, lay, _ = _exchange(W, E, K, H, Ts, **c)
    for r, rk in enumerate(ranks):
        got, want = rk["res"][True], rk["res"][False]
        for k in ("rows", "pkt", "send"):
            assert torch.equal(got[k], want[k]), f"rank {r}: {k} differs from the twin"
        # the rows are the shared layout twin's (the triton backend's formula)
        assert torch.equal(want["rows"], route_rows_torch(rk["idx"], rk["plan"][:E]).to(torch.int32))
        # every packet slot is used exactly once and by the right token
        pk = want["pkt"]
        assert sorted(set(pk[pk >= 0].tolist())) == list(range(sum(rk["ss"])))


def test_count_kernel_bad_ids_and_repeated_calls():
    """Ids outside [-1, E) are counted, not binned; the ticket resets so calls of other sizes stay right."""
    lay = send_layout(32, 2)
    ro = Router(2, 8, 2, 300, "cpu", _launch(), lay, (2, 16), None)
    gen = torch.Generator().manual_seed(3)
    for T in (300, 5, 64, 65, 1):
        idx = torch.randint(-3, 11, (T, 2), generator=gen)
        got = ro.count(idx, T, False, True).clone()
        assert torch.equal(got, count_row_torch(idx, 8, 2, False)), T
    assert torch.equal(ro.count(torch.empty(0, 2, dtype=torch.int64), 0, True, True),
                       count_row_torch(torch.empty(0, 2, dtype=torch.int64), 8, 2, True))


@pytest.mark.parametrize("name,wire,keep,tail", [("w3_empty_rank_k3", "bf16", False, 0),
                                                 ("w2_long_rows", "bf16", False, 0), ("w4_k1", "fp8", True, 0),
                                                 ("w4_k1", "mxfp4", False, 0),
                                                 ("w3_empty_rank_k3", "bf16", False, 1037)])
def test_unpack_kernel_equals_twin(name, wire, keep, tail):
    """Kernel == twin on poisoned outputs; ``tail``: the sync-free dispatch's ``max_recv_tokens`` rows past the
    real ones (``slots[2]``): the kernel's tail programs must zero those weights as the twin does (its rows stay
    unspecified, not compared)."""
    c = dict(CASES[name])
    W, E, K, H, Ts = c.pop("W"), c.pop("E"), c.pop("K"), c.pop("H"), c.pop("Ts")
    if wire != "bf16":
        H = 128
    ins, ranks, lay, fmt = _exchange(W, E, K, H, Ts, wire=wire, **c)
    A = c.get("A", 1)
    for d in range(W):
        zero_row = keep and A > 1
        recv = _recv(ranks, d, lay, zero_row)
        Nr = sum(ranks[d]["rs"])
        if zero_row:
            recv[Nr].zero_()
            fmt.wire_views(recv[Nr:], H)[1].fill_(fmt.zero_scale)
        R = int(ranks[d]["need"][d])
        up = Unpacker(d, E, E // W, K, H, A, _launch(), lay, (E + W, E + W + E // W))
        up.target = 64  # several program columns (the GPU split of long rows)
        outs = {}
        for ut in (False, True):
            if not fmt.quantized:
                o = [torch.full((R, H), 7.0, dtype=torch.bfloat16)]
                srcs = [(recv, 0, lay.width // 2)]
            elif keep:
                o = [torch.full((R, fmt.payload_bytes(H)), 9, dtype=torch.uint8),
                     torch.full((R, fmt.num_scales(H)), 3, dtype=fmt.scale_dtype)]
                se = o[1].element_size()
                srcs = [(recv, 0, lay.width), (recv, fmt.payload_bytes(H) // se, lay.width // se)]
            else:
                o = [torch.full((R, H), 7.0, dtype=torch.bfloat16)]
                srcs = [(fmt.dequantize_rows(recv, H, torch.bfloat16), 0, H)]
            if tail:
                o = [torch.cat([t, t[:1].expand(tail, -1)]) if R else t.new_full((tail, t.shape[1]), 7)
                     for t in o]
            ow = torch.full((R + tail,), 5.0)
            rr = torch.full((Nr, K), -9, dtype=torch.int32)
            rw = torch.full((Nr, K), 9.0)
            if R + tail:
                up.unpack(recv, srcs, o, tuple(t.shape[1] for t in o), ow, rr, rw, ranks[d]["plan"], Nr, zero_row, ut,
                          (0, 0, R + tail))
            outs[ut] = [t[:R] for t in o] + [ow, rr, rw]
        for i, (a, b) in enumerate(zip(outs[True], outs[False])):
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                               b.view(torch.uint8) if b.dtype != torch.uint8 else b), f"rank {d}: output {i}"


def test_combine_kernels_equal_twins():
    """partials (+ the per-route scalars), sums by per-route packets (+ their read-back), the combine backward's
    pack and expand: kernel = twin (dot products within fp32 rounding)."""
    W, E, K, H, Ts, A = 3, 12, 3, 600, [70, 0, 9], 2
    ins, ranks, lay, _ = _exchange(W, E, K, H, Ts, A=A, seed=5)
    clay = send_layout(2 * H, K, K)
    gen = torch.Generator().manual_seed(9)
    for d in range(W):
        recv = _recv(ranks, d, lay)
        Nr, R, T = sum(ranks[d]["rs"]), int(ranks[d]["need"][d]), Ts[d]
        up = Unpacker(d, E, E // W, K, H, A, _launch(), lay, (E + W, E + W + E // W))
        up.target = 64
        rr = torch.empty(Nr, K, dtype=torch.int32)
        rw = torch.empty(Nr, K)
        if R:
            up.unpack(recv, [(recv, 0, lay.width // 2)], [torch.empty(R, H, dtype=torch.bfloat16)], (H,),
                      torch.empty(R), rr, rw, ranks[d]["plan"], Nr, False, False)
        eo = torch.randn(R + 2, H, generator=gen).to(torch.bfloat16)
        gw = torch.randn(R, generator=gen)
        gy = torch.randn(Nr, H, generator=gen).to(torch.bfloat16)
        sends, geos, gws = {}, {}, {}
        for ut in (False, True):
            s = torch.full((Nr, clay.width), 0x5A, dtype=torch.uint8)
            local_partials(_launch(), eo, rr, rw, s, clay, torch.bfloat16, True, ut, Nr, H, K, False, gw)
            sends[ut] = s
            p32 = torch.full((Nr, H), 3.0)
            part_lay = send_layout(4 * H, K, 0)._replace(mo=4 * H, width=4 * H)
            local_partials(_launch(), eo, rr, rw, p32, part_lay, torch.float32, False, ut, Nr, H, K, False)
            sends[(ut, "fp32")] = p32
            geos[ut] = torch.zeros(R + 2, H, dtype=torch.bfloat16)
            gws[ut] = torch.zeros(R)
            if Nr:
                up.grad_expand(gy, eo, rr, rw, geos[ut], gws[ut], Nr, ut)
        assert torch.equal(sends[True], sends[False]), f"rank {d}: partials"
        assert torch.equal(sends[(True, "fp32")], sends[(False, "fp32")]), f"rank {d}: fp32 partials"
        assert torch.equal(geos[True], geos[False]), f"rank {d}: grad expert_out"
        torch.testing.assert_close(gws[True], gws[False], rtol=1e-5, atol=1e-5)
        # the source side of rank d: sums over its packets and the scalars read back
        pkt = ranks[d]["res"][False]["pkt"]
        Ns = sum(ranks[d]["ss"])
        back = torch.randint(0, 256, (Ns, clay.width), generator=gen, dtype=torch.uint8)
        back.view(torch.bfloat16)[:, :H] = torch.randn(Ns, H, generator=gen).to(torch.bfloat16)
        ys, gtws, packed = {}, {}, {}
        for ut in (False, True):
            ys[ut] = torch.full((T, H), 1.0, dtype=torch.bfloat16)
            gtws[ut] = torch.full((T, K), 4.0)
            sum_partials(_launch(), back, torch.bfloat16, clay.width // 2, pkt, ys[ut], ut, T, H, K, Ns, clay, gtws[ut])
            packed[ut] = torch.zeros(Ns, H, dtype=torch.bfloat16)
            if Ns:
                up.pack_rows(ranks[d]["x"], pkt, packed[ut], T, ut)
        assert torch.equal(ys[True], ys[False]), f"rank {d}: sums"
        assert torch.equal(gtws[True], gtws[False]), f"rank {d}: weight gradients read back"
        assert torch.equal(packed[True], packed[False]), f"rank {d}: packed grad rows"
        assert torch.equal(packed[False], ranks[d]["res"][False]["send"].view(-1).view(torch.bfloat16).view(
            Ns, -1)[:, :H] if Ns else packed[False]), f"rank {d}: grad rows ride the dispatch's packets"
        if T:
            g = typed_rows(back, clay.mo // 4, clay.width // 4, Ns, K, torch.float32)
            want = torch.where(pkt >= 0, g[pkt.clamp(min=0).long(), torch.arange(K)], 0.0)
            assert torch.equal(gtws[False], want)
