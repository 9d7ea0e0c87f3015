"""One local kernel of the DeepEP-compatible ``num_worst_tokens`` mode: outputs of a call refused for capacity are
filled with NaN, so they cannot pass for a result.

A ``num_worst_tokens`` dispatch runs sync-free (no host read): when some rank would receive more rows than
``num_worst_tokens``, EPBuffer refuses the call on every rank and returns the empty layout (no row received), and
only a later read raises the CapacityError (``Buffer.check()``, or the next synced dispatch). The rows lane's handle
still holds the exchanged counts (``[W, W]``: rows of every source rank to every receiving rank), so every rank can
compute that verdict on the device: refused when some column sum exceeds ``num_worst_tokens``, exactly EPBuffer's
capacity test for that lane (one pseudo-expert per rank, no alignment). :func:`poison` then writes all-ones bits
into the given tensors: NaN in bfloat16, float32, float8_e4m3fn, and in UE8M0 scale bytes. When the call was not
refused its programs read the counts and return (one launch, nothing written).

Twin: :func:`tritonep.compat.deep_ep.packing.poison_torch` (bit-exact).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ....errors import InputError
from .meta import _launch, _p2

__all__ = ["poison", "poison_kernel"]


@triton.jit
def poison_kernel(counts_ptr, cs0, cs1, limit, a_ptr, NA, b_ptr, NB, nprog, W: tl.constexpr, WB: tl.constexpr,
                  BLOCK: tl.constexpr):
    """``counts [W, W]`` int32 (strides ``cs0``, ``cs1``): when some column sums to more than ``limit``, every element
    of ``a [NA]`` and ``b [NB]`` (integer views) is set to -1 (all bits); else nothing is written. Any grid
    (``nprog`` programs, each a strided loop over blocks: correct at grid 1)."""
    r = tl.arange(0, WB)
    m = (r < W)[:, None] & (r < W)[None, :]
    c = tl.load(counts_ptr + r[:, None] * cs0 + r[None, :] * cs1, mask=m, other=0)
    over = tl.max(tl.sum(c, axis=0), axis=0) > limit
    if over:
        start = tl.program_id(0) * BLOCK
        for s in range(start, NA, nprog * BLOCK):
            o = tl.arange(0, BLOCK).to(tl.int64) + s
            tl.store(a_ptr + o, tl.full((BLOCK,), -1, a_ptr.dtype.element_ty), mask=o < NA)
        for s in range(start, NB, nprog * BLOCK):
            o = tl.arange(0, BLOCK).to(tl.int64) + s
            tl.store(b_ptr + o, tl.full((BLOCK,), -1, b_ptr.dtype.element_ty), mask=o < NB)


_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous: a reshape of anything else would copy, and the fill would be lost) as a flat integer view
    of its element size."""
    if not t.is_contiguous() or t.element_size() not in _INT:
        raise InputError(f"poison needs contiguous tensors of 1-, 2- or 4-byte elements, got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()}")
    return t.view(_INT[t.element_size()]).view(-1)


def poison(counts: torch.Tensor, limit: int, a: torch.Tensor, b: torch.Tensor | None = None) -> None:
    """Fill ``a`` (and ``b``) with NaN bits in place when some column of ``counts`` (int32 ``[W, W]``, device) sums to
    more than ``limit``; no host read. ``a`` / ``b``: contiguous tensors of 1-, 2- or 4-byte elements on
    ``counts``' device. Same bits as :func:`tritonep.compat.deep_ep.packing.poison_torch`.

    Raises:
        InputError: ``a`` or ``b`` not contiguous, or of another element size (before the launch)."""
    W = counts.shape[0]
    dev = a.device
    av = _bits(a)
    bv = _bits(b) if b is not None else av[:0]
    n = max(av.numel(), bv.numel())
    block = 1024 if dev.type == "cuda" else 4096
    grid = min(max(triton.cdiv(n, block), 1), 132) if dev.type == "cuda" else 1
    _launch(poison_kernel, (grid,), (counts, counts.stride(0), counts.stride(1), int(limit), av, av.numel(), bv,
                                     bv.numel(), grid),
            dict(W=W, WB=_p2(W), BLOCK=block, num_warps=4), dev)
