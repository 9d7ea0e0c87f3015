"""The compat Buffer's torch ops against plain loops, and the fact they build on: rows travel as bits.

- every 16-bit pattern (NaN payloads, infinities, subnormals, -0) crosses a compat dispatch unchanged, both backends:
  the premise of handing caller-quantized rows and top-k metadata on in bf16 rows;
- the layout (ids -1 and out of range select nothing, repeated ids count twice), twin and kernel, over several
  programs and repeated calls (the kernel's accumulator is left zeroed);
- the per-rank slots, the meta lane's K slots per rank, top-k id packing and the local-id table (never wraps an id
  onto an expert); the packing kernel against its twin bit for bit (weights with NaN payloads included);
- the unpacking twin and kernel (received tokens only when the count lives on the device; the histogram read on
  the host through pinned memory, none without a read);
- quantized rows (strided float scales, int32 scales) packed and unpacked bit for bit;
- the low-latency slot map and the UE8M0 packing;
- the NaN fill of a ``num_worst_tokens`` call refused for capacity: twin and kernel, bit for bit, and only when some
  rank's rows exceed the limit.
"""

import pytest
import torch

from tests.compat.deepep_reference import layout_ref
from tritonep.compat.deep_ep.meta import MetaOps
from tritonep.compat.deep_ep.low_latency import expert_slots, ue8m0_pack
from tritonep.compat.deep_ep.packing import (layout_torch, local_id_table, meta_slots, meta_width, pack_meta,
                                              pack_quantized, pack_torch, poison_torch, rank_slots, unpack_meta,
                                              unpack_quantized)
from tritonep.errors import InputError
from tritonep.testing import run_cpu_world


def all_patterns(group, backend):
    """Every 16-bit pattern through a compat dispatch (rows to every rank); True when every rank got them all."""
    import tritonep.compat.deep_ep as deep_ep

    rank, W = group.rank(), group.size()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    T, H = 65536 // (1024 * W), 1024  # W ranks x T rows x 1024 = every 16-bit pattern once
    bits = (torch.arange(T * H, dtype=torch.int32) + rank * T * H).to(torch.int16).view(T, H)
    buf = deep_ep.Buffer(group, 0, 0, backend=backend)
    itr = torch.ones(T, W, dtype=torch.bool, device=dev)
    rx, *_ = buf.dispatch(bits.to(dev).view(torch.bfloat16), num_tokens_per_rank=itr.sum(0, dtype=torch.int32),
                          is_token_in_rank=itr, num_tokens_per_expert=torch.zeros(W, dtype=torch.int32, device=dev))
    buf.destroy()
    expect = torch.cat([(torch.arange(T * H, dtype=torch.int32) + s * T * H).to(torch.int16).view(T, H)
                        for s in range(W)])
    return torch.equal(rx.cpu().view(torch.int16), expect)


def test_every_bf16_bit_pattern_crosses_unchanged():
    assert run_cpu_world(2, all_patterns, "triton") == [True, True]
    assert run_cpu_world(2, all_patterns, "nccl") == [True, True]


def test_layout_matches_loops():
    kernels = MetaOps("cpu")
    gen = torch.Generator().manual_seed(0)
    # (3, 12, 600, 4): several programs of the kernel (a CPU tile holds 256 tokens)
    for W, E, T, K in ((2, 4, 9, 2), (3, 12, 17, 4), (4, 4, 5, 3), (1, 3, 4, 2), (2, 8, 0, 3), (3, 12, 600, 4)):
        idx = torch.randint(-2, E + 2, (T, K), generator=gen)  # -1, -2 and ids >= E select nothing
        if T:
            idx[0, :2] = 0  # a repeated id counts twice per expert, once per rank
        ref = layout_ref(idx, E, W)
        for dt in (torch.int64, torch.int32):
            for got in (layout_torch(idx.to(dt), E, W), kernels.layout(idx.to(dt), E, W),
                        kernels.layout(idx.to(dt), E, W)):  # twice: the accumulator starts from zero again
                for g, r in zip(got, ref):
                    assert g.dtype == r.dtype and torch.equal(g, r)


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def test_pack_kernel_matches_twin_bit_for_bit():
    kernels = MetaOps("cpu")
    gen = torch.Generator().manual_seed(3)
    for W, E, T, K in ((2, 8, 7, 3), (1, 4, 5, 8), (3, 12, 300, 4), (4, 8, 0, 2), (2, 6, 1, 1)):
        idx = torch.randint(-2, E + 2, (T, K), generator=gen)
        w = torch.rand(T, K, generator=gen)
        if T:
            w.view(torch.int32)[0, 0] = 0x7FC00123  # a NaN payload travels as bits
        in_rank = torch.rand(T, W, generator=gen) < 0.5
        for dt in (torch.int64, torch.int32):
            ref = pack_torch(in_rank, idx.to(dt), w)
            for args in ((in_rank, idx.to(dt), w), (in_rank.T.contiguous().T, idx.to(dt).T.contiguous().T, w)):
                got = kernels.pack(*args)  # the second: strided inputs, made contiguous
                assert [g.shape for g in got] == [r.shape for r in ref]
                for g, r in zip(got, ref):
                    assert g.dtype == r.dtype and g.is_contiguous() and torch.equal(_bits(g), _bits(r))
                # the four parts are views of one allocation, each 16-byte aligned
                assert len({g.untyped_storage().data_ptr() for g in got}) == 1
                assert all(g.data_ptr() % 16 == 0 for g in got)


def test_meta_round_trip_and_local_ids():
    kernels = MetaOps("cpu")
    gen = torch.Generator().manual_seed(1)
    E, W, K = 12, 3, 4
    L = E // W
    idx = torch.randint(-1, E, (7, K), generator=gen)
    idx[0, 0], idx[1, 1] = E + 5, -7  # outside [-1, E): read as -1, never wrapped onto an expert
    w = torch.rand(7, K, generator=gen)
    rows = pack_meta(idx)
    assert rows.shape == (7, meta_width(K)) and rows.dtype == torch.bfloat16
    in_rank = torch.rand(7, W, generator=gen) < 0.6
    slots = rank_slots(in_rank, torch.arange(W, dtype=torch.int32))
    assert slots.tolist() == [[r if in_rank[t, r] else -1 for r in range(W)] for t in range(7)]
    ms = meta_slots(slots, K)
    assert ms.tolist() == [[r if in_rank[t, r] else -1 for r in range(W) for _ in range(K)] for t in range(7)]
    for rank in range(W):
        table = local_id_table(rank, L, E, torch.int64, "cpu")
        # what the meta lane hands this rank: K rows per received token (each a copy of the token's row) and the
        # route weights, slot by slot
        got = in_rank[:, rank]
        lane_rows, lane_w = rows[got].repeat_interleave(K, 0), w[got].reshape(-1)
        local, weights, hist = unpack_meta(lane_rows, lane_w, K, table, E, L)
        R = lane_rows.shape[0] // K
        for dt in (torch.int64, torch.int32):  # the kernel, on the lane's rows with spare rows after the received
            spare = torch.full((3 * K, lane_rows.shape[1]), 77, dtype=torch.int16).view(torch.bfloat16)
            reads = kernels.host_reads
            ki, kw, kh = kernels.unpack_meta(torch.cat([lane_rows, spare]), torch.cat([lane_w, torch.ones(3 * K)]),
                                             R, K, rank, L, dt)
            assert ki.dtype == dt and torch.equal(ki.long(), local) and torch.equal(kw, weights)
            assert kh == hist.tolist() and kernels.host_reads == reads + (1 if R else 0)
            live = torch.tensor(max(R - 2, 0), dtype=torch.int32)  # num_worst_tokens: the count on the device
            ki, kw, kh = kernels.unpack_meta(lane_rows, lane_w, R, K, rank, L, dt, live=live, read=False)
            n = int(live)
            assert kh is None and kernels.host_reads == reads + (1 if R else 0)
            assert torch.equal(ki[:n].long(), local[:n]) and bool((ki[n:] == -1).all()) and not kw[n:].any()
            assert torch.equal(kw[:n], weights[:n])
            _, _, kh = kernels.unpack_meta(lane_rows, lane_w, R, K, rank, L, dt, live=live)  # counts live ones only
            assert kh == unpack_meta(lane_rows[:n * K], lane_w[:n * K], K, table, E, L)[2].tolist()
        for i, t in enumerate(torch.nonzero(got)[:, 0].tolist()):
            for k in range(K):
                g = int(idx[t, k])
                exp = g - rank * L if rank * L <= g < (rank + 1) * L else -1
                assert int(local[i, k]) == exp
                assert float(weights[i, k]) == (float(w[t, k]) if exp >= 0 else 0.0)
        assert hist.tolist() == [int((local == j - 1).sum()) for j in range(L + 1)]


def test_unpack_kernel_over_programs_and_calls():
    """Received tokens over several programs (a CPU program takes 64), repeated calls (the accumulator is left
    zeroed, a read-free call too) and the twin's values every time."""
    kernels = MetaOps("cpu")
    gen = torch.Generator().manual_seed(4)
    E, W, K = 8, 2, 3
    L = E // W
    for R in (150, 1, 64, 150):
        rows = torch.randint(-3, E + 3, (R * K, meta_width(K) // 2), generator=gen, dtype=torch.int32)
        w = torch.rand(R * K, generator=gen)
        for rank in range(W):
            local, weights, hist = unpack_meta(rows.view(torch.bfloat16), w, K,
                                               local_id_table(rank, L, E, torch.int32, "cpu"), E, L)
            kernels.unpack_meta(rows.view(torch.bfloat16), w, R, K, rank, L, torch.int32, read=False)
            ki, kw, kh = kernels.unpack_meta(rows.view(torch.bfloat16), w, R, K, rank, L, torch.int32)
            assert torch.equal(ki, local) and torch.equal(kw, weights) and kh == hist.tolist()


def test_quantized_rows_round_trip_bit_exact():
    gen = torch.Generator().manual_seed(2)
    T, H = 5, 256
    q = torch.randint(0, 256, (T, H), generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    for scales in (torch.rand(H // 128, T, generator=gen).T,  # column-major float scales
                   torch.randint(-2**31, 2**31 - 1, (T, 2), generator=gen, dtype=torch.int64).to(torch.int32)):
        rows = pack_quantized(q, scales)
        assert rows.shape == (T, H) and rows.dtype == torch.bfloat16
        rq, rs = unpack_quantized(rows, q.dtype, scales.dtype, scales.shape[1])
        assert torch.equal(rq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rs, scales.contiguous())
        assert rq.is_contiguous() and rs.is_contiguous()


def test_expert_slots_and_ue8m0():
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)  # segments [0,3) [3,3) [3,7), rows 7.. past the end
    ntpe = torch.tensor([3, 0, 4], dtype=torch.int32)
    seg, pos = expert_slots(offs, ntpe, 9, slots=3)  # expert 2 has 4 rows but 3 slots: its 4th goes nowhere
    assert seg.tolist() == [0, 0, 0, 2, 2, 2, 3, 3, 3] and pos.tolist() == [0, 1, 2, 0, 1, 2, 0, 0, 0]
    s = torch.tensor([[2.0 ** -3, 1.0, 2.0 ** 5, 2.0 ** -126]])
    packed = ue8m0_pack(s)
    assert packed.dtype == torch.int32 and packed.shape == (1, 1)
    assert packed.view(torch.uint8).tolist() == [[124, 127, 132, 1]]


def test_poison_fills_only_a_refused_call():
    ops = MetaOps("cpu")
    gen = torch.Generator().manual_seed(3)
    for W in (1, 2, 3, 5):
        counts = torch.randint(0, 5, (W, W), generator=gen, dtype=torch.int32)
        most = int(counts.sum(0).max())
        for limit, refused in ((most, False), (most - 1, True)):  # EPBuffer refuses a rank over max_recv_tokens
            for a, b in ((torch.randn(7, 5, generator=gen).bfloat16(), torch.rand(3, 2, generator=gen)),
                         (torch.randn(9000, generator=gen), None),  # several blocks of the kernel's loop
                         (torch.randint(0, 120, (5, 3), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn),
                          torch.randint(0, 9, (4,), generator=gen, dtype=torch.int32))):
                t_bits = [t.clone() for t in (a, b) if t is not None]
                k_bits = [t.clone() for t in t_bits]
                poison_torch(counts, limit, *t_bits)
                ops.poison(counts.t().contiguous().t(), limit, *k_bits)  # any strides of the counts
                for orig, t, k in zip((a, b), t_bits, k_bits):
                    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]
                    assert torch.equal(t.view(ints), k.view(ints))
                    want = torch.full_like(orig.view(ints), -1) if refused else orig.view(ints)
                    assert torch.equal(t.view(ints), want), (W, limit, orig.dtype)


def test_poison_refuses_what_it_cannot_fill_in_place():
    counts = torch.ones(2, 2, dtype=torch.int32)
    for bad in (torch.zeros(4, 4)[:, :2], torch.zeros(3, dtype=torch.float64)):  # a strided view; 8-byte elements
        with pytest.raises(InputError, match="contiguous"):
            MetaOps("cpu").poison(counts, 0, torch.zeros(2), bad)
