"""Minimal peer-write / epoch-wait kernels for testing a symmetric heap (CPU interpreter and GPU alike).

Rank ``rank`` writes ``n*1000 + rank*100 + i`` (n = call number from ``calls_ptr``) into row ``rank`` of every
rank's ``data [W, N]`` region through the pointer table, then signals; the wait kernel waits (bounded, wait id 7)
until every rank's signal for call n arrived. The rank and the bound are runtime arguments Triton does not
specialise (``do_not_specialize``, as in the library's kernels): the ranks of a world share one compiled variant.
"""

import triton
import triton.language as tl

from tritonep.device.signal import signal_peers, wait_all_ge

__all__ = ["peer_write_kernel", "peer_wait_kernel"]


@triton.jit(do_not_specialize=["rank"])
def peer_write_kernel(data_tab, flags_tab, calls_ptr, rank, N: tl.constexpr, W: tl.constexpr, WB: tl.constexpr):
    """Write this rank's row into every rank's ``data`` and add 1 to every rank's ``flags[rank]``."""
    n = tl.load(calls_ptr)
    offs = tl.arange(0, N)
    for d in range(W):
        dst = tl.load(data_tab + d).to(tl.pointer_type(tl.int64))
        tl.store(dst + rank * N + offs, n * 1000 + rank * 100 + offs)
    signal_peers(flags_tab, 0, W, rank, WB)


@triton.jit(do_not_specialize=["timeout"])
def peer_wait_kernel(flags_ptr, calls_ptr, status_ptr, timeout, W: tl.constexpr, WB: tl.constexpr,
                     HAS_TIMER: tl.constexpr):
    """Wait until ``flags[r] >= calls`` for every rank r (timeout: ns of wall time, GPU and interpreter)."""
    n = tl.load(calls_ptr)
    wait_all_ge(flags_ptr, W, n, status_ptr, 7, timeout, HAS_TIMER, WB)
