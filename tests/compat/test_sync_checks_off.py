"""The compat Buffer with the host's status reads off (``TRITONEP_SYNC_CHECKS=0``): a dispatch then knows its received
rows from the device only (``expert_offsets``), and its rows lane's handle is a sync-free one, whose combine takes
the lane's ``max_recv_tokens`` rows (``EPBuffer._rows_of``). The caller's combine still passes DeepEP's
``[num_recv_tokens, H]`` rows: the Buffer hands the lane its full-size input, as it does for a dispatch whose top-k
came as meta rows. W = 2, both backends, every way of the top-k (meta lane, meta rows, carried with the rows on
the decode tiles): rows, ids, weights, counts
(aligned), the combine and its weights, a cached dispatch and a dispatch without top-k against DeepEP's semantics as
plain loops (:mod:`tests.compat.deepep_reference`), then ``check()`` finds nothing.
"""

import pytest
import torch

from tests.compat.deepep_reference import gather, normal_ref
from tests.compat.normal_checks import combine_ref, expert_fn
from tests.support.harness import set_env
from tritonep.testing import run_cpu_world


def _world(group, backend, meta_rows_max_tokens, geometry=""):
    set_env(TRITONEP_SYNC_CHECKS="0", TRITONEP_GEOMETRY=geometry)
    import tritonep.compat.deep_ep as compat

    rank, W = group.rank(), group.size()
    E = 2 * W
    buf = compat.Buffer(group, 0, 0, backend=backend, meta_rows_max_tokens=meta_rows_max_tokens)
    gen = torch.Generator().manual_seed(rank)
    bad = []
    for T, K, align in ((5 + 2 * rank, 2, 1), (7, 3, 4), (3 * rank, 2, 1)):  # rank 0 has no tokens in the last
        x = torch.randn(T, 64, generator=gen).bfloat16()
        idx = torch.rand(T, E, generator=gen).argsort(1)[:, :K]  # K distinct experts a token
        if T:
            idx[0, 0] = -1
        w = torch.rand(T, K, generator=gen)
        n, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
        xs, ids, ws, irs = map(list, zip(*gather(group, (x, idx, w, itr))))
        e_rows, e_ids, e_w, e_counts, _ = normal_ref(xs, ids, ws, irs, rank, E, W)
        rx, ridx, rw, counts, h, _ = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr,
                                                  num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w,
                                                  expert_alignment=align)
        case = (T, K)
        if not torch.equal(rx.view(torch.int16), e_rows.view(torch.int16)):
            bad.append((case, "rows"))
            continue
        if not (torch.equal(ridx, e_ids) and torch.equal(rw, e_w)):
            bad.append((case, "ids / weights"))
        if counts != [(c + align - 1) // align * align for c in e_counts.tolist()]:
            bad.append((case, "counts", counts))
        try:
            y, cw, _ = buf.combine(expert_fn(rx, rank), h, topk_weights=rw)
            if not torch.equal(y, combine_ref(x, itr)) or not torch.equal(cw, w.masked_fill(idx < 0, 0.0)):
                bad.append((case, "combine"))
        except Exception as e:  # noqa: BLE001 - reported with the case
            bad.append((case, "combine raised", type(e).__name__, str(e)[:120]))
        if not torch.equal(buf.dispatch(x, handle=h)[0].view(torch.int16), e_rows.view(torch.int16)):
            bad.append((case, "cached dispatch"))
        rxn, _, _, cn, _, _ = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr, num_tokens_per_expert=nte)
        if not torch.equal(rxn.view(torch.int16), e_rows.view(torch.int16)) or cn != e_counts.tolist():
            bad.append((case, "no top-k"))
    try:
        buf.check()
    except Exception as e:  # noqa: BLE001 - reported
        bad.append(("check", type(e).__name__, str(e)[:120]))
    buf.destroy()
    return bad


@pytest.mark.parametrize("backend", ["nccl", "triton"])
@pytest.mark.parametrize("meta_rows_max_tokens", [0, 256])  # the meta lane, meta rows
def test_combine_with_host_reads_off(backend, meta_rows_max_tokens):
    assert run_cpu_world(2, _world, backend, meta_rows_max_tokens, timeout_s=300) == [[], []]


def test_combine_with_host_reads_off_carried():
    """The decode tiles' rows lane, which carries the top-k with its rows: the carried ids and weights come for the
    lane's receive capacity and are cut to the rows the device counted."""
    assert run_cpu_world(2, _world, "triton", 256, "bt=2,dec=3", timeout_s=300) == [[], []]
