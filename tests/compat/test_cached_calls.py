"""Calls on a compat Buffer whose values are worked out once and kept (docs/deep_ep.md, "Where the host time ...
goes"): a warm Buffer must give what a fresh one gives for the same call.

* A refused dispatch on a warm Buffer takes part in the lane of its own call (the row width of its ``x``, its
  ``num_worst_tokens``, its top-k width), not the latest dispatch's: where they differ, the peers' call runs on
  another lane, and a refused rank on the latest one would leave them waiting (a timeout, the Buffer then unusable).
  A ``num_worst_tokens`` that is not an int >= 0 is refused on every rank (the latest dispatch's value stands in).
  W = 2, both backends; mutation-checked (taking part with the latest dispatch's lane alone: the peers time out).
* Calls that share a kept dispatch entry (the same row width, ``num_worst_tokens``, K, T and E; with meta rows or the
  meta lane's way, ``meta_rows_max_tokens=0``) with other inputs: int32 then int64 ids, non-contiguous ``x`` /
  ``topk_idx`` / ``topk_weights``, caller-quantized rows after bf16 ones, a rank with no tokens, a capacity growth and
  back to the first T (the entries are dropped and remade), a handle from before the growth combined after it;
  combines with and without ``topk_weights`` over handles of more, then fewer, then more rows (the kept weights buffer
  zeroed only where an earlier, longer call wrote: checked on the buffer itself, its stale tail is never read back).
  Every result against DeepEP's semantics as plain loops (:mod:`tests.compat.deepep_reference`). Mutation-checked: the
  kept entries keyed without T, or kept over a capacity growth, or the weights buffer's tail left unzeroed, each fail.
"""

import pytest
import torch

from tests.compat.deepep_reference import gather, normal_ref, routing
from tests.compat.normal_checks import combine_ref, expert_fn, quantize_rows
from tests.support.outcomes import refusal
from tritonep.testing import run_cpu_world

T, E = 4, 4
IDX = ((0, 2), (1, 3), (0, 3), (1, 2))  # every token to both ranks (W = 2): 8 rows received per rank


def _refused_call(group, backend, case):
    """Rank 1's dispatch is refused (a float32 ``x``, or a bad ``num_worst_tokens``) after a dispatch of another lane;
    returns ``[the call in one word, the next synced calls' row counts]``."""
    import tritonep.compat.deep_ep as compat
    from tritonep.errors import PeerInputError

    rank = group.rank()
    buf = compat.Buffer(group, 0, 0, backend=backend, timeout_s=10)  # a wait on a lane the peer is not in: 10 s
    idx, w = torch.tensor(IDX), torch.ones(T, 2)
    n, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)

    def run(H=64, topk=True, worst=0, bad=None):
        x = (torch.arange(T * H) % 251).view(T, H).bfloat16() + rank
        if bad == "x":
            x = x.float()
        elif bad is not None:
            worst = bad
        kw = dict(topk_idx=idx, topk_weights=w) if topk else {}
        return buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr, num_tokens_per_expert=nte,
                            num_worst_tokens=worst, **kw)[0].shape[0]

    before, call, bad = {}, {}, "x"
    if case == "worst":
        call = {"worst": 16}
    elif case == "topk":
        before = {"topk": False}
    elif case == "width":
        call = {"H": 128}
    else:  # a num_worst_tokens that is not an int >= 0
        bad = {"negative": -1, "bool": True}[case]
    run(**call)  # every lane made: the refused rank finds the lane it would wrongly take part in
    run(**before)
    said = [refusal(lambda: run(**call, bad=bad if rank == 1 else None),
                    "bfloat16" if bad == "x" else "num_worst_tokens")]
    try:
        said.append(run())
    except PeerInputError:  # a refused num_worst_tokens call: raised by the next synced call
        said += ["peer-later", run()]
    buf.destroy()
    return said


@pytest.mark.parametrize("backend", ["triton", "nccl"])
@pytest.mark.parametrize("case", ["worst", "topk", "width", "negative", "bool"])
def test_refused_dispatch_takes_part_in_its_own_lane(backend, case):
    r0, r1 = run_cpu_world(2, _refused_call, backend, case, timeout_s=90)
    if case == "worst":  # no host read in the call: both raise at the next synced call
        assert r0 == ["no error", "peer-later", 8] and r1 == ["own", "peer-later", 8], (r0, r1)
    else:
        assert r0 == ["peer", 8] and r1 == ["own", 8], (r0, r1)


H = 128


def _check(buf, group, seed, T, K=2, idx_dtype=torch.int64, worst=0, quant=False, strided=False):
    """One dispatch of fresh inputs, checked against the reference; returns ``(state for combines, failures)``."""
    rank, W = group.rank(), group.size()
    gen = torch.Generator().manual_seed(100 * seed + rank)
    x = torch.randn(T, H, generator=gen).bfloat16()
    idx, w = routing(T, E, K, gen)
    idx = idx.to(idx_dtype)
    n, _, nte, itr, _ = buf.get_dispatch_layout(idx, E)
    xs, ids, ws, irs = map(list, zip(*gather(group, (x, idx, w, itr))))
    e_rows, e_ids, e_w, e_counts, _ = normal_ref(xs, ids, ws, irs, rank, E, W)
    xin, iin, win = x, idx, w
    if strided:  # non-contiguous views of the same values
        wide = torch.zeros(T, 2 * H, dtype=torch.bfloat16)
        wide[:, ::2] = x
        xin, iin, win = wide[:, ::2], idx.T.contiguous().T, w.T.contiguous().T
    if quant:
        q, sc = quantize_rows(x)
        xin = (q, sc)
    rx, ridx, rw, counts, h, _ = buf.dispatch(xin, num_tokens_per_rank=n, is_token_in_rank=itr,
                                              num_tokens_per_expert=nte, topk_idx=iin, topk_weights=win,
                                              num_worst_tokens=worst)
    R, bad = e_rows.shape[0], []
    if quant:
        qs, ss = zip(*gather(group, (q.view(torch.uint8), sc.contiguous())))
        if not (torch.equal(rx[0][:R].view(torch.uint8), normal_ref(list(qs), None, None, irs, rank, E, W)[0])
                and torch.equal(rx[1][:R], normal_ref(list(ss), None, None, irs, rank, E, W)[0])):
            bad.append(f"{seed}: quantized rows")
        rx = buf.dispatch(x, handle=h)[0]  # the bf16 rows along the same handle
    if not torch.equal(rx[:R].view(torch.int16), e_rows.view(torch.int16)):
        bad.append(f"{seed}: rows")
    if ridx.dtype != idx_dtype or not torch.equal(ridx[:R].long(), e_ids) or not torch.equal(rw[:R], e_w):
        bad.append(f"{seed}: ids / weights")
    if worst:
        if rx.shape[0] != worst or counts != [] or not bool((ridx[R:] == -1).all()) or rw[R:].any():
            bad.append(f"{seed}: num_worst_tokens tail")
    elif rx.shape[0] != R or counts != e_counts.tolist():
        bad.append(f"{seed}: counts {counts}")
    eo = expert_fn(rx, rank)
    if worst:
        eo[R:] = float("nan")  # rows past the received ones are never read
    return dict(x=x, idx=idx, w=w, itr=itr, h=h, eo=eo, rx=rx.clone(), rw=rw.clone(), seed=seed), bad


def _combine(buf, s, weights: bool) -> list:
    y, cw, _ = buf.combine(s["eo"], s["h"], topk_weights=s["rw"] if weights else None)
    bad = [] if torch.equal(y, combine_ref(s["x"], s["itr"])) else [f"{s['seed']}: combine"]
    if weights and not torch.equal(cw, s["w"].masked_fill(s["idx"] < 0, 0.0)):
        bad.append(f"{s['seed']}: combined weights")
    return bad


def _warm_calls(group, backend, meta_rows_max_tokens):
    """A sequence of calls on one Buffer, each checked against the reference; returns the failures (none)."""
    import tritonep.compat.deep_ep as compat

    rank = group.rank()
    buf = compat.Buffer(group, 0, 0, backend=backend, meta_rows_max_tokens=meta_rows_max_tokens)
    bad = []

    def d(seed, T, **kw):
        s, b = _check(buf, group, seed, T[rank], **kw)
        bad.extend(b)
        return s

    a = d(0, (9, 7))                                  # the entry of (128, 0, 2, T, 4) made
    b = d(1, (9, 7), idx_dtype=torch.int32)           # ... and reused: int32 ids, int32 out
    c = d(2, (9, 7), strided=True)                    # ... non-contiguous x / topk_idx / topk_weights
    d(3, (9, 7), quant=True)                          # ... fp8 rows and scales of the same width
    z = d(4, (0, 3))                                  # a rank with no tokens
    small = d(5, (2, 1))
    wst = d(6, (9, 7), worst=32)
    for s, wts in ((a, True), (small, True), (a, False), (b, True), (wst, True), (small, True), (c, True),
                   (z, True), (wst, False), (a, True)):  # the weights buffer: more, fewer, more rows
        bad += _combine(buf, s, wts)
        for _, wb, written, _ in buf._normal._wb.values():  # what a fresh zeroed buffer would hold past the weights
            if wb[written:].any():  # written (rows past the received ones are not read back: not seen in y or w)
                bad.append(f"{s['seed']}: the kept weights buffer is not zero past its first {written} weights")
    g = d(7, (70, 3))                                 # over the capacity: grown on both ranks, entries dropped
    a2 = d(8, (9, 7))                                 # the first T again, under the new capacity
    d(9, (9, 7), idx_dtype=torch.int32)
    for s, wts in ((a, True), (g, True), (a2, True), (small, False), (a2, True)):  # handles from before the growth
        bad += _combine(buf, s, wts)
    if not torch.equal(buf.dispatch(a["x"], handle=a["h"])[0].view(torch.int16), a["rx"].view(torch.int16)):
        bad.append("cached dispatch of a handle from before the growth")
    buf.destroy()
    return bad


@pytest.mark.parametrize("backend,meta_rows_max_tokens", [("triton", 256), ("nccl", 256), ("nccl", 0), ("triton", 0)])
def test_warm_buffer_calls_match_the_reference(backend, meta_rows_max_tokens):
    assert run_cpu_world(2, _warm_calls, backend, meta_rows_max_tokens, timeout_s=600) == [[], []]
