"""A planner launch that stops before every program took its arrival ticket (an exception inside an interpreted
launch: Ctrl-C in a CPU run, an interpreter error) must not leave the persistent state (call number + arrivals,
flags) out of step: every later plan() equals the twins, with a clean status."""

import pytest
import torch

import tritonep.balance.kernels.planner as kernel_mod
from tritonep.balance import place_torch, plan, plan_status, remap_torch


def test_plan_after_an_aborted_launch_equals_twins(monkeypatch):
    monkeypatch.setenv("TRITONEP_TIMEOUT_S", "2")  # a wait left out of step gives up quickly instead of in 300 s
    topk = torch.tensor([[0, 1], [0, 2], [0, 3]], dtype=torch.int64)
    counts = torch.tensor([[3, 1, 1, 1], [5, 0, 0, 0]], dtype=torch.int32)
    want_p = place_torch(counts)
    want = remap_torch(topk, want_p, 0, counts)
    p, rid = plan(counts, topk, 0)
    assert p.equal(want_p) and torch.equal(rid, want)

    def interrupted(*args, **kwargs):  # the placement program stops: the chunk program never takes its ticket
        raise KeyboardInterrupt("stopped inside the planner launch")

    with monkeypatch.context() as m:
        m.setattr(kernel_mod, "place_and_store", interrupted)
        with pytest.raises(KeyboardInterrupt):
            plan(counts, topk, 0)
    for call in range(3):
        p, rid = plan(counts, topk, 0)
        assert plan_status(p) == 0, (call, p.status.tolist())
        assert p.equal(want_p), call
        assert torch.equal(rid, want), (call, rid.tolist(), want.tolist())
