"""The launch-sequence recorder of the CPU world (tritonep.testing.protocol): a rank-dependent launch or
collective fails the world (ProtocolMismatch naming the rank); collectives through distributed_c10d are recorded;
kernels launched directly are not, so no signalling kernel may be launched outside a Launcher (a source scan)."""

import pytest
import torch
import torch.distributed as dist

import tritonep as tep
from tritonep.runtime.launch import Launcher
from tritonep.backends.triton.kernels.layout import chunk_hist_kernel
from tritonep.testing import ProtocolMismatch, run_cpu_world
from tritonep.bench.cases import make_rank_inputs


def _direct_launch_world(group, how):
    from tritonep.runtime.launch import Launcher
    from tritonep.backends.triton.kernels.layout import chunk_hist_kernel

    rank = dist.get_rank(group)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    hist = torch.zeros(1, 5, dtype=torch.int32)
    if how == "launch":
        if rank == 1:  # a rank-dependent launch the recorder should see
            chunk_hist_kernel[(1,)](idx, hist, 4, 1, K=2, E=4, EB=4, BT=16, KB=2)
    else:  # the same collective and launch on both ranks, in a different order (a deadlock on a GPU)
        launch = Launcher(torch.device("cpu"))
        if rank == 0:
            launch(chunk_hist_kernel, (1,), idx, hist, 4, 1, K=2, E=4, EB=4, BT=16, KB=2)
        dist.distributed_c10d.all_reduce(torch.zeros(1), group=group)
        if rank == 1:
            launch(chunk_hist_kernel, (1,), idx, hist, 4, 1, K=2, E=4, EB=4, BT=16, KB=2)
    return "done"


@pytest.mark.parametrize("how", [
    pytest.param("launch", marks=pytest.mark.xfail(strict=True, reason=(
        "by design: kernels launched directly (kernel[grid](...)) are not recorded; every signalling kernel must go "
        "through a Launcher, which test_every_signalling_kernel_is_launched_through_a_launcher (this file) checks on "
        "the source"))),
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
        launch = Launcher(torch.device("cpu"))
        launch(chunk_hist_kernel, (1,), idx, torch.zeros(1, 5, dtype=torch.int32), 8, 1, K=2, E=4, EB=4, BT=16,
               KB=2)
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


def test_every_signalling_kernel_is_launched_through_a_launcher():
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

    direct = {m.group(1) for p, text in sources.items() if p.name != "launch.py"
              for m in re.finditer(r"\b(\w+)\[[^\]]*\]\(", text) if m.group(1) in bodies}
    assert direct, "the scan found no direct launch at all (regex broken?)"
    bad = sorted(k for k in direct if signals(k))
    assert not bad, f"signalling kernels launched outside a Launcher (invisible to the recorder): {bad}"
