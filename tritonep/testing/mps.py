"""A private CUDA MPS control daemon for one GPU world (ranks that share a GPU run at once instead of time-slicing).

``nvidia-cuda-mps-control -d`` with ``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY`` pointing into the world's
own temporary folder starts a daemon that only this world's ranks (which get the same two variables) connect to;
``echo quit | nvidia-cuda-mps-control`` with the same variables stops it. Any other CUDA process keeps using the GPU
without MPS. Measured on one H200 (docs/platform.md): a cross-rank flag round trip takes 204 us (2 ranks) / 86 us
(4 ranks) under MPS against 2.5 / 4.5 ms time-sliced. The daemon needs the right to start MPS on the GPU (root on
our GPU machine). Source: NVIDIA's MPS documentation (control daemon commands, the pipe / log directory variables).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from .. import envs
from ..errors import ConfigError

__all__ = ["MpsDaemon", "MpsUnavailable", "CONTROL", "external_mps_pipe"]

CONTROL = "nvidia-cuda-mps-control"
"""The MPS control program (looked up on ``PATH``)."""


class MpsUnavailable(ConfigError):
    """The MPS daemon could not be started; the message is one line saying why."""


def external_mps_pipe(environ=None) -> str | None:
    """The pipe folder of an MPS daemon that this process's CUDA children would join without being asked:
    ``CUDA_MPS_PIPE_DIRECTORY``, or NVIDIA's default ``/tmp/nvidia-mps``, when its ``control`` pipe exists; else
    None. Ranks that share a GPU under such a daemon run at once, so they need the same grid cap as under ours."""
    env = envs.environ() if environ is None else environ
    d = env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return d if os.path.exists(os.path.join(d, "control")) else None


def _one_line(text: str, limit: int = 200) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


class MpsDaemon:
    """One MPS control daemon with private pipe and log folders under ``root``.

    Args:
        root: a folder the world owns (its temporary folder); ``root/mps_pipe`` and ``root/mps_log`` are made.
        control: the control program (default: ``nvidia-cuda-mps-control`` found on ``PATH``).
        timeout_s: bound of every call of the control program and of the wait for the daemon to answer.

    Use :meth:`start` before the ranks start (they need :meth:`env`) and :meth:`stop` after every rank ended.
    """

    def __init__(self, root: str, control: str | None = None, timeout_s: float = 20.0):
        self.root = root
        self.pipe_dir = os.path.join(root, "mps_pipe")
        self.log_dir = os.path.join(root, "mps_log")
        self.control = control or shutil.which(CONTROL)
        self.timeout_s = float(timeout_s)
        self.running = False

    def env(self) -> dict:
        """The variables that bind a process to this daemon (every rank sets them before it touches CUDA)."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def start_command(self) -> list:
        """``[control, "-d"]`` (run with :meth:`env` added to the environment)."""
        return [self.control or CONTROL, "-d"]

    def _call(self, args: list, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(args, input=stdin, env={**envs.environ(), **self.env()}, capture_output=True, text=True,
                              timeout=self.timeout_s)

    def _answers(self) -> bool:
        try:
            return self._call([self.control], "get_server_list\n").returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def start(self) -> "MpsDaemon":
        """Start the daemon and wait until it answers.

        Raises:
            MpsUnavailable: the control program is missing, exits with an error, or the daemon never answers
                (one line naming the command and its output).
        """
        if not self.control:
            raise MpsUnavailable(f"MPS: {CONTROL} is not on PATH (it comes with the NVIDIA driver)")
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        cmd = self.start_command()
        try:
            p = self._call(cmd)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MpsUnavailable(f"MPS: `{' '.join(cmd)}` failed: {_one_line(e)}") from None
        if p.returncode != 0:
            raise MpsUnavailable(f"MPS: `{' '.join(cmd)}` exited {p.returncode}: "
                                 f"{_one_line(p.stderr or p.stdout or 'no output')}")
        self.running = True
        deadline = time.monotonic() + self.timeout_s
        while not self._answers():
            if time.monotonic() > deadline:
                self.stop()
                raise MpsUnavailable(f"MPS: the daemon started by `{' '.join(cmd)}` did not answer within "
                                     f"{self.timeout_s:.0f} s (log: {self.log_dir}/control.log)")
            time.sleep(0.1)
        return self

    def stop(self) -> bool:
        """Ask the daemon to quit (after the ranks ended) and wait until it stops answering; True when it did.

        Never raises: a daemon that does not quit within ``timeout_s`` is reported by the return value.
        """
        if not self.running:
            return True
        self.running = False
        try:
            self._call([self.control], "quit\n")
        except (OSError, subprocess.TimeoutExpired):
            return False
        deadline = time.monotonic() + self.timeout_s
        while self._answers():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True
