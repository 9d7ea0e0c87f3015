"""Caller-quantized rows (``dispatch((x_q, scales))``) of every even width the Buffer accepts, also one that is not a
multiple of 4 (H = 6, 130: the scales' bytes then start off a 4-byte boundary of the packed row): packed and unpacked
bit for bit (5, 1 and 0 rows), and through a W = 2 dispatch of both backends against DeepEP's semantics as plain loops
(:mod:`tests.compat.deepep_reference`), never an untyped error (one raised before the exchange would leave the peers
waiting: the Buffer's refusals take part, a RuntimeError does not).
"""

import pytest
import torch

from tests.compat.deepep_reference import gather, normal_ref
from tritonep.compat.deep_ep.packing import pack_quantized, unpack_quantized
from tritonep.testing import run_cpu_world


def _scales(T, S, gen):
    """Column-major float32 scales and int32 (UE8M0-style) scales ``[T, S]``."""
    return (torch.rand(S, T, generator=gen).T,
            torch.randint(-2**31, 2**31 - 1, (T, S), generator=gen, dtype=torch.int64).to(torch.int32))


@pytest.mark.parametrize("H,S", [(6, 1), (130, 1), (10, 2), (256, 2)])
def test_quantized_rows_of_any_even_width_round_trip(H, S):
    gen = torch.Generator().manual_seed(H)
    for T in (5, 1, 0):  # one row or none: a slice that counts as contiguous
        q = torch.randint(0, 256, (T, H), generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
        for scales in _scales(T, S, gen):
            rows = pack_quantized(q, scales)
            assert rows.shape == (T, H) and rows.dtype == torch.bfloat16
            rq, rs = unpack_quantized(rows, q.dtype, scales.dtype, S)
            assert torch.equal(rq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(rs, scales.contiguous())
            assert rq.is_contiguous() and rs.is_contiguous() and rs.dtype == scales.dtype


def _world(group, backend, H, S):
    import tritonep.compat.deep_ep as compat

    rank, W = group.rank(), group.size()
    E, T = 2 * W, (4, 1)[rank]  # rank 1 sends one row
    gen = torch.Generator().manual_seed(rank)
    buf = compat.Buffer(group, 0, 0, backend=backend)
    q = torch.randint(0, 256, (T, H), generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    idx = torch.rand(T, E, generator=gen).argsort(1)[:, :2]
    w = torch.rand(T, 2, generator=gen)
    n, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    bad = []
    for scales in _scales(T, S, gen):
        try:
            (rq, rs), ridx, _, counts, _, _ = buf.dispatch((q, scales), num_tokens_per_rank=n, is_token_in_rank=itr,
                                                            num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)
        except Exception as e:  # noqa: BLE001 - reported
            bad.append((type(e).__module__, type(e).__name__, str(e)[:100]))
            continue
        qs, ss, ids, ws, irs = map(list, zip(*gather(group, (q.view(torch.uint8), scales.contiguous(), idx, w, itr))))
        if not torch.equal(rq.view(torch.uint8), normal_ref(qs, None, None, irs, rank, E, W)[0]):
            bad.append("rows")
        if rs.dtype != scales.dtype or not torch.equal(rs, normal_ref(ss, None, None, irs, rank, E, W)[0]):
            bad.append("scales")
        _, e_ids, _, e_counts, _ = normal_ref(qs, ids, ws, irs, rank, E, W)
        if not torch.equal(ridx, e_ids) or counts != e_counts.tolist():
            bad.append("ids / counts")
    buf.destroy()
    return bad


@pytest.mark.parametrize("backend", ["nccl", "triton"])
def test_dispatch_of_quantized_rows_off_a_4_byte_width(backend):
    assert run_cpu_world(2, _world, backend, 130, 1, timeout_s=300) == [[], []]
