"""SIGINT / SIGTERM to the parent of a world: every rank ends within seconds, nothing is left behind.

A real ``tritonep run`` (CPU world) and scripts around ``run_cpu_world`` / ``run_gpu_world`` (ranks on the CPU
device) run in a subprocess; once their ranks are up, the parent alone gets the signal. The CLI prints one line and
exits 130 / 143; a library caller gets ``KeyboardInterrupt`` for SIGINT (after the cleanup) and, for SIGTERM, one line
and the default end by SIGTERM. In every case no rank process and no ``tritonep_world_*`` folder survives.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import ROOT


def _children(pid: int) -> list:
    """Live (not zombie) processes whose parent is ``pid`` (read from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def _alive(pids) -> list:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _default_sigint():
    """In the child between fork and exec: SIGINT and SIGQUIT take their default action."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _interrupt(argv, tmp_path, sig, ranks, ready_s=240, group=False, ready_files=False):
    """Start ``argv`` (TMPDIR = tmp_path), wait until ``ranks`` rank processes and the world's folder exist, send
    ``sig`` to the parent only (``group``: to its whole process group, as a terminal's Ctrl-C does); returns
    (returncode, stderr, seconds from the signal to the exit, rank pids)."""
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TQDM_DISABLE="1", COLUMNS="200", TRITON_INTERPRET="1")
    # SIGINT / SIGQUIT back to their defaults in the child: a shell starts background jobs with them ignored
    # (bash without job control: `cmd &`), Python keeps an inherited ignored SIGINT and the script would never see
    # KeyboardInterrupt (seen as SigIgn 0x...1007 in a CI run started with `nohup ... &`)
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=group, preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + ready_s
        kids = []
        while time.monotonic() < deadline and p.poll() is None:
            kids = _children(p.pid)
            if len(kids) >= ranks and list(tmp_path.glob("tritonep_world_*")):
                break
            time.sleep(0.2)
        assert p.poll() is None and len(kids) >= ranks, f"the world never started: {p.communicate()}"
        while ready_files and time.monotonic() < deadline and len(list(tmp_path.glob("ready*"))) < ranks:
            time.sleep(0.2)  # the script's ranks touch TMPDIR/ready<rank> once inside their work
        time.sleep(1.0)  # the ranks are inside their work now
        before = _signal_state(p.pid)
        t0 = time.monotonic()
        if group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say why: the parent's signal masks before / now and where it sleeps
            raise AssertionError(f"no exit 60 s after {signal.Signals(sig).name}; parent {p.pid} before the "
                                 f"signal: {before}; now: {_signal_state(p.pid)}") from None
        return p.returncode, err, time.monotonic() - t0, kids
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def _signal_state(pid: int) -> str:
    """SigBlk / SigIgn / SigCgt / Threads / State of ``pid`` and its kernel wait channel (/proc), for a failure."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        keep = [ln.replace("\t", " ") for ln in lines if ln.split(":")[0] in ("State", "Threads", "SigBlk", "SigIgn",
                                                                               "SigCgt")]
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        return "; ".join(keep) + f"; wchan {wchan}"
    except OSError as e:
        return f"unreadable ({e})"


def _nothing_left(kids, tmp_path):
    deadline = time.monotonic() + 5
    while _alive(kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(kids), f"rank processes outlived their parent: {_alive(kids)}"
    assert not list(tmp_path.glob("tritonep_world_*")), "the world's temporary folder was left behind"


@pytest.mark.parametrize("sig,code,ranks,group", [(signal.SIGINT, 130, 2, False), (signal.SIGTERM, 143, 3, False),
                                                   (signal.SIGINT, 130, 2, True)],
                         ids=["SIGINT", "SIGTERM", "Ctrl-C-to-the-group"])
def test_cli_run_interrupted_prints_one_line_and_leaves_nothing(tmp_path, sig, code, ranks, group):
    argv = [sys.executable, "-m", "tritonep.cli.main", "run", "--world-size", str(ranks), "--layers", "2", "--tokens",
            "4", "--steps", "500"]  # 3 ranks: the default expert count (66) fits the world size
    rc, err, took, kids = _interrupt(argv, tmp_path, sig, ranks=ranks, group=group)
    name = signal.Signals(sig).name
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == code, (rc, err)
    assert "Traceback" not in err, err
    assert [ln for ln in lines if "interrupted" in ln] == [
        f"tritonep run: interrupted by {name}: every rank stopped, temporary files removed"], err
    assert took < 15, f"{name}: {took:.1f} s from the signal to the exit"
    _nothing_left(kids, tmp_path)


_CPU_SCRIPT = """
import time
from tritonep.testing import run_cpu_world
run_cpu_world(2, lambda group: time.sleep(600), timeout_s=900)
"""

_GPU_SCRIPT = """
from tritonep.testing import run_gpu_world
from tests.testing import test_gpu_world  # the repository root is on PYTHONPATH (_interrupt)
run_gpu_world(2, test_gpu_world._sleep, 600, timeout_s=900, devices=["cpu"])
"""


@pytest.mark.parametrize("world", ["run_cpu_world", "run_gpu_world"])
def test_library_world_sigterm_kills_ranks_then_ends_by_sigterm(tmp_path, world):
    script = _CPU_SCRIPT if world == "run_cpu_world" else _GPU_SCRIPT
    rc, err, took, kids = _interrupt([sys.executable, "-c", script], tmp_path, signal.SIGTERM, ranks=2)
    assert rc == -signal.SIGTERM, (rc, err)  # the default end by SIGTERM: a shell reports 143
    assert "Traceback" not in err, err
    assert [ln for ln in err.splitlines() if "SIGTERM" in ln] == [
        "tritonep: SIGTERM: stopped 1 running world(s) (every rank killed, temporary files removed)"], err
    assert took < 15
    _nothing_left(kids, tmp_path)


_CPU_SIGINT_SCRIPT = """
import os, time
from tritonep.testing import run_cpu_world
def work(group):
    open(os.path.join(os.environ["TMPDIR"], "ready%d" % group.rank()), "w").close()
    time.sleep(600)
try:
    run_cpu_world(2, work, timeout_s=900)
except KeyboardInterrupt:
    raise SystemExit(130)  # the caller got KeyboardInterrupt, after the world's cleanup
"""


def test_library_cpu_world_sigint_is_keyboard_interrupt_after_cleanup(tmp_path):
    rc, err, took, kids = _interrupt([sys.executable, "-c", _CPU_SIGINT_SCRIPT], tmp_path, signal.SIGINT, ranks=2,
                                     ready_files=True)
    assert rc == 130 and "Traceback" not in err, (rc, err)
    assert took < 15
    _nothing_left(kids, tmp_path)
