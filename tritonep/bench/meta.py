"""What every benchmark JSON records about its run (``meta``): the command, the code, the versions, the GPU, the date.

``scripts/results_index.py add`` turns such a JSON into the benchmark's current result under
``benchmarks/results/`` and fills what a run could not know (the commit, when the GPU machine's copy of the tree
has no git).
"""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys

import torch

from .. import envs

__all__ = ["run_meta", "command_line"]


def command_line(argv: list[str] | None = None) -> str:
    """The command that started this process, as a user would type it again: ``torchrun --nproc-per-node N`` in front
    under torchrun, else ``python``; every ``TRITONEP_*`` variable that is set in front of it."""
    argv = list(sys.argv if argv is None else argv)
    if envs.get("TORCHELASTIC_RUN_ID") is not None:
        launcher = f"torchrun --nproc-per-node {envs.get('LOCAL_WORLD_SIZE', '1')}"
    else:
        launcher = "python"
    if argv and argv[0] == "-m":
        argv = argv[1:]
    elif argv and argv[0].endswith("__main__.py"):  # python -m tritonep.cli.main: argv[0] is the module's file
        argv = ["-m", "tritonep.cli.main"] + argv[1:]
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(envs.snapshot().items())]
    return " ".join(env + [launcher] + [shlex.quote(a) for a in argv])


def _commit() -> str | None:
    """``git rev-parse --short HEAD`` of the checkout this file is in, ``+`` when it has uncommitted changes; None
    outside a git checkout (the GPU machine's copy of the tree)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_meta(**extra) -> dict:
    """``meta`` of a benchmark JSON: ``command`` (:func:`command_line`), ``commit`` (None without git), ``torch``,
    ``triton``, ``cuda`` (torch's CUDA version), ``nccl``, ``gpu`` (device 0's name, or ``"cpu"``), ``date``
    (UTC, ISO 8601), plus ``extra``."""
    import triton

    cuda = torch.cuda.is_available()
    meta = dict(command=command_line(), commit=_commit(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                gpu=torch.cuda.get_device_name(0) if cuda else "cpu",
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    meta.update(extra)
    return meta
