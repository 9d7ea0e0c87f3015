"""Per-call host-path budgets of the triton backend through the API entry (``EPBuffer``), counted on the CPU.

:mod:`tritonep.bench.host_path` runs the real ``EPBuffer`` calls with every launch stubbed and counts what a call
does on the host: torch calls from Python (each a few microseconds on a GPU machine), allocations, Triton launches
and device->host reads. Launches and host reads must match exactly (the protocol and the eager budget: one read per
synced dispatch, none elsewhere); torch calls, aten ops (what reaches the dispatcher: allocations and views) and
allocations may only go down (then lower the budget), or go up by a trade stated here. The counts include ~6-12 cheap
attribute reads (``x.shape``, ``x.device``) that the counter sees as torch calls. The handle storage's fields reach
the kernels as addresses (:class:`tritonep.runtime.field_view.FieldView`), not as per-call slices; the row weights of a
synced dispatch are a field of the handle storage, their view made while the launches run; the output pool
(:mod:`tritonep.runtime.pool`) hands a released call's handle storage and its views back (decode: also the rows and the
combine output), so a dispatch makes one allocation (none on the decode geometry) and returns two slices
(``rows[:R]``, ``weights[:R]``). The combine / combine-backward slice is the measuring caller's ``expert_out[:rows]``.
A caller that keeps every output gets fresh allocations (``test_output_pool.py``).
An eager combine (its handle's dispatch read the host) reads its status once at its end: one host read and no further
torch call (a spin on the ticket its last launch publishes, as the dispatch's read), so a peer that refused the call
or never arrived raises in the call on every rank (tests/ep/test_failed_peer.py).
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.testing import run_cpu_world

# call -> (torch calls, aten ops, allocations, launches, host reads), world 2, bf16, two-kernel CPU geometry
BUDGET = {
    # handle storage + rows (the weights: a view of the storage); hist, exchange, send, expand; one read (22 -> 21
    # torch calls when the read began spinning on the ticket the exchange publishes: no tolist of the status view)
    "dispatch": (19, 2, 1, 4, 1),  # rows (the storage block and its views: the output pool's; +1: the pooled row
    # weights' requires_grad read, pool.py _Set.marked, a property read, not a torch op)
    "dispatch_sync_free": (18, 2, 2, 4, 0),  # rows + zeroed row weights, no read (+1 requires_grad read, as above)
    "combine": (9, 2, 1, 2, 1),  # the output; partial, out (the counter advances in the out kernel); one read
    # (the eager combine's status, published by its last launch: a peer's refusal or timeout raises in the call)
    "dispatch_bwd": (12, 2, 2, 2, 0),  # grad_x, grad_topk_weights
    "combine_bwd": (13, 3, 2, 2, 0),  # grad rows, grad weights (both empty: the expand writes every row); send, expand
}


# the one-launch decode geometry (TRITONEP_GEOMETRY=bt=2,dec=3): the dispatch takes max_recv_tokens rows (pooled)
# before its one launch and cuts them to the rows received after the read
BUDGET_DECODE = {
    "dispatch": (19, 2, 0, 1, 1),  # storage + rows: ONE set of the shared pool; one launch; one read; rows[:R],
    # weights[:R]; +2: the requires_grad reads of the pooled row weights and rows (pool.py _Set.marked)
    "dispatch_sync_free": (19, 2, 0, 1, 0),  # the same two slices (fresh views of the pooled tensors), as above
    "combine": (9, 2, 0, 1, 1),  # the output: a slice of a pooled block; one launch; +1 its requires_grad read;
    # one host read (the eager combine's status)
    "dispatch_bwd": (12, 2, 2, 1, 0),  # grad_x, grad_topk_weights; one launch (the decode combine, unweighted)
    "combine_bwd": (13, 3, 2, 2, 0),
}


def _count(group, T, geometry=""):
    import os

    if geometry:
        os.environ["TRITONEP_GEOMETRY"] = geometry
    import tritonep as tep
    from tritonep.bench.host_path import measure_host_path
    from tritonep.bench.cases import make_rank_inputs

    rank = dist.get_rank(group)
    x, idx, w = make_rank_inputs(rank, T, 64, 8, 2, seed=4, mask_frac=0.2)
    buf = tep.EPBuffer(group, 8, 64, 16, 2)
    res = measure_host_path(buf, x, idx, w.contiguous(), iters=2)
    buf.close()
    return {k: (v["torch_calls"], v["aten_ops"], v["allocs"], v["launches"], v["host_reads"], v["torch_names"],
                v["aten_names"]) for k, v in res.items()}


@pytest.mark.parametrize("T,geometry", [(16, ""), (0, ""), (16, "bt=2,dec=3")])
def test_triton_per_call_host_budget(T, geometry):
    budget = BUDGET_DECODE if geometry else BUDGET
    for rank, out in enumerate(run_cpu_world(2, _count, T, geometry, timeout_s=300)):
        for call, (calls, aten, allocs, launches, reads) in budget.items():
            got = out[call]
            assert got[3] == launches and got[4] == reads, (rank, call, got)
            assert got[0] <= calls and got[1] <= aten and got[2] <= allocs, (
                f"rank {rank} {call}: {got[0]} torch calls / {got[1]} aten ops / {got[2]} allocations, budget "
                f"{calls} / {aten} / {allocs} ({got[5]}; {got[6]})")


def test_host_calibration_measures_this_host():
    """The host-speed figures every eager profile carries: both kinds of work timed, in microseconds, and the slice
    is a real view op (a tensor of another device or a no-op loop would read far below a microsecond's tenth)."""
    from tritonep.bench.host_path import host_calibration

    cal = host_calibration(torch.device("cpu"), iters=200, rounds=2)
    assert set(cal) == {"calib_python_loop_100_us", "calib_slice_us"}
    assert all(0.05 < v < 1000 for v in cal.values()), cal
