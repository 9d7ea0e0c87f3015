"""One local kernel of the DeepEP-compatible ``num_worst_tokens`` mode: outputs of a call refused for capacity are
filled with NaN, so they cannot pass for a result (its host side, bound once through the launch runtime:
:meth:`tritonep.compat.deep_ep.meta.MetaOps.poison`).

A ``num_worst_tokens`` dispatch runs sync-free (no host read): when some rank would receive more rows than
``num_worst_tokens``, EPBuffer refuses the call on every rank and returns the empty layout (no row received), and
only a later read raises the CapacityError (``Buffer.check()``, or the next synced dispatch). The rows lane's handle
still holds the exchanged counts (``[W, W]``: rows of every source rank to every receiving rank), so every rank can
compute that verdict on the device: refused when some column sum exceeds ``num_worst_tokens``, exactly EPBuffer's
capacity test for that lane (one pseudo-expert per rank, no alignment). :func:`poison_kernel` then writes all-ones
bits into the given tensors: NaN in bfloat16, float32, float8_e4m3fn, and in UE8M0 scale bytes. When the call was
not refused its programs read the counts and return (one launch, nothing written).

Twin: :func:`tritonep.compat.deep_ep.packing.poison_torch` (bit-exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["poison_kernel"]


@triton.jit
def _ints(p, NBYTES: tl.constexpr):
    """``p`` as a pointer to integers of ``NBYTES`` bytes (1, 2 or 4)."""
    if NBYTES == 1:
        return p.to(tl.pointer_type(tl.int8))
    elif NBYTES == 2:
        return p.to(tl.pointer_type(tl.int16))
    else:
        return p.to(tl.pointer_type(tl.int32))


@triton.jit
def poison_kernel(counts_ptr, cs0, cs1, limit, a_ptr, NA, b_ptr, NB, nprog, W: tl.constexpr, WB: tl.constexpr,
                  BLOCK: tl.constexpr, AB: tl.constexpr, BB: tl.constexpr):
    """``counts [W, W]`` int32 (strides ``cs0``, ``cs1``): when some column sums to more than ``limit``, every element
    of ``a [NA]`` and ``b [NB]`` (contiguous, elements of ``AB`` / ``BB`` bytes, written as integers) is set to -1
    (all bits); else nothing is written. Any grid (``nprog`` programs, each a strided loop over blocks: correct at
    grid 1)."""
    r = tl.arange(0, WB)
    m = (r < W)[:, None] & (r < W)[None, :]
    c = tl.load(counts_ptr + r[:, None] * cs0 + r[None, :] * cs1, mask=m, other=0)
    over = tl.max(tl.sum(c, axis=0), axis=0) > limit
    if over:
        pa = _ints(a_ptr, AB)
        pb = _ints(b_ptr, BB)
        start = tl.program_id(0) * BLOCK
        for s in range(start, NA, nprog * BLOCK):
            o = tl.arange(0, BLOCK).to(tl.int64) + s
            tl.store(pa + o, tl.full((BLOCK,), -1, pa.dtype.element_ty), mask=o < NA)
        for s in range(start, NB, nprog * BLOCK):
            o = tl.arange(0, BLOCK).to(tl.int64) + s
            tl.store(pb + o, tl.full((BLOCK,), -1, pb.dtype.element_ty), mask=o < NB)
