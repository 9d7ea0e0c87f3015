"""Every element of a dispatch's handle storage that a caller or a later kernel reads is written by the call's own
kernels: the block (:meth:`tritonep.backends.triton.outputs.HandleLayout.new`, ``torch.empty``) is filled with a poison
pattern before the launches (NaN as float32, 2**31 - 2**22 + 0x123 as int32), on every geometry (two kernels, fused,
decode), with alignment padding (A = 4) and a rank of 0 tokens.

The row weights a synced dispatch returns are a view of the block's ``rw`` field, written only by
the data kernels (routes and alignment padding), and the decode dispatch's sync-free weights are the whole field
(zeroed past the rows received by the kernel); no allocation zeroes them. On the CPU a fresh block often
holds the previous call's bits (glibc reuses the freed block), so an element no kernel writes can pass a test of
repeated calls; the poison makes it show. Checked: the synced call's records and gradients against the reference
(:func:`tests.support.harness.check_calls` / ``check_grads``), the sync-free call's rows, weights (zero past
``expert_offsets[-1]``), layout and combine.

The block comes from the buffer's output pool (:mod:`tritonep.runtime.pool`) and is reused once
nobody holds it, holding the previous call's bits: the poison is applied to every set the pool hands out too, so
a reused block is as poisoned as a fresh one (and the decode geometry's pooled rows: their padding rows must be
written by the kernel as well).
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.backends.triton.outputs import HandleLayout
from tritonep.runtime.pool import OutputPool
from tritonep.testing import run_cpu_world
from tests.support.harness import (_host, check_calls, check_grads, expert, make_calls, open_buffer, record,
                                      run_grad_call, set_env)

CFG = dict(E=8, H=64, Tmax=8, K=3, A=4)
POISON = 0x7FC00123  # a NaN as float32


def _poisoned_new(orig):
    def new(self, device):
        store = orig(self, device)
        store.fill_(POISON)
        return store
    return new


def _poisoned_take(orig):
    def take(self, *stream):
        got = orig(self, *stream)
        if got is not None:
            for t in got[:2]:  # the store (and on the decode geometry the rows; a combine pool's output)
                if t.dim() == 1 and t.dtype == torch.int32:
                    t.fill_(POISON)
                elif t.is_floating_point():
                    t.fill_(float("nan"))
        return got
    return take


def _world(group, geometry, calls):
    HandleLayout.new = _poisoned_new(HandleLayout.new)  # this forked rank only
    OutputPool.take = _poisoned_take(OutputPool.take)
    rank = dist.get_rank(group)
    set_env(TRITONEP_GEOMETRY=geometry or None)
    buf = open_buffer(group, CFG)
    synced = run_grad_call(buf, *calls[rank][0], grad_seed=9 + rank)
    d = buf.dispatch(*calls[rank][1], sync_free=True)
    end = int(d.expert_offsets[-1])
    eo = expert(d.x)
    y = buf.combine(eo, d.handle)
    free = record(d, eo, y)
    free.update(x=free["x"][:end], w=free["w"][:end], eo=free["eo"][:end], tail=_host(d.weights[end:]))
    buf.close()
    return synced, free


@pytest.mark.parametrize("geometry", ["", "fs=2,fe=2,fc=1", "bt=2,dec=3"], ids=["two-kernel", "fused", "decode"])
def test_every_read_element_of_the_handle_is_written(geometry):
    calls = make_calls(2, CFG, [7, 0], [11, 12], mask_frac=0.2)
    res = run_cpu_world(2, _world, geometry, calls, timeout_s=300)
    check_calls(CFG, [[c[0]] for c in calls], [[r[0]] for r in res])
    check_grads(CFG["E"], [r[0] for r in res], expert_alignment=CFG["A"])
    check_calls(CFG, [[c[1]] for c in calls], [[r[1]] for r in res])
    for r in range(2):
        tail = res[r][1]["tail"]
        assert tail.numel() and not tail.isnan().any() and not tail.any(), f"rank {r}: weights past the rows"
