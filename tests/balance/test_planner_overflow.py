"""Counts whose total does not fit int32: the twin refuses them (PlanError), so the Triton planner must flag them in
its status word (bit 16; ``validate=True`` raises PlanError) instead of planning from wrapped or truncated sums
(silent on a GPU, an untyped interpreter error on a CPU). A total of exactly 2**31 - 1 still plans as the twin."""

import pytest
import torch

from tritonep.balance import check_plan_status, place_torch, plan, plan_status, remap_torch
from tritonep.errors import PlanError

NO_ROUTES = torch.empty(0, 2, dtype=torch.int64)
BIG = 2**31


@pytest.mark.parametrize("rows,dtype", [
    ([[0, 0, 0, 0], [2**30, 2**30 - 1, 5, 0]], torch.int32),  # int32 entries, their sum wraps
    ([[0, 0, 0, 0], [2**30, 2**30, 0, 0]], torch.int64),  # a total of exactly 2**31
    ([[0, 0, 0, 0], [2**32 + 1, 0, 3, 0]], torch.int64),  # an entry past int32 (its low word is 1)
], ids=["int32_sum", "int64_sum", "int64_entry"])
@pytest.mark.parametrize("mode", ["reference", "minimal"])
def test_counts_past_int32_are_flagged(rows, dtype, mode):
    counts = torch.tensor(rows, dtype=dtype)
    with pytest.raises(PlanError, match="does not fit int32"):
        place_torch(counts, mode)
    p, _ = plan(counts, NO_ROUTES, 0, mode=mode)
    assert plan_status(p) & 16, p.status.tolist()
    with pytest.raises(PlanError, match="does not fit int32"):
        check_plan_status(p)
    with pytest.raises(PlanError, match="does not fit int32"):
        plan(counts, NO_ROUTES, 0, mode=mode, validate=True)


@pytest.mark.parametrize("mode", ["reference", "minimal"])
def test_largest_total_plans_as_the_twin(mode):
    topk = torch.tensor([[0, 1], [2, -1]])
    counts = torch.tensor([[1, 1, 1, 0], [BIG - 1 - 3 - 7, 0, 0, 7]], dtype=torch.int64)
    want = place_torch(counts, mode)
    for c in (counts, counts.to(torch.int32)):
        p, rid = plan(c, topk, 0, mode=mode)
        assert plan_status(p) == 0 and p.equal(want)
        assert torch.equal(rid, remap_torch(topk, want, 0, counts))
