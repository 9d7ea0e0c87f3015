"""DeepEP's documented semantics as plain loops over every rank's inputs: the oracle of the compat tests.

Written from DeepEP's V1 docstrings and its tests (tests/test_intranode.py, tests/test_low_latency.py): normal
dispatch returns one row per (token, receiving rank) in (source rank, source token) order with local expert ids (-1
elsewhere) and weights (0 where the id is -1); the per-expert counts are the group's routes per local expert; the
combine is the unweighted sum over the receiving ranks; the low-latency dispatch packs each local expert's rows into a
prefix, in (source rank, source token) order here (DeepEP leaves the order inside a source rank's block open).
Shared by the CPU-world and GPU tests (importable by spawned GPU ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def assert_close(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float, what: str = ""):
    """``|got - ref| <= atol + rtol * |ref|`` elementwise, no NaN (torch.testing.assert_close imports DTensor and
    sympy on first use: seconds in every forked rank)."""
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    assert g.shape == r.shape, (what, g.shape, r.shape)
    bad = ~((g - r).abs() <= atol + rtol * r.abs())
    assert not bool(bad.any()), (what, int(bad.sum()), float((g - r).abs().max()))


def gather(group, obj):
    """Every rank's ``obj`` (CPU copies of tensors), in rank order."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, _cpu(obj), group=group)
    return out


def _cpu(o):
    if isinstance(o, torch.Tensor):
        return o.detach().cpu()
    if isinstance(o, (tuple, list)):
        return type(o)(_cpu(v) for v in o)
    return o


def routing(T: int, E: int, K: int, gen: torch.Generator, masked: int = 2, device="cpu"):
    """``(topk_idx int64 [T, K], topk_weights float32 [T, K])``: K distinct experts per token, ``masked`` slots -1
    whose weight is NaN (DeepEP never reads the weight of a -1 slot)."""
    idx = torch.rand(T, E, generator=gen).argsort(1)[:, :K]
    for _ in range(masked if T else 0):
        idx[torch.randint(T, (1,), generator=gen), torch.randint(K, (1,), generator=gen)] = -1
    w = (torch.rand(T, K, generator=gen) + 0.25).masked_fill(idx < 0, float("nan"))
    return idx.to(device), w.to(device)


def layout_ref(topk_idx: torch.Tensor, E: int, W: int):
    L = E // W
    T = topk_idx.shape[0]
    in_rank = torch.zeros(T, W, dtype=torch.bool)
    per_expert = torch.zeros(E, dtype=torch.int32)
    for t in range(T):
        for e in topk_idx[t].tolist():
            if 0 <= e < E:
                in_rank[t, e // L] = True
                per_expert[e] += 1
    return in_rank.sum(0).to(torch.int32), per_expert, in_rank


def normal_ref(xs, idxs, ws, in_ranks, rank: int, E: int, W: int):
    """What ``rank`` receives: ``(rows [R, ...], local ids [R, K], weights [R, K], counts [L], rank_prefix [W, W])``
    from every rank's x rows, topk_idx, topk_weights and is_token_in_rank (lists by rank)."""
    L = E // W
    rows, ids, wts = [], [], []
    for s in range(W):
        for t in range(xs[s].shape[0]):
            if bool(in_ranks[s][t, rank]):
                rows.append(xs[s][t])
                if idxs is not None:
                    g = idxs[s][t]
                    loc = torch.where((g >= rank * L) & (g < (rank + 1) * L), g - rank * L, torch.full_like(g, -1))
                    ids.append(loc)
                    wts.append(torch.where(loc >= 0, ws[s][t], torch.zeros_like(ws[s][t])))
    H = xs[0].shape[1:]
    R = len(rows)
    out_rows = torch.stack(rows) if R else torch.empty((0,) + tuple(H), dtype=xs[0].dtype)
    counts = torch.zeros(L, dtype=torch.int64)
    if idxs is not None:
        for s in range(W):
            g = idxs[s]
            for j in range(L):
                counts[j] += int((g == rank * L + j).sum())
    K = idxs[0].shape[1] if idxs is not None else 0
    out_ids = torch.stack(ids) if ids else torch.empty(0, K, dtype=torch.int64)
    out_w = torch.stack(wts) if wts else torch.empty(0, K)
    per_src = torch.tensor([[int(in_ranks[s][:, r].sum()) for r in range(W)] for s in range(W)], dtype=torch.int32)
    return out_rows, out_ids, out_w, counts, torch.cumsum(per_src, 0).to(torch.int32)


def ll_ref(xs, idxs, rank: int, E: int, W: int, M: int):
    """Low-latency receive of ``rank``: per local expert the list of ``(source rank, source token)`` in order, and
    ``layout_range [L, W]`` (begin << 32 | count)."""
    L = E // W
    srcs = [[] for _ in range(L)]
    rng = torch.zeros(L, W, dtype=torch.int64)
    for j in range(L):
        e = rank * L + j
        for s in range(W):
            toks = [t for t in range(idxs[s].shape[0]) if e in idxs[s][t].tolist()]
            rng[j, s] = (len(srcs[j]) << 32) | len(toks)
            srcs[j] += [(s, t) for t in toks]
    return srcs, rng
