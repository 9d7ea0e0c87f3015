"""The compat Buffer's torch ops against plain loops, and the fact they build on: rows travel as bits.

- every 16-bit pattern (NaN payloads, infinities, subnormals, -0) crosses a compat dispatch unchanged, both backends:
  the premise of handing caller-quantized rows and top-k metadata on in bf16 rows;
- the layout (ids -1 and out of range select nothing, repeated ids count twice), twin and kernel, over several
  programs and repeated calls (the kernel's accumulator is left zeroed);
- the per-rank slots, the meta lane's K slots per rank, top-k id packing and the local-id table (never wraps an id
  onto an expert); the packing kernel against its twin bit for bit (weights with NaN payloads included);
- the unpacking twin and kernel (received tokens only when the count lives on the device; the histogram read on
  the host through pinned memory, none without a read);
- meta rows (the top-k carried by the rows lane itself): how many per pair of ranks, the packing kernel (x copied,
  the meta groups, the slots) and the unpacking kernel against their twins bit for bit, and the round trip against
  plain loops (local ids, weights with NaN payloads, 0 where the id is -1, the histogram; a num_worst_tokens tail);
  the combine's copy of the caller's rows into the lane's expert-output buffer, bit for bit, nothing after them;
- quantized rows (strided float scales, int32 scales) packed and unpacked bit for bit;
- the low-latency slot map and the UE8M0 packing;
- the NaN fill of a ``num_worst_tokens`` call refused for capacity: twin and kernel, bit for bit, and only when some
  rank's rows exceed the limit.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.compat.deepep_reference import layout_ref
from tritonep.compat.deep_ep.meta import MetaOps
from tritonep.compat.deep_ep.low_latency import expert_slots, ue8m0_pack
from tritonep.compat.deep_ep.packing import (layout_torch, local_id_table, meta_rows_per_rank, meta_slots,
                                              meta_width, pack_meta, pack_quantized, pack_rows_torch, pack_torch,
                                              poison_torch, rank_slots, unpack_meta, unpack_quantized,
                                              unpack_rows_torch)
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


def test_meta_rows_per_rank():
    # DeepSeek-V3 rows: 3584 words a row, 16 a token: 128 tokens need one meta row, 256 two
    assert meta_rows_per_rank(128, 8, 7168, 8, 256) == 1 and meta_rows_per_rank(256, 8, 7168, 1, 1024) == 2
    assert meta_rows_per_rank(256, 8, 7168, 1, 256) == 0  # 256 + 2 tokens: over the limit, the meta lane
    assert meta_rows_per_rank(64, 3, 128, 2, 256) == 7  # 1 + 64 * 6 words in rows of 64
    for bad in ((64, 0, 128), (64, 3, 127), (64, 3, None), (64, 3, 0)):  # no top-k; an odd or unknown width
        assert meta_rows_per_rank(*bad, 2, 256) == 0
    assert meta_rows_per_rank(64, 3, 128, 2, 0) == 0


def _received(packed, itr, rank, P, T):
    """What rank ``rank`` receives from sources packing ``packed`` (each ``(x_in, slots)`` of pack_rows_torch), as its
    rows lane lays it out: every source's token rows (source order), then every source's P meta rows for it."""
    toks = [x_in[:t][itr_s[:, rank]] for (x_in, _), itr_s, t in zip(packed, itr, T)]
    meta = [x_in[t + rank * P:t + (rank + 1) * P] for (x_in, _), t in zip(packed, T)]
    return torch.cat(toks + meta), sum(int(i[:, rank].sum()) for i in itr)


def test_meta_rows_kernels_match_twins_and_loops():
    kernels = MetaOps("cpu")
    gen = torch.Generator().manual_seed(6)
    # (W, E, K, H, tokens per source): several programs (a CPU program packs 64 tokens, unpacks 64 rows), a source
    # with none, a top-1, rows of few words (a token's words cross rows)
    for W, E, K, H, T in ((2, 8, 3, 64, (7, 0)), (3, 12, 4, 128, (150, 70, 3)), (1, 4, 8, 16, (5,)),
                          (2, 6, 1, 8, (1, 2))):
        tcap, L = 256, E // W
        P = meta_rows_per_rank(tcap, K, H, W, 10 ** 9)
        srcs = []
        for t in T:
            idx = torch.randint(-2, E + 2, (t, K), generator=gen)  # -1, -2 and ids >= E: local -1 everywhere
            w = torch.rand(t, K, generator=gen)
            if t:
                w.view(torch.int32)[0, 0] = 0x7FC00123  # a NaN payload travels as bits
            itr = torch.rand(t, W, generator=gen) < 0.6
            x = torch.randint(-2 ** 15, 2 ** 15, (t, H), generator=gen, dtype=torch.int32).to(torch.int16)
            srcs.append((x.view(torch.bfloat16), itr, idx, w))
        packed = []
        for x, itr, idx, w in srcs:
            for dt in (torch.int64, torch.int32):
                ref = pack_rows_torch(x, itr, idx.to(dt), w, E, P)
                x_in = torch.full((tcap + W * P, H), 3.0, dtype=torch.bfloat16)  # a used buffer: rows rewritten
                slots = kernels.pack_rows(x, itr, idx.to(dt), w, x_in, E, P)
                n = x.shape[0] + W * P
                assert torch.equal(slots, ref[1]) and torch.equal(x_in[:n].view(torch.int16), ref[0].view(torch.int16))
            packed.append(ref)
        itrs = [s[1] for s in srcs]
        for rank in range(W):
            rows, R = _received(packed, itrs, rank, P, T)
            rows = torch.cat([rows, torch.full((5, H), 9.0, dtype=torch.bfloat16)])  # spare rows after the lane's
            offs = torch.tensor([R, R + W * P], dtype=torch.int32)
            # DeepEP's values by plain loops: each received token's ids local to this rank, weights 0 where -1
            e_idx = torch.cat([torch.where((i >= rank * L) & (i < (rank + 1) * L), i - rank * L, -1)[m[:, rank]]
                               for _, m, i, _ in srcs])
            e_w = torch.cat([torch.where(e >= 0, w[m[:, rank]], 0.0) for e, (_, m, _, w) in
                             zip(torch.split(e_idx, [int(m[:, rank].sum()) for _, m, _, _ in srcs]), srcs)])
            for n in (R, R + 3):  # the rows received, and a num_worst_tokens tail after them
                ri, rw, rh = unpack_rows_torch(rows, R, n, K, L, W, P)
                assert torch.equal(ri[:R], e_idx) and torch.equal(rw[:R].view(torch.int32), e_w.view(torch.int32))
                assert bool((ri[R:] == -1).all()) and not rw[R:].any()
                assert rh.tolist() == [int((e_idx == j - 1).sum()) for j in range(L + 1)]
                for dt in (torch.int64, torch.int32):
                    reads = kernels.host_reads
                    ki, kw, kh = kernels.unpack_rows(rows, offs, n, K, L, W, P, dt)
                    assert ki.dtype == dt and torch.equal(ki, ri.to(dt))
                    assert torch.equal(kw.view(torch.int32), rw.view(torch.int32))
                    assert kh == rh.tolist() and kernels.host_reads == reads + (1 if n else 0)
                    ki, kw, kh = kernels.unpack_rows(rows, offs, n, K, L, W, P, dt, read=False)
                    assert kh is None and torch.equal(ki, ri.to(dt)) and kernels.host_reads == reads + (1 if n else 0)


def test_copy_rows_kernel_copies_bits_into_the_head_only():
    """A meta-rows combine's copy of the caller's rows into the lane's expert-output buffer: every 16-bit pattern
    (NaN payloads) moved as bits into rows [0, n), the rows after them untouched; several programs; n = 0 no launch."""
    kernels = MetaOps("cpu")
    for n, H in ((130, 96), (3, 1030), (0, 64)):
        src = (torch.arange(n * H, dtype=torch.int32) * 7 + 11).to(torch.int16).view(n, H).view(torch.bfloat16)
        dst = torch.full((n + 4, H), 2.5, dtype=torch.bfloat16)
        ref = dst.clone()
        ref[:n].copy_(src)
        kernels.copy_rows(src, dst)
        assert torch.equal(dst.view(torch.int16), ref.view(torch.int16)), (n, H)


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
    seg, pos, dropped = expert_slots(offs, ntpe, 9, slots=3)  # expert 2 has 4 rows but 3 slots: its 4th goes nowhere
    assert seg.tolist() == [0, 0, 0, 2, 2, 2, 3, 3, 3] and pos.tolist() == [0, 1, 2, 0, 1, 2, 0, 0, 0]
    assert dropped.tolist() == [False] * 6 + [True] * 3
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


def test_poison_of_a_counts_field_address():
    """The counts given as a field of a storage block (an address: FieldView) with their shape and strides, as a
    meta-rows handle gives them (``NormalHandle.poison_counts``: every other column of a ``[W, 2W]`` field), fill as
    the twin on the strided view does; one MetaOps, calls of other sizes between (its kept launches per size)."""
    from tritonep.runtime.field_view import FieldView

    ops = MetaOps("cpu")
    gen = torch.Generator().manual_seed(4)
    for W in (1, 2, 3):
        store = torch.randint(0, 5, (8 + 2 * W * W + 8,), generator=gen, dtype=torch.int32)
        field = store[8:8 + 2 * W * W].view(W, 2 * W)
        counts = field[:, 0::2]
        fv = FieldView(store, store.data_ptr(), 8, 2 * W * W, torch.int32)
        most = int(counts.sum(0).max())
        for limit, n in ((most, 5), (most - 1, 7), (most - 1, 5), (most, 7)):
            a, b = torch.randn(n, 3, generator=gen).bfloat16(), torch.rand(n, 2, generator=gen)
            ta, tb, ka, kb = a.clone(), b.clone(), a.clone(), b.clone()
            poison_torch(counts, limit, ta, tb)
            ops.poison(fv, limit, ka, kb, (W, 2 * W, 2))
            assert torch.equal(ta.view(torch.int16), ka.view(torch.int16)) and torch.equal(tb.view(torch.int32),
                                                                                         kb.view(torch.int32))
            assert torch.equal(ka.view(torch.int16), a.view(torch.int16)) == (limit == most), (W, limit, n)


def test_poison_refuses_what_it_cannot_fill_in_place():
    counts = torch.ones(2, 2, dtype=torch.int32)
    for bad in (torch.zeros(4, 4)[:, :2], torch.zeros(3, dtype=torch.float64)):  # a strided view; 8-byte elements
        with pytest.raises(InputError, match="contiguous"):
            MetaOps("cpu").poison(counts, 0, torch.zeros(2), bad)


def test_repeated_slots_take_the_token_rows_k_fold():
    """A handle's repeated slots (the routes of the meta-lane dispatch a combine of topk_weights runs) are the token
    rows' slots, each column repeated K times (``slots[:T].index_select(1, arange(W).repeat_interleave(K))``), the
    meta rows' never read; the take index kept per (T, K) gives the right rows when T and K change between calls and
    after the kept indices are dropped (more than 64 shapes)."""
    from tritonep.compat.deep_ep.handles import NormalHandle
    from tritonep.compat.deep_ep.normal import NormalMode

    gen = torch.Generator().manual_seed(6)
    for W in (1, 2, 3):
        mode = NormalMode(0, None, 0, W)
        shapes = [(T, K) for T in (1, 5, 12, 5) for K in (1, 3, 8)] + [(n % 9 + 1, n % 4 + 1) for n in range(70)]
        for T, K in shapes:
            P = 2
            slots = torch.randint(-1, 50, (T + W * P, W), generator=gen, dtype=torch.int32)
            h = NormalHandle(owner=0, x_lane=None, x_handle=None, meta_lane=None, meta_handle=None, slots=slots,
                             num_tokens=T, num_rows=0, topk=K, is_token_in_rank=None, worst=False, meta_rows=P)
            got = h.repeated_slots(mode._rep_index(T, K, slots.device), mode._ranks2_on(slots.device))
            want = slots[:T].index_select(1, torch.arange(W).repeat_interleave(K))
            assert got.dtype == torch.int32 and got.is_contiguous() and torch.equal(got, want), (W, T, K)
            assert h.repeated_slots(None, None) is got  # made once per handle
            # a dispatch that carried its top-k: its slots are the bool rank mask, the rows lane handle's copy of
            # it ids 2r (-1 where unset; its block's field, more words after it), which the routes are taken from
            mask = torch.rand(T, W, generator=gen) < 0.5
            ids = torch.where(mask, 2 * torch.arange(W, dtype=torch.int32), -1)
            block = torch.cat([ids.flatten(), torch.full((7,), 99, dtype=torch.int32)])
            xh = SimpleNamespace(store=block, layout=SimpleNamespace(tensor=lambda store, name: store))
            hc = NormalHandle(owner=0, x_lane=None, x_handle=xh, meta_lane=None, meta_handle=None, slots=mask,
                              num_tokens=T, num_rows=0, topk=K, is_token_in_rank=mask, worst=False, meta_rows=P,
                              carried=True)
            mask.fill_(True)  # the caller's mask overwritten after the dispatch: not read
            got = hc.repeated_slots(mode._rep_index(T, K, mask.device), mode._ranks2_on(mask.device))
            assert torch.equal(got, ids.index_select(1, torch.arange(W).repeat_interleave(K))), (W, T, K)
        assert len(mode._rep_idx) <= 64
