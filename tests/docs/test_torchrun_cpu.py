"""The examples without a GPU. ``torchrun ... examples/torchrun_moe.py`` runs on a gloo group with
``backend="nccl"``, an EPBuffer and an MoE layer outside ``run_cpu_world``, and exits 0 with its one result line (a
non-zero exit of a worker would become torchrun's own ChildFailedError traceback). ``examples/train_moe.py`` runs
from ``python`` (the README's command) and under torchrun. docs/integrations.md, "torchrun"; README, "Train a real
model"."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import ROOT

TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")


def _run(argv, env_extra=None, timeout=300):
    """``argv`` in a fresh process group from the repository root, TRITON_INTERPRET unset (the examples set it
    themselves, before tritonep's kernels are imported); ``(returncode, stdout, stderr)``. On a timeout every process
    of the group (torchrun and its workers) is killed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {}))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(f"{argv} did not finish in {timeout} s:\n{stdout}{stderr}")
    return p.returncode, stdout, stderr


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU paths of the examples (GPUs: the device "
                                                              "machine)")
NEEDS_TORCHRUN = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not installed next to this Python")


@NO_GPU
@NEEDS_TORCHRUN
@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_torchrun_example_without_gpu_runs_on_gloo_with_the_nccl_backend():
    rc, stdout, stderr = _run([TORCHRUN, "--standalone", "--nproc-per-node", "2",  # --standalone: a free port
                               str(ROOT / "examples" / "torchrun_moe.py")])
    out = stdout + stderr
    assert rc == 0, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    line = [ln for ln in stdout.splitlines() if ln.startswith("world 2 on cpu")]
    assert len(line) == 1 and "nccl backend" in line[0] and "backward done" in line[0], stdout


@NO_GPU
@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_torchrun_example_from_python_without_gpu_runs_in_a_cpu_world():
    """``python examples/torchrun_moe.py`` (the README's command without a GPU), TRITON_INTERPRET unset: the example
    imports torch._dynamo, which imports triton.language, so it sets the variable before that import (else Triton's
    library functions are compiled ones, which the interpreted kernels cannot call, and run_cpu_world refuses)."""
    rc, stdout, stderr = _run([sys.executable, str(ROOT / "examples" / "torchrun_moe.py")])
    assert rc == 0, stdout + stderr
    line = [ln for ln in stdout.splitlines() if ln.startswith("world 2 on cpu")]
    assert len(line) == 1 and "triton backend" in line[0] and "backward done" in line[0], stdout + stderr


@NO_GPU
@pytest.mark.slow  # 4.5 s on 2 cores: CI's second step
def test_torchrun_example_leaves_its_group_to_destroy_process_group(tmp_path):
    """``examples/torchrun_moe.py``'s imports, in its order, then its ``main`` on a gloo group (world 1, the nccl
    backend): afterwards nothing but torch's own registry holds the group, so ``destroy_process_group`` ends it
    while the interpreter is alive. torch's custom ops import torch._dynamo on their first call, which binds the
    default group into default arguments when the group exists already: the group then lived until the interpreter's
    exit, where destroying a gloo group can abort the process (the example imports torch._dynamo first)."""
    code = textwrap.dedent(f"""
        import gc, os, sys
        os.environ["TRITON_INTERPRET"] = "1"
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import torchrun_moe as example
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method={"file://" + str(tmp_path / "store")!r}, rank=0, world_size=1)
        group = dist.group.WORLD
        before = sys.getrefcount(group)
        example.main(group, backend="nccl")
        gc.collect()
        print("references", before, sys.getrefcount(group))
        dist.destroy_process_group()
    """)
    rc, stdout, stderr = _run([sys.executable, "-c", code])
    assert rc == 0, stdout + stderr
    refs = [ln.split()[1:] for ln in stdout.splitlines() if ln.startswith("references")]
    assert len(refs) == 1 and refs[0][0] == refs[0][1], stdout + stderr


@NO_GPU
@NEEDS_TORCHRUN
@pytest.mark.slow  # 17 s on 2 cores: CI second step
def test_train_example_under_torchrun_and_python_without_gpu():
    """``examples/train_moe.py``: ``python examples/train_moe.py`` (the README's command) imported tritonep's
    kernels before choosing the interpreter and was refused; under torchrun it exited 1 (torchrun's traceback).
    Both now train, with the same losses (the EP groups use the nccl backend either way)."""
    steps = ["--steps", "2"]
    rc, stdout, stderr = _run([sys.executable, str(ROOT / "examples" / "train_moe.py"), *steps])
    assert rc == 0, stdout + stderr
    world = [ln for ln in stdout.splitlines() if ln.startswith("step")]
    rc, stdout, stderr = _run([TORCHRUN, "--standalone", "--nproc-per-node", "4",
                               str(ROOT / "examples" / "train_moe.py"), *steps])
    assert rc == 0 and "Traceback" not in stdout + stderr, stdout + stderr
    assert [ln for ln in stdout.splitlines() if ln.startswith("step")] == world and len(world) == 2, (world, stdout)
