"""int64 top-k ids that do not fit 32 bits (``2**32 + 1``, ``2**40``, ``-2**32 + 2``) select nothing on every path of
the compat Buffer, as ``get_dispatch_layout`` says (an id outside ``[0, E)`` selects nothing) and as the rows lane's
meta rows carry them (range-checked at the ids' own width): the meta lane's packing (the path of token capacities
past ``meta_rows_max_tokens``, here forced with 0) must not cast them to int32 first, where ``2**32 + 1`` becomes
expert 1 (a received id and a per-expert count the layout never gave).

* the packing twin and kernel: such an id travels as -1 (the unpacking then gives -1, weight 0, not counted);
* a W = 2 world, both ways of the top-k (meta lane, meta rows) and both backends: ids, weights, counts and the
  combined weights against DeepEP's semantics as plain loops (:mod:`tests.compat.deepep_reference`).
"""

import pytest
import torch

from tests.compat.deepep_reference import gather, layout_ref, normal_ref
from tritonep.compat.deep_ep.meta import MetaOps
from tritonep.compat.deep_ep.packing import local_id_table, pack_meta, pack_torch, unpack_meta
from tritonep.testing import run_cpu_world

WIDE = (2**32 + 1, 2**40, -2**32 + 2, 2**33)  # low 32 bits: 1, 0, 2, 0 (experts of rank 0 at E = 8, W = 2)


def test_ids_past_32_bits_travel_as_minus_one():
    E, W, K, T = 8, 2, 3, 5
    idx = torch.tensor([[WIDE[0], 1, -1], [WIDE[1], 5, WIDE[2]], [0, 2, 3], [WIDE[3], -1, 7], [6, 1, 0]])
    w = torch.rand(T, K)
    in_rank = torch.ones(T, W, dtype=torch.bool)
    clean = idx.masked_fill((idx < -1) | (idx >= E), -1)
    kernels = MetaOps("cpu")
    for rows in (pack_meta(idx), pack_torch(in_rank, idx, w)[1], kernels.pack(in_rank, idx, w)[1]):
        assert torch.equal(rows[:, :2 * K].view(torch.int32), clean.to(torch.int32)), rows[:, :2 * K].view(
            torch.int32).tolist()
        for rank in range(W):  # what the unpacking makes of them: -1, weight 0, not counted
            local, wout, hist = unpack_meta(rows.repeat_interleave(K, 0), w.repeat_interleave(W, 0)[::W].reshape(-1),
                                            K, local_id_table(rank, E // W, E, torch.int64, "cpu"), E, E // W)
            lo = rank * (E // W)
            want = torch.where((clean >= lo) & (clean < lo + E // W), clean - lo, -1)
            assert torch.equal(local, want), (rank, local.tolist(), want.tolist())
            assert int(hist[1:].sum()) == int((want >= 0).sum())


def _world(group, backend, meta_rows_max_tokens):
    import tritonep.compat.deep_ep as compat

    rank, W = group.rank(), group.size()
    E, T, K, H = 4 * W, 6, 3, 64
    gen = torch.Generator().manual_seed(rank)
    buf = compat.Buffer(group, 0, 0, backend=backend, meta_rows_max_tokens=meta_rows_max_tokens)
    x = torch.randn(T, H, generator=gen).bfloat16()
    idx = torch.randint(0, E, (T, K), generator=gen)
    idx[0, 0], idx[2, 1], idx[3, 2], idx[5, 0] = WIDE
    w = torch.rand(T, K, generator=gen) + 0.5
    n, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    xs, ids, ws, irs = map(list, zip(*gather(group, (x, idx, w, itr))))
    _, e_ids, e_w, e_counts, _ = normal_ref(xs, ids, ws, irs, rank, E, W)
    bad = [] if all(torch.equal(a, b) for a, b in zip((n, nte, itr), layout_ref(idx, E, W))) else ["layout"]
    rx, ridx, rw, counts, h, _ = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr,
                                              num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)
    if not torch.equal(ridx, e_ids):
        bad.append(("ids", ridx.tolist(), e_ids.tolist()))
    if not torch.equal(rw, e_w):
        bad.append("weights")
    if counts != e_counts.tolist():
        bad.append(("counts", counts, e_counts.tolist()))
    _, cw, _ = buf.combine(rx, h, topk_weights=rw)
    want_cw = w.masked_fill((idx < 0) | (idx >= E), 0.0)  # the sum over the receiving ranks of the received weights
    if not torch.equal(cw, want_cw):
        bad.append(("combined weights", cw.tolist(), want_cw.tolist()))
    buf.destroy()
    return bad


@pytest.mark.parametrize("backend", ["nccl", "triton"])
@pytest.mark.parametrize("meta_rows_max_tokens", [0, 256])  # the meta lane, meta rows
def test_dispatch_ids_past_32_bits_select_nothing(backend, meta_rows_max_tokens):
    assert run_cpu_world(2, _world, backend, meta_rows_max_tokens, timeout_s=300) == [[], []]
