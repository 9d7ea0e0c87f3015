"""Virtual-expert weight transport: push native weights into peers' virtual slots, pull slot gradients back.

Contract (from :class:`tritonep.balance.Placement`): ``experts_to_copy[d, s] = e`` means virtual slot s of rank d
holds global expert e this step; its owner is rank ``e // L``. Both kernels read the placement on the device (no
host sync) and are correct at grid=1.

* :func:`push_weights_kernel`: the owner copies ``w[e % L]`` (a flat row of ``N`` elements) into slot s of rank d.
* :func:`pull_grads_kernel`: for each native expert j of this rank that some peer held, sums the slot gradients
  of every holder d (d ascending: a fixed order) in fp32 and adds the sum into ``grad[j]`` in place; experts no
  peer held are left untouched (decided on the device: the launch is the same on every rank).
* :func:`barrier_kernel`: every rank signals every peer and waits for all (bounded); the rendezvous that keeps a
  slot from being rewritten while a peer still reads it.

Idea: Megatron-LM / MoonEP virtual experts (../shared/reference/balance_anchors.md §1.7-1.8); kernels are ours.
"""

import triton
import triton.language as tl

from ....device.common import cast_rne, widen
from ....device.protocol import STATUS_TIMEOUT
from ....device.signal import signal_peers, wait_all_ge


@triton.jit(do_not_specialize=['row_off', 'call_idx', 'timeout', 'wait_id', 'rank'])
def barrier_kernel(flags_ptr, flags_tab, row_off, calls_ptr, call_idx, status_ptr, timeout, wait_id,
                   rank, W: tl.constexpr, WB: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Rendezvous: add 1 to ``flags[row, rank]`` on every rank, then wait (bounded) until this rank's row reaches
    ``calls[call_idx]`` from every peer."""
    n = tl.load(calls_ptr + call_idx)
    signal_peers(flags_tab, row_off, W, rank, WB)
    wait_all_ge(flags_ptr + row_off // 8, W, n, status_ptr, wait_id, timeout, HAS_TIMER, WB)


@triton.jit(do_not_specialize=['N', 'rank'])
def push_weights_kernel(w_ptr, slots_tab, etc_ptr, N, status_ptr,
                        rank, W: tl.constexpr, L: tl.constexpr, BLOCK: tl.constexpr):
    """Copy owned experts' rows ``w[j, :N]`` into ``slots[s, :N]`` of every rank d with etc[d, s] = rank*L + j."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    live = tl.load(status_ptr) != STATUS_TIMEOUT
    offs = tl.arange(0, BLOCK)
    nchunks = tl.cdiv(N, BLOCK)
    for slot in range(W * L):
        d = slot // L
        s = slot % L
        e = tl.load(etc_ptr + slot)
        if (e >= 0) & (e // L == rank) & live:
            j = e % L
            dst = tl.multiple_of(tl.load(slots_tab + d).to(tl.pointer_type(w_ptr.dtype.element_ty)), 16)
            for c in range(pid, nchunks, G):
                o = c * BLOCK + offs
                m = o < N
                v = tl.load(w_ptr + j.to(tl.int64) * N + o, mask=m)
                tl.store(dst + s.to(tl.int64) * N + o, v, mask=m)


@triton.jit(do_not_specialize=['N', 'num_targets', 'rank'])
def pull_grads_kernel(grad_ptr, num_targets, gslots_tab, slot_of_ptr, N, status_ptr,
                      rank, W: tl.constexpr, L: tl.constexpr, E: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Add every holder's slot gradient into this rank's native gradient, IN PLACE, only for held experts.

    For each native expert ``j < num_targets`` of this rank (global id ``e = rank*L + j``) that some peer ``d``
    holds (``expert_slot[e, d] = s >= 0``, ``d != rank``)::

        grad[j] = DT(float(grad[j]) + float(DT(sum_{d ascending} float(gslots_d[s]))))

    (fp32 sum over the holders in ascending rank order, rounded once to the gradient dtype DT, then added the way
    torch adds two DT tensors: in fp32, rounded once; rounding by :func:`cast_rne`, widening by :func:`widen`, so
    GPU and interpreter give the same bits). Experts no peer holds, and every ``j >= num_targets``, are neither
    read nor written: the launch is the same on every rank whatever the placement (docs/protocols.md (host protocol rule)) and does no
    work where nothing is held (``num_targets = 0``: ``grad_ptr`` may then be a one-element dummy).

    Args:
        grad_ptr: ``[L, N]`` native gradient (bf16 or fp32, the slots' dtype), contiguous.
        num_targets: ``L``, or 0 for "no target" (runtime int: one compiled variant).
        gslots_tab: int64 ``[W]`` pointer table of the ``[L, N]`` gradient slots of every rank.
        slot_of_ptr: int32 ``[E, W]`` ``expert_slot`` of the placement (-1 where rank d holds no copy).
        N: elements per expert. status_ptr: the transport's status word (nothing is read after a timeout).
    """
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    live = tl.load(status_ptr) != STATUS_TIMEOUT
    offs = tl.arange(0, BLOCK)
    nchunks = tl.cdiv(N, BLOCK)
    for item in range(pid, num_targets * nchunks, G):
        j = item // nchunks + tl.zeros((), dtype=tl.int64)
        c = item % nchunks
        e = rank * L + j
        o = c * BLOCK + offs
        m = o < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        nheld = tl.zeros((), dtype=tl.int32)
        for d in range(W):
            s = tl.load(slot_of_ptr + e * W + d)
            if (s >= 0) & (d != rank) & live:
                src = tl.multiple_of(tl.load(gslots_tab + d).to(tl.pointer_type(grad_ptr.dtype.element_ty)), 16)
                acc += widen(tl.load(src + s.to(tl.int64) * N + o, mask=m, other=0.0))
                nheld += 1
        if nheld > 0:
            g = widen(tl.load(grad_ptr + j * N + o, mask=m, other=0.0))
            pulled = widen(cast_rne(acc, grad_ptr.dtype.element_ty))
            tl.store(grad_ptr + j * N + o, cast_rne(g + pulled, grad_ptr.dtype.element_ty), mask=m)
