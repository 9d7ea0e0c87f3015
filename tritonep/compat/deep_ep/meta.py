"""The host side of the compat Buffer's local ops (:class:`MetaOps`): DeepEP's dispatch layout, the packing of a
dispatch's lane inputs and the unpacking of the meta lane's rows (:mod:`tritonep.compat.deep_ep.kernels.meta`), and
the packing and unpacking of a dispatch whose top-k travels as meta rows of the rows lane
(:mod:`tritonep.compat.deep_ep.kernels.meta_rows`), each ONE launch of its kernel, bound through the launch runtime (:class:`tritonep.runtime.launch.Launch`:
every launch bound once per variant, then called with its per-call values only; on the GPU the compiled variant's C
entry, on a CPU Triton's interpreter).

Their torch twins (the specification, bit-exact: integer work and moves only) are
:func:`tritonep.compat.deep_ep.packing.layout_torch`, :func:`tritonep.compat.deep_ep.packing.pack_torch`,
:func:`tritonep.compat.deep_ep.packing.unpack_meta`, :func:`tritonep.compat.deep_ep.packing.pack_rows_torch` and
:func:`tritonep.compat.deep_ep.packing.unpack_rows_torch`; the NaN fill of a ``num_worst_tokens`` call refused for capacity
(one launch of :mod:`tritonep.compat.deep_ep.kernels.poison`) has :func:`tritonep.compat.deep_ep.packing.poison_torch`. The kernels are local (no peer access, no signal): their launches
are not recorded by the protocol recorder and their grid follows this rank's data (docs/protocols.md, host protocol
rule).

State kept per variant: an int32 accumulator the kernels count into and leave zeroed (no call allocates or fills
zeros), and for the unpackings a pinned host tensor the kernels publish the received-expert histogram into with a
ticket (:class:`tritonep.runtime.host_status.HostStatus`: the host spins on a word of pinned memory, no
device-to-host copy, stream synchronize or event; the idea of DeepEP's host-mapped receive counters). The
accumulators are shared by the calls of one Buffer on one device: its calls run in stream order (on the caller's
current stream, as DeepEP's on its one communication stream), never two of them at once on two streams.
"""

from __future__ import annotations

import torch
import triton

from ... import envs
from ...errors import InputError
from ...runtime.host_status import HostStatus
from ...runtime.launch import Launch
from ...runtime.pool import remember
from .kernels.meta import layout_kernel, pack_kernel, unpack_meta_kernel
from .kernels.meta_rows import copy_rows_kernel, pack_rows_kernel, unpack_rows_kernel
from .kernels.poison import poison_kernel
from .packing import meta_width

__all__ = ["MetaOps"]


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in plain integers (``triton.cdiv`` is a constexpr function: ~1-2 us of host time a call)."""
    return -(-a // b)


def _p2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


_BYTE_DTYPES = (torch.int8, torch.uint8)
_KEPT = 4096  # (bound launch, grid) pairs kept per kind of launch (their keys follow the token count)


def _fillable(t: torch.Tensor) -> tuple:
    """``(t as the poison kernel takes it, its element size)`` (it writes integers of ``t``'s element size through
    its address): ``t`` itself, or an int8 view of a one-byte float (fp8: no dtype of the interpreter's).

    Raises:
        InputError: ``t`` not contiguous (the fill would miss its elements), or not of 1-, 2- or 4-byte elements."""
    n = t.element_size()
    if n not in (1, 2, 4) or not t.is_contiguous():
        raise InputError(f"poison needs contiguous tensors of 1-, 2- or 4-byte elements, got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()}")
    return (t.view(torch.int8) if n == 1 and t.dtype not in _BYTE_DTYPES else t), n


def _floor_p2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _r4(n: int) -> int:
    return (n + 3) // 4 * 4  # 16-byte aligned starts of the pack block's parts


class MetaOps:
    """The layout, packing, unpacking (meta lane and meta rows) and poison launches of one device (module
    docstring).

    Args:
        device: the device the tensors live on.
        launch: the launch path (:data:`tritonep.envs.LAUNCH_MODES`; the compat Buffer's, read once with its
            options); ignored on a CPU.
        rank: this rank (named in a read's timeout). timeout_s: the bound of the host's spin on a published
            histogram is ``2 * timeout_s + 5`` seconds (None: ``TRITONEP_TIMEOUT_S``).

    Attributes: ``host_reads``: the histograms read on the host so far (one per synced dispatch with top-k).

    Raises:
        ConfigError: kernels built for another device (:class:`tritonep.runtime.launch.Launch`).
    """

    def __init__(self, device, launch: str = "packed", rank: int = 0, timeout_s: float | None = None):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        # local kernels: nothing to record, no program cap (they wait for nobody)
        self._launch = Launch(self.device, record=False, max_programs=0, mode=launch)
        self.rank = rank
        self.timeout_s = envs.timeout_s() if timeout_s is None else float(timeout_s)
        self._acc: dict = {}   # key -> int32 accumulator (+ done counter), zeros, left zeroed by the kernels
        self._hosts: dict = {}  # L -> (pinned int64 [L + 2], HostStatus)
        self._tile: dict = {}  # variant key -> its token tile (the grid's unit)
        # a call's one lookup, per kind of launch:
        # (variant key, T) -> (bound launch, grid tuple) of the layout and packing launches (their grid follows T);
        # at most _KEPT kept, as the poisons' (then dropped and looked up again: a bound launch stays with Launch)
        self._launch_grids: dict = {}
        # variant key -> (bound launch, token tile) of the meta-rows unpacking (its grid: cdiv(rows, tile) per call)
        self._unpack_tiles: dict = {}
        # (W, elements and element size of both fills) -> (bound launch, grid) of the capacity poison
        self._poisons: dict = {}
        self._copies: dict = {}  # row width -> (bound launch, token tile) of the combine's row copy
        self.host_reads = 0

    def _zeros(self, key, n: int) -> torch.Tensor:
        a = self._acc.get(key)
        if a is None:
            a = self._acc[key] = torch.zeros(n, dtype=torch.int32, device=self.device)
        return a

    def layout(self, topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
        """``(num_tokens_per_rank int32 [W], num_tokens_per_expert int32 [E], is_token_in_rank bool [T, W])`` of
        ``topk_idx [T, K]`` (contiguous int32 / int64, on this device), by one launch of
        :func:`tritonep.compat.deep_ep.kernels.meta.layout_kernel` (one program per token tile); same values as
        :func:`tritonep.compat.deep_ep.packing.layout_torch` (an id outside ``[0, E)`` selects nothing). The two
        counts are views of one allocation."""
        T, K = topk_idx.shape
        W, E = num_ranks, num_experts
        in_rank = torch.empty(T, W, dtype=torch.bool, device=self.device)
        counts = torch.empty(W + E, dtype=torch.int32, device=self.device)
        got = self._launch_grids.get(("layout", K, E, W, T))
        if got is None:
            got = remember(self._launch_grids, ("layout", K, E, W, T), self._layout_launch(K, E, W, T), _KEPT)
        got[0](got[1], topk_idx, T, in_rank, counts)
        per_rank, per_expert = counts.split_with_sizes((W, E))  # Tensor.split's Python wrapper: ~3 us more
        return per_rank, per_expert, in_rank

    def _layout_launch(self, K: int, E: int, W: int, T: int):
        """``(bound launch, grid)`` of a layout of ``T`` tokens of top-k ``K`` over ``E`` experts and ``W`` ranks (the
        variant bound on first use)."""
        key = ("layout", K, E, W)
        bk = self._launch.bound(key)
        if bk is None:
            KB, WB = _p2(K), _p2(W)
            bt = _floor_p2(max(1, min(64 if self._cuda else 256, 8192 // (KB * WB))))
            acc = self._zeros(key, W + E + 1)
            bk = self._launch.variant(key, lambda: self._launch.bind(layout_kernel, dict(
                acc_ptr=acc, K=K, KB=KB, E=E, L=E // W, W=W, WB=WB, BT=bt, NB=min(1024, _p2(W + E)),
                num_warps=4), ("ids_ptr", "T", "in_rank_ptr", "counts_ptr")))
            self._tile[key] = bt
        return bk, (max(1, _cdiv(T, self._tile[key])),)

    def pack(self, is_token_in_rank: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """``(slots [T, W] int32, meta_rows [T, meta_width(K)] bf16, meta_slots [T, W*K] int32, meta_weights
        [T, W*K] float32)`` of one dispatch (``is_token_in_rank [T, W]`` bool, ``topk_idx [T, K]`` int32/int64,
        ``topk_weights [T, K]`` float32, on this device; made contiguous here), by one launch of
        :func:`tritonep.compat.deep_ep.kernels.meta.pack_kernel`: four contiguous views of one int32 allocation
        (each part starts 16-byte aligned). Same bits as :func:`tritonep.compat.deep_ep.packing.pack_torch`."""
        T, W = is_token_in_rank.shape
        K = topk_idx.shape[1]
        MW2, WK = meta_width(K) // 2, W * K
        o_meta = _r4(T * W)
        o_slots = o_meta + _r4(T * MW2)
        o_w = o_slots + _r4(T * WK)
        blk = torch.empty(o_w + T * WK, dtype=torch.int32, device=is_token_in_rank.device)
        out = (blk.as_strided((T, W), (W, 1), 0), blk.as_strided((T, MW2), (MW2, 1), o_meta).view(torch.bfloat16),
               blk.as_strided((T, WK), (WK, 1), o_slots), blk.view(torch.float32).as_strided((T, WK), (WK, 1), o_w))
        if T:
            key = ("pack", K, W)
            bk = self._launch.bound(key)
            if bk is None:
                KB, WB, WKB = _p2(K), _p2(W), _p2(WK)
                bt = _floor_p2(max(1, min(64 if self._cuda else 256, 8192 // max(WKB, _p2(MW2)))))
                bk = self._launch.variant(key, lambda: self._launch.bind(pack_kernel, dict(
                    K=K, KB=KB, W=W, WB=WB, MW2=MW2, MB=_p2(MW2), WKB=WKB, BT=bt, num_warps=4),
                    ("in_rank_ptr", "ids_ptr", "w_ptr", "T", "out_ptr", "o_meta", "o_slots", "o_w")))
                self._tile[key] = bt
            c = torch.Tensor.is_contiguous
            itr = is_token_in_rank if c(is_token_in_rank) else is_token_in_rank.contiguous()
            bk((_cdiv(T, self._tile[key]),), itr, topk_idx if c(topk_idx) else topk_idx.contiguous(),
               topk_weights if c(topk_weights) else topk_weights.contiguous(), T, blk, o_meta, o_slots, o_w)
        return out

    def _host_of(self, L: int):
        h = self._hosts.get(L)
        if h is None:
            mapped = torch.zeros(L + 2, dtype=torch.int64, pin_memory=self._cuda)
            h = self._hosts[L] = (mapped, HostStatus(mapped, L + 1, self.rank, self.timeout_s))
        return h

    def unpack_meta(self, rows: torch.Tensor, weights: torch.Tensor, num_tokens: int, topk: int, rank: int,
                    num_local_experts: int, idx_dtype: torch.dtype, live: torch.Tensor | None = None,
                    read: bool = True):
        """The meta lane's received rows -> ``(recv_topk_idx [R, K] idx_dtype, recv_topk_weights [R, K] float32,
        hist)`` for its first ``R = num_tokens`` tokens (``rows``: bf16 ``[>= R*K, meta_width(K)]``, contiguous;
        ``weights``: float32 ``[>= R*K]``), by one launch of :func:`tritonep.compat.deep_ep.kernels.meta.
        unpack_meta_kernel` (``cdiv(R, BR)`` programs; none for R = 0). ``hist``: with ``read``, the histogram as a
        list of ``L + 1`` ints (``[0]``: slots with -1, ``[1 + j]``: slots with local expert j), read on the host
        through pinned memory (one spin, :attr:`host_reads` + 1; none for R = 0); else None (no host read: graph
        capture). ``live``: a device int32 scalar, the tokens actually received (rows past it read as not received:
        ids -1, weight 0, not counted). Same values as :func:`tritonep.compat.deep_ep.packing.unpack_meta`.

        Raises:
            PeerTimeoutError: the histogram was not published within ``2 * timeout_s + 5`` s (the launch never ran).
        """
        K, L = topk, num_local_experts
        has_live = live is not None
        key = ("unpack_meta", K, L, has_live)  # rows of meta_width(K): their width is K's
        bk = self._launch.bound(key)
        if bk is None:
            bk = self._unpacker(key, L, lambda acc, mapped, br: self._launch.bind(unpack_meta_kernel, dict(
                acc_ptr=acc, host_ptr=mapped, RS=meta_width(K) // 2, K=K, KB=_p2(K), L=L, BR=br,
                NB=min(1024, _p2(L + 1)), LIVE=has_live, GPU=self._cuda, num_warps=4),
                ("rows_ptr", "w_ptr", "R", "live_ptr", "lo", "idx_ptr", "wout_ptr", "ticket")))
        return self._unpack(bk, key, num_tokens, K, L, idx_dtype, rows.device, read,
                            (rows, weights, num_tokens, live if has_live else self._acc[("unpack_meta", L)], rank * L))

    def _unpacker(self, key, L: int, bind):
        """Bind an unpacking variant (``bind(acc, mapped, tile)``; its accumulator, shared by both unpackings: calls
        run in stream order, and pinned histogram of L) and note its tile."""
        mapped, _ = self._host_of(L)
        acc = self._zeros(("unpack_meta", L), L + 2)
        br = 128 if self._cuda else 64
        self._tile[key] = br
        return self._launch.variant(key, lambda: bind(acc, mapped, br))

    def _unpack(self, bk, key, R: int, K: int, L: int, idx_dtype, dev, read: bool, args: tuple):
        """One unpacking launch ``bk(grid, *args, idx, wout, ticket)`` over R rows (none for R = 0) into new
        ``idx [R, K]`` (idx_dtype) and ``wout [R, K]`` float32, and the histogram read through pinned memory
        (:meth:`unpack_meta`)."""
        idx = torch.empty(R, K, dtype=idx_dtype, device=dev)
        wout = torch.empty(R, K, dtype=torch.float32, device=dev)
        if not R:
            return idx, wout, [0] * (L + 1) if read else None
        host = self._hosts[L][1]
        ticket = host.next_ticket() if read else 0
        bk((_cdiv(R, self._tile[key]),), *args, idx, wout, ticket)
        if not read:
            return idx, wout, None
        self.host_reads += 1
        return idx, wout, host.read(ticket)

    def pack_rows(self, x: torch.Tensor, is_token_in_rank: torch.Tensor, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor, x_in: torch.Tensor, num_experts: int, meta_rows: int) -> torch.Tensor:
        """A meta-rows dispatch's rows-lane input: ``x [T, H]`` bf16 (H even) copied into ``x_in`` (bf16 ``[>= T +
        W*P, H]``, ``P = meta_rows``; written in place: rows ``[0, T + W*P)``), then per destination rank its P meta
        rows (:mod:`tritonep.compat.deep_ep.kernels.meta_rows`); returns the lane's slots ``[T + W*P, W]`` int32 (a
        new tensor). ``is_token_in_rank [T, W]`` bool, ``topk_idx [T, K]`` int32/int64, ``topk_weights [T, K]``
        float32, all on this device (made contiguous here). One launch of
        :func:`tritonep.compat.deep_ep.kernels.meta_rows.pack_rows_kernel`; same bits as
        :func:`tritonep.compat.deep_ep.packing.pack_rows_torch`."""
        T, W = is_token_in_rank.shape
        K, H = topk_idx.shape[1], x.shape[1]
        slots = torch.empty(T + W * meta_rows, W, dtype=torch.int32, device=self.device)
        got = self._launch_grids.get(("pack_rows", K, W, num_experts, H, meta_rows, T))
        if got is None:
            got = remember(self._launch_grids, ("pack_rows", K, W, num_experts, H, meta_rows, T),
                           self._pack_rows_launch(K, W, num_experts, H, meta_rows, T), _KEPT)
        c = torch.Tensor.is_contiguous
        got[0](got[1], x if c(x) else x.contiguous(),
               is_token_in_rank if c(is_token_in_rank) else is_token_in_rank.contiguous(),
               topk_idx if c(topk_idx) else topk_idx.contiguous(),
               topk_weights if c(topk_weights) else topk_weights.contiguous(), T, x_in, slots)
        return slots

    def _pack_rows_launch(self, K: int, W: int, num_experts: int, H: int, meta_rows: int, T: int):
        """``(bound launch, grid)`` of a meta-rows packing of ``T`` tokens (the variant of top-k ``K``, ``W`` ranks,
        ``num_experts``, row width ``H`` and ``meta_rows`` bound on first use)."""
        key = ("pack_rows", K, W, num_experts, H, meta_rows)
        bk = self._launch.bound(key)
        if bk is None:
            bt = 4 if self._cuda else 64
            bk = self._launch.variant(key, lambda: self._launch.bind(pack_rows_kernel, dict(
                H=H, BH=min(1024, _p2(H)), W=W, WB=_p2(W), K=K, KB=_p2(K), L=num_experts // W, P=meta_rows,
                HW=H // 2, BT=bt, CH=128, ZB=512, QB=_p2(W * meta_rows), num_warps=4),
                ("x_ptr", "in_rank_ptr", "ids_ptr", "w_ptr", "T", "xin_ptr", "slots_ptr")))
            self._tile[key] = bt
        return bk, (max(1, _cdiv(T, self._tile[key])),)

    def unpack_rows(self, rows: torch.Tensor, offsets: torch.Tensor, num_rows: int, topk: int,
                    num_local_experts: int, world_size: int, meta_rows: int, idx_dtype: torch.dtype,
                    read: bool = True):
        """A meta-rows dispatch's received rows (the rows lane's ``x``: bf16 ``[>= offsets[0] + W*P, H]``, token rows
        first, then every source's ``P = meta_rows`` meta rows; ``offsets``: the lane's int32 ``expert_offsets``, on
        the device) -> ``(recv_topk_idx [R, K] idx_dtype, recv_topk_weights [R, K] float32, hist)`` for
        ``R = num_rows`` rows (rows at or past ``offsets[0]``: ids -1, weight 0, not counted). ``hist`` as
        :meth:`unpack_meta` (a list of ``L + 1`` ints read through pinned memory with ``read``, else None). One launch
        of :func:`tritonep.compat.deep_ep.kernels.meta_rows.unpack_rows_kernel` (none for R = 0); same values as
        :func:`tritonep.compat.deep_ep.packing.unpack_rows_torch`.

        Raises:
            PeerTimeoutError: the histogram was not published within ``2 * timeout_s + 5`` s (the launch never ran).
        """
        K, L, HW = topk, num_local_experts, rows.shape[1] // 2
        key = ("unpack_rows", K, L, world_size, meta_rows, HW)
        if not read:  # the common case with the count routing: no histogram to read, one lookup
            got = self._unpack_tiles.get(key)  # (bound launch, token tile)
            if got is not None:
                idx = torch.empty(num_rows, K, dtype=idx_dtype, device=self.device)
                wout = torch.empty(num_rows, K, dtype=torch.float32, device=self.device)
                if num_rows:
                    got[0]((-(-num_rows // got[1]),), rows, offsets, num_rows, idx, wout, 0)
                return idx, wout, None
        bk = self._launch.bound(key)
        if bk is None:
            bk = self._unpacker(key, L, lambda acc, mapped, br: self._launch.bind(unpack_rows_kernel, dict(
                acc_ptr=acc, host_ptr=mapped, W=world_size, WB=_p2(world_size), K=K, KB=_p2(K), L=L, P=meta_rows,
                HW=HW, BR=br, NB=min(1024, _p2(L + 1)), GPU=self._cuda, num_warps=4),
                ("rows_ptr", "offs_ptr", "R", "idx_ptr", "wout_ptr", "ticket")))
        self._unpack_tiles[key] = (bk, self._tile[key])
        return self._unpack(bk, key, num_rows, K, L, idx_dtype, rows.device, read, (rows, offsets, num_rows))

    def poison(self, counts, limit: int, a: torch.Tensor, b: torch.Tensor | None = None,
               shape: tuple | None = None) -> None:
        """Fill ``a`` (and ``b``) with NaN bits in place when some column of ``counts`` (int32 ``[W, W]``, this
        device) sums to more than ``limit``; no host read. ``a`` / ``b``: contiguous tensors of 1-, 2- or 4-byte
        elements on this device (no view made of them but for fp8's int8). ``shape``: ``(W, stride0, stride1)`` of
        ``counts`` when it is given as an address (a :class:`tritonep.runtime.field_view.FieldView`:
        :meth:`tritonep.compat.deep_ep.handles.NormalHandle.poison_counts`); None: read from the tensor. One launch
        of :func:`tritonep.compat.deep_ep.kernels.poison.poison_kernel`
        (``min(cdiv(n, BLOCK), 132)`` programs on a GPU, 1 on a CPU); same bits as
        :func:`tritonep.compat.deep_ep.packing.poison_torch`.

        Raises:
            InputError: ``a`` or ``b`` not contiguous, or of another element size (before the launch)."""
        W, cs0, cs1 = (counts.shape[0], counts.stride(0), counts.stride(1)) if shape is None else shape
        av, ab = _fillable(a)
        bv, bb = _fillable(b) if b is not None else (av, ab)
        na, nb = av.numel(), (bv.numel() if b is not None else 0)
        got = self._poisons.get((W, na, ab, nb, bb))
        if got is None:
            got = self._poison_launch(W, na, ab, nb, bb)
        got[0]((got[1],), counts, cs0, cs1, int(limit), av, na, bv, nb, got[1])

    def _poison_launch(self, W: int, na: int, ab: int, nb: int, bb: int) -> tuple:
        """``(bound launch, grid)`` of a poison over ``W`` ranks of ``na`` / ``nb`` elements of ``ab`` / ``bb``
        bytes (the variant bound on first use; kept per those values, at most :data:`_KEPT`, then looked up
        again)."""
        n = max(na, nb)
        block = 1024 if self._cuda else 4096
        grid = min(max(_cdiv(n, block), 1), 132) if self._cuda else 1
        key = ("poison", W, block, ab, bb)
        bk = self._launch.bound(key)
        if bk is None:
            bk = self._launch.variant(key, lambda: self._launch.bind(poison_kernel, dict(
                W=W, WB=_p2(W), BLOCK=block, AB=ab, BB=bb, num_warps=4),
                ("counts_ptr", "cs0", "cs1", "limit", "a_ptr", "NA", "b_ptr", "NB", "nprog")))
        return remember(self._poisons, (W, na, ab, nb, bb), (bk, grid), _KEPT)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``dst[:n] = src`` bit for bit: ``src [n, H]`` bf16, ``dst [>= n, H]`` bf16, both contiguous on this device
        (a meta-rows combine's rows into the rows lane's expert-output buffer). One launch of
        :func:`tritonep.compat.deep_ep.kernels.meta_rows.copy_rows_kernel` (none for n = 0); twin:
        ``dst[:n].copy_(src)``. The caller checks the shapes (the compat's combine: the handle's rows)."""
        n, H = src.shape
        if not n:
            return
        got = self._copies.get(H)  # (bound launch, token tile)
        if got is None:
            key = ("copy_rows", H)
            bk = self._launch.bound(key)
            if bk is None:
                bt = 2 if self._cuda else 64
                bk = self._launch.variant(key, lambda: self._launch.bind(copy_rows_kernel, dict(
                    H=H, BT=bt, BH=min(1024, _p2(H)), num_warps=4), ("src_ptr", "dst_ptr", "N")))
                self._tile[key] = bt
            got = self._copies[H] = (bk, self._tile[key])
        got[0]((-(-n // got[1]),), src, dst, n)
