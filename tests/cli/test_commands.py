"""The ``tritonep`` command line: every subcommand's CPU behaviour and its error messages (exit codes 0 / 1 / 2).

``tritonep run`` itself (the main job) runs in CI through the README's first command; here only its help and a
refused option are checked, to keep the suite short.
"""

import json
import os
import subprocess
import sys

import pytest
import torch


def _cli(*argv, timeout=600):
    env = dict(os.environ, COLUMNS="200")  # rich wraps at the terminal width
    p = subprocess.run([sys.executable, "-m", "tritonep.cli.main", *argv], capture_output=True, text=True,
                       timeout=timeout, env=env)
    return p.returncode, p.stdout + p.stderr


def test_env_prints_versions_and_backend_choice():
    rc, out = _cli("env")
    assert rc == 0, out
    assert "torch" in out and "triton" in out


def test_env_names_what_must_come_after_the_interpreter_variable(monkeypatch):
    """The TRITON_INTERPRET line of a command that chose the interpreter itself names everything that must be
    imported after the variable is set: tritonep's kernels and triton.language, which torch._dynamo imports too
    (docs/platform.md, CPU interpret mode)."""
    from tritonep.cli.env import INTERPRET_SET_BY_CLI, collect_env

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(INTERPRET_SET_BY_CLI, "1")
    text = collect_env()["TRITON_INTERPRET"]
    assert text.startswith("1 (set by the tritonep command") and "tritonep's kernels" in text, text
    assert "triton.language" in text and "torch._dynamo" in text, text


def test_plan_on_a_histogram(tmp_path):
    out_json = tmp_path / "plan.json"
    rc, out = _cli("plan", "--world-size", "4", "--num-experts", "64", "--json", str(out_json))
    assert rc == 0, out
    res = json.loads(out_json.read_text())
    assert res, "empty plan JSON"


def test_bench_soak_on_cpu_is_checked():
    rc, out = _cli("bench", "dispatch", "--soak", "3")
    assert rc == 0, out
    assert "all equal to the" in " ".join(out.split())  # rich may wrap the line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU messages")
@pytest.mark.parametrize("op", ["dispatch", "combine", "moe", "planner"])
def test_bench_without_gpu_says_what_it_needs(op):
    rc, out = _cli("bench", op)
    assert rc == 2, out
    assert "GPU" in out
    if op != "planner":  # the cpu-smoke profile of --help runs from the CLI (tests/cli/test_newcomer.py)
        assert f"tritonep bench {op} --profile cpu-smoke" in " ".join(out.split()), out


def test_bench_unknown_profile_lists_the_valid_ones():
    rc, out = _cli("bench", "dispatch", "--profile", "nope")
    assert rc == 2, out
    for name in ("deepseek-v3", "decode", "qwen3-moe", "real-trace"):
        assert name in out


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_run_help_and_bad_layer():
    rc, out = _cli("run", "--help")
    assert rc == 0 and "--routing" in out and "--balance" in out
    assert "(default: None)" not in out and "(default: )" not in out  # no empty / doubled defaults
    rc, out = _cli("run", "--layers", "99", "--no-check")
    assert rc == 2, out
    assert "99" in out
    rc, out = _cli("run", "--hidden", "100", "--layers", "2")  # refused before any rank starts, naming the flag
    assert rc == 2 and "--hidden 100 is not a multiple of 8" in out and "Traceback" not in out, out
    rc, out = _cli("run", "--hidden", "64", "--dispatch-wire", "fp8", "--layers", "2")
    assert rc == 2 and "--dispatch-wire fp8 quantizes hidden in blocks of 128" in out and "Traceback" not in out, out


def test_bench_plot_writes_a_png(tmp_path):
    from tritonep.bench.plot import plot_gbps_vs_tokens

    rows = [dict(op=op, tokens=t, num_sms=s, nvlink_gbps=t / 64.0 + s, logical_gbps=1.0)
            for op in ("tritonep.dispatch.bf16", "nccl.a2a") for t in (128, 1024, 4096) for s in (0, 24)]
    path = tmp_path / "gbps.png"
    assert plot_gbps_vs_tokens(rows, str(path)) == 4
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nvlink_gbps"):
        plot_gbps_vs_tokens([dict(op="x")], str(path))


def test_run_default_hidden_follows_the_wire_block_as_its_help_says():
    from tritonep.cli.main import build_parser
    from tritonep.cli.run import _settings

    parser = build_parser()
    for wire, hidden in (("bf16", 64), ("mxfp4", 64), ("fp8", 128), ("fp8_e5m2", 128)):
        args = parser.parse_args(["run", "--dispatch-wire", wire, "--layers", "2"])
        assert _settings(args, on_gpu=False, world_size=2)["hidden"] == hidden, wire
    assert _settings(parser.parse_args(["run", "--layers", "2"]), on_gpu=True, world_size=2)["hidden"] == 2048
    run_help = next(a for a in parser._subparsers._group_actions[0].choices["run"]._actions if a.dest == "hidden").help
    assert "2048" in run_help and "64" in run_help and "128 with fp8" in run_help
