"""Single-process pure-torch oracles for expert-parallel dispatch / combine (THE spec the kernels are tested against).

Every function takes EVERY rank's inputs at once (Python lists indexed by rank) and returns every rank's expected
outputs. Conventions (docs/architecture.md):

* ``E = num_experts``, ``W = world_size``, ``L = E // W`` local experts; global expert ``e`` lives on rank ``e // L``
  with local id ``e % L``.
* ``topk_idx[r]`` is ``[T_r, K]`` int32/int64 with entries in ``[-1, E)``; ``-1`` is a masked slot (no route).
  ``T_r`` may be 0 and may differ across ranks; K and H are the same on every rank.
* A *route* is one valid ``(source rank, token, k)``. Dispatch makes one received row per route (a token that picks
  two experts of one rank gives one row in each of the two segments; a token that picks the same expert twice gives
  two rows in that segment).

Data movement (:func:`dispatch_reference`) is exact: kernels must match it bit for bit (``torch.equal``).
Arithmetic (combine sums) fixes the order of the fp32 additions so a kernel that follows the same order matches
bit for bit; each product ``w * row`` is rounded to fp32 before it is added (no FMA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .errors import ConfigError, InputError
from .reference_checks import check_routing
from .reference_moe import moe_dense_reference  # public path of the MoE oracle

__all__ = [
    "RefDispatch",
    "count_sums_reference",
    "carry_reference",
    "dispatch_reference",
    "combine_reference",
    "combine_reference_partial",
    "dispatch_backward_reference",
    "combine_backward_reference",
    "moe_dense_reference",
]


@dataclass
class RefDispatch:
    """What one destination rank receives from dispatch (R = received rows including alignment padding).

    Attributes:
        x: ``[R, H]`` input dtype; expert-grouped rows. Inside local expert j's segment the rows are ordered by
            ``(source rank, source token, k)`` ascending; padding rows at a segment's end are zero.
        num_tokens_per_expert: ``[L]`` int32, real rows per local expert (padding excluded).
        expert_offsets: ``[L]`` int32, cumulative segment ENDS; segment j has length
            ``round_up(num_tokens_per_expert[j], expert_alignment)`` and spans ``[expert_offsets[j-1] (or 0),
            expert_offsets[j])``; ``R = expert_offsets[-1]``.
        src_rank, src_token, src_k: ``[R]`` int32, the route each row came from; -1 on padding rows.
        weights: ``[R]`` float32, ``topk_weights[src_rank][src_token, src_k]``; 0 on padding rows.
        counts: ``[W, E]`` int32, ``counts[r, e]`` = routes of rank r to expert e (identical on every rank).
    """

    x: torch.Tensor
    num_tokens_per_expert: torch.Tensor
    expert_offsets: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_k: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor


def dispatch_reference(
    xs: Sequence[torch.Tensor],
    topk_idxs: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    num_experts: int,
    world_size: int,
    expert_alignment: int = 1,
) -> list[RefDispatch]:
    """Expected dispatch output of every rank (see :class:`RefDispatch` for the exact layout).

    Args:
        xs: per rank ``[T_r, H]`` tokens (any dtype, the same on every rank; copied as is, no wire rounding).
        topk_idxs: per rank ``[T_r, K]`` int32/int64 in ``[-1, E)``; topk_weights: per rank ``[T_r, K]`` float.
        num_experts: E (multiple of world_size). world_size: W >= 1. expert_alignment: segment length multiple >= 1.

    Returns:
        ``world_size`` :class:`RefDispatch`, one per destination rank. Differentiable w.r.t. ``xs`` (``x`` is built
        by gathering rows of ``xs``).

    Raises:
        ConfigError: bad world_size / num_experts / expert_alignment. InputError: list lengths, shapes, dtypes, or
        ids outside ``[-1, E)``.
    """
    _, num_local = check_routing(topk_idxs, topk_weights, num_experts, world_size)
    if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment < 1:
        raise ConfigError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
    if len(xs) != world_size:
        raise InputError(f"xs has {len(xs)} entries, expected world_size={world_size}")
    hiddens = {x.shape[1] if x.dim() == 2 else None for x in xs}
    dtypes = {x.dtype for x in xs}
    if None in hiddens or len(hiddens) != 1 or len(dtypes) != 1:
        raise InputError(f"xs must be [T_r, H] with one H and one dtype, got {[(tuple(x.shape), x.dtype) for x in xs]}")
    for r, (x, idx) in enumerate(zip(xs, topk_idxs)):
        if x.shape[0] != idx.shape[0]:
            raise InputError(f"rank {r}: x has {x.shape[0]} tokens but topk_idx has {idx.shape[0]}")
    hidden, dtype = hiddens.pop(), dtypes.pop()
    device = xs[0].device

    # every route (rank, token, k) in (r, t, k) ascending order, then a stable sort by expert groups them
    e_all, r_all, t_all, k_all, w_all = [], [], [], [], []
    counts = torch.zeros(world_size, num_experts, dtype=torch.int64)
    base, bases = 0, []
    for r, (idx, w) in enumerate(zip(topk_idxs, topk_weights)):
        bases.append(base)
        base += idx.shape[0]
        t, k = torch.nonzero(idx.cpu() >= 0, as_tuple=True)  # row-major: (t, k) ascending
        e = idx.cpu()[t, k].to(torch.int64)
        counts[r] = torch.bincount(e, minlength=num_experts)
        e_all.append(e), r_all.append(torch.full_like(t, r)), t_all.append(t), k_all.append(k)
        w_all.append(w.detach().cpu().to(torch.float32)[t, k])
    e_all, r_all, t_all, k_all, w_all = (torch.cat(a) for a in (e_all, r_all, t_all, k_all, w_all))
    order = torch.sort(e_all, stable=True).indices
    e_all, r_all, t_all, k_all, w_all = (a[order] for a in (e_all, r_all, t_all, k_all, w_all))
    x_all = torch.cat(list(xs), dim=0)
    flat_src = torch.tensor(bases, dtype=torch.int64)[r_all] + t_all if len(r_all) else r_all

    per_expert = counts.sum(0)  # [E]
    expert_start = torch.cumsum(per_expert, 0) - per_expert  # start of expert e in the sorted route list
    out = []
    for d in range(world_size):
        n = per_expert[d * num_local : (d + 1) * num_local]
        seg = (n + expert_alignment - 1) // expert_alignment * expert_alignment
        ends = torch.cumsum(seg, 0)
        rows_total = int(ends[-1])
        x = torch.zeros(rows_total, hidden, dtype=dtype, device=device)
        src_rank = torch.full((rows_total,), -1, dtype=torch.int32)
        src_token, src_k = src_rank.clone(), src_rank.clone()
        weights = torch.zeros(rows_total, dtype=torch.float32)
        for j in range(num_local):
            e = d * num_local + j
            cnt, s = int(per_expert[e]), int(expert_start[e])
            row0 = int(ends[j] - seg[j])
            sel = slice(s, s + cnt)
            rows = slice(row0, row0 + cnt)
            x[rows] = x_all[flat_src[sel].to(device)]
            src_rank[rows], src_token[rows], src_k[rows] = r_all[sel].int(), t_all[sel].int(), k_all[sel].int()
            weights[rows] = w_all[sel]
        dev = lambda a: a.to(device)  # noqa: E731
        out.append(
            RefDispatch(
                x=x,
                num_tokens_per_expert=dev(n.to(torch.int32)),
                expert_offsets=dev(ends.to(torch.int32)),
                src_rank=dev(src_rank),
                src_token=dev(src_token),
                src_k=dev(src_k),
                weights=dev(weights),
                counts=dev(counts.to(torch.int32)),
            )
        )
    return out


def _route_rows(
    dispatched: Sequence[RefDispatch], topk_idxs: Sequence[torch.Tensor], row_counts: Sequence[int] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Per source rank: (dest rank [T, K] int64, row on that rank [T, K] int64), -1 on masked slots; and L."""
    world = len(dispatched)
    if world < 1:
        raise InputError("dispatched is empty")
    num_local = dispatched[0].num_tokens_per_expert.numel()
    check_routing(topk_idxs, None, num_local * world, world)
    if row_counts is not None:
        for d, (disp, rows) in enumerate(zip(dispatched, row_counts)):
            if rows != disp.src_rank.numel():
                raise InputError(f"rank {d}: got {rows} expert rows, dispatch produced {disp.src_rank.numel()}")
    dest, row = [], []
    for idx in topk_idxs:
        idx = idx.cpu().to(torch.int64)
        dest.append(torch.where(idx >= 0, idx // num_local, -1))
        row.append(torch.full_like(idx, -1))
    for d, disp in enumerate(dispatched):
        src_rank, src_token, src_k = (a.cpu().to(torch.int64) for a in (disp.src_rank, disp.src_token, disp.src_k))
        for r in range(world):
            m = src_rank == r
            if m.any() and (int(src_token[m].max()) >= row[r].shape[0] or int(src_k[m].max()) >= row[r].shape[1]):
                raise InputError(f"dispatched[{d}] names rows of rank {r} outside its topk_idx {tuple(row[r].shape)}")
            row[r][src_token[m], src_k[m]] = torch.nonzero(m, as_tuple=True)[0]
    for r in range(world):
        valid = dest[r] >= 0
        if not torch.equal(valid, row[r] >= 0):
            raise InputError(f"dispatched does not match topk_idxs of rank {r} (routes without a row or vice versa)")
    return dest, row, num_local


def _gather_setup(expert_outs, dispatched, topk_idxs):
    """Concatenate expert outputs (fp32) and map each source route to its global row (-1 on masked slots)."""
    world = len(dispatched)
    if len(expert_outs) != world:
        raise InputError(f"expert_outs has {len(expert_outs)} entries, expected world_size={world}")
    hiddens = {o.shape[1] if o.dim() == 2 else None for o in expert_outs}
    if None in hiddens or len(hiddens) != 1:
        raise InputError(f"expert_outs must be [R_d, H] with one H, got {[tuple(o.shape) for o in expert_outs]}")
    dest, row, _ = _route_rows(dispatched, topk_idxs, [o.shape[0] for o in expert_outs])
    device = expert_outs[0].device
    eo_all = torch.cat([o.to(device=device, dtype=torch.float32) for o in expert_outs], dim=0)
    base = torch.tensor([0] + [o.shape[0] for o in expert_outs], dtype=torch.int64).cumsum(0)
    grow = [torch.where(dr >= 0, base[dr.clamp(min=0)] + rr, -1).to(device) for dr, rr in zip(dest, row)]
    return eo_all, [d.to(device) for d in dest], grow, hiddens.pop(), device


def _weighted_sum(expert_outs, dispatched, topk_idxs, topk_weights, num_tokens, partial_dtype, by_rank: bool):
    world = len(dispatched)
    if len(num_tokens) != world or len(topk_weights) != world:
        raise InputError(f"num_tokens ({len(num_tokens)}) and topk_weights ({len(topk_weights)}) need {world} entries")
    eo_all, dest, grow, hidden, device = _gather_setup(expert_outs, dispatched, topk_idxs)
    ys = []
    for r in range(world):
        t_r, k = topk_idxs[r].shape
        if num_tokens[r] != t_r:
            raise InputError(f"rank {r}: num_tokens={num_tokens[r]} but topk_idx has {t_r} tokens")
        if tuple(topk_weights[r].shape) != (t_r, k):
            raise InputError(f"rank {r}: topk_weights {tuple(topk_weights[r].shape)} != topk_idx {(t_r, k)}")
        w = topk_weights[r].to(device=device, dtype=torch.float32)
        # terms[k] = fp32(w[:, k] * row(t, k)); masked slots read row 0 (or nothing) and are zeroed by where()
        terms = [w[:, kk : kk + 1] * eo_all[grow[r][:, kk].clamp(min=0)] if eo_all.shape[0] else
                 torch.zeros(t_r, hidden, device=device) for kk in range(k)]
        zero = torch.zeros(t_r, hidden, dtype=torch.float32, device=device)
        y = zero
        for d in range(world) if by_rank else [None]:
            acc = zero
            for kk in range(k):
                m = dest[r][:, kk] >= 0 if d is None else dest[r][:, kk] == d
                acc = acc + torch.where(m[:, None], terms[kk], zero)
            if d is not None and partial_dtype is not None:
                acc = acc.to(partial_dtype).float()
            y = acc if d is None else y + acc
        ys.append(y)
    return ys


def combine_reference(
    expert_outs: Sequence[torch.Tensor],
    dispatched: Sequence[RefDispatch],
    topk_idxs: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    num_tokens: Sequence[int],
) -> list[torch.Tensor]:
    """Expected combine output of every source rank, summing in k order.

    ``y_r[t] = sum_{k=0..K-1, topk_idx[t,k] >= 0} topk_weights_r[t,k] * expert_outs[e // L][row(r, t, k)]``, the terms
    rounded to fp32 and added left to right starting from 0; a token with no valid route gives zeros. Padding rows
    of ``expert_outs`` are never read.

    Args:
        expert_outs: per destination rank ``[R_d, H]`` (any float dtype; R_d = rows of ``dispatched[d]``).
        dispatched: the :func:`dispatch_reference` output that says which row holds which route.
        topk_idxs / topk_weights: per source rank ``[T_r, K]`` (the weights used are these, not ``dispatched``'s).
        num_tokens: per source rank T_r (must equal ``topk_idxs[r].shape[0]``).

    Returns:
        per source rank ``[T_r, H]`` float32. Differentiable w.r.t. ``expert_outs`` and ``topk_weights``.

    Raises:
        InputError: list lengths, shapes, ids, or ``dispatched`` not matching ``topk_idxs``.
    """
    return _weighted_sum(expert_outs, dispatched, topk_idxs, topk_weights, num_tokens, None, by_rank=False)


def combine_reference_partial(
    expert_outs: Sequence[torch.Tensor],
    dispatched: Sequence[RefDispatch],
    topk_idxs: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
    num_tokens: Sequence[int],
    partial_dtype: torch.dtype | None = torch.bfloat16,
) -> list[torch.Tensor]:
    """Expected combine output in the EXACT reduction order of the Triton combine (docs/protocols.md "Combine").

    For source rank r and token t: for each expert rank d = 0..W-1 in ascending order,
    ``partial_d = 0 + sum_{k ascending, route (t,k) on rank d} fp32(w[t,k] * row)`` (fp32, left to right), then
    ``partial_d`` is rounded to ``partial_dtype`` (the wire format of the partial; None keeps fp32) and widened back
    to fp32; finally ``y[t] = 0 + partial_0 + partial_1 + ... + partial_{W-1}`` in fp32, left to right. A rank with
    no route of the token contributes an exact 0. Same arguments, returns, autograd and errors as
    :func:`combine_reference`.
    """
    return _weighted_sum(expert_outs, dispatched, topk_idxs, topk_weights, num_tokens, partial_dtype, by_rank=True)


def dispatch_backward_reference(
    grad_rows: Sequence[torch.Tensor],
    dispatched: Sequence[RefDispatch],
    topk_idxs: Sequence[torch.Tensor],
    num_tokens: Sequence[int],
) -> list[torch.Tensor]:
    """Gradient of dispatch w.r.t. the source tokens: combine of the received-row gradients with all weights 1.

    ``grad_x_r[t] = sum_{k ascending, valid} grad_rows[e // L][row(r, t, k)]`` in fp32 (padding rows ignored).

    Args:
        grad_rows: per destination rank ``[R_d, H]`` gradient of ``dispatched[d].x``.
        dispatched, topk_idxs, num_tokens: as in :func:`combine_reference`.

    Returns:
        per source rank ``[T_r, H]`` float32.

    Raises:
        InputError: as :func:`combine_reference`.
    """
    ones = [torch.ones(tuple(i.shape), dtype=torch.float32) for i in topk_idxs]
    return combine_reference(grad_rows, dispatched, topk_idxs, ones, num_tokens)


def combine_backward_reference(
    grad_ys: Sequence[torch.Tensor],
    expert_outs: Sequence[torch.Tensor],
    dispatched: Sequence[RefDispatch],
    topk_idxs: Sequence[torch.Tensor],
    topk_weights: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients of :func:`combine_reference` w.r.t. ``expert_outs`` and ``topk_weights``.

    * ``grad_expert_outs[d][row] = fp32(w[t,k]) * grad_ys[r][t]`` for the route ``(r, t, k)`` of each real row; padding
      rows get 0.
    * ``grad_topk_weights[r][t, k] = <grad_ys[r][t], expert_outs[d][row(r, t, k)]>`` in fp32; masked slots get 0.

    Args:
        grad_ys: per source rank ``[T_r, H]``; the other arguments as in :func:`combine_reference`.

    Returns:
        ``(grad_expert_outs: per destination rank [R_d, H] float32, grad_topk_weights: per source rank [T_r, K]
        float32)``.

    Raises:
        InputError: as :func:`combine_reference`, or ``grad_ys`` shapes not ``[T_r, H]``.
    """
    world = len(dispatched)
    if len(grad_ys) != world or len(topk_weights) != world:
        raise InputError(f"grad_ys ({len(grad_ys)}) and topk_weights ({len(topk_weights)}) need {world} entries")
    eo_all, _, grow, hidden, device = _gather_setup(expert_outs, dispatched, topk_idxs)
    eo_all = eo_all.detach()
    grad_all = torch.zeros(eo_all.shape, dtype=torch.float32, device=device)
    grad_w = []
    for r in range(world):
        g = grad_ys[r]
        if g.dim() != 2 or tuple(g.shape) != (topk_idxs[r].shape[0], hidden):
            raise InputError(f"rank {r}: grad_y {tuple(g.shape)} must be [T_r={topk_idxs[r].shape[0]}, H={hidden}]")
        g = g.detach().to(device=device, dtype=torch.float32)
        w = topk_weights[r].detach().to(device=device, dtype=torch.float32)
        t, k = torch.nonzero(grow[r] >= 0, as_tuple=True)
        rows = grow[r][t, k]
        grad_all[rows] = w[t, k][:, None] * g[t]
        gw = torch.zeros(tuple(topk_idxs[r].shape), dtype=torch.float32, device=device)
        gw[t, k] = (g[t] * eo_all[rows]).sum(-1)
        grad_w.append(gw)
    grad_eo = list(torch.split(grad_all, [o.shape[0] for o in expert_outs], dim=0))
    return [ge.clone() for ge in grad_eo], grad_w



def count_sums_reference(count_ids: list, count_experts: int) -> list:
    """The count routing of :meth:`tritonep.EPBuffer.dispatch` (``count_ids``), summed per receiver: for every
    rank r a list of ``count_experts / W`` ints, entry j = the routes of every rank's ``count_ids`` (``[T_s, CK]``
    int32/int64, a list by rank) to expert ``r * L + j`` (a repeated id counts twice; ids outside
    ``[0, count_experts)`` count nowhere): what ``handle.count_sums`` holds on rank r (twin of the decode kernel's
    count routing, :func:`tritonep.backends.triton.kernels.decode_dispatch.dispatch_decode_kernel`). Integers,
    exact."""
    W = len(count_ids)
    total = torch.zeros(count_experts + 1, dtype=torch.int64)
    for ids in count_ids:
        g = ids.detach().to("cpu", torch.int64).reshape(-1)
        g = torch.where((g >= 0) & (g < count_experts), g, count_experts)
        total += torch.bincount(g, minlength=count_experts + 1)
    L = count_experts // W
    return [total[r * L:(r + 1) * L].tolist() for r in range(W)]


def carry_reference(ref: RefDispatch, rank: int, count_ids: list, count_weights: list, count_experts: int,
                    num_rows: int) -> tuple:
    """The count routing carried with the rows (:meth:`tritonep.EPBuffer.dispatch`'s ``count_weights`` /
    ``count_out``) as rank ``rank`` receives it: ``(idx [num_rows, CK] int64, weights [num_rows, CK] float32)``.

    Row i of ``ref`` (this rank's :class:`RefDispatch`) from route ``(src_rank, src_token)`` gets that token's
    ``count_ids[src_rank][src_token]`` local to this rank (``id - rank*CL`` for an id in ``[rank*CL, (rank+1)*CL)``,
    ``CL = count_experts / W``, else -1) and its ``count_weights`` (0 where the id is -1); padding rows and the rows
    past the received ones: -1 and 0. Twin of :mod:`tritonep.backends.triton.kernels.carry`. Exact (data
    movement)."""
    W = len(count_ids)
    CK = count_ids[0].shape[1]
    CL = count_experts // W
    idx = torch.full((num_rows, CK), -1, dtype=torch.int64)
    w = torch.zeros(num_rows, CK, dtype=torch.float32)
    src_r, src_t = ref.src_rank.cpu().to(torch.int64), ref.src_token.cpu().to(torch.int64)
    for i in range(min(num_rows, src_r.shape[0])):
        if src_r[i] < 0:
            continue
        ids = count_ids[int(src_r[i])][int(src_t[i])].cpu().to(torch.int64)
        mine = (ids >= rank * CL) & (ids < (rank + 1) * CL)
        idx[i] = torch.where(mine, ids - rank * CL, -1)
        w[i] = torch.where(mine, count_weights[int(src_r[i])][int(src_t[i])].cpu().to(torch.float32), 0.0)
    return idx, w

