"""Per-call host-path budgets of the DeepEP-compatible Buffer's normal-mode round trip, counted on the CPU.

What Megatron's DeepEP path calls per step: ``get_dispatch_layout``, ``dispatch(x, topk_idx, topk_weights, ...)`` and
``combine(recv_x, handle)``; vLLM / SGLang's graph-captured prefill the same with ``num_worst_tokens``.
:func:`tritonep.bench.host_path.measure_calls` runs each call with every bound launch running for real outside the
counts (the compat calls read what the kernels wrote) and counts what the call does on the host: torch calls from
Python (each a few microseconds on a GPU machine, the counts include ~1 per attribute read such as ``x.shape``),
aten ops, allocations and torch kernels (aten ops that run a device kernel: torch's own launches on a GPU), Triton
launches, and host reads (the lanes' pinned status reads, the compat's own
histogram read through pinned memory, and any torch call that reads the device: ``tolist``, ``item``, ...).

Launches and host reads must match exactly. On the one-launch decode tiles the top-k is carried with the rows of the
rows lane (the Buffer's default there: one launch per dispatch and per combine). Elsewhere at these sizes it travels
as meta rows of the rows lane: a dispatch is one launch of the packing kernel (x copied into the lane's input with
the meta rows, and the lane's slots), the rows lane's dispatch (four launches with the two-kernel tiles) and one
launch of the unpacking kernel; it reads the host once (the rows
lane's status, spun on as the kernel publishes it before any row moves, with DeepEP's per-expert counts, summed in
the same exchange: the lane's count routing; the two-kernel tiles' counts exchange launch likewise) and a
``num_worst_tokens`` dispatch never (its capacity poison launch instead: NaN rows and weights when the call
overflowed). It allocates the lane's slots and the two outputs (the lane's input is kept per lane) and runs no torch
kernel of its own. A combine is the rows lane's (one read when its dispatch read, none after a ``num_worst_tokens``
one) after one copy launch of the caller's rows into the lane's expert-output buffer (the lane's layout has the meta
rows after them; ``MetaOps.copy_rows``: a torch copy into that symmetric region cost ~14 us of host time on a GPU). With ``meta_rows_max_tokens=0`` (the meta lane, a second EPBuffer dispatch) a dispatch is the
packing launch of both lanes' inputs, the two lanes' dispatches and the meta unpacking launch, one read; its combine no
copy. A combine of ``topk_weights`` (Megatron's fused-dispatch backward; counted as a handle's
first) adds the meta lane's backward (after a meta-rows dispatch first a sync-free dispatch of a meta lane routed
like the rows lane) and the ranks' sum of the weights. The layout is one launch and no read. Torch calls, aten ops,
allocations and torch kernels may only go down (then lower the budget; the torch way, ``packing.pack_torch``, a
zeroed histogram and its ``tolist``, is six torch kernels and a device-to-host copy per dispatch). The previous
step's outputs are let go before a dispatch, as a loop over steps does.
"""

import pytest
import torch
import torch.distributed as dist

from tritonep.testing import run_cpu_world

T, H, E, K = 12, 64, 8, 3

# call -> (torch calls, aten ops, allocations, torch kernels, launches, host reads), world 2, T tokens per rank
BUDGET = {  # the CPU's own tiles: the two-kernel lane dispatch (what a GPU takes at 4096 tokens)
    "layout": (8, 3, 2, 0, 1, 0),  # in_rank + one block for both counts (split in two views); no autograd mode set
    # pack (1) + rows lane (4) + unpack (1); one pinned read (the counts with the rows lane's status: its count
    # routing, summed in the counts exchange launch; was 58 calls and two reads); slots, the outputs, the lane's
    # handle and rows (4 of the torch calls: attribute reads of the refusal bookkeeping, which lanes were read and
    # the rows' device; 4 more: the count routing's check); the arguments' checks in one pass (was 62)
    "dispatch": (52, 6, 4, 0, 6, 1),
    # the copy into the lane's expert-output buffer (a torch kernel), the rows lane's combine (its output, two
    # launches, its status read), the token rows of its output (a view)
    "combine": (14, 2, 1, 0, 3, 1),  # +1: the device check of x; the checks in one pass: -1; the copy a bound
    # launch (MetaOps.copy_rows: +1 torch call, x.is_contiguous; -1 torch kernel)
    # combine(..., topk_weights): Megatron's fused-dispatch backward, a handle's first. + the meta lane routed like the
    # rows lane (its sync-free dispatch, one launch: the handle's slots K-fold, one take made once per handle;
    # its outputs) and its backward (one launch: the weights back unsummed into the kept zeroed weight rows, one copy;
    # its output), the ranks' sum of the weights (a torch kernel). Was 54 / 18 / 7 / 6: a repeat_interleave, a zeroed
    # weight buffer and its copy per call
    "combine_w": (49, 10, 5, 4, 9, 1),  # +2: the device checks of x and topk_weights; the copy a launch; the
    # repeated slots one take of the slots (was a slice and an index_select); the weights checked in one pass (-2)
    # num_worst_tokens: no read at all; + the capacity poison launch (NaN rows and weights when the call overflowed:
    # no host read can tell) on the token rows' counts (a strided view of the exchange's); the torch kernel: the
    # lane's zeroed row weights (EPBuffer's sync-free dispatch on these tiles)
    "worst_dispatch": (55, 6, 5, 1, 7, 0),  # the poison reads the counts field's address (no view of it: was 64 / 10)
    "worst_combine": (18, 2, 1, 0, 4, 0),  # + the capacity poison launch on the combined rows; +1: x's device; the
    # copy a launch
    "worst_combine_w": (56, 10, 5, 4, 10, 0),  # was 66 / 17 / 7 / 6; +2: the device checks; the copy a launch
}
BUDGET_DECODE = {  # TRITONEP_GEOMETRY=bt=2,dec=3: the one-launch decode tiles (what a GPU takes up to 256 tokens)
    "layout": (8, 3, 2, 0, 1, 0),
    # the rows lane's ONE launch: the top-k carried with the rows (EPBuffer.dispatch(count_weights=...)) and the
    # caller's is_token_in_rank as its routing (a bool rank mask the kernel reads), no packing or unpacking launch
    # (was 3 launches, 52 calls, 3 allocations); ONE read: the per-expert counts come with the lane's status (its
    # count routing); the carried outputs: a set of the lane's pool of them (was two allocations, 49 calls)
    "dispatch": (48, 4, 0, 0, 1, 1),
    "combine": (11, 1, 0, 0, 1, 1),  # the lane's combine reads the caller's rows: no copy launch (was 14 / 2 / 2)
    # the meta lane's routes: the rows lane handle's copy of the rank mask (ids 2r: one slice of its block), repeated
    # by one take once per handle; no copy launch (was 50 / 10 / 3 / 4; 48 / 11 / 2 / 4 with the mask made ids)
    "combine_w": (48, 10, 2, 3, 3, 1),
    # no read; + the capacity poison launch (was 56 / 6 / 3 / 0 / 4: the packing and unpacking launches; now the
    # carried weights' checks in the lane's dispatch and the cut of the carried outputs to num_worst_tokens)
    "worst_dispatch": (58, 6, 0, 0, 2, 0),  # the carried outputs pooled (was 7 aten ops, 2 allocations)
    # the sync-free lane's receive capacity is num_worst_tokens rows (no meta rows' room: its token rows travel
    # alone), the caller's rows: its combine reads them (no copy launch: was 17 / 1 / 0 / 0 / 3)
    "worst_combine": (15, 1, 0, 0, 2, 0),
    "worst_combine_w": (55, 10, 2, 3, 4, 0),  # the handle's copy of the mask, as combine_w (was 57 / 11 / 2 / 4 / 5)
}
BUDGET_META_LANE = {  # meta_rows_max_tokens=0, decode tiles: the top-k in the meta lane
    "layout": (8, 3, 2, 0, 1, 0),
    # pack (both lanes' inputs: one block, four views) + rows lane (1) + meta lane (1) + unpack; no torch kernel; one
    # read: the counts with the rows lane's status (was 2 reads, 77 calls)
    "dispatch": (73, 15, 3, 0, 4, 1),  # the arguments' checks in one pass (was 81)
    "combine": (11, 1, 0, 0, 1, 1),  # +1: the device check of x; the checks in one pass: -1
    # + the meta lane's backward (the weights into the kept zeroed weight rows: one copy) and the ranks' sum
    "combine_w": (29, 6, 2, 2, 2, 1),  # was 33 / 9 / 3 / 3: a zeroed weight buffer and its copy per call; the
    # weights' checks in one pass (was 31);
    # +2: the device checks of x and topk_weights
    "worst_dispatch": (78, 16, 3, 0, 5, 0),  # the poison: the counts field's address (was 86 / 19)
    "worst_combine": (15, 1, 0, 0, 2, 0),  # +1: the device check of x
    "worst_combine_w": (36, 6, 2, 2, 3, 0),  # was 45 / 8 / 3 / 3; +2: the device checks
}


def _count(group, geometry, meta_rows_max_tokens=256):
    import os

    if geometry:
        os.environ["TRITONEP_GEOMETRY"] = geometry
    import tritonep.compat.deep_ep as deep_ep
    from tritonep.bench.host_path import measure_calls
    from tritonep.bench.cases import make_rank_inputs

    rank, W = dist.get_rank(group), dist.get_world_size(group)
    x, idx, w = make_rank_inputs(rank, T, H, E, K, seed=5, mask_frac=0.2)
    w = w.contiguous()
    buf = deep_ep.Buffer(group, 0, 0, max_tokens_per_rank=T, meta_rows_max_tokens=meta_rows_max_tokens)
    st = {}

    def dispatch(worst=0):
        st.pop("d", None)  # the previous step's outputs are let go (the lanes' output pools reuse them)
        n, _, ne, itr, _ = st["layout"]
        st["d"] = buf.dispatch(x, num_tokens_per_rank=n, is_token_in_rank=itr, num_tokens_per_expert=ne,
                               topk_idx=idx, topk_weights=w, num_worst_tokens=worst)

    def combine_w():  # a handle's first combine of topk_weights (what it makes once per handle is made again)
        st["d"][4].__dict__["_rep"] = None
        buf.combine(st["d"][0], st["d"][4], topk_weights=st["d"][2])

    calls = {"layout": lambda: st.__setitem__("layout", buf.get_dispatch_layout(idx, E)),
             "dispatch": dispatch, "combine": lambda: buf.combine(st["d"][0], st["d"][4]), "combine_w": combine_w,
             "worst_dispatch": lambda: dispatch(W * T), "worst_combine": lambda: buf.combine(st["d"][0], st["d"][4]),
             "worst_combine_w": combine_w}

    def reads():
        return sum(lane.host_reads for _, lane in buf.lanes) + sum(o.host_reads for o in buf._normal._meta_ops.values())

    res = measure_calls(calls, reads, iters=0, run_kernels=True)
    buf.destroy()
    return {k: (v["torch_calls"], v["aten_ops"], v["allocs"], v["torch_kernels"], v["launches"], v["host_reads"],
                v["torch_names"], v["aten_names"]) for k, v in res.items()}


@pytest.mark.parametrize("geometry,meta_rows_max_tokens,budget", [("", 256, BUDGET), ("bt=2,dec=3", 256, BUDGET_DECODE),
                                                                    ("bt=2,dec=3", 0, BUDGET_META_LANE)])
def test_compat_round_trip_host_budget(geometry, meta_rows_max_tokens, budget):
    for rank, out in enumerate(run_cpu_world(2, _count, geometry, meta_rows_max_tokens, timeout_s=600)):
        for call, (calls, aten, allocs, kernels, launches, reads) in budget.items():
            got = out[call]
            assert got[4] == launches and got[5] == reads, (rank, call, got[:6])
            assert got[0] <= calls and got[1] <= aten and got[2] <= allocs and got[3] <= kernels, (
                f"rank {rank} {call}: {got[0]} torch calls / {got[1]} aten ops / {got[2]} allocations / {got[3]} "
                f"torch kernels, budget {calls} / {aten} / {allocs} / {kernels} ({got[6]}; {got[7]})")
