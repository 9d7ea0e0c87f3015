"""torchrun without a GPU (issue 29): ``examples/torchrun_moe.py`` runs on a gloo group with ``backend="nccl"``, an
EPBuffer and an MoE layer outside ``run_cpu_world``, and exits 0 with its one result line (it used to exit 1 with a
message, which torchrun turns into its own ChildFailedError traceback). README, "Two GPUs with torchrun" and "On
the GPU machine"."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path of the example (GPUs: the device machine)")
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this Python")
def test_torchrun_example_without_gpu_runs_on_gloo_with_the_nccl_backend():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # the example sets it itself, before tritonep's kernels are imported
    p = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node", "2",  # --standalone: a free port
                          str(ROOT / "examples" / "torchrun_moe.py")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # torchrun and its two workers: nothing left behind
        stdout, stderr = p.communicate()
        pytest.fail(f"torchrun did not finish in 300 s:\n{stdout}{stderr}")
    out = stdout + stderr
    assert p.returncode == 0, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    line = [ln for ln in stdout.splitlines() if ln.startswith("world 2 on cpu")]
    assert len(line) == 1 and "nccl backend" in line[0] and "backward done" in line[0], stdout
