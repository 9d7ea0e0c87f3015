"""The sending side of the nccl backend's dispatch: the counts row before the exchange, the packed send rows after.

:class:`Router` holds what the static configuration decides (tile sizes, the send row layout, the per-chunk
scratch of the kernels) and runs either the Triton kernels of :mod:`tritonep.backends.nccl.kernels.route` or their torch
twins, which are the specification (same bits; the twins use ``torch.nonzero`` and are meant for the CPU):

* :func:`count_row_torch`: the rank's counts row ``[E + W + 2]`` int32: routes per expert (ids in ``[0, E)``),
  packets per destination rank (tokens with at least one route there), ids outside ``[-1, E)``, the refused flag.
* :func:`pack_send_torch`: every route's destination row (``send_base[e]`` + its rank among this rank's routes to
  ``e`` in (token, k) order; -1 for a masked slot), every route's packet slot (packets ordered by (destination rank,
  token): ``dest_start[d]`` + the rank of the token among this rank's tokens with a packet to ``d``) and the send
  rows: per packet the token's wire row and the int32 meta ``rows[t, :K] | topk_idx[t, :K] | weight bits [t, :K]``.

Send row layout (:class:`SendLayout`): the wire row's ``rb`` bytes at 0, the meta at byte ``mo`` (16-aligned),
``width`` bytes a row (16-aligned). Idea source: the triton backend's layout kernels (:mod:`tritonep.backends.triton.kernels.layout`:
chunk histograms, exclusive chunk prefixes, pairwise ranks inside a chunk), one ticketed launch instead of two.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels.route import route_count_kernel, route_pack_kernel
from .pack import cdiv, h_split, pow2, round_up, target_programs

__all__ = ["Router", "SendLayout", "count_row_torch", "pack_send_torch", "send_layout"]


class SendLayout(NamedTuple):
    """Byte layout of one send row: ``rb`` wire bytes at 0, int32 meta (3K words) at ``mo``, ``width`` a row."""

    rb: int
    mo: int
    width: int


def send_layout(row_bytes: int, topk: int, extra_meta_words: int | None = None) -> SendLayout:
    """The :class:`SendLayout` of rows of ``row_bytes`` wire bytes and ``3 * topk`` int32 meta words (or
    ``extra_meta_words``), both 16-byte aligned (vector loads and stores)."""
    mo = round_up(row_bytes, 16)
    words = 3 * topk if extra_meta_words is None else extra_meta_words
    return SendLayout(row_bytes, mo, round_up(mo + 4 * words, 16))


def count_row_torch(topk_idx: torch.Tensor, E: int, W: int, refused: bool) -> torch.Tensor:
    """Twin of :func:`tritonep.backends.nccl.kernels.route.route_count_kernel`'s row: int32 ``[E + W + 2]`` (module docstring).

    Args:
        topk_idx: ``[T, K]`` int32 / int64, any values; E experts; W ranks; refused: the int of the last column (the
            front door's flag, with the synced dispatch's count stamp above bit 0).
    """
    L = E // W
    ids = topk_idx.long()
    valid = (ids >= 0) & (ids < E)
    row = torch.zeros(E + W + 2, dtype=torch.int64, device=ids.device)
    row[:E] = torch.bincount(ids[valid], minlength=E)
    dest = torch.where(valid, torch.div(ids, L, rounding_mode="floor"), W)
    present = torch.zeros(ids.shape[0], W + 1, dtype=torch.bool, device=ids.device).scatter_(1, dest, True)
    row[E:E + W] = present[:, :W].sum(0)
    row[E + W] = ((ids < -1) | (ids >= E)).sum()
    row[E + W + 1] = int(refused)
    return row.to(torch.int32)


def pack_send_torch(src0: torch.Tensor, src1: torch.Tensor | None, topk_idx: torch.Tensor,
                    topk_weights: torch.Tensor, send_base: torch.Tensor, dest_start: torch.Tensor, E: int, W: int,
                    send: torch.Tensor, lay: SendLayout):
    """Twin of :func:`tritonep.backends.nccl.kernels.route.route_pack_kernel` (module docstring).

    Args:
        src0: ``[T, n0]`` the wire row (bf16 rows, or the quantized payload bytes); src1: ``[T, n1]`` uint8 scale
            bytes placed right after src0's bytes, or None.
        topk_idx: ``[T, K]`` ids in ``[-1, E)``; topk_weights: float32 ``[T, K]``.
        send_base: int32 ``[E]``; dest_start: int32 ``[W]`` (exclusive prefix of this rank's packets per rank).
        send: uint8 ``[>= Ns, lay.width]``, row ``dest_start[d] + i`` written for the i-th packet to rank d (bytes
            outside the wire row and meta, and rows of no packet, are left as they are).

    Returns:
        ``(rows int32 [T, K], pkt int32 [T, K])``.
    """
    T, K = topk_idx.shape
    L = E // W
    dev = topk_idx.device
    ids = topk_idx.long()
    valid = (ids >= 0) & (ids < E)  # ids outside [-1, E) only reach here in a refused sync-free call: no route
    key = torch.where(valid, ids, E).view(-1)
    ks, order = torch.sort(key, stable=True)
    cnt = torch.bincount(key, minlength=E + 1)
    within_sorted = torch.arange(T * K, device=dev) - (torch.cumsum(cnt, 0) - cnt)[ks]
    within = torch.empty_like(within_sorted).scatter_(0, order, within_sorted).view(T, K)
    rows = torch.where(valid, send_base.long()[ids.clamp(0, E - 1)] + within, -1).to(torch.int32)
    dest = torch.where(valid, torch.div(ids, L, rounding_mode="floor"), W)
    present = torch.zeros(T, W + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :W]
    pi = present.long()
    slot_tw = dest_start.long()[None, :] + torch.cumsum(pi, 0) - pi  # [T, W]
    pkt = torch.where(valid, slot_tw.gather(1, dest.clamp(max=W - 1)), -1).to(torch.int32)
    nz = torch.nonzero(present.t())  # the packets in (destination rank, token) order = slot order
    tok = nz[:, 1]
    pos = slot_tw[tok, nz[:, 0]]  # their slots: 0..Ns-1 (synced), or d * slots + i (sync-free)
    b0 = src0.view(torch.uint8)
    send[pos, :b0.shape[1]] = b0.index_select(0, tok)
    if src1 is not None:
        b1 = src1.view(torch.uint8)
        send[pos, b0.shape[1]:b0.shape[1] + b1.shape[1]] = b1.index_select(0, tok)
    meta = torch.cat([rows, topk_idx.to(torch.int32), topk_weights.view(torch.int32)], 1)
    send[pos, lay.mo:lay.mo + 12 * K] = meta.index_select(0, tok).view(torch.uint8)
    return rows, pkt


class Router:
    """The static part of the sending side (tiles, scratch, send layout) and its two per-call steps.

    Args:
        world_size W, num_experts E, topk K, max_tokens_per_rank, device; launch: the backend's
        :class:`tritonep.runtime.launch.Launch` (both kernels are bound here, once); lay: the dispatch wire's
        :class:`SendLayout`; src0 / src1: ``(element size, elements a row)`` of the wire row's sources (bf16:
        ``(2, H)``, None; quantized wires: ``(1, payload bytes)``, ``(1, scale bytes)``).

    Persistent tensors (one stream at a time, as every buffer of this library): ``row`` int32 ``[E + W + 2]`` (the
    counts row the exchange reads), the kernels' chunk scratch ``hist`` and ticket. Both steps use them within one
    dispatch only, so handles never share them.
    """

    def __init__(self, world_size: int, num_experts: int, topk: int, max_tokens_per_rank: int, device, launch,
                 lay: SendLayout, src0: tuple, src1: tuple | None):
        self.W, self.E, self.K = world_size, num_experts, topk
        self.L = num_experts // world_size
        self.lay = lay
        self.KB = pow2(topk)
        self.BT = max(1, 64 // self.KB)  # BT * KB = 64 routes: pairwise rank tiles of 64 x 64 (no register spills)
        self.C = num_experts + world_size + 1
        nc = max(1, cdiv(max_tokens_per_rank, self.BT))
        ncb = min(pow2(nc), 256)
        self.hist = torch.empty(nc, self.C, dtype=torch.int32, device=device)
        self.ticket = torch.zeros(1, dtype=torch.int32, device=device)
        self.row = torch.zeros(self.C + 1, dtype=torch.int32, device=device)
        self._count = launch.bind(route_count_kernel, dict(
            hist_ptr=self.hist, row_ptr=self.row, ticket_ptr=self.ticket, K=topk, KB=self.KB, E=num_experts,
            L=self.L, W=world_size, EB=pow2(num_experts), WB=pow2(world_size), BT=self.BT, NCB=ncb,
            CB=max(1, min(32, 8192 // ncb)), num_warps=4), ("idx_ptr", "T", "refused"))
        e0, n0 = src0
        e1, n1 = (1, 0) if src1 is None else src1
        bh = min(pow2(max(n0, n1, 1)), max(16, 1024 // self.BT))  # 1K-element tiles: no register spills
        self.target = target_programs(device)  # programs the pack launch aims at (h splits; tests may raise it)
        self._n0, self._bh = n0, bh
        self._pack = launch.bind(route_pack_kernel, dict(
            hist_ptr=self.hist, K=topk, KB=self.KB, E=num_experts, L=self.L, W=world_size, BT=self.BT, N0=n0,
            ROW0=lay.width // e0, N1=n1, ROW1=lay.width // e1, COL1=(n0 * e0) // e1, META=lay.mo // 4,
            ROW32=lay.width // 4, BH=bh, num_warps=8),
            ("idx_ptr", "w_ptr", "src0_ptr", "src1_ptr", "small_ptr", "rows_ptr", "pkt_ptr", "send_ptr",
             "idx_copy_ptr", "w_copy_ptr", "T", "HC"))

    def count(self, topk_idx: torch.Tensor, T: int, refused: bool, use_triton: bool) -> torch.Tensor:
        """Write this rank's counts row into ``self.row`` (no host read) and return it; T = 0 costs one fill.
        ``refused``: the int stored in the row's last column (the synced dispatch's front-door flag in bit 0 and its
        count stamp above it; the sync-free dispatch's flag alone)."""
        if T == 0:
            self.row.zero_()
            if refused:
                self.row[-1] = int(refused)
        elif use_triton:
            self._count((cdiv(T, self.BT),), topk_idx, T, int(refused))
        else:
            self.row.copy_(count_row_torch(topk_idx, self.E, self.W, refused))
        return self.row

    def pack(self, src0, src1, topk_idx, topk_weights, small, send, rows, pkt, T: int, use_triton: bool,
             idx_copy, w_copy):
        """Fill ``rows``/``pkt`` (int32 ``[T, K]``) and the send rows (uint8 ``[Ns, width]``) after the host plan,
        and copy the routing into ``idx_copy`` / ``w_copy`` (``[T, K]``, the dtypes of ``topk_idx`` /
        ``topk_weights``: the handle's own copy, written by the same launch instead of two clones).

        ``small`` int32 holds ``send_base [E]`` then ``dest_start [W]``; the kernel reads the chunk prefixes that
        :meth:`count` left in ``hist`` (same call, same T).
        """
        if use_triton:
            nc = cdiv(T, self.BT)
            hs, hc = h_split(nc, self._n0, self._bh, self.target)
            self._pack((nc, hs), topk_idx, topk_weights, src0, src0 if src1 is None else src1, small, rows, pkt, send,
                       idx_copy, w_copy, T, hc)
            return
        idx_copy.copy_(topk_idx)
        w_copy.copy_(topk_weights)
        E, W = self.E, self.W
        r, p = pack_send_torch(src0, src1, topk_idx, topk_weights, small[:E], small[E:E + W], E, W, send,
                               self.lay)
        rows.copy_(r)
        pkt.copy_(p)
