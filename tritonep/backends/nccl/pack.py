"""Local (no communication) reductions of the nccl backend's combine: host wrappers of the Triton kernels
(:mod:`tritonep.backends.nccl.kernels.reduce`) and their torch twins; the small host arithmetic of the backend's
grids and tiles.

Both functions compute fixed-order fp32 sums, so the Triton kernel (CUDA; also runs in the interpreter) and the torch
twin (CPU default) give the same bits, and the same bits as the triton backend's combine kernels
(:mod:`tritonep.backends.triton.kernels.combine`) and :func:`tritonep.reference.combine_reference_partial`:

* :func:`local_partials` (expert rank): per received packet p (one per (source rank, token)),
  ``part[p] = 0 + sum_{k ascending, rows[p, k] >= 0} fp32(w[p, k] * fp32(eo[rows[p, k]]))`` (each product rounded
  before the add: ``mul.rn`` on the GPU, never an FMA), stored as fp32 or rounded to bf16 (round-to-nearest-even);
  optionally also the per-route scalars ``gw[rows[p, k]]`` (the dispatch backward's weight gradients).
* :func:`sum_partials` (source rank): ``y[t] = 0 + sum over the packets of t in ascending order (= destination
  ranks ascending) of fp32(pp[packet])`` rounded to ``y``'s dtype; the packets of t are the distinct values of
  ``pkt[t, :]`` (-1: masked slot); optionally also ``gtw[t, k] = gb[pkt[t, k], k]``.

Why a kernel: in eager torch the per-k loop costs about ten fp32 passes over ``[packets, H]`` per k; the kernel reads
each expert row once (2 bytes per element per route) and writes the partial once. ``index_add_`` cannot replace it:
on CUDA its float additions are atomics in no fixed order. The kernels are plain local loads and stores (no
signals), bound through the backend's :class:`tritonep.runtime.launch.Launch` (``record=False``: not recorded by the
protocol recorder): their grids depend on this rank's data, which the host protocol rule (docs/protocols.md (host
protocol rule)) allows for non-signalling work.
"""

from __future__ import annotations

import functools

import torch

from .kernels.reduce import partials_kernel, sum_kernel

__all__ = ["local_partials", "sum_partials", "tiles", "round_up", "typed_rows", "h_split", "target_programs",
           "cdiv", "pow2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of non-negative ints in plain Python (``triton.cdiv`` is a JIT function: microseconds a call
    on the per-call path)."""
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1), in plain Python."""
    return 1 << max(n - 1, 0).bit_length()


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return (n + m - 1) // m * m


def target_programs(device) -> int:
    """Programs a row-moving launch should reach: two per SM on a GPU, 1 elsewhere (the interpreter: fewest)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def h_split(tiles: int, n: int, bh: int, target: int) -> tuple[int, int]:
    """``(splits, elements per split)``: rows of ``n`` elements cut in BH-multiples so that ``tiles * splits``
    reaches about ``target`` programs (a decode-sized call would otherwise leave most SMs idle); 1 split when
    ``tiles >= target``."""
    most = cdiv(n, bh)
    hs = max(1, min(most, cdiv(target, max(tiles, 1))))
    hc = cdiv(most, hs) * bh
    return cdiv(n, hc), hc


@functools.lru_cache(maxsize=None)
def tiles(hidden: int) -> tuple[int, int]:
    """``(BT, BH)``: rows and columns of one program's tile (BH a power of two <= 1024, BT * BH = 4096)."""
    bh = min(pow2(hidden), 1024)
    return max(1, 4096 // bh), bh


def typed_rows(s: torch.Tensor, c: int, st: int, n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n, width]`` view of ``dtype`` into the contiguous ``s`` whose row p starts at element ``c + p * st`` (the
    raw-buffer addressing of the kernels, for the twins)."""
    flat = s.view(-1)
    if s.dtype != dtype:
        flat = flat.view(torch.uint8).view(dtype)
    flat = flat[c:]
    return flat.as_strided((n, width), (st, 1), flat.storage_offset())


def local_partials(launch, eo: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, send: torch.Tensor, lay,
                   out_dtype: torch.dtype, weighted: bool, use_triton: bool, N: int, H: int, K: int, use_asm: bool,
                   gw: torch.Tensor | None = None) -> None:
    """Write every packet's partial sum into its send row (see the module docstring for the exact arithmetic).

    Args:
        launch: the backend's :class:`tritonep.runtime.launch.Launch`.
        eo: ``[R', H]`` bfloat16, contiguous (expert outputs; only rows named in ``rows`` are read).
        rows: int32 ``[N, K]`` contiguous: row of route k of packet p in ``eo``, -1 where the route is not here.
        w: float32 ``[N, K]`` contiguous: the route weights (0 where ``rows`` is -1); ignored if not ``weighted``.
        send: uint8 ``[N, lay.width]`` contiguous (:class:`tritonep.backends.nccl.route.SendLayout` ``lay``): row p gets
            the partial as ``out_dtype`` (float32 as is, bfloat16 rounded to nearest even) in its first bytes and,
            with ``gw``, ``gw[rows[p, k]]`` (float32, 0 where ``rows`` is -1) at byte ``lay.mo + 4k``.
        weighted: multiply each row by its weight (combine) or not (dispatch backward).
        use_triton: the Triton kernel (CUDA, or the interpreter) instead of the torch twin.
        N / H / K: packets, hidden, topk (the caller knows them: no tensor attribute is read on the fixed path);
            use_asm: ``mul.rn`` products (CUDA).
        gw: float32 ``[R]`` per-row scalars (the dispatch backward's weight gradients), or None.
    """
    if N == 0:
        return
    es = 2 if out_dtype == torch.bfloat16 else 4
    if use_triton:
        bt, bh = tiles(H)
        g = gw is not None
        bk = launch.variant(
            ("partials", H, K, es, lay.width, lay.mo, weighted, g, use_asm),
            lambda: launch.bind(partials_kernel, dict(
                K=K, KB=pow2(K), H=H, BT=bt, BH=bh, OUT_BF16=es == 2, OSTRIDE=lay.width // es, WEIGHTED=weighted,
                GW=g, GCOL=lay.mo // 4, GSTRIDE=lay.width // 4, USE_ASM=use_asm, num_warps=4),
                ("eo_ptr", "rows_ptr", "w_ptr", "out_ptr", "gw_ptr", "N")))
        bk((cdiv(N, bt), cdiv(H, bh)), eo, rows, w, send, gw if g else w, N)
        return
    acc = torch.zeros(N, H, dtype=torch.float32, device=eo.device)
    for k in range(K):
        sel = torch.nonzero(rows[:, k] >= 0).flatten()  # the torch twin runs on the CPU: no device sync
        if sel.numel():
            v = eo.index_select(0, rows[sel, k].long())
            acc.index_add_(0, sel, v * w[sel, k, None] if weighted else v.float())  # unique sel: one add each
    typed_rows(send, 0, lay.width // es, N, H, out_dtype).copy_(acc)
    if gw is not None:
        g = torch.where(rows >= 0, gw[rows.clamp(min=0).long()], 0.0) if gw.shape[0] else 0.0
        typed_rows(send, lay.mo // 4, lay.width // 4, N, K, torch.float32).copy_(g)


def sum_partials(launch, pp: torch.Tensor, pp_dtype: torch.dtype, pstride: int, pkt: torch.Tensor, y: torch.Tensor,
                 use_triton: bool, T: int, H: int, K: int, Ns: int, lay=None,
                 gtw: torch.Tensor | None = None) -> None:
    """``y[t] = 0 + sum over the packets of token t (ascending) of pp[packet]`` in fp32, rounded to ``y``'s dtype.

    Args:
        launch: the backend's :class:`tritonep.runtime.launch.Launch`.
        pp: contiguous buffer whose row p (``pstride`` elements of ``pp_dtype`` apart) starts with the partial of
            packet p (bfloat16 or float32): e.g. the uint8 receive rows themselves.
        pkt: int32 ``[T, K]`` contiguous: the packet that carried route (t, k), -1 for a masked slot (the routes of
            one token to one rank share their packet).
        y: ``[T, H]`` contiguous output (bfloat16).
        use_triton: the Triton kernel instead of the torch twin. T / H / K / Ns: tokens, hidden, topk, packets.
        lay / gtw: with ``gtw`` (float32 ``[T, K]`` contiguous), ``gtw[t, k]`` = the float32 at byte
            ``lay.mo + 4k`` of ``pp``'s row ``pkt[t, k]`` (0 where ``pkt`` is -1; ``lay.width`` bytes a row).
    """
    if T == 0:
        return
    if use_triton:
        bt, bh = tiles(H)
        g = gtw is not None
        bk = launch.variant(
            ("sum", H, K, pp_dtype, pstride, g, lay.width if g else 0, lay.mo if g else 0),
            lambda: launch.bind(sum_kernel, dict(
                K=K, KB=pow2(K), H=H, BT=bt, BH=bh, PP_BF16=pp_dtype == torch.bfloat16, PSTRIDE=pstride, GTW=g,
                GCOL=lay.mo // 4 if g else 0, GSTRIDE=lay.width // 4 if g else 0, num_warps=4),
                ("pp_ptr", "pkt_ptr", "y_ptr", "gb_ptr", "gtw_ptr", "T")))
        bk((cdiv(T, bt), cdiv(H, bh)), pp, pkt, y, pp, gtw if g else y, T)
        return
    if Ns == 0:  # nothing was sent: every slot is masked
        y.zero_()
        if gtw is not None:
            gtw.zero_()
        return
    part = typed_rows(pp, 0, pstride, Ns, H, pp_dtype)
    srt = torch.sort(pkt.long(), dim=1).values
    take = srt >= 0
    take[:, 1:] &= srt[:, 1:] != srt[:, :-1]  # each packet once
    acc = torch.zeros(T, H, dtype=torch.float32, device=y.device)
    for i in range(K):  # packets ascending; a skipped slot adds +0.0, which leaves an fp32 sum started at +0 as is
        acc += torch.where(take[:, i, None], part[srt[:, i].clamp(min=0)].float(), 0.0)
    y.copy_(acc)
    if gtw is not None:
        gb = typed_rows(pp, lay.mo // 4, lay.width // 4, Ns, K, torch.float32)
        gtw.copy_(torch.where(pkt >= 0, gb[pkt.clamp(min=0).long(), torch.arange(K, device=y.device)], 0.0))
