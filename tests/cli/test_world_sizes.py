"""World sizes on the command line (issues 23 and 29): the defaults of ``tritonep run`` / ``tritonep plan`` fit
every world size the commands accept, and ``--world-size`` / ``--mps`` are documented in ``--help``."""

import os
import subprocess
import sys

import pytest

from tritonep.cli.main import build_parser
from tritonep.cli.run import _check_settings, _settings


@pytest.mark.parametrize("routing", ["flame", "olmoe"])
@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "gpu"])
def test_default_expert_count_fits_every_world_size(routing, on_gpu):
    """``tritonep run --world-size 3`` failed: 64 experts do not split over 3 ranks. The default is now the
    smallest multiple of the world size that holds the source's 64 experts (66 for 3 ranks), for 1..64 ranks."""
    for W in range(1, 65):
        args = build_parser().parse_args(["run", "--routing", routing, "--world-size", str(W)])
        s = _settings(args, on_gpu, W)
        assert s["num_experts"] % W == 0 and 64 <= s["num_experts"] < 64 + W, (W, s["num_experts"])
        _check_settings(s, W)  # the layer's own checks (what refused world size 3)
    assert _settings(build_parser().parse_args(["run", "--world-size", "3"]), on_gpu, 3)["num_experts"] == 66


def test_plan_default_experts_at_three_ranks():
    env = dict(os.environ, COLUMNS="200")
    p = subprocess.run([sys.executable, "-m", "tritonep.cli.main", "plan", "--world-size", "3"], capture_output=True,
                       text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "balancedness" in p.stdout


def test_help_documents_shared_ranks_and_mps():
    for cmd in ("run", "bench"):
        text = " ".join(build_parser()._subparsers._group_actions[0].choices[cmd].format_help().split())
        assert "--mps {off,on,auto}" in text and "measure nothing about NVLink" in text, cmd
