"""Virtual-expert weight transport: push native weights into peers' virtual slots, pull slot gradients back.

Contract (from :class:`tritonep.balance.Placement`): ``experts_to_copy[d, s] = e`` means virtual slot s of rank d
holds global expert e this step; its owner is rank ``e // L``. Both kernels read the placement on the device (no
host sync) and are correct at grid=1.

* :func:`push_weights_kernel`: the owner copies ``w[e % L]`` (a flat row of ``N`` elements) into slot s of rank d.
* :func:`pull_grads_kernel`: for each native expert j of this rank, adds the slot gradients of every rank d that
  held it (d ascending: a fixed order) into ``grad[j]`` in fp32.
* :func:`barrier_kernel`: every rank signals every peer and waits for all (bounded); the rendezvous that keeps a
  slot from being rewritten while a peer still reads it.

Idea: Megatron-LM / MoonEP virtual experts (../shared/reference/balance_anchors.md §1.7-1.8); kernels are ours.
"""

import triton
import triton.language as tl

from .common import cast_rne, widen
from .signal import STATUS_TIMEOUT, signal_peers, wait_all_ge


@triton.jit(do_not_specialize=['row_off', 'call_idx', 'timeout', 'wait_id'])
def barrier_kernel(flags_ptr, flags_tab, row_off, calls_ptr, call_idx, status_ptr, timeout, wait_id,
                   RANK: tl.constexpr, W: tl.constexpr, WB: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Rendezvous: add 1 to ``flags[row, RANK]`` on every rank, then wait (bounded) until this rank's row reaches
    ``calls[call_idx]`` from every peer."""
    n = tl.load(calls_ptr + call_idx)
    signal_peers(flags_tab, row_off, W, RANK, WB)
    wait_all_ge(flags_ptr + row_off // 8, W, n, status_ptr, wait_id, timeout, HAS_TIMER, WB)


@triton.jit(do_not_specialize=['N'])
def push_weights_kernel(w_ptr, slots_tab, etc_ptr, N, status_ptr,
                        RANK: tl.constexpr, W: tl.constexpr, L: tl.constexpr, BLOCK: tl.constexpr):
    """Copy owned experts' rows ``w[j, :N]`` into ``slots[s, :N]`` of every rank d with etc[d, s] = RANK*L + j."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    live = tl.load(status_ptr) != STATUS_TIMEOUT
    offs = tl.arange(0, BLOCK)
    nchunks = tl.cdiv(N, BLOCK)
    for slot in range(W * L):
        d = slot // L
        s = slot % L
        e = tl.load(etc_ptr + slot)
        if (e >= 0) & (e // L == RANK) & live:
            j = e % L
            dst = tl.multiple_of(tl.load(slots_tab + d).to(tl.pointer_type(w_ptr.dtype.element_ty)), 16)
            for c in range(pid, nchunks, G):
                o = c * BLOCK + offs
                m = o < N
                v = tl.load(w_ptr + j.to(tl.int64) * N + o, mask=m)
                tl.store(dst + s.to(tl.int64) * N + o, v, mask=m)


@triton.jit(do_not_specialize=['N'])
def pull_grads_kernel(grad_ptr, gslots_tab, slot_of_ptr, N, status_ptr,
                      RANK: tl.constexpr, W: tl.constexpr, L: tl.constexpr, E: tl.constexpr,
                      BLOCK: tl.constexpr):
    """``grad[j] = sum_{d ascending, d holds expert RANK*L+j in slot s} gslots_d[s]`` (fp32 sum, then cast).

    ``slot_of_ptr``: ``expert_slot [E, W]`` of the placement (-1 where rank d holds no copy). Experts no peer
    holds get zeros.
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    live = tl.load(status_ptr) != STATUS_TIMEOUT
    offs = tl.arange(0, BLOCK)
    nchunks = tl.cdiv(N, BLOCK)
    for item in range(pid, L * nchunks, G):
        j = item // nchunks + tl.zeros((), dtype=tl.int64)
        c = item % nchunks
        e = RANK * L + j
        o = c * BLOCK + offs
        m = o < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for d in range(W):
            s = tl.load(slot_of_ptr + e * W + d)
            if (s >= 0) & (d != RANK) & live:
                src = tl.multiple_of(tl.load(gslots_tab + d).to(tl.pointer_type(grad_ptr.dtype.element_ty)), 16)
                acc += widen(tl.load(src + s.to(tl.int64) * N + o, mask=m, other=0.0))
        tl.store(grad_ptr + j * N + o, cast_rne(acc, grad_ptr.dtype.element_ty), mask=m)
