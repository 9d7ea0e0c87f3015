"""The receiving side of the nccl backend's dispatch and the row moves of its combine backward: host wrappers of
:mod:`tritonep.backends.nccl.kernels.unpack` and their torch twins (the specification; same bits, except the fp32 dot
products of :func:`grad_expand_torch`, which sum in another order: tolerance 1e-5 relative).

* :func:`unpack_torch`: per received packet p and route k here (``0 <= id < E``, ``id // L == rank``):
  ``out0[row] = src0[p]`` (and ``out1[row] = src1[p]``), ``out_w[row] = w``; the handle's per-packet routes
  ``rr[p, k]`` (row or -1) and ``rw[p, k]`` (weight or 0); padding rows (``expert_alignment`` > 1) hold zeros, or
  source row ``Nr`` (the encoding of a zero row) when the rows stay quantized, and weight 0.
* :func:`pack_rows_torch`: ``send[pkt[t, k]] = src[t]`` (the packets of a dispatch, for the combine backward).
* :func:`grad_expand_torch`: ``grad_expert_out[row] = bf16(fp32(w * grad_y[p]))`` and
  ``grad_w[row] = <grad_y[p], expert_out[row]>`` (fp32) for every route here.
"""

from __future__ import annotations

import torch

from .kernels.unpack import grad_expand_kernel, pack_rows_kernel, route_unpack_kernel
from .pack import cdiv, h_split, pow2, target_programs, typed_rows

__all__ = ["Unpacker", "unpack_torch", "pack_rows_torch", "grad_expand_torch"]


def _row_map(rr: torch.Tensor, R: int) -> torch.Tensor:
    """int64 ``[R]``: the packet of every row (-1 for rows no route names: padding)."""
    Nr, K = rr.shape
    dst = torch.where(rr >= 0, rr.long(), R).view(-1)
    pk = torch.arange(Nr, device=rr.device).repeat_interleave(K)
    return torch.full((R + 1,), -1, dtype=torch.int64, device=rr.device).scatter_(0, dst, pk)[:R]


def unpack_torch(meta: torch.Tensor, srcs: list, outs: list, out_w: torch.Tensor, rr: torch.Tensor,
                 rw: torch.Tensor, rank: int, E: int, L: int, zero_row: bool) -> None:
    """Twin of :func:`tritonep.backends.nccl.kernels.unpack.route_unpack_kernel` (module docstring), written in place.

    Args:
        meta: int32 ``[Nr, 3K]`` (rows | ids | weight bits of every received packet).
        srcs / outs: matching lists of ``[>= Nr, n]`` sources and ``[R, n]`` outputs of the same dtype.
        out_w: float32 ``[R]``; rr: int32 ``[Nr, K]``; rw: float32 ``[Nr, K]``.
        zero_row: padding rows copy source row ``Nr`` (else they are zeroed).
    """
    Nr, K = rr.shape
    R = out_w.shape[0]
    rows, ids, w = meta[:, :K], meta[:, K:2 * K], meta[:, 2 * K:].view(torch.float32)
    here = (ids >= 0) & (ids < E) & (torch.div(ids, L, rounding_mode="floor") == rank) & (rows < R)
    rr.copy_(torch.where(here, rows, -1))
    rw.copy_(torch.where(here, w, 0.0))
    src = _row_map(rr, R)
    pad = src < 0
    ww = torch.zeros(R + 1, dtype=torch.float32, device=rr.device)  # padding rows keep weight 0
    ww.scatter_(0, torch.where(rr >= 0, rr.long(), R).view(-1), rw.view(-1))
    out_w.copy_(ww[:R])
    for s, o in zip(srcs, outs):
        o.copy_(s.index_select(0, src.clamp(min=0)))  # bit copies (index_select / index_put)
        if pad.any():
            o[pad] = s[Nr] if zero_row else torch.zeros((), dtype=o.dtype, device=o.device)


def pack_rows_torch(src: torch.Tensor, pkt: torch.Tensor, send: torch.Tensor) -> None:
    """Twin of :func:`tritonep.backends.nccl.kernels.unpack.pack_rows_kernel`: ``send[pkt[t, k]] = src[t]`` in place."""
    T, K = pkt.shape
    flat = pkt.view(-1).long()
    tok = torch.arange(T, device=pkt.device).repeat_interleave(K)
    pos = torch.zeros(send.shape[0] + 1, dtype=torch.int64, device=pkt.device)
    pos.scatter_(0, torch.where(flat >= 0, flat, send.shape[0]), tok)  # every route of a packet names its token
    send.copy_(src.index_select(0, pos[:-1]))


def grad_expand_torch(gy: torch.Tensor, eo: torch.Tensor, rr: torch.Tensor, rw: torch.Tensor, geo: torch.Tensor,
                      gw: torch.Tensor) -> None:
    """Twin of :func:`tritonep.backends.nccl.kernels.unpack.grad_expand_kernel`; writes the rows named in ``rr`` only."""
    R = gw.shape[0]
    src = _row_map(rr, R)
    named = src >= 0
    w = torch.zeros(R + 1, dtype=torch.float32, device=rr.device)
    w.scatter_(0, torch.where(rr >= 0, rr.long(), R).view(-1), rw.view(-1))
    g = gy.index_select(0, src.clamp(min=0))
    rows = torch.nonzero(named).flatten()  # the twin runs on the CPU: no device sync
    geo[rows] = (g[rows] * w[rows, None]).to(geo.dtype)
    gw[rows] = (g[rows].float() * eo[rows].float()).sum(-1)


class Unpacker:
    """Static tiles and constants of the receiving side, and its three per-call steps (kernel or twin).

    Args:
        rank, num_experts E, local experts L, topk K, hidden H, expert_alignment A; launch: the backend's
        :class:`tritonep.runtime.launch.Launch` (the row-move and gradient kernels are bound here, the unpack once
        per source layout on first use); lay: the dispatch wire's send layout
        (:class:`tritonep.backends.nccl.route.SendLayout`); lay_offsets: where ``num_tokens_per_expert`` and
        ``expert_offsets`` sit in the per-call int32 plan vector; cuda: the device is a GPU (``mul.rn`` products);
        launch_device: the device whose SM count sizes the row-moving grids (None: one program column).
    """

    def __init__(self, rank: int, E: int, L: int, K: int, H: int, A: int, launch, lay, lay_offsets: tuple,
                 cuda: bool = False, launch_device=None):
        self.rank, self.E, self.L, self.K, self.H, self.A = rank, E, L, K, H, A
        self.cuda = cuda
        self.launch, self.lay = launch, lay
        self.KB = pow2(K)
        self.BP = max(1, 128 // self.KB)
        ntpe, offs = lay_offsets
        self._kw = dict(K=K, KB=self.KB, E=E, L=L, rank=rank, BP=self.BP, META=lay.mo // 4, ROW32=lay.width // 4,
                        NTPE=ntpe, OFFS=offs, BA=pow2(A), num_warps=8)
        self._bh = min(pow2(H), max(16, 1024 // self.BP))  # 1K-element tiles: no register spills
        self.target = target_programs(launch_device) if launch_device is not None else 1  # h splits (tests raise it)
        self._unpack: dict = {}  # source layout -> bound route_unpack_kernel
        self._bz = 1024  # tail weights zeroed per program (sync-free dispatch)
        self._rows_bt = max(1, 128 // self.KB)
        self._pack_rows = launch.bind(pack_rows_kernel, dict(
            K=K, KB=self.KB, N=H, BT=self._rows_bt, BH=self._bh, num_warps=4),
            ("src_ptr", "pkt_ptr", "send_ptr", "T", "HC"))
        self._expand_bp = 4  # few packets a program: a decode-sized call still spreads over the SMs (dots need rows)
        self._grad_expand = launch.bind(grad_expand_kernel, dict(
            K=K, KB=self.KB, H=H, BP=self._expand_bp, BH=min(pow2(H), 512), USE_ASM=cuda, num_warps=4),
            ("gy_ptr", "eo_ptr", "rr_ptr", "rw_ptr", "geo_ptr", "gw_ptr", "Nr"))

    def unpack(self, recv, srcs: list, outs: list, widths: tuple, out_w, rr, rw, small, Nr: int, zero_row: bool,
               use_triton: bool, slots: tuple = (0, 0, 0), R: int | None = None) -> None:
        """Run :func:`unpack_torch`'s spec on ``recv`` (uint8 ``[Nr (+1), width]``).

        ``srcs``: one or two ``(tensor, element offset of row 0, row stride)`` read as the matching output's
        dtype (the kernel path takes e.g. the receive buffer itself); ``outs``: ``[R, n]`` outputs with ``n`` in
        ``widths``. ``slots``: ``(S, o, R)`` with S > 0 for the sync-free dispatch's fixed slots (S per source rank):
        packet p is live only when ``p % S < small[o + p // S]`` (the packets its source sent); the others are
        dropped (routes -1, weights 0); R > 0: ``out_w`` has R rows and the kernel also zeroes the tail weights
        (every weight written: ``out_w`` may be uninitialised, as in the twin, which writes all of them). ``R``: the
        rows of ``outs`` / ``out_w`` (None: ``out_w``'s length); a route to a row at or past it is dropped (no write
        outside them).
        """
        if R is None:
            R = out_w.shape[0]
        if use_triton:
            (s0, c0, st0), o0 = srcs[0], outs[0]
            (s1, c1, st1), o1 = srcs[-1], outs[-1]
            n0, n1 = widths[0], (widths[1] if len(widths) > 1 else 0)
            pad = 0 if self.A == 1 else (2 if zero_row else 1)
            npad = self.L if pad else 0
            tiles = cdiv(Nr, self.BP) + npad + (cdiv(slots[2], self._bz) if slots[2] else 0)
            bh = min(self._bh, pow2(max(n0, n1)))
            hs, hc = h_split(tiles, n0, bh, self.target)
            key = (st0, c0, n0, st1, c1, n1, pad, slots)  # the source layout (wire, keep_quantized, padding, slots)
            bk = self._unpack.get(key)
            if bk is None:
                bk = self._unpack[key] = self.launch.bind(route_unpack_kernel, dict(
                    S0=st0, C0=c0, N0=n0, S1=st1, C1=c1, N1=n1, PAD=pad, BH=bh, SLOTS=slots[0], RCNT=slots[1],
                    NPAD=npad, MAXR=slots[2], BZ=self._bz, **self._kw),
                    ("recv_ptr", "src0_ptr", "src1_ptr", "out0_ptr", "out1_ptr", "out_w_ptr", "rr_ptr", "rw_ptr",
                     "lay_ptr", "Nr", "HC", "NR"))
            bk((tiles, hs), recv, s0, s1, o0, o1, out_w, rr, rw, small, Nr, hc, R)
            return
        lay, K = self.lay, self.K
        meta = recv[:Nr, lay.mo:lay.mo + 12 * K].view(torch.int32)
        if slots[0]:  # drop the slots their source left empty: ids -1
            S, o = slots[:2]
            p = torch.arange(Nr, device=meta.device)
            dead = (p % S) >= small[o:o + Nr // S].long().repeat_interleave(S)
            meta = meta.clone()
            meta[:, K:2 * K].masked_fill_(dead[:, None], -1)
        n = Nr + (1 if zero_row else 0)
        views = [typed_rows(s, c, st, n, w, o.dtype) for (s, c, st), o, w in zip(srcs, outs, widths)]
        unpack_torch(meta, views, outs, out_w, rr, rw, self.rank, self.E, self.L, zero_row)

    def pack_rows(self, src, pkt, send, T: int, use_triton: bool) -> None:
        """``send[pkt[t, k]] = src[t]`` (``src [T, H]`` / ``send [Ns, H]`` contiguous, same dtype)."""
        if use_triton:
            tiles = cdiv(T, self._rows_bt)
            hs, hc = h_split(tiles, self.H, self._bh, self.target)
            self._pack_rows((tiles, hs), src, pkt, send, T, hc)
            return
        pack_rows_torch(src, pkt, send)

    def grad_expand(self, gy, eo, rr, rw, geo, gw, Nr: int, use_triton: bool) -> None:
        """The combine backward's expert-side step (:func:`grad_expand_torch`)."""
        if use_triton:
            self._grad_expand((cdiv(Nr, self._expand_bp),), gy, eo, rr, rw, geo, gw, Nr)
            return
        grad_expand_torch(gy, eo, rr, rw, geo, gw)
