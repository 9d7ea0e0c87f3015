"""Torch ops of the DeepEP-compatible normal mode: the layout, the per-rank slots, and how rows travel as bits.

Every EPBuffer row is bfloat16 and its raw (``bf16``) wire moves rows as they are, bit for bit (loads and stores
only, on both backends; ``tests/compat/test_packing.py`` sends every 16-bit pattern, NaN payloads included). The
compat Buffer uses that to carry what DeepEP carries besides bf16 rows:

* a caller-quantized dispatch ``(x_fp8, scales)``: the row's bytes (``H`` one-byte elements, then the scales' bytes,
  any 4-byte dtype) packed into a ``[T, H]`` bf16 row (:func:`pack_quantized`; ``H`` bf16 = ``2H`` bytes hold
  ``H + 4S``) and taken apart on the receiver (:func:`unpack_quantized`): the caller's bits, unchanged;
* the top-k ids and weights of every row, at small token capacities as meta rows of the rows lane itself
  (:func:`meta_rows_per_rank`, :func:`pack_rows_torch` / :func:`unpack_rows_torch`: one exchange per dispatch), else
* the top-k ids of every row (:func:`pack_meta` / :func:`unpack_meta`): int32 ids as bf16 pairs, in a second, narrow
  lane whose routing has K slots per rank (:func:`meta_slots`), so that each received token arrives as K rows there,
  one per top-k slot. The weights ride that lane's per-route weight, which EPBuffer moves as float32 both ways: to
  the receiver in the dispatch (``Dispatched.weights``) and, for DeepEP's combine of ``topk_weights``, back to the
  source unsummed through :meth:`tritonep.EPBuffer.dispatch_backward` (``grad_topk_weights[t, k] = w[row(t, k)]``),
  where the K-slot groups of the ranks are summed in float32: DeepEP's reduction, exact to float32.

Idea: DeepEP's intranode layout and row order (``csrc/kernels/layout.cu``, ``intranode.cu`` of its V1 API), written
anew on tritonep's EPBuffer.
"""

from __future__ import annotations

import torch

__all__ = ["layout_torch", "rank_slots", "meta_slots", "meta_width", "pack_meta", "pack_torch", "unpack_meta",
           "local_id_table", "pack_quantized", "unpack_quantized", "over_capacity", "poison_torch", "meta_rows_per_rank",
           "pack_rows_torch", "unpack_rows_torch"]


def layout_torch(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """DeepEP's dispatch layout of this rank's routing.

    Args:
        topk_idx: ``[T, K]`` int32/int64 expert ids; -1 (and any id outside ``[0, E)``) selects nothing.
        num_experts: E, a multiple of ``num_ranks``; expert e lives on rank ``e // (E / num_ranks)``.
        num_ranks: W.

    Returns:
        ``(num_tokens_per_rank int32 [W], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, W])``: tokens
        sent to each rank (a token counts once per rank), routes to each expert (a repeated id counts twice), and
        whether token t goes to rank r. Device ops only (no host read).
    """
    T = topk_idx.shape[0]
    L = num_experts // num_ranks
    ids = topk_idx.long()
    valid = (ids >= 0) & (ids < num_experts)
    ids = torch.where(valid, ids, num_experts)  # every invalid slot -> the spare bin E
    in_rank = torch.zeros(T, num_ranks + 1, dtype=torch.bool, device=ids.device)
    in_rank.scatter_(1, ids // L, True)  # the spare bin E lands in the spare column W
    is_token_in_rank = in_rank[:, :num_ranks].contiguous()
    per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    per_expert = torch.bincount(ids.reshape(-1), minlength=num_experts + 1)[:num_experts].to(torch.int32)
    return per_rank, per_expert, is_token_in_rank


def rank_slots(is_token_in_rank: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """The routing of the per-rank composition: ``[T, W]`` int32, slot r = r where token t goes to rank r, else -1.

    An EPBuffer with ``num_experts = W`` (one pseudo-expert per rank), ``topk = W`` and these ids, weight 1, receives
    exactly DeepEP's rows: one per (token, receiving rank), in (source rank, source token) order, and its combine
    is the unweighted sum over ranks. ``ranks``: ``arange(W)`` int32 on the device (cached by the caller)."""
    return torch.where(is_token_in_rank, ranks, -1)


def meta_slots(slots: torch.Tensor, topk: int) -> torch.Tensor:
    """The meta lane's routing: ``[T, W*K]`` int32, slot ``r*K + k`` = r where token t goes to rank r, else -1. Each
    received token then arrives as K consecutive rows (slot k = 0..K-1) in the meta lane's (source rank, source
    token, slot) order, aligned with the rows lane's rows."""
    return slots.repeat_interleave(topk, dim=1)


def meta_width(topk: int) -> int:
    """bf16 elements of a meta row: ``2K`` (the token's K int32 ids), rounded up to a multiple of 8 (16-byte rows)."""
    return (2 * topk + 7) // 8 * 8


def pack_meta(topk_idx: torch.Tensor) -> torch.Tensor:
    """``[T, meta_width(K)]`` bf16 rows holding each token's ids as int32 bit patterns (DeepEP's ids fit: experts <
    2^31); an id outside ``[-1, 2^31)`` is written as -1 (checked at the ids' own width, so an int64 id such as
    ``2^32 + 1`` is never cast onto an expert: it selects nothing, as in the layout)."""
    T, K = topk_idx.shape
    ids = topk_idx.masked_fill((topk_idx < -1) | (topk_idx > 2**31 - 1), -1).to(torch.int32).view(torch.bfloat16)
    pad = meta_width(K) - 2 * K
    return torch.cat([ids, ids.new_zeros(T, pad)], 1) if pad else ids


def pack_torch(is_token_in_rank: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
    """A dispatch's inputs of both lanes from DeepEP's: ``is_token_in_rank [T, W]`` bool, ``topk_idx [T, K]``
    int32/int64, ``topk_weights [T, K]`` float32 ->

    ``(slots [T, W] int32, meta_rows [T, meta_width(K)] bf16, meta_slots [T, W*K] int32, meta_weights [T, W*K]
    float32)``: the rows lane's routing (:func:`rank_slots`), the meta lane's rows (:func:`pack_meta`), its routing
    (:func:`meta_slots`) and its route weights (``w[t, k]`` at slot ``r*K + k`` for every rank r, bit for bit). The
    twin of :func:`tritonep.compat.deep_ep.kernels.meta.pack_kernel` (one launch,
    :meth:`tritonep.compat.deep_ep.meta.MetaOps.pack`)."""
    W, K = is_token_in_rank.shape[1], topk_idx.shape[1]
    slots = rank_slots(is_token_in_rank, torch.arange(W, dtype=torch.int32, device=is_token_in_rank.device))
    return slots, pack_meta(topk_idx), meta_slots(slots, K), topk_weights.repeat(1, W)


def local_id_table(rank: int, num_local_experts: int, num_experts: int, dtype, device) -> torch.Tensor:
    """``[E + 1]`` table: entry g = g - rank*L for this rank's experts, -1 for the others; the last entry (index -1)
    is -1. ``table[ids]`` turns global ids (-1 included) into DeepEP's local ids without ever wrapping."""
    t = torch.full((num_experts + 1,), -1, dtype=dtype)
    lo = rank * num_local_experts
    t[lo:lo + num_local_experts] = torch.arange(num_local_experts, dtype=dtype)
    return t.to(device)


def unpack_meta(rows: torch.Tensor, weights: torch.Tensor, topk: int, table: torch.Tensor, num_experts: int,
                num_local_experts: int):
    """The meta lane's received rows ``[R*K, meta_width]`` and route weights ``[R*K]`` ->
    ``(recv_topk_idx [R, K] table.dtype, recv_topk_weights [R, K] float32, hist [L + 1])``.

    ``recv_topk_idx``: local expert ids, -1 where the expert lives elsewhere (or the id was -1 / outside
    ``[-1, E)``); ``recv_topk_weights``: the weight, 0 where the id is -1 (DeepEP's rule); ``hist[0]``: slots with
    -1, ``hist[1 + j]``: slots with local expert j (DeepEP's per-expert receive count, before alignment)."""
    K = topk
    R = rows.shape[0] // K
    ids = rows.view(R, K, rows.shape[1])[:, 0, :2 * K].view(torch.int32).clamp(-1, num_experts)
    local = table[ids]  # an id outside [-1, E) reads the last entry: -1
    w = torch.where(local >= 0, weights.view(R, K), 0.0)
    hist = torch.bincount((local + 1).reshape(-1), minlength=num_local_experts + 1)
    return local, w, hist


def pack_quantized(xq: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(xq [T, H] one-byte dtype, scales [T, S] four-byte dtype, any strides)`` -> ``[T, H]`` bf16 rows whose bytes
    are xq's row, then the scales' bytes, then 2H - H - 4S bytes left unset. The caller checks 4S <= H (and H even).
    With H not a multiple of 4 the scales' bytes start off a 4-byte boundary (no 4-byte view of them): copied as
    bytes."""
    T, H = xq.shape
    S = scales.shape[1]
    out = torch.empty(T, 2 * H, dtype=torch.uint8, device=xq.device)
    out[:, :H].copy_(xq.view(torch.uint8))
    if H % 4:
        out[:, H:H + 4 * S].copy_(scales.contiguous().reshape(-1).view(torch.uint8).view(T, 4 * S))
    else:
        out[:, H:H + 4 * S].view(scales.dtype).copy_(scales)
    return out.view(torch.bfloat16)


def unpack_quantized(rows: torch.Tensor, x_dtype: torch.dtype, scale_dtype: torch.dtype, num_scales: int):
    """Received ``[R, H]`` bf16 rows of :func:`pack_quantized` -> ``(xq [R, H] x_dtype, scales [R, S] scale_dtype)``,
    both contiguous, bit for bit what the sender packed."""
    R, H = rows.shape
    b = rows.view(torch.uint8)
    xq = b[:, :H].contiguous().view(x_dtype)
    # a new tensor (offset 0): a slice of one row or none counts as contiguous, and off a 4-byte width its offset H
    # would refuse the 4-byte view
    scales = b[:, H:H + 4 * num_scales].clone(memory_format=torch.contiguous_format).view(scale_dtype)
    return xq, scales


def over_capacity(counts: torch.Tensor, limit: int) -> torch.Tensor:
    """Whether a rows-lane call with these exchanged counts (int32 ``[W, W]``: rows of source rank i to rank j) was
    refused for capacity: some rank would receive more than ``limit`` rows (EPBuffer's test for a lane of one
    pseudo-expert per rank and ``max_recv_tokens = limit``). A 0-dim bool device tensor, no host read."""
    return counts.sum(0).amax() > limit


def poison_torch(counts: torch.Tensor, limit: int, *tensors: torch.Tensor) -> None:
    """Twin of :func:`tritonep.compat.deep_ep.kernels.poison.poison`: when :func:`over_capacity`, every element of
    every tensor (contiguous, 1-, 2- or 4-byte elements) gets all-ones bits in place (NaN in bfloat16, float32,
    float8_e4m3fn and UE8M0 bytes); else nothing changes. No host read."""
    over = over_capacity(counts, limit)
    for t in tensors:
        t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]).masked_fill_(over, -1)


def meta_rows_per_rank(token_capacity: int, topk: int, width, world_size: int, max_tokens: int) -> int:
    """Meta rows P per (source, destination) rank of a dispatch that carries its top-k in the rows lane (0: it does
    not; the meta lane carries it). A destination's group of P rows of ``width`` bf16 (``width // 2`` int32 words
    each) holds a count word and 2K words per token it may receive (``token_capacity`` at most); the rows lane then
    holds ``token_capacity + W*P`` tokens per rank, which must not exceed ``max_tokens`` (the Buffer's
    ``meta_rows_max_tokens``). 0 also without top-k (``topk`` 0) or for a width that is not an even int >= 2."""
    if not topk or not isinstance(width, int) or width < 2 or width % 2:
        return 0
    p = -(-(1 + token_capacity * 2 * topk) // (width // 2))
    return p if token_capacity + world_size * p <= max_tokens else 0


def pack_rows_torch(x: torch.Tensor, is_token_in_rank: torch.Tensor, topk_idx: torch.Tensor,
                    topk_weights: torch.Tensor, num_experts: int, meta_rows: int):
    """The rows-lane input of a dispatch whose top-k travels as meta rows: ``(x_in [T + W*P, H] bf16, slots
    [T + W*P, W] int32)`` from ``x [T, H]`` bf16 (H even), ``is_token_in_rank [T, W]`` bool, ``topk_idx [T, K]``
    int32/int64, ``topk_weights [T, K]`` float32 and ``P = meta_rows``.

    ``x_in``: x bit for bit, then for every destination rank r (ascending) P rows whose int32 words are: the count
    ``n_r`` of tokens going to r, then for each of them in token order its K ids local to r (``id - r*L`` for ids in
    ``[r*L, (r+1)*L)``, else -1; ``L = E / W``) and its K weights (float32 bits, +0.0 where the local id is -1), then
    zeros. ``slots``: token t: ``2r`` where it goes to rank r, else -1 (pseudo-expert 2r: the token rows rank r
    receives); pseudo-token ``T + r*P + p``: ``2r + 1`` at slot r, -1 elsewhere (rank r's meta rows). Twin of
    :func:`tritonep.compat.deep_ep.kernels.meta_rows.pack_rows_kernel`."""
    T, W = is_token_in_rank.shape
    K, H = topk_idx.shape[1], x.shape[1]
    P, L, hw = meta_rows, num_experts // W, H // 2
    dev = x.device
    x_in = torch.zeros(T + W * P, H, dtype=torch.bfloat16, device=dev)
    x_in[:T].view(torch.int16).copy_(x.view(torch.int16))
    words = x_in[T:].view(torch.int32).view(W, P * hw)
    ids, bits = topk_idx.long(), topk_weights.contiguous().view(torch.int32)
    for r in range(W):
        ok = (ids >= r * L) & (ids < (r + 1) * L)
        m = is_token_in_rank[:, r]
        meta = torch.cat([torch.where(ok, ids - r * L, -1).to(torch.int32), torch.where(ok, bits, 0)], 1)[m]
        n = meta.shape[0]
        words[r, 0] = n
        words[r, 1:1 + n * 2 * K] = meta.reshape(-1)
    ranks = torch.arange(W, dtype=torch.int32, device=dev)
    slots = torch.full((T + W * P, W), -1, dtype=torch.int32, device=dev)
    slots[:T] = torch.where(is_token_in_rank, 2 * ranks, -1)
    for r in range(W):
        slots[T + r * P:T + (r + 1) * P, r] = 2 * r + 1
    return x_in, slots


def unpack_rows_torch(rows: torch.Tensor, token_rows: int, num_rows: int, topk: int, num_local_experts: int,
                      world_size: int, meta_rows: int, idx_dtype: torch.dtype = torch.int64):
    """The received rows of a meta-rows dispatch -> ``(recv_topk_idx [R, K] idx_dtype, recv_topk_weights [R, K]
    float32, hist [L + 1] int64)`` for ``R = num_rows``.

    ``rows``: the rows lane's received bf16 rows, contiguous: ``token_rows`` token rows (source rank, then token
    order), then every source's ``P = meta_rows`` meta rows (:func:`pack_rows_torch`'s groups for this rank, sources
    ascending). Token row i of source s (the ``i - start[s]``-th of its rows, ``start`` the prefix sum of the groups'
    counts) takes the ids and weights the sender wrote for it; an id outside ``[0, L)`` reads as -1 with weight 0;
    rows at or past ``token_rows`` get -1 and 0 and are not counted. ``hist[0]``: slots with -1, ``hist[1 + j]``:
    slots with local expert j. Twin of :func:`tritonep.compat.deep_ep.kernels.meta_rows.unpack_rows_kernel`."""
    K, L, W, P = topk, num_local_experts, world_size, meta_rows
    base = int(token_rows)
    words = rows[base:base + W * P].contiguous().view(torch.int32).reshape(W, -1)
    got = torch.full((num_rows, K), -1, dtype=torch.int32)
    wbits = torch.zeros(num_rows, K, dtype=torch.int32)
    i = 0
    for s in range(W):
        n = int(words[s, 0])
        take = max(0, min(n, min(base, num_rows) - i))
        blk = words[s, 1:1 + take * 2 * K].reshape(take, 2 * K).cpu()
        got[i:i + take], wbits[i:i + take] = blk[:, :K], blk[:, K:]
        i += n
    ok = (got >= 0) & (got < L)
    local = torch.where(ok, got, -1)
    w = torch.where(ok, wbits, 0).view(torch.float32)
    live = torch.arange(num_rows)[:, None] < base
    hist = torch.bincount((local + 1)[live.expand(-1, K)], minlength=L + 1)
    return local.to(idx_dtype).to(rows.device), w.to(rows.device), hist
