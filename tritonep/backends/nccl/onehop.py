"""One-hop sync-free dispatch of the nccl backend: 2 launches + ONE even ``all_to_all_single``, no host read.

Protocol (identical on every rank whatever its data; nothing on the host depends on the data):

1. Send launch (:func:`tritonep.backends.nccl.kernels.onehop.onehop_send_kernel`, twin :func:`onehop_send_torch`) into the
   persistent uint8 send buffer ``[W * (1 + Tcap), width]`` (``Tcap = max_tokens_per_rank``): block d (to rank d)
   = slot 0 the HEADER (int32 ``[E + W + 2]``: this rank's counts row, exactly
   :func:`tritonep.backends.nccl.route.count_row_torch`: routes per expert, packets per destination, ids outside
   ``[-1, E)``, the refused flag; the same row in every block), slots ``1..Tcap`` the packets to d in token order
   (wire row, then int32 meta ``lr[t, :K] | topk_idx[t, :K] | weight bits[t, :K]``; ``lr`` = rank of the route
   among THIS rank's routes to its expert in (t, k) order, -1 masked). Also ``pkt [T, K]`` int32 (absolute send
   slot of each route, -1 masked) and the handle's routing copies. Packets are written for every valid id even when
   the header says bad input (the receivers ignore that call).
2. ``all_to_all_single(recv, send)`` with even splits (``1 + Tcap`` rows per peer; no split lists).
3. Receive launch (:func:`tritonep.backends.nccl.kernels.onehop.onehop_recv_kernel`, twin :func:`onehop_recv_torch`): from
   the W headers every rank derives the SAME verdict (status code 0 ok; ``STATUS_BAD_INPUT``: some source has bad
   ids or was refused -- wins over capacity; ``STATUS_CAPACITY``: some rank's aligned total rows exceed
   ``max_recv_tokens``) and this rank's layout (:func:`tritonep.backends.layout.layout_torch`: rows of a local expert
   ordered by (source rank, token, k), segments aligned to A). Valid packets (index in block < the source's
   packets to this rank) go to ``row = seg_start[j] + routes of earlier sources to e + lr``.

Outputs (:class:`OneHopOut`, DeepEP's ``num_worst_tokens`` convention): ``out [max_recv_tokens, H]`` (real rows
``[0, offs[-1])``, padding rows zero, tail rows unspecified), ``out_w`` float32 ``[max_recv_tokens]`` (0 on
padding and tail rows), ``ntpe`` / ``offs`` int32 ``[L]``, ``status`` int64 ``[4]`` = ``[code, bad-rank mask (bit
s = source s had bad ids or was refused), rows the worst rank needs, that rank]``, ``pkt`` int32 ``[T, K]``,
``rr`` int32 / ``rw`` float32 ``[W * (1 + Tcap), K]`` (row / weight of each received route, -1 / 0 on header,
empty and foreign slots: the combine's per-packet routes), ``idx_c`` / ``w_c`` (routing copies), ``counts`` int32
``[W, E]`` (every source's routes per expert, from the headers, whatever the verdict). On a refused
verdict no row is written: ``out_w`` all 0, ``ntpe`` / ``offs`` 0, ``rr`` -1.

Combine: :meth:`tritonep.backends.nccl.combine.NcclCombine.combine` works unchanged with a handle whose splits are the
even ``(1 + Tcap,) * W`` and ``num_send = num_recv = W * (1 + Tcap)`` (tested bit-equal to the synced combine).

Wired into the nccl backend as its sync-free ``onehop`` mode (:mod:`tritonep.backends.nccl.sync_free`,
``TRITONEP_NCCL_SYNC_FREE``): there the receive launch also writes the handle's ``counts`` snapshot (int32
``[W, E]`` from the headers) and merges its verdict into the backend's status word (``status_word=``, the kernel's
``MERGE``), and every output but the rows and the ids' copy is a field of ONE per-call int32 block at a static
offset (:attr:`OneHopDispatch.fields`, :meth:`OneHopDispatch.outputs` / :meth:`OneHopDispatch.views`; the launches get
the block's address once: :class:`tritonep.runtime.bound.BoundKernel` ``fields``), pooled by the backend; the
``all_to_all`` is bound once to the process group's backend (:class:`tritonep.backends.nccl.collectives.BoundCollective`):
2 launches (3 and 2 per-call values), 1 collective; the backend adds two shape reads and the aliases of the pooled
rows and row weights.

Costs per call of :meth:`OneHopDispatch.__call__`: 2 launches (the receive launch's grid is static, the send launch's
follows T: a host int, cached per T), 1 collective, 0 host reads, 0 host syncs, no data-dependent host value;
allocations: the 11 returned tensors (the nccl backend's sync-free mode takes them from its output pool instead:
:mod:`tritonep.backends.nccl.sync_free`; the send / recv buffers are persistent and reused in stream order: the synchronous
collective orders the next call's send launch after this call's transfer). Bytes moved: ``W * (1 + Tcap) * width`` per
rank whatever T (fixed blocks: the price of no counts exchange). The send kernel's prefix scans are redundant per tile
(quadratic in T: fine at decode sizes, T <= a few hundred; at T = 4096 the gather mode's route kernels). Only the bf16
wire is supported by :class:`OneHopDispatch` (the send kernel and its twin also take quantized payload + scale bytes;
the receive side would need the kept-quantized padding encoding or a dequantization step). Status: tested in the
interpreter and in gloo worlds (``tests/backends/nccl/test_onehop.py``); both kernels compile for sm_90 offline without
spills (the ``compile``-marked tests); on one H200 (128 tokens of DeepSeek-V3, world 1) the GPU tests of both
sync-free modes pass and the launches take 14.5 us (send) and 11.0 us (receive).

Idea sources: DeepEP's low-latency mode (fixed per-expert receive slots, counts carried with the data, the
``num_worst_tokens`` output convention), pplx-kernels' dispatch; our code.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...errors import CapacityError, ConfigError, WireError
from .kernels.onehop import onehop_recv_kernel, onehop_send_kernel
from ...runtime.status import STATUS_BAD_INPUT, STATUS_CAPACITY, STATUS_OK
from ...runtime.bound import STORE
from .collectives import BoundCollective
from ...runtime.launch import Launch
from .pack import cdiv, h_split, pow2, round_up, target_programs, typed_rows
from .route import SendLayout, count_row_torch, send_layout

__all__ = ["OneHopDispatch", "OneHopOut", "onehop_layout", "onehop_send_torch", "onehop_recv_torch"]


_VIEW_NAMES = {"status_ptr": "status", "out_w_ptr": "out_w", "rw_ptr": "rw", "rr_ptr": "rr", "ntpe_ptr": "ntpe",
               "offs_ptr": "offs", "counts_ptr": "counts", "w_copy_ptr": "w_c", "pkt_ptr": "pkt"}


class OneHopOut(NamedTuple):
    """What :meth:`OneHopDispatch.__call__` returns (module docstring)."""

    out: torch.Tensor
    out_w: torch.Tensor
    ntpe: torch.Tensor
    offs: torch.Tensor
    status: torch.Tensor
    pkt: torch.Tensor
    rr: torch.Tensor
    rw: torch.Tensor
    idx_c: torch.Tensor
    w_c: torch.Tensor
    counts: torch.Tensor


def onehop_layout(row_bytes: int, K: int, E: int, W: int) -> SendLayout:
    """The dispatch wire's :func:`send_layout`, widened (16-byte multiple) so a row holds the int32 header
    ``[E + W + 2]``."""
    lay = send_layout(row_bytes, K)
    return lay._replace(width=max(lay.width, round_up(4 * (E + W + 2), 16)))


def _within(ids: torch.Tensor, valid: torch.Tensor, E: int) -> torch.Tensor:
    """int64 ``[T, K]``: rank of route (t, k) among the valid routes to the same expert in (t, k) order."""
    T, K = ids.shape
    key = torch.where(valid, ids, E).view(-1)
    ks, order = torch.sort(key, stable=True)
    cnt = torch.bincount(key, minlength=E + 1)
    ws = torch.arange(T * K, device=ids.device) - (torch.cumsum(cnt, 0) - cnt)[ks]
    return torch.empty_like(ws).scatter_(0, order, ws).view(T, K)


def onehop_send_torch(src0: torch.Tensor, src1, topk_idx: torch.Tensor, topk_weights: torch.Tensor, refused: bool,
                      E: int, W: int, Tcap: int, send: torch.Tensor, lay: SendLayout) -> torch.Tensor:
    """Twin of :func:`tritonep.backends.nccl.kernels.onehop.onehop_send_kernel` (module docstring); returns ``pkt``.

    Args:
        src0: ``[T, n0]`` contiguous wire row (bf16 rows or quantized payload bytes); src1: ``[T, n1]`` scale bytes
            right after src0's bytes, or None. topk_idx: int32 / int64 ``[T, K]`` (any values);
            topk_weights: float32 ``[T, K]``; refused: the front door's flag (header column ``E + W + 1``).
        send: uint8 ``[W * (1 + Tcap), lay.width]``: headers and packets written, other bytes left as they are.
    """
    T, K = topk_idx.shape
    L, blk = E // W, 1 + Tcap
    dev = topk_idx.device
    s32 = send.view(torch.int32)
    s32[0::blk, :E + W + 2] = count_row_torch(topk_idx, E, W, refused)
    ids = topk_idx.long()
    valid = (ids >= 0) & (ids < E)
    lr = torch.where(valid, _within(ids, valid, E), -1).to(torch.int32)
    dest = torch.where(valid, torch.div(ids, L, rounding_mode="floor"), W)
    present = torch.zeros(T, W + 1, dtype=torch.bool, device=dev).scatter_(1, dest, True)[:, :W]
    pi = present.long()
    slot_tw = torch.arange(W, device=dev)[None, :] * blk + 1 + torch.cumsum(pi, 0) - pi  # [T, W]
    pkt = torch.where(valid, slot_tw.gather(1, dest.clamp(max=W - 1)), -1).to(torch.int32)
    nz = torch.nonzero(present)  # the twin runs on the CPU: no device sync
    tok, slots = nz[:, 0], slot_tw[nz[:, 0], nz[:, 1]]
    b0 = src0.view(torch.uint8)
    send[slots, :b0.shape[1]] = b0.index_select(0, tok)
    if src1 is not None:
        b1 = src1.view(torch.uint8)
        send[slots, b0.shape[1]:b0.shape[1] + b1.shape[1]] = b1.index_select(0, tok)
    meta = torch.cat([lr, topk_idx.to(torch.int32), topk_weights.view(torch.int32)], 1)
    send[slots, lay.mo:lay.mo + 12 * K] = meta.index_select(0, tok).view(torch.uint8)
    return pkt


def onehop_recv_torch(recv: torch.Tensor, out: torch.Tensor, out_w, rr, rw, ntpe, offs, status, rank: int, E: int,
                      W: int, Tcap: int, A: int, maxr: int, lay: SendLayout, stride: int, counts=None,
                      st=None) -> None:
    """Twin of :func:`tritonep.backends.nccl.kernels.onehop.onehop_recv_kernel`, written in place.

    Args:
        recv: uint8 ``[W * (1 + Tcap), lay.width]`` (block s from rank s); its wire rows are read as ``out``'s
            dtype, ``stride`` elements a row, ``out.shape[1]`` elements copied.
        out: ``[maxr, n0]`` (real and padding rows written); out_w: float32 ``[maxr]``; rr / rw: int32 / float32
            ``[W * (1 + Tcap), K]``; ntpe / offs: int32 ``[L]``; status: int64 ``[4]``.
        counts: int32 ``[W, E]`` or None: every source's routes per expert (the headers), written whatever the
            verdict. st: int32 ``[4 + 2W]`` or None: the nccl backend's status word, the verdict merged into it as
            :func:`tritonep.backends.nccl.plan.device_plan_torch` does (the kernel's ``MERGE``).
    """
    L, blk, C = E // W, 1 + Tcap, E + W + 2
    K = rr.shape[1]
    r32 = recv.view(torch.int32)
    hdr = r32[0::blk, :C].long()
    cnt_all = hdr[:, :E]
    badv = (hdr[:, E + W] != 0) | (hdr[:, E + W + 1] != 0)
    mask = sum(1 << s for s in range(W) if bool(badv[s]))
    total = cnt_all.sum(0).view(W, L)
    aligned = (total + A - 1) // A * A
    need = aligned.sum(1)
    worst, worst_rank = int(need.max()), int(torch.argmax(need))
    code = STATUS_BAD_INPUT if mask else (STATUS_CAPACITY if worst > maxr else STATUS_OK)
    status.copy_(torch.tensor([code, mask, worst, worst_rank], dtype=torch.int64))
    if counts is not None:
        counts.copy_(cnt_all)
    if st is not None:  # merged as the gather mode's plan merges (first unread refusal kept, flags gathered)
        err = code != STATUS_OK
        if err and int(st[0]) == 0:
            st[0], st[1], st[3] = code, worst_rank, worst
        st[2] += int(err)
        st[4:4 + W] = torch.maximum(st[4:4 + W], (hdr[:, E + W] != 0).to(torch.int32))
        st[4 + W:] = torch.maximum(st[4 + W:], (hdr[:, E + W + 1] != 0).to(torch.int32))
    rr.fill_(-1)
    rw.zero_()
    out_w.zero_()
    if code != STATUS_OK:
        ntpe.zero_()
        offs.zero_()
        return
    cnt, al = total[rank], aligned[rank]
    ends = torch.cumsum(al, 0)
    starts = ends - al
    ntpe.copy_(cnt)
    offs.copy_(ends)
    p = torch.arange(W * blk, device=recv.device)
    s, i = p // blk, p % blk
    live = (i >= 1) & (i - 1 < hdr[s, E + rank])
    meta = r32[:, lay.mo // 4:lay.mo // 4 + 3 * K]
    lr, ids, w = meta[:, :K].long(), meta[:, K:2 * K].long(), meta[:, 2 * K:].view(torch.float32)
    here = live[:, None] & (ids >= 0) & (ids < E) & (torch.div(ids, L, rounding_mode="floor") == rank)
    j = torch.where(here, ids - rank * L, 0)
    mine = cnt_all[:, rank * L:(rank + 1) * L]
    pre = torch.cumsum(mine, 0) - mine  # [W, L]: routes of earlier sources to local expert j
    row = starts[j] + pre[s[:, None].expand_as(j), j] + lr
    here &= (lr >= 0) & (row < maxr)
    rr.copy_(torch.where(here, row, -1))
    rw.copy_(torch.where(here, w, 0.0))
    pp, kk = torch.nonzero(here, as_tuple=True)
    rows = row[pp, kk]
    out_w[rows] = w[pp, kk]
    wire = typed_rows(recv, 0, stride, W * blk, out.shape[1], out.dtype)
    out[rows] = wire[pp]
    for jj in range(L):  # padding rows
        out[int(starts[jj] + cnt[jj]):int(ends[jj])] = 0


class OneHopDispatch:
    """The one-hop dispatch of one rank (module docstring): static shapes, bound kernels, persistent buffers.

    Args: cfg, the buffer's :class:`tritonep.ep.config.EPConfig`, read whole (W, E, K, H, ``max_tokens_per_rank``
    Tcap, ``expert_alignment`` A, ``max_recv_tokens``, dtype (bfloat16), the dispatch wire ("bf16"), the launch
    path); keywords: group (``torch.distributed`` group), rank, device, use_triton (default: CUDA device; False
    runs the torch twins, e.g. on gloo / CPU), target (programs
    a launch aims at by splitting rows into column ranges, :func:`tritonep.backends.nccl.pack.h_split`; default two per
    SM on a GPU, 1 elsewhere; tests raise it to exercise the split), status_word (the nccl backend's int32 status
    word ``[4 + 2W]``: the receive launch merges each call's verdict into it, :mod:`tritonep.backends.nccl.sync_free`;
    None: only the per-call ``status``).

    Raises:
        ConfigError: W > 63 (the status mask), or a non-bfloat16 dtype.
        WireError: a quantized wire (not supported here yet).
    """

    def __init__(self, cfg, *, group, rank: int, device="cpu", use_triton: bool | None = None,
                 target: int | None = None, status_word: torch.Tensor | None = None):
        W, E, K, H, dtype = cfg.world_size, cfg.num_experts, cfg.topk, cfg.hidden, cfg.dtype
        if W > 63:
            raise ConfigError(f"one-hop dispatch: world_size={W} > 63 is not supported (its status mask)")
        if dtype != torch.bfloat16:
            raise ConfigError(f"one-hop dispatch: dtype must be torch.bfloat16, got {dtype}")
        if cfg.dispatch_wire != "bf16":
            raise WireError(f"one-hop dispatch: wire {cfg.dispatch_wire!r} is not supported yet (bf16 only)")
        self.group, self.rank, self.W, self.E, self.K, self.H = group, rank, W, E, K, H
        self.L, self.Tcap = cfg.num_local_experts, cfg.max_tokens_per_rank
        self.A, self.maxr = cfg.expert_alignment, cfg.max_recv_tokens
        self.device = dev = torch.device(device)
        self.dtype = dtype
        self.use_triton = dev.type == "cuda" if use_triton is None else use_triton
        self.es = es = torch.empty(0, dtype=dtype).element_size()
        self.lay = lay = onehop_layout(H * es, K, E, W)
        self.nslot = W * (1 + self.Tcap)
        self.send = torch.zeros(self.nslot, lay.width, dtype=torch.uint8, device=dev)
        self.recv = torch.zeros(self.nslot, lay.width, dtype=torch.uint8, device=dev)
        self._launch = launch = Launch(dev, record=False, max_programs=0, mode=cfg.launch)  # local: signal nobody
        # the per-call outputs besides the rows: fields of ONE int32 block (:meth:`outputs`) at static offsets, so
        # a launch passes the block's address once (BoundKernel ``fields``); the token-sized fields get Tcap rows
        MR, NK, TK, L = self.maxr, self.nslot * K, self.Tcap * K, self.L
        f32, i32 = torch.float32, torch.int32
        # the row weights first: at storage offset 0, as a fresh tensor (the ``tritonep::dispatch`` op's fake says
        # so); the int64 status word last, at an even offset (8-byte aligned)
        sizes = (("out_w_ptr", MR, f32), ("rw_ptr", NK, f32), ("rr_ptr", NK, i32), ("ntpe_ptr", L, i32),
                 ("offs_ptr", L, i32), ("counts_ptr", W * E, i32), ("w_copy_ptr", TK, f32), ("pkt_ptr", TK, i32),
                 ("status_ptr", 8, torch.int64))
        self.fields, at = {}, 0
        for name, n, dt in sizes:
            at += at & 1 if dt is torch.int64 else 0
            self.fields[name] = (at, n, dt)
            at += n
        self.block_numel = at
        self.target = target_programs(dev) if target is None else target
        KB = pow2(K)
        # send tiles of 8 routes (one token at top-8), 4 warps, scan steps of 128 routes: every program column redoes
        # its tile's index work (pairwise compares against the tokens before it), so small tiles win
        # (benchmarks/probes/onehop_send_probe.py, 128 tokens of DeepSeek-V3 on the H200: tiles of 16 / 8 / 4 / 2 / 1
        # tokens 73.9 / 32.6-41 / 22 / 17.4 / 14.5 us); no spill for sm_90 (ptxas; 4-token tiles with 4 warps
        # or larger scan steps spilled 8-12 bytes)
        self.BT = max(1, 8 // KB)
        self._send_bh = min(pow2(H), max(16, 1024 // self.BT))
        self._send_k = launch.bind(onehop_send_kernel, dict(
            send_ptr=self.send, K=K, KB=KB, E=E, L=self.L, W=W, EB=pow2(E), WB=pow2(W), BT=self.BT, TCAP=self.Tcap,
            N0=H, ROW0=lay.width // es, N1=0, ROW1=lay.width, COL1=0, META=lay.mo // 4, ROW32=lay.width // 4,
            BH=self._send_bh, HT=max(self.BT, 128 // KB), ST=max(self.BT, 128 // KB), src1_ptr=self.send,
            num_warps=4), ("idx_ptr", "w_ptr", "src0_ptr", STORE, "idx_copy_ptr", "T", "refused", "HC"),
            fields={n: self.fields[n] for n in ("w_copy_ptr", "pkt_ptr")})
        # packet / row tiles: a route's segment start is a ``tl.gather`` from the layout vector (no [BP, KB, LB]
        # one-hot: packet tiles need not shrink with L); a row tile's segment search holds [BZ, LB] (2048 elements)
        # when there are padding rows (A > 1), else it only zeroes tail weights (1024 rows a program)
        LBp = pow2(self.L)
        bp, bz = max(1, 128 // KB), (max(1, min(64, 2048 // LBp)) if self.A > 1 else 1024)
        rbh = min(pow2(H), max(16, 1024 // bp))
        merge = status_word is not None
        st = status_word if merge else torch.zeros(1, dtype=torch.int32, device=dev)  # (not read without MERGE)
        tiles = cdiv(self.nslot, bp) + cdiv(self.maxr, bz)
        hs, self._recv_hc = h_split(tiles, H, rbh, self.target)
        self._recv_grid = (tiles, hs)  # static: the recv launch's grid never depends on the data
        self._recv_k = launch.bind(onehop_recv_kernel, dict(
            recv_ptr=self.recv, st_ptr=st, MERGE=merge, K=K, KB=KB, E=E, L=self.L, W=W, rank=rank, EB=pow2(E),
            LB=pow2(self.L), WB=pow2(W),
            TCAP=self.Tcap, A=self.A, MAXR=self.maxr, BP=bp, BZ=bz, N0=H, S0=lay.width // es, META=lay.mo // 4,
            ROW32=lay.width // 4, BH=rbh, CODE_CAP=STATUS_CAPACITY, CODE_BAD=STATUS_BAD_INPUT, HC=self._recv_hc,
            num_warps=4), ("out_ptr", STORE),
            fields={n: self.fields[n] for n in ("out_w_ptr", "rr_ptr", "rw_ptr", "ntpe_ptr", "offs_ptr", "status_ptr",
                                                "counts_ptr")})
        self._st = status_word
        self._a2a = BoundCollective(self.recv, self.send, group)
        self._send_grids: dict = {}  # T -> ((grid), column split) of the send launch

    @property
    def splits(self) -> tuple:
        """The even split sizes of both directions: ``(1 + Tcap,) * W`` (for a combine handle)."""
        return (1 + self.Tcap,) * self.W

    def outputs(self, T: int, idt: torch.dtype) -> tuple:
        """A call's outputs besides the rows, for ``T`` tokens and ``topk_idx`` dtype ``idt``: ``(blk, idx_c)`` --
        ``blk`` the int32 block of every other field (:attr:`fields`: name -> ``(start, numel, dtype)`` in int32
        elements; the kernels get its address once), ``idx_c`` ``[T, K]`` of ``idt`` (the routing ids' copy)."""
        return (torch.empty(self.block_numel, dtype=torch.int32, device=self.device),
                torch.empty(T, self.K, dtype=idt, device=self.device))

    def views(self, blk: torch.Tensor, T: int) -> dict:
        """The fields of ``blk`` (:meth:`outputs`) as tensors of :class:`OneHopOut`'s shapes: ``out_w``, ``rw`` /
        ``rr`` ``[W * (1 + Tcap), K]``, ``ntpe``, ``offs``, ``counts`` ``[W, E]``, ``w_c`` / ``pkt`` ``[T, K]``,
        ``status`` int64 ``[4]``."""
        shape = {"rw_ptr": (self.nslot, self.K), "rr_ptr": (self.nslot, self.K), "counts_ptr": (self.W, self.E),
                 "w_copy_ptr": (T, self.K), "pkt_ptr": (T, self.K)}
        out = {}
        for name, (at, n, dt) in self.fields.items():
            v = blk[at:at + n]
            if dt is not torch.int32:
                v = v.view(dt)
            if name in ("w_copy_ptr", "pkt_ptr"):
                v = v[:T * self.K]
            out[_VIEW_NAMES[name]] = v.view(shape[name]) if name in shape else v
        return out

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 refused: bool = False) -> OneHopOut:
        """Dispatch ``x [T, H]`` bfloat16 by ``topk_idx [T, K]`` int32 / int64 and ``topk_weights [T, K]``
        float32 (all contiguous, on the device, past the front door's shape / dtype checks: nothing is re-checked
        here; ``refused``: the front door refused this rank's input and passes ``T = 0``). Returns
        :class:`OneHopOut` (module docstring; fresh tensors, the small ones views of one block); read ``status``
        (when the caller chooses) for the verdict.

        Raises:
            CapacityError: ``T > max_tokens_per_rank`` (a shape, known on the host; raised before any collective,
                so only for a caller that lets shapes differ between ranks -- the front door refuses it first).
        """
        T = x.shape[0]
        if T > self.Tcap:
            raise CapacityError(f"one-hop dispatch: T={T} tokens > max_tokens_per_rank={self.Tcap}", needed=T,
                                available=self.Tcap)
        blk, idx_c = self.outputs(T, topk_idx.dtype)
        out = torch.empty(self.maxr, self.H, dtype=self.dtype, device=self.device)
        self.run(x, topk_idx, topk_weights, refused, out, blk, idx_c, self.use_triton, T)
        return OneHopOut(out=out, idx_c=idx_c, **self.views(blk, T))

    def run(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, refused: bool,
            out: torch.Tensor, blk: torch.Tensor, idx_c: torch.Tensor, ut: bool, T: int) -> None:
        """The call's two launches and its collective into the caller's rows ``out`` ``[max_recv_tokens, H]``,
        block ``blk`` and ids' copy ``idx_c`` (:meth:`outputs`: any such tensors, e.g. pooled ones); ``ut``:
        Triton kernels, else the twins. ``T = x.shape[0] <= max_tokens_per_rank`` is the caller's to ensure."""
        if ut:
            g = self._send_grids.get(T)
            if g is None:  # the send launch's grid and column split of T tokens (host ints, made once per T)
                nc = max(1, cdiv(T, self.BT))
                hs, hc = h_split(nc, self.H, self._send_bh, self.target)
                g = self._send_grids[T] = ((nc, hs), hc)
            self._send_k(g[0], topk_idx, topk_weights, x, blk, idx_c, T, int(refused), g[1])
            self._a2a()
            self._recv_k(self._recv_grid, out, blk)
            return
        o = self.views(blk, T)
        idx_c.copy_(topk_idx)
        o["w_c"].copy_(topk_weights)
        o["pkt"].copy_(onehop_send_torch(x, None, topk_idx, topk_weights, refused, self.E, self.W, self.Tcap,
                                         self.send, self.lay))
        self._a2a()
        onehop_recv_torch(self.recv, out, o["out_w"], o["rr"], o["rw"], o["ntpe"], o["offs"], o["status"], self.rank,
                          self.E, self.W, self.Tcap, self.A, self.maxr, self.lay, self.lay.width // self.es,
                          o["counts"], self._st)