"""Local (no communication) reductions of the nccl backend's combine: host wrappers of the Triton kernels
(:mod:`tritonep.kernels.nccl_reduce`) and their torch twins.

Both functions compute fixed-order fp32 sums, so the Triton kernel (CUDA; also runs in the interpreter) and the torch
twin (CPU default) give the same bits, and the same bits as the triton backend's combine kernels
(:mod:`tritonep.kernels.combine`) and :func:`tritonep.reference.combine_reference_partial`:

* :func:`local_partials` (expert rank): per received packet p (one per (source rank, token)),
  ``part[p] = 0 + sum_{k ascending, rows[p, k] >= 0} fp32(w[p, k] * fp32(eo[rows[p, k]]))`` (each product rounded
  before the add: ``mul.rn`` on the GPU, never an FMA), stored as fp32 or rounded to bf16 (round-to-nearest-even).
* :func:`sum_partials` (source rank): ``y[t] = 0 + sum_{ranks r ascending, pos[r, t] >= 0} fp32(pp[pos[r, t]])``
  rounded to ``y``'s dtype.

Why a kernel: in eager torch the per-k loop costs about ten fp32 passes over ``[packets, H]`` per k; the kernel reads
each expert row once (2 bytes per element per route) and writes the partial once. ``index_add_`` cannot replace it:
on CUDA its float additions are atomics in no fixed order. The kernels are plain local loads and stores (no
signals), launched directly (not through the triton backend's Launcher): their grids depend on this rank's
data, which the host protocol rule (docs/protocols.md (host protocol rule)) allows for non-signalling work.
"""

from __future__ import annotations

import torch
import triton

from ...kernels.nccl_reduce import partials_kernel, sum_kernel

__all__ = ["local_partials", "sum_partials", "tiles", "gather_rows", "round_up"]

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def round_up(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return (n + m - 1) // m * m


def _word_size(t: torch.Tensor) -> int:
    """Widest integer word (8, 4, 2 or 1 bytes) that tiles every row of the 2-D unit-column-stride ``t`` exactly."""
    es = t.element_size()
    n, off, st = t.shape[1] * es, t.storage_offset() * es, t.stride(0) * es
    for w in (8, 4, 2):
        if n % w == 0 and off % w == 0 and st % w == 0:
            return w
    return 1


def _as_words(t: torch.Tensor, w: int) -> torch.Tensor:
    """The same bytes as ``[N, bytes per row / w]`` integer words (a view).

    An empty tensor may carry any strides (torch calls it contiguous with stride 0, e.g. the gradient of a sum on
    a rank with no tokens): it is re-made contiguous first, which costs nothing at 0 elements.
    """
    if t.numel() == 0 and t.dim() > 0 and t.stride(-1) != 1:
        t = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return t.view(torch.uint8).view(_WORD_DTYPES[w])


def gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src.index_select(0, idx)`` as a bit copy in the widest integer words the row widths allow.

    torch's index_select kernels move one element per thread step, so 8-byte words move 4x the bytes of bf16
    elements (8x those of uint8) per step; the bits are the same.

    Args:
        src: ``[N, C]`` any dtype, unit column stride (any row stride, e.g. a column slice of a receive buffer).
        idx: int64 (or int32) ``[M]`` row indices into ``src``.
        out: optional ``[M, C']`` destination with the same bytes per row (any dtype, unit column stride, e.g. a
            column slice of a send buffer); written in place.

    Returns:
        ``out``, or a new contiguous ``[M, C]`` tensor of ``src``'s dtype.
    """
    if out is None:
        w = _word_size(src)
        return torch.index_select(_as_words(src, w), 0, idx).view(torch.uint8).view(src.dtype)
    w = min(_word_size(src), _word_size(out))
    torch.index_select(_as_words(src, w), 0, idx, out=_as_words(out, w))
    return out


def tiles(hidden: int) -> tuple[int, int]:
    """``(BT, BH)``: rows and columns of one program's tile (BH a power of two <= 1024, BT * BH = 4096)."""
    bh = min(triton.next_power_of_2(hidden), 1024)
    return max(1, 4096 // bh), bh


def local_partials(eo: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, out: torch.Tensor, weighted: bool,
                   use_triton: bool) -> None:
    """Write every packet's partial sum into ``out`` (see the module docstring for the exact arithmetic).

    Args:
        eo: ``[R', H]`` bfloat16, contiguous (expert outputs; only rows named in ``rows`` are read).
        rows: int32 ``[N, K]`` contiguous: row of route k of packet p in ``eo``, -1 where the route is not here.
        w: float32 ``[N, K]`` contiguous: the route weights (0 where ``rows`` is -1); ignored if not ``weighted``.
        out: ``[N, H]`` float32 or bfloat16 with unit column stride (any row stride, e.g. a column slice of a send
            buffer): receives the partials (fp32 as is; bf16 rounded to nearest even).
        weighted: multiply each row by its weight (combine) or not (dispatch backward).
        use_triton: the Triton kernel (CUDA, or the interpreter) instead of the torch twin.
    """
    N, K = rows.shape
    H = eo.shape[1]
    if N == 0:
        return
    if use_triton:
        bt, bh = tiles(H)
        grid = (triton.cdiv(N, bt), triton.cdiv(H, bh))
        partials_kernel[grid](eo, rows, w, out, N, out.stride(0), K=K, H=H, BT=bt, BH=bh, WEIGHTED=weighted,
                               USE_ASM=eo.device.type == "cuda", num_warps=4)
        return
    acc = torch.zeros(N, H, dtype=torch.float32, device=eo.device)
    for k in range(K):
        sel = torch.nonzero(rows[:, k] >= 0).flatten()  # the torch twin runs on the CPU: no device sync
        if sel.numel():
            v = eo.index_select(0, rows[sel, k].long())
            acc.index_add_(0, sel, v * w[sel, k, None] if weighted else v.float())  # unique sel: one add each
    out.copy_(acc)


def sum_partials(pp: torch.Tensor, pos: torch.Tensor, send_tok: torch.Tensor, splits: list, y: torch.Tensor,
                 use_triton: bool) -> None:
    """``y[t] = 0 + sum over ranks r ascending of pp[pos[r, t]]`` in fp32, rounded to ``y``'s dtype.

    Args:
        pp: ``[Ns, H]`` bfloat16 or float32 partials (one per packet, ordered by (rank, token)), unit column stride.
        pos: int64 ``[W, T]`` contiguous: packet of (rank r, token t), -1 if t sent nothing to r (Triton path).
        send_tok: int64 ``[Ns]`` token of every packet; splits: packets per rank (host list) (torch path).
        y: ``[T, H]`` contiguous output (bfloat16).
        use_triton: the Triton kernel instead of the torch twin.
    """
    T, H = y.shape
    if T == 0:
        return
    if use_triton:
        bt, bh = tiles(H)
        grid = (triton.cdiv(T, bt), triton.cdiv(H, bh))
        sum_kernel[grid](pp, pos, y, T, pp.stride(0), W=pos.shape[0], H=H, BT=bt, BH=bh, num_warps=4)
        return
    acc = torch.zeros(T, H, dtype=torch.float32, device=y.device)
    start = 0
    for n in splits:  # ranks ascending; a token has at most one packet per rank (unique indices: one add each)
        if n:
            acc.index_add_(0, send_tok[start:start + n], pp[start:start + n].float())
        start += n
    y.copy_(acc)
