"""Per-call host-path budgets of the nccl backend, counted on the CPU: a regression fails here.

The backend's four calls run on its GPU path (``use_triton``; the kernels run in the interpreter, outside the
counters: :func:`tritonep.bench.host_path.stub_launches` with ``run``) and are counted by
:class:`tritonep.bench.host_path.HostCounter`: torch calls from Python, allocations, Triton launches and host reads.
Counted at the backend (the buffer's backend object, :func:`tests.support.hooks.backend_of`), so the front door's own
checks (EPBuffer, autograd) are not in these numbers. The budgets are exact counts of today's path (independent of shapes and of the machine); lower is welcome
(then lower the budget), higher fails.

Lowest possible, for the same output. The 30-line pipeline of :mod:`tritonep.bench.ep` (index_select pack +
``all_to_all_single`` + index_select / ``index_copy_`` unpack) is 4 torch calls, 2 allocations, 3 kernels and 1
collective per dispatch, but its indices, split sizes and layout are computed once outside the timed call and it
returns neither ``num_tokens_per_expert`` / ``expert_offsets`` / row weights nor any state for combine or backward.
With routing that changes every call (what a dispatch is), the same output needs at least: the counts of this
rank (1 kernel), their exchange (1 collective), one device->host read (``all_to_all_single`` takes host split sizes),
the layout and split sizes (host arithmetic), the layout back on the device (1 host->device copy, or 1 more
kernel), building the per-route rows and packing the travelling rows (1 kernel), the exchange (1 collective) and
the unpack (1 kernel), plus allocating what is returned (rows, row weights, counts / offsets) and the two row
buffers: 3 kernels, 2 collectives, 2 copies, 5 allocations. ``dispatch`` below is exactly that plus the 4
allocations its handle owns for combine and backward (per-route rows and packets, per-packet rows and weights; a
handle must own them: two dispatches may be in flight before their combines) and its copy of the routing (a
caller may refill its routing tensors in place after dispatch): 17 torch calls = 2 collectives, the
device->host copy, 11 allocations (8 + the host->device copy + the 2 tensors of the routing copy, which the pack
launch writes: no clone kernels), a split and a view of the plan
vector, one shape read. Combine: the pipeline is ~9 torch ops (zeros, gather, float, mul, index_add_, cast, collective,
zero_, index_add_); here 2 launches, 1 collective, 3 allocations (the send and receive rows and the output), plus the
one all_gather of every rank's refused flag and, eager, its one host read (a peer that refused raises in the call;
sync-free: a NaN fill and the flags ORed into the pending ones on the device, 3 torch calls). The dispatch backward
gathers the same flags (a rank whose backward input was refused takes part as refused) and ORs them into the pending
ones: 2 torch calls, no fill (its NaN rows already reach every element computed from them); so does the combine
backward (2 torch calls more than its pack, collective and expand).

Sync-free dispatch (``sync_free=True``, :mod:`tritonep.backends.nccl.sync_free`): no host read and no host->device copy (the
layout is computed by one more launch, the device plan), the send / receive rows persistent, the
per-call outputs from the output pool (:mod:`tritonep.runtime.pool`) once the caller let the previous ones go, and the
``all_to_all`` bound once (:class:`tritonep.backends.nccl.collectives.BoundCollective`: the process
group's backend called directly, no torch function): 5 torch calls (the all_gather, 2 aliases of the rows and row
weights, 2 shape reads), 0 allocations, 4 launches (a rank without tokens, which allocates: 11, 6, 2). Its one-hop mode
(``TRITONEP_NCCL_SYNC_FREE=onehop``, :mod:`tritonep.backends.nccl.onehop`): 4 torch calls (the 2 aliases, 2 shape reads), 0
allocations, 2 launches, with or without tokens (the one-hop outputs are pooled for a rank without tokens too: their
sizes are fixed; the handle's fields are kept per pooled set). Combine and both backward passes on its handle cost what
they cost on a synced handle.

Launch path: every launch is a bound one (:class:`tritonep.runtime.bound.BoundKernel`, made by the one launch
runtime), and on a fake GPU (``tests/backends/nccl/fake_gpu.py``) a warm call's launches are all direct C-launcher calls:
none goes through Triton's ``kernel[grid]`` path (38-61 us of host time a launch on the H200).
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.backends.nccl.fake_gpu import fake_gpu
from tritonep.testing import run_cpu_world
from tests.support.hooks import backend_of

# call -> (torch calls, allocations, launches, host reads): world 2, bf16, expert_alignment 1, tokens on both ranks
BUDGET = {
    "dispatch": (17, 11, 3, 1),  # 8 empties + the plan copy + the handle's own routing (2 empty_like, written by
    # the pack launch); all_gather, device->host copy, split, view, a2a
    "combine": (6, 3, 2, 1),  # send, back, y; a2a; the refused-flag all_gather and its one read (an eager
    # combine: a peer that took part as refused raises in the call, tritonep/backends/nccl/combine.py)
    "dispatch_bwd": (9, 4, 2, 0),  # + the weight gradients; contiguous() of the autograd gradients (2); the
    # refused-flag all_gather and the OR into the pending flags (a peer that took part as refused: no host read)
    "combine_bwd": (8, 4, 2, 0),  # send, recv, grad_expert_out, grad_w; a2a; the refused-flag all_gather and the
    # OR into the pending flags (a peer whose combine backward input was refused takes part as refused)
    # sync-free: no host read, no host->device copy; count, plan, pack, unpack launches; the send /
    # receive rows are persistent and the call's outputs (the plan vector, the rows, the row weights and the
    # handle's six tensors) come from the output pool once the previous call's are let go
    "sf_dispatch": (9, 0, 4, 0),  # pooled outputs; all_gather, 2 aliases (rows, row weights), 2 shape reads (the
    # a2a is bound: no torch call), 4 requires_grad reads of the pooled float tensors (pool.py _Set.marked: property
    # reads, not torch ops)
    "sf_combine": (8, 3, 2, 0),  # as on a synced handle (equal splits), without the read: the flags' any, the NaN
    # fill and the OR into the pending flags instead (on the device)
    "sf_dispatch_bwd": (9, 4, 2, 0),
    "sf_combine_bwd": (8, 4, 2, 0),
}
# a rank without tokens: no count launch (one fill of the counts row), no pack, no sum; it still unpacks and
# reduces the rows it receives
BUDGET_EMPTY = {"dispatch": (14, 7, 1, 1), "combine": (6, 3, 1, 1), "dispatch_bwd": (9, 4, 1, 0),
                "combine_bwd": (8, 4, 1, 0),
                "sf_dispatch": (11, 6, 2, 0), "sf_combine": (8, 3, 1, 0), "sf_dispatch_bwd": (9, 4, 1, 0),
                "sf_combine_bwd": (8, 4, 1, 0)}

# the one-hop sync-free mode (TRITONEP_NCCL_SYNC_FREE=onehop): send and receive launches, one collective, no
# count / plan launch; allocations: one float32 block (row weights, per-slot weights, the routing weights' copy and,
# as int32, packets, per-slot rows, ntpe, offsets, counts), the rows and the routing ids' copy
BUDGET_ONEHOP = {"sf_dispatch": (8, 0, 2, 0),  # pooled outputs; 2 aliases, 2 shape reads (the a2a is bound), 4
                 # requires_grad reads of the pooled float tensors (pool.py _Set.marked)
                 "sf_combine": (8, 3, 2, 0), "sf_dispatch_bwd": (9, 4, 2, 0), "sf_combine_bwd": (8, 4, 2, 0)}
# a rank without tokens: its outputs are pooled too (fixed sizes)
BUDGET_ONEHOP_EMPTY = {"sf_dispatch": (8, 0, 2, 0), "sf_combine": (8, 3, 1, 0), "sf_dispatch_bwd": (9, 4, 1, 0),
                       "sf_combine_bwd": (8, 4, 1, 0)}


def _count(group, T0, T1, mode="gather"):
    from tritonep.bench.cases import make_rank_inputs

    rank = dist.get_rank(group)
    T = (T0, T1)[rank]
    x, idx, w = make_rank_inputs(rank, T, 64, 8, 2, seed=4, mask_frac=0.2)
    with fake_gpu() as log:  # bound kernels on a fake GPU: the direct path after a variant's first launch
        return _count_calls(group, x, idx, w, T, log, mode)


def _count_calls(group, x, idx, w, T, log, mode):
    from tritonep import EPBuffer
    from tritonep.bench.host_path import HostCounter, stub_launches

    os.environ["TRITONEP_NCCL_SYNC_FREE"] = mode  # (a forked rank: its own environment)
    buf = EPBuffer(group, 8, 64, 16, 2, backend="nccl", device="cpu")
    assert backend_of(buf).sync_free_mode == mode
    impl = backend_of(buf)
    impl.use_triton = True  # the GPU path; its kernels run in the interpreter, uncounted
    w = w.float()
    out = {}
    with stub_launches(buf, run=True) as launched:
        def measure(name, fn):
            fn()  # warm
            n0, r0, l0 = len(launched), impl.host_reads, len(log)
            with HostCounter() as c:
                res = fn()
            out[name] = (c.torch_calls, c.allocs, len(launched) - n0, impl.host_reads - r0)
            out[name + ".names"] = c.torch_names
            out[name + ".paths"] = [k for k, _ in log[l0:]]
            return res

        o, ow, _, _, h = measure("dispatch", lambda: impl.dispatch_fwd(x, idx, w, True))
        eo = (o.float() * 0.5).to(torch.bfloat16)
        measure("combine", lambda: impl.combine_fwd(eo, h, read=True))  # eager (what EPBuffer.combine passes)
        measure("dispatch_bwd", lambda: impl.dispatch_bwd(eo, ow, h))
        gy = torch.randn(T, 64).to(torch.bfloat16)
        measure("combine_bwd", lambda: impl.combine_bwd(gy, eo, h))
        # the sync-free dispatch and the calls on its handle (max_recv_tokens rows)
        o, ow, _, _, h = measure("sf_dispatch", lambda: impl.dispatch_fwd(x, idx, w, 0, sync_free=True))
        eo = (o.float().nan_to_num() * 0.5).to(torch.bfloat16)
        measure("sf_combine", lambda: impl.combine_fwd(eo, h))
        measure("sf_dispatch_bwd", lambda: impl.dispatch_bwd(eo, ow, h))
        measure("sf_combine_bwd", lambda: impl.combine_bwd(gy, eo, h))
    buf.close()
    return out


@pytest.mark.parametrize("mode", ["gather", "onehop"])
@pytest.mark.parametrize("tokens", [(12, 9), (12, 0)])
def test_nccl_per_call_host_budget(tokens, mode):
    res = run_cpu_world(2, _count, *tokens, mode, timeout_s=300)
    for rank, out in enumerate(res):
        want = dict(BUDGET_EMPTY if tokens[rank] == 0 else BUDGET)
        if mode == "onehop":
            want.update(BUDGET_ONEHOP_EMPTY if tokens[rank] == 0 else BUDGET_ONEHOP)
        for call, (calls, allocs, launches, reads) in want.items():
            got = out[call]
            assert got[2] == launches and got[3] == reads, (rank, call, got, out[call + ".names"])
            paths = out[call + ".paths"]
            assert paths == ["direct"] * launches, (rank, call, paths)  # bound, direct
            assert got[0] <= calls and got[1] <= allocs, (
                f"rank {rank} {call}: {got[0]} torch calls / {got[1]} allocations, budget {calls} / {allocs} "
                f"({out[call + '.names']})")
