"""What a new user meets on the first day: ``bench --help`` gives the profiles' shapes; every TRITONEP_* value is
refused when the command starts (before any world), naming the variable; a refusal names the flag the user typed
(``--layer``, ``--hidden`` with the wire's own block); a world that times out on a terminal prints its error on a
line of its own after the progress lines; a CSV row whose routes all score 0 is refused at FILE:LINE:COL."""

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import time

import pytest

from tritonep.bench.ep import PROFILES
from tritonep.cli.main import build_parser
from tritonep.cli.main import main as cli_main
from tritonep.data.routing_file import load_routing_csv
from tritonep.errors import DataError


def test_bench_help_gives_every_profile_shape():
    text = build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    for name, p in PROFILES.items():
        line = next((ln for ln in text.splitlines() if ln.split()[:1] == [name]), None)
        assert line is not None, f"profile {name} has no line in bench --help:\n{text}"
        tokens = str(p["tokens"]) if p["tokens"] else "trace/W"
        assert line.split()[1:5] == [str(p["hidden"]), str(p["num_experts"]), str(p["topk"]), tokens], line
        if "geometry" in p:
            assert f"TRITONEP_GEOMETRY={p['geometry']}" in line


@pytest.mark.parametrize("name,value", [
    ("TRITONEP_TIMEOUT_S", "-5"), ("TRITONEP_TIMEOUT_S", "0"), ("TRITONEP_TIMEOUT_S", "inf"),
    ("TRITONEP_TIMEOUT_S", "soon"), ("TRITONEP_SYNC_CHECKS", "maybe"), ("TRITONEP_NUM_SMS", "-1"),
    ("TRITONEP_MAX_PROGRAMS", "x"), ("TRITONEP_COMBINE", "puhs"), ("TRITONEP_GEOMETRY", "bt=3"),
    ("TRITONEP_GEOMETRY", "colour=red"), ("TRITONEP_CPU_HEAP_BYTES", "0"), ("TRITONEP_FAST_LAUNCH", "2"),
    ("TRITONEP_FORCE_NO_P2P", "yes"),
])
def test_bad_environment_refused_before_any_world(monkeypatch, capsys, name, value):
    import tritonep.testing as testing

    def no_world(*a, **k):
        raise AssertionError("a world started before the environment was checked")

    monkeypatch.setattr(testing, "run_cpu_world", no_world)
    monkeypatch.setattr(testing, "run_gpu_world", no_world)
    monkeypatch.setenv(name, value)
    for argv in (["run", "--tokens", "2", "--layers", "2"], ["plan"], ["bench", "dispatch", "--soak", "1"], ["env"]):
        t0 = time.monotonic()
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"tritonep {argv[0]}: error: ConfigError: "), err
        assert f"{name}={value!r}" in err[0] or f"{name} entry" in err[0], err
        assert time.monotonic() - t0 < 10, argv


@pytest.mark.parametrize("value", ["fc=1", "dec=128", "bt=2,grid=128"])
def test_geometry_valid_for_some_configuration_passes_the_start_check(monkeypatch, value):
    """TRITONEP_GEOMETRY entries valid for some configurations only (fc=1 alone: the table's fused roles, >= 1024
    tokens per rank on a GPU; dec=: <= 256 tokens per rank) pass the command's start-up check (``tritonep env`` and
    ``bench`` on 2 GPUs were refused for fc=1 because the check used a tiny CPU config); what no configuration takes is
    refused there (test above, and fc=1 with dec=)."""
    from tritonep.cli.main import check_environment
    from tritonep.errors import ConfigError

    monkeypatch.setenv("TRITONEP_GEOMETRY", value)
    check_environment()
    monkeypatch.setenv("TRITONEP_GEOMETRY", "fc=1,dec=128")  # the fused combine needs roles, decode turns them off
    with pytest.raises(ConfigError, match="TRITONEP_GEOMETRY"):
        check_environment()


@pytest.mark.parametrize("argv,line", [
    (["plan", "--layer", "99"], "tritonep plan: error: DataError: --layer 99: no layer 99 in the olmoe (arxiv) "
                                "histograms (its layers: 0 7 15)"),
    (["run", "--layers", "2", "99", "100"], "tritonep run: error: DataError: --layers 99 100: no layers 99 100 in the "
                                            "flame trace (its layers: 2 3 4 5 6 7 8 9)"),
    (["run", "--hidden", "100", "--dispatch-wire", "fp8"], "tritonep run: error: ConfigError: --hidden 100: "
     "--dispatch-wire fp8 quantizes hidden in blocks of 128 elements (one scale per block, no padding): use a "
     "multiple of 128, e.g. 128"),
    (["run", "--hidden", "96", "--combine-wire", "fp8_e5m2"], "tritonep run: error: ConfigError: --hidden 96: "
     "--combine-wire fp8_e5m2 quantizes hidden in blocks of 128 elements"),
    (["run", "--hidden", "100"], "tritonep run: error: ConfigError: --hidden 100 is not a multiple of 8"),
    (["run", "--hidden", "0"], "tritonep run: error: ConfigError: --hidden 0 must be a positive integer"),
    (["run", "--timeout", "-1"], "tritonep run: error: ConfigError: --timeout -1 must be a positive number of seconds"),
])
def test_refusals_name_the_flag_as_typed(capsys, argv, line):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line), err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CPU world")
@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_world_timeout_on_a_terminal_prints_progress_then_one_error_line(tmp_path):
    """On a terminal: the parent's progress lines (no rank draws a bar), then, when --timeout kills the world, the
    error on a line of its own (cleared first)."""
    main_fd, sub_fd = pty.openpty()
    fcntl.ioctl(sub_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # a terminal of 160 columns
    env = dict(os.environ, COLUMNS="200", TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "tritonep.cli.main", "run", "--world-size", "2", "--timeout", "6",
                          "--tokens", "4", "--layers", "2", "3", "--steps", "500"], stdin=subprocess.DEVNULL,
                         stdout=sub_fd, stderr=sub_fd, env=env)
    os.close(sub_fd)
    chunks = []
    while True:
        try:
            data = os.read(main_fd, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main_fd)
    assert p.wait(timeout=120) == 2
    text = b"".join(chunks).decode(errors="replace")
    assert "tritonep run: 2 ranks started; running 2 layers" in text, text  # the parent's progress line
    err = [ln for ln in text.replace("\r\n", "\n").split("\n") if "tritonep run: error:" in ln]
    assert len(err) == 1, text
    assert err[0].split("\r")[-1].startswith("\033[Ktritonep run: error: CPU world of 2:"), repr(err[0])
    assert "did not finish within 6 s" in err[0]


def test_csv_row_whose_routes_all_score_zero_is_refused(tmp_path):
    path = tmp_path / "zeros.csv"
    path.write_text("layer,token,e0,e1,s0,s1\n0,0,5,2,0.6,0.2\n0,1,7,5,0,0.0\n")
    with pytest.raises(DataError) as ei:
        load_routing_csv(str(path))
    msg = str(ei.value)
    assert msg.startswith(f"{path}:3:9: the scores of this row's routes are all 0"), msg
    assert "Leave the s-columns out" in msg
    ok = tmp_path / "fine.csv"  # a zero next to a positive score, and a dropped token (no valid route), are fine
    ok.write_text("layer,token,e0,e1,s0,s1\n0,0,5,2,0.6,0\n0,1,-1,-1,0,0\n")
    idx, w = load_routing_csv(str(ok)).routing(0)
    assert w.tolist() == [[1.0, 0.0], [0.0, 0.0]] and idx.tolist() == [[5, 2], [-1, -1]]
