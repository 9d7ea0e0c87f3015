"""Rank functions of the normal-mode checks (CPU worlds and GPU worlds run the same code on their device)."""

from __future__ import annotations

import torch

from tests.compat.deepep_reference import gather, layout_ref, normal_ref, routing

H, L, TOPK = 128, 2, 3
TOKENS = (6, 0, 9, 4, 7, 2, 5, 8)  # per rank: uneven, rank 1 has none


def _dev():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def expert_fn(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """What rank ``rank``'s "experts" return for received bf16 rows: bf16(x * (rank + 1) + 0.5), exact to recompute."""
    return (rows.float() * (rank + 1) + 0.5).bfloat16()


def combine_ref(xs_rank, in_rank, ranks_fn=expert_fn):
    """DeepEP's combine of this rank's tokens: sum over receiving ranks (ascending, fp32) of their expert output."""
    T = xs_rank.shape[0]
    acc = torch.zeros(T, xs_rank.shape[1])
    for r in range(in_rank.shape[1]):
        m = in_rank[:, r]
        acc[m] += ranks_fn(xs_rank[m], r).float()
    return acc.bfloat16()


def quantize_rows(x: torch.Tensor):
    """A caller's own per-128 fp8 quantization (as DeepEP's tests: amax / 448, scales column-major)."""
    T, Hx = x.shape
    xb = x.float().view(T, Hx // 128, 128)
    amax = xb.abs().amax(2).clamp(min=1e-4)
    q = (xb * (448.0 / amax[..., None])).to(torch.float8_e4m3fn).view(T, Hx)
    return q, (amax / 448.0).T.contiguous().T


def lane_kinds(buf) -> list:
    """The kinds of the inner EPBuffers a compat Buffer made: ``"xm"`` rows lanes with meta rows, ``"x"`` rows lanes
    of one pseudo-expert per rank, ``"meta"`` / ``"meta2"`` meta lanes (sorted, each once)."""
    return sorted({key[0] for key, _ in buf.lanes})


def host_reads(buf) -> int:
    """Host reads of a compat Buffer so far: its lanes' status reads and its own pinned histogram reads."""
    return sum(lane.host_reads for _, lane in buf.lanes) + sum(o.host_reads for o in buf._normal._meta_ops.values())


def normal_case(group, backend: str, seed: int, meta_rows_max_tokens=None, kinds=None, carried=None):
    """Every normal-mode semantic on one Buffer: layout, dispatch (bf16 / fp8 / int32 scales / no top-k / aligned /
    num_worst_tokens), cached dispatch, combine (weights, bias), over two rounds of fresh inputs.
    ``meta_rows_max_tokens``: the Buffer's (None: its default, the top-k as meta rows at these sizes; 0: the meta
    lane). ``kinds``: the inner EPBuffer kinds (:func:`lane_kinds`) the Buffer must have made. ``carried``: whether
    the top-k dispatches must carry their ids and weights with the rows (the decode tiles' lane), when given."""
    import tritonep.compat.deep_ep as deep_ep

    rank, W = group.rank(), group.size()
    dev, E = _dev(), L * W
    K = min(TOPK, E)  # distinct experts per token (a world of one has two)
    opt = {} if meta_rows_max_tokens is None else {"meta_rows_max_tokens": meta_rows_max_tokens}
    buf = deep_ep.Buffer(group, 0, 0, backend=backend, **opt)
    checked = 0
    for rnd in range(2):
        gen = torch.Generator().manual_seed(1000 * seed + 10 * rnd + rank)
        T = TOKENS[(rank + rnd) % len(TOKENS)]
        x = torch.randn(T, H, generator=gen).bfloat16().to(dev)
        idx, w = routing(T, E, K, gen, device=dev)
        ntr, nrdma, nte, itr, ev = buf.get_dispatch_layout(idx, E)
        r_ntr, r_nte, r_itr = layout_ref(idx.cpu(), E, W)
        assert nrdma is None and ev.event is None
        assert torch.equal(ntr.cpu(), r_ntr) and torch.equal(nte.cpu(), r_nte) and torch.equal(itr.cpu(), r_itr)
        xs, ids, ws, irs = map(list, zip(*gather(group, (x, idx, w, itr))))
        e_rows, e_ids, e_w, e_counts, e_rpm = normal_ref(xs, ids, ws, irs, rank, E, W)

        # dispatch with top-k
        reads = host_reads(buf)
        rx, ridx, rw, counts, h, ev = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                                   num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w,
                                                   async_finish=True, previous_event=buf.capture())
        ev.current_stream_wait()
        assert carried is None or h.carried == carried, (h.carried, carried)
        if rnd == 0 and h.x_lane.sums_counts:  # the triton backend: DeepEP's per-expert counts come with the rows
            # lane's status, ONE read (round 1 first reads the lanes its last calls left)
            assert host_reads(buf) == reads + 1, (host_reads(buf), reads)
        assert torch.equal(rx.cpu().view(torch.int16), e_rows.view(torch.int16)), "rows"
        assert torch.equal(ridx.cpu(), e_ids) and ridx.dtype == idx.dtype, "ids"
        assert torch.equal(rw.cpu(), e_w), "weights"
        assert counts == e_counts.tolist(), (counts, e_counts)
        assert torch.equal(h[0].cpu(), e_rpm) and h[4] is itr and len(h) == 6
        a, b, c, d, e, f = h  # unpacks like DeepEP's 6-tuple
        assert b is None and torch.equal(a, h[0])

        # combine: unweighted sum over the receiving ranks, and the weights reduced back
        eo = expert_fn(rx, rank)
        y, cw, _ = buf.combine(eo, h, topk_weights=rw)
        assert torch.equal(y.cpu(), combine_ref(x.cpu(), itr.cpu())), "combine"
        assert torch.equal(cw.cpu(), w.cpu().masked_fill(idx.cpu() < 0, 0.0)), "combined weights"
        b0 = torch.randn(T, H, generator=gen).bfloat16().to(dev)
        yb, cw0, _ = buf.combine(eo, h, bias=(b0, b0))
        assert cw0 is None
        assert torch.equal(yb.cpu(), (y.float() + b0.float() + b0.float()).bfloat16().cpu()), "bias"

        # cached dispatch: the same rows again, from the handle alone
        rx2, n1, n2, n3, n4, _ = buf.dispatch(x, handle=h)
        assert (n1, n2, n3, n4) == (None, None, None, None)
        assert torch.equal(rx2.view(torch.int16), rx.view(torch.int16)), "cached"

        # caller-quantized rows (column-major float scales), then int32 scales: the caller's bits unchanged
        q, sc = quantize_rows(x)
        hq = None
        for scales in (sc, torch.randint(-2**31, 2**31 - 1, (T, H // 128), generator=gen, dtype=torch.int64)
                       .to(torch.int32).to(dev)):
            (rq, rs), _, _, cq, hs, _ = buf.dispatch((q, scales), num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                                     num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)
            qs, ss = zip(*gather(group, (q.view(torch.uint8), scales.contiguous())))
            e_q = normal_ref(list(qs), None, None, irs, rank, E, W)[0]
            e_s = normal_ref(list(ss), None, None, irs, rank, E, W)[0]
            assert torch.equal(rq.cpu().view(torch.uint8), e_q) and rq.dtype == torch.float8_e4m3fn
            assert torch.equal(rs.cpu(), e_s) and rs.dtype == scales.dtype and rs.is_contiguous()
            assert cq == counts
            if hq is None:
                hq, e_s_float = hs, e_s
        (cq8, cs8), *_ = buf.dispatch((q, sc), handle=hq)  # cached dispatch of quantized rows
        assert torch.equal(cq8.cpu().view(torch.uint8), e_q) and torch.equal(cs8.cpu(), e_s_float)
        assert torch.equal(buf.combine(eo, hq)[0].view(torch.int16), y.view(torch.int16)), "combine after fp8"

        # expert_alignment: the counts rounded up, the rows not
        _, _, _, c4, _, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte,
                                         topk_idx=idx, topk_weights=w, expert_alignment=4)
        assert c4 == [(c + 3) // 4 * 4 for c in e_counts.tolist()]

        # no top-k: DeepEP's counts come from the group's num_tokens_per_expert
        rxn, rin, rwn, cn, hn, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                                num_tokens_per_expert=nte)
        assert rin is None and rwn is None and cn == e_counts.tolist()
        assert torch.equal(rxn.view(torch.int16), rx.view(torch.int16))

        # num_worst_tokens: no host read, fixed rows; the received ones first, then ids -1 and weight 0
        worst = W * max(TOKENS) + 3
        rxw, riw, rww, cw_list, hw, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=itr,
                                                     num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w,
                                                     num_worst_tokens=worst)
        R = rx.shape[0]
        assert carried is None or hw.carried == carried, (hw.carried, carried)
        assert cw_list == [] and rxw.shape == (worst, H) and riw.shape == (worst, K) and rww.shape == (worst, K)
        assert torch.equal(rxw[:R].view(torch.int16), rx.view(torch.int16))
        assert torch.equal(riw[:R], ridx) and torch.equal(rww[:R], rw)
        assert bool((riw[R:] == -1).all()) and not rww[R:].any()
        eow = torch.full((worst, H), float("nan"), dtype=torch.bfloat16, device=dev)  # rows past R are never read
        eow[:R] = eo
        yw, cww, _ = buf.combine(eow, hw, topk_weights=rww)
        assert torch.equal(yw.view(torch.int16), y.view(torch.int16)) and torch.equal(cww, cw)
        rxc = buf.dispatch(x, handle=hw)[0]
        assert rxc.shape == (worst, H) and torch.equal(rxc[:R].view(torch.int16), rx.view(torch.int16))
        checked += 1
    if kinds is not None:
        assert lane_kinds(buf) == kinds, lane_kinds(buf)
    buf.destroy()
    return checked
