"""A rank whose ``topk_idx`` (or ``topk_weights``) is malformed (not a 2-D tensor) takes part in the dispatch its peers
make, so the call is refused on every rank: InputError naming the value on that rank, PeerInputError on the others
(PeerConfigError where no lane can be agreed: a fresh Buffer and no top-k width to go by), never a wait on a lane the
peers do not use. Then the next call pairs. W = 2, both backends; the cases: lanes already made; a fresh Buffer whose
first call is the bad one (the top-k width taken from the 2-D weights); a fresh Buffer with neither 2-D; a
``num_worst_tokens`` call (no host read: the peers see it at their next synced call)."""

import pytest
import torch

import tritonep.compat.deep_ep as compat
from tritonep.errors import PeerInputError
from tritonep.testing import run_cpu_world
from tests.support.outcomes import refusal

CASES = (("made", "idx"), ("fresh", "idx"), ("fresh", "both"), ("made", "weights"), ("worst", "idx"))
T, K = 6, 2


def _setup(group, backend):
    """``(rank, compat Buffer, x [T, 128] bf16, topk_idx [T, K] (ids 0-7 in turn), topk_weights [T, K] all 0.5, the
    layout's dispatch arguments)`` of one rank: 8 experts, 4 a rank at W = 2."""
    rank = group.rank()
    buf = compat.Buffer(group, 0, 0, backend=backend)
    x = (torch.arange(T * 128) % 251).view(T, 128).bfloat16() + rank
    idx = (torch.arange(T * K) % 8).view(T, K)
    w = torch.full((T, K), 0.5)
    n, _, nte, itr, _ = buf.get_dispatch_layout(idx, 8)
    return rank, buf, x, idx, w, dict(num_tokens_per_rank=n, is_token_in_rank=itr, num_tokens_per_expert=nte)


def _next_counts(buf, x, idx, w, args):
    """The next good call's ``[received counts]``, or ``["peer-later", counts]`` where it first read a refusal nobody
    read in its own call (num_worst_tokens) and the call after it paired; then the buffer is destroyed."""
    res = []
    try:
        res.append(buf.dispatch(x, topk_idx=idx, topk_weights=w, **args)[3])
    except PeerInputError:
        res.append("peer-later")
        res.append(buf.dispatch(x, topk_idx=idx, topk_weights=w, **args)[3])
    buf.destroy()
    return res


def _malformed(group, backend, fresh, which):
    rank, buf, x, idx, w, args = _setup(group, backend)
    if fresh != "fresh":
        buf.dispatch(x, topk_idx=idx, topk_weights=w, **args)
    bad_idx, bad_w = idx, w
    if rank == 1:
        if which in ("idx", "both"):
            bad_idx = idx.reshape(-1)  # 1-D
        if which in ("weights", "both"):
            bad_w = w.reshape(-1)
    worst = 2 * T if fresh == "worst" else 0
    said = refusal(lambda: buf.dispatch(x, topk_idx=bad_idx, topk_weights=bad_w, num_worst_tokens=worst, **args),
                   "topk_weights" if which == "weights" else "topk_idx", "2-D")
    return [said] + _next_counts(buf, x, idx, w, args)


@pytest.mark.parametrize("backend", ["nccl", "triton"])
@pytest.mark.parametrize("fresh,which", CASES)
def test_malformed_topk_refused_on_every_rank(backend, fresh, which):
    r0, r1 = run_cpu_world(2, _malformed, backend, fresh, which, timeout_s=300)
    # 2 ranks x 6 tokens of ids [0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3]; experts 0-3 on rank 0, 4-7 on rank 1
    c0, c1 = [4, 4, 4, 4], [2, 2, 2, 2]
    if fresh == "worst":  # no read in the call: the refusing rank raises, its peer at its next synced call
        assert r1 == ["own", "peer-later", c1] and r0 == ["no error", "peer-later", c0], (r0, r1)
    else:
        assert r1 == ["own", c1], r1
        assert r0 == ["peer-config" if which == "both" else "peer", c0], r0


def _unknown_width(group, backend, earlier_topk, worst):
    """Rank 1 passes a top-k of unknown width (neither 2-D) after a dispatch without top-k; rank 0 a valid one."""
    rank, buf, x, idx, w, args = _setup(group, backend)
    if earlier_topk:  # an earlier dispatch carried the top-k: its width stands in
        buf.dispatch(x, topk_idx=idx, topk_weights=w, **args)
    buf.dispatch(x, **args)  # the latest dispatch carries no top-k
    bad_idx, bad_w = (idx.reshape(-1), w.reshape(-1)) if rank == 1 else (idx, w)
    said = refusal(lambda: buf.dispatch(x, topk_idx=bad_idx, topk_weights=bad_w,
                                        num_worst_tokens=2 * T if worst else 0, **args), "topk_idx", "2-D")
    return [said] + _next_counts(buf, x, idx, w, args)


@pytest.mark.parametrize("backend", ["nccl", "triton"])
@pytest.mark.parametrize("earlier_topk,worst", [(False, False), (False, True), (True, False)])
def test_unknown_topk_width_after_a_dispatch_without_topk(backend, earlier_topk, worst):
    """The latest dispatch carried no top-k, the peers pass one and this rank's has no width to read: the call is
    refused on every rank (InputError naming topk_idx here; PeerConfigError on the peer, whose lanes of that top-k
    were never agreed, or PeerInputError where an earlier dispatch's top-k width stands in), never a wait on a lane
    the peers do not use; then the next call pairs."""
    r0, r1 = run_cpu_world(2, _unknown_width, backend, earlier_topk, worst, timeout_s=300)
    c0, c1 = [4, 4, 4, 4], [2, 2, 2, 2]
    assert r1 == ["own", c1] or (worst and r1 == ["own", "peer-later", c1]), r1
    assert r0 == ["peer" if earlier_topk else "peer-config", c0], r0


def _width_zero(group, backend, worst):
    """A dispatch of top-k width 0 (``topk_idx`` / ``topk_weights`` ``[T, 0]``), its combine with the received
    weights, then a dispatch of width K on the same Buffer: what each returned."""
    rank, buf, x, idx, w, args = _setup(group, backend)
    idx0, w0 = idx[:, :0], w[:, :0]
    n, _, nte, itr, _ = buf.get_dispatch_layout(idx0, 8)
    rx, ridx, rw, counts, h, _ = buf.dispatch(x, topk_idx=idx0, topk_weights=w0, num_tokens_per_rank=n,
                                              is_token_in_rank=itr, num_tokens_per_expert=nte, num_worst_tokens=worst)
    y, yw, _ = buf.combine(rx, h, topk_weights=rw)
    got = [tuple(rx.shape), ridx.dtype, tuple(ridx.shape), rw.dtype, tuple(rw.shape), counts, tuple(y.shape),
           yw.dtype, tuple(yw.shape), bool((y == 0).all())]
    return got + _next_counts(buf, x, idx, w, args)


@pytest.mark.parametrize("backend", ["nccl", "triton"])
@pytest.mark.parametrize("worst", [0, 2 * T])
def test_topk_width_zero(backend, worst):
    """DeepEP's top-k width 0 (every token routed nowhere): ``recv_topk_idx`` / ``recv_topk_weights`` are ``[R, 0]``
    tensors (the ids' dtype, float32), not None, the counts zero (none with ``num_worst_tokens``: DeepEP's empty
    list), and the combine of those weights returns ``[T, 0]`` float32 weights and zero rows; then a dispatch of
    width K pairs on the same Buffer."""
    r0, r1 = run_cpu_world(2, _width_zero, backend, worst, timeout_s=300)
    R = worst  # no token goes to any rank: no row, or the num_worst_tokens rows
    for r, c in ((r0, [4, 4, 4, 4]), (r1, [2, 2, 2, 2])):
        assert r == [(R, 128), torch.int64, (R, 0), torch.float32, (R, 0), [] if worst else [0, 0, 0, 0], (T, 128),
                     torch.float32, (T, 0), True, c], r
