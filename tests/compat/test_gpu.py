"""The compat Buffer's semantic checks on GPUs: a world of one rank and the multi-rank world (``gpu_world``; ranks
share a GPU when there are fewer GPUs than ranks). The same rank functions as the CPU worlds
(:mod:`tests.compat.normal_checks`, :mod:`tests.compat.ll_checks`, :func:`tests.compat.test_packing.all_patterns`),
on the device: rows and ids bit for bit against DeepEP's semantics, the combines, fp8 bits, and every 16-bit pattern
through the compiled kernels (the premise of carrying quantized rows and metadata in bf16 rows); and the refusals
(:mod:`tests.compat.test_worst_overflow`: a ``num_worst_tokens`` call over capacity, NaN outputs by the compiled
poison kernel and CapacityError at the next synced dispatch / ``check()``; :mod:`tests.compat.test_combine_refused`:
one rank refusing a call, every rank raising). The nccl backend needs an NCCL group: one GPU per rank (it skips,
saying so, on shared GPUs)."""

import pytest

from tests.compat import test_combine_refused as refused
from tests.compat import test_worst_overflow as worst
from tests.compat.ll_checks import ll_case
from tests.compat.normal_checks import normal_case
from tests.compat.test_packing import all_patterns

pytestmark = pytest.mark.gpu


@pytest.mark.world1
@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_compat_world1(gpu_world, backend):
    assert gpu_world(1, normal_case, backend, 1, None, ["meta2", "x", "xm"]) == [2]  # the top-k as meta rows
    assert gpu_world(1, normal_case, backend, 1, 0, ["meta", "x"]) == [2]  # ... in the meta lane
    assert gpu_world(1, ll_case, backend, 1) == [5]
    assert gpu_world(1, all_patterns, backend) == [True]


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_compat_world(gpu_world, gpu_world_size, backend):
    W = gpu_world_size
    nccl = backend == "nccl"
    assert gpu_world(W, normal_case, backend, W, nccl=nccl) == [2] * W
    assert gpu_world(W, normal_case, backend, W, 0, nccl=nccl) == [2] * W
    assert gpu_world(W, ll_case, backend, W, nccl=nccl) == [5] * W
    assert gpu_world(W, all_patterns, backend, nccl=nccl) == [True] * W


@pytest.mark.parametrize("backend", ["triton", "nccl"])
def test_compat_refusals_world(gpu_world, gpu_world_size, backend):
    W = gpu_world_size
    if W < 2:
        pytest.skip("a refusal needs a peer: gpu_world_size >= 2")
    nccl = backend == "nccl"
    for mrm in (256, 0):  # the top-k as meta rows, and in the meta lane
        assert gpu_world(W, worst._world, backend, mrm, nccl=nccl) == [worst.EXPECT] * W
        for how in ("dtype", "worst", "worst_handle", "cached", "worst_dispatch"):
            refused.assert_normal(gpu_world(W, refused._normal_world, backend, how, mrm, nccl=nccl), how)
    for how in ("combine", "dispatch"):
        refused.assert_ll(gpu_world(W, refused._ll_world, backend, how, nccl=nccl), backend, how)


@pytest.mark.world1
def test_meta_kernels_match_twins_on_gpu():
    """The compiled layout, packing and unpacking kernels against their torch twins, bit for bit, at the shapes the
    benchmark runs (DeepSeek-V3's 256 experts, top-8, 4096 tokens: many programs counting into one accumulator with
    element-wise atomics; W 1 and 8), each twice (the accumulators are left zeroed), and the histogram read through
    pinned memory (one host read each)."""
    import torch

    from tritonep.compat.deep_ep.meta import MetaOps
    from tritonep.compat.deep_ep.packing import layout_torch, local_id_table, meta_width, pack_torch, unpack_meta

    dev = torch.device("cuda", torch.cuda.current_device())
    ops = MetaOps(dev)
    gen = torch.Generator().manual_seed(7)
    E, K = 256, 8
    for W, T in ((1, 4096), (8, 4096), (8, 128), (1, 1), (8, 0)):
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else \
            torch.empty(0, K, dtype=torch.int64)
        if T:
            idx[: T // 7, 3] = -1  # masked slots
            idx[T // 7: T // 5, 0] = E + 3  # out of range: selects nothing
        w = torch.rand(T, K, generator=gen)
        for dt in (torch.int64, torch.int32):
            d_idx, d_w = idx.to(dt).to(dev), w.to(dev)
            ref = layout_torch(d_idx, E, W)
            for _ in range(2):
                got = ops.layout(d_idx, E, W)
                assert all(torch.equal(g, r) for g, r in zip(got, ref)), (W, T, dt)
            pref = pack_torch(ref[2], d_idx, d_w)
            for g, r in zip(ops.pack(ref[2], d_idx, d_w), pref):
                assert g.dtype == r.dtype and torch.equal(g.view(torch.int16) if g.element_size() == 2 else
                                                          g.view(torch.int32), r.view(torch.int16)
                                                          if r.element_size() == 2 else r.view(torch.int32))
    L = E // 8
    for R in (4096 * 8, 128, 1):
        rows = torch.randint(-3, E + 3, (R * K, meta_width(K) // 2), generator=gen, dtype=torch.int32)
        wts = torch.rand(R * K, generator=gen)
        d_rows, d_w = rows.view(torch.bfloat16).to(dev), wts.to(dev)
        for rank in (0, 5):
            local, weights, hist = unpack_meta(d_rows, d_w, K, local_id_table(rank, L, E, torch.int64, dev), E, L)
            for _ in range(2):
                reads = ops.host_reads
                ki, kw, kh = ops.unpack_meta(d_rows, d_w, R, K, rank, L, torch.int64)
                assert torch.equal(ki, local) and torch.equal(kw, weights) and kh == hist.tolist(), (R, rank)
                assert ops.host_reads == reads + 1
            live = torch.tensor(R // 3, dtype=torch.int32, device=dev)
            ki, kw, kh = ops.unpack_meta(d_rows, d_w, R, K, rank, L, torch.int32, live=live, read=False)
            n = R // 3
            assert kh is None and torch.equal(ki[:n].long(), local[:n]) and bool((ki[n:] == -1).all())
            _, _, kh = ops.unpack_meta(d_rows, d_w, R, K, rank, L, torch.int32, live=live)
            assert kh == unpack_meta(d_rows[:n * K], d_w[:n * K], K, local_id_table(rank, L, E, torch.int64, dev),
                                     E, L)[2].tolist()


@pytest.mark.world1
def test_meta_rows_kernels_match_twins_on_gpu():
    """The compiled meta-rows kernels against their torch twins, bit for bit, at the benchmark's shape (DeepSeek-V3:
    hidden 7168, 256 experts, top-8; 128 and 256 tokens, W 1 and 8: several programs, tokens crossing meta rows), each
    twice (the accumulator left zeroed), the histogram read through pinned memory."""
    import torch

    from tritonep.compat.deep_ep.meta import MetaOps
    from tritonep.compat.deep_ep.packing import meta_rows_per_rank, pack_rows_torch, unpack_rows_torch

    dev = torch.device("cuda", torch.cuda.current_device())
    ops = MetaOps(dev)
    gen = torch.Generator().manual_seed(8)
    E, K, H = 256, 8, 7168
    for W, T in ((1, 128), (8, 128), (8, 256), (1, 1), (8, 0)):
        P = meta_rows_per_rank(max(T, 64), K, H, W, 1 << 20)
        idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) if T else \
            torch.empty(0, K, dtype=torch.int64)
        if T:
            idx[: T // 7, 3] = -1
            idx[T // 7: T // 5, 0] = E + 3
        w = torch.rand(T, K, generator=gen)
        itr = torch.zeros(T, W, dtype=torch.bool)
        for r in range(W):
            itr[:, r] = ((idx >= r * (E // W)) & (idx < (r + 1) * (E // W))).any(1)
        x = torch.randn(T, H, generator=gen).bfloat16()
        d = [t.to(dev) for t in (x, itr, idx, w)]
        ref_in, ref_slots = pack_rows_torch(*d, E, P)
        x_in = torch.full((max(T, 64) + W * P, H), 5.0, dtype=torch.bfloat16, device=dev)
        for _ in range(2):
            slots = ops.pack_rows(*d, x_in, E, P)
            assert torch.equal(slots, ref_slots) and \
                torch.equal(x_in[:T + W * P].view(torch.int16), ref_in.view(torch.int16)), (W, T)
        # what rank 0 receives when every source sent this: the token rows, then each source's meta rows for it
        R = W * int(itr[:, 0].sum())
        rows = torch.cat([ref_in[:T][d[1][:, 0]]] * W + [ref_in[T:T + P]] * W)
        offs = torch.tensor([R, R + W * P], dtype=torch.int32, device=dev)
        for n in (R, R + 5):
            ri, rw, rh = unpack_rows_torch(rows, R, n, K, E // W, W, P)
            for _ in range(2):
                reads = ops.host_reads
                ki, kw, kh = ops.unpack_rows(rows, offs, n, K, E // W, W, P, torch.int64)
                assert torch.equal(ki, ri) and torch.equal(kw.view(torch.int32), rw.view(torch.int32)), (W, T, n)
                assert kh == rh.tolist() and ops.host_reads == reads + (1 if n else 0)
        # the combine's copy of its rows into the lane's expert-output buffer: bits into the head, the rest untouched
        dst = torch.full((R + W * P, H), 7.0, dtype=torch.bfloat16, device=dev)
        ref = dst.clone()
        ref[:R].copy_(rows[:R])
        ops.copy_rows(rows[:R].contiguous(), dst)
        assert torch.equal(dst.view(torch.int16), ref.view(torch.int16)), (W, T)
