"""The launch-sequence recorder of the CPU world (tritonep.testing.protocol): a rank-dependent launch or
collective fails the world (ProtocolMismatch naming the rank); collectives through distributed_c10d are recorded;
kernels launched directly are not, so no signalling kernel may be launched outside a bound launch of the launch runtime
(a source scan)."""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.backends.triton.kernels.layout import chunk_hist_kernel
from tritonep.bench.cases import make_rank_inputs
from tritonep.runtime.launch import Launch
from tritonep.testing import ProtocolMismatch, run_cpu_world

_HIST = dict(hist_ptr=None, K=2, E=4, EB=4, BT=16, KB=2)  # chunk_hist_kernel's static arguments (hist per test)


def _hist_launch(hist):
    """chunk_hist_kernel bound through a (recording) launch runtime on the CPU: per call (topk_idx, T, NC)."""
    return Launch(torch.device("cpu")).bind(chunk_hist_kernel, dict(_HIST, hist_ptr=hist), ("topk_idx_ptr", "T", "NC"),
                                            grid=(1,))


def _direct_launch_world(group, how):
    rank = dist.get_rank(group)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    hist = torch.zeros(1, 5, dtype=torch.int32)
    if how == "launch":
        if rank == 1:  # a rank-dependent launch the recorder should see
            chunk_hist_kernel[(1,)](idx, hist, 4, 1, K=2, E=4, EB=4, BT=16, KB=2)
    else:  # the same collective and launch on both ranks, in a different order (a deadlock on a GPU)
        launch = _hist_launch(hist)
        if rank == 0:
            launch(idx, 4, 1)
        dist.distributed_c10d.all_reduce(torch.zeros(1), group=group)
        if rank == 1:
            launch(idx, 4, 1)
    return "done"


@pytest.mark.parametrize("how", [
    pytest.param("launch", marks=pytest.mark.xfail(strict=True, reason=(
        "by design: kernels launched directly (kernel[grid](...)) are not recorded; every signalling kernel must be a "
        "bound launch of the launch runtime, which test_every_signalling_kernel_is_a_bound_launch (this file) checks "
        "on the source"))),
    "c10d",  # collectives through torch.distributed.distributed_c10d are recorded (fixed)
])
def test_recorder_sees_direct_launches_and_c10d_collectives(how):
    from tritonep.testing import ProtocolMismatch

    with pytest.raises(ProtocolMismatch):
        run_cpu_world(2, _direct_launch_world, how, timeout_s=60)


def _rank_dependent_world(group, extra_on):
    rank = dist.get_rank(group)
    buf = tep.EPBuffer(group, 4, 64, 8, 2)
    x, idx, w = make_rank_inputs(rank, 8, 64, 4, 2, seed=1)
    d = buf.dispatch(x, idx, w)
    dist.all_reduce(torch.zeros(1), group=group)  # recorded as ("collective", "all_reduce") on every rank
    if rank == extra_on:  # a launch only this rank makes (harmless here, a deadlock or mis-pairing on a GPU)
        _hist_launch(torch.zeros(1, 5, dtype=torch.int32))(idx, 8, 1)
    buf.combine(d.x, d.handle)
    buf.close()
    return "done"


def test_recorder_fails_a_rank_dependent_launch():
    with pytest.raises(ProtocolMismatch) as ei:
        run_cpu_world(2, _rank_dependent_world, 1, timeout_s=60)
    msg = str(ei.value)
    assert "chunk_hist_kernel" in msg and "rank 1" in msg, msg
    seqs = ei.value.sequences
    assert len(seqs) == 2 and len(seqs[1]) == len(seqs[0]) + 1
    assert ("collective", "all_reduce") in seqs[0] and ("launch", "exchange_kernel", (1,)) in seqs[0], seqs[0]
    # the same world with no rank-dependent launch passes, and its sequences hold the dispatch/combine launches
    assert run_cpu_world(2, _rank_dependent_world, -1, timeout_s=60) == ["done", "done"]


def test_every_signalling_kernel_is_a_bound_launch():
    """Kernels launched directly (``name[grid](...)``) escape the recorder: none of them may signal or wait."""
    import pathlib
    import re

    root = pathlib.Path(tep.__file__).parent
    sources = {p: p.read_text() for p in root.rglob("*.py") if "testing" not in p.parts}  # test-only kernels aside
    bodies = {}
    for text in sources.values():
        for m in re.finditer(r"^def (\w+)\(.*?(?=^(?:@|def |class )|\Z)", text, re.S | re.M):
            bodies[m.group(1)] = m.group(0)
    signalling = re.compile(r"\b(signal_peers|signal_one|publish_epoch|publish_epoch_one|wait_all_ge|wait_ge)\(")

    def signals(name, seen=()):
        body = bodies.get(name, "")
        if signalling.search(body):
            return True
        return any(signals(c, seen + (name,)) for c in re.findall(r"\b(\w+)\(", body)
                   if c in bodies and c not in seen and c != name)

    direct = {m.group(1) for p, text in sources.items()
              for m in re.finditer(r"\b(\w+)\[[^\]]*\]\(", text) if m.group(1) in bodies}
    assert direct, "the scan found no direct launch at all (regex broken?)"
    bad = sorted(k for k in direct if signals(k))
    assert not bad, f"signalling kernels launched outside a bound launch (invisible to the recorder): {bad}"
