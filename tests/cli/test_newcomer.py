"""What a newcomer meets: every bad value is one line on stderr and exit 2 before any world starts or any tensor of its
size is allocated (ids beyond int64 in routing files, sizes that cannot fit in memory, world size below 1, an
interpreter setting that makes no sense without a GPU), the ``cpu-smoke`` profile runs without a GPU, and the training
example writes its plot to an output folder. ``tritonep run``'s progress lines from the parent: tests/cli/
test_routing_option.py (``test_run_on_a_json_histogram_with_more_experts``, which runs a world anyway)."""

import json
import os
import time

import pytest
import torch

from tritonep.cli.main import main as cli_main
from tritonep.cli.memory import RunMemory, check_device_memory, check_host_memory
from tritonep.errors import ConfigError

from tests import ROOT, load_script


@pytest.fixture
def no_world(monkeypatch):
    """Make any world start fail the test: refusals must come before one."""
    import tritonep.testing as testing

    def refuse(*a, **k):
        raise AssertionError("a world started before the refusal")

    monkeypatch.setattr(testing, "run_cpu_world", refuse)
    monkeypatch.setattr(testing, "run_gpu_world", refuse)


def _one_line(capsys, head: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(head), err
    return err[0]


@pytest.mark.parametrize("field,text", [("e0", "99999999999999999999999"), ("token", "-9223372036854775809"),
                                        ("layer", "18446744073709551616")])
def test_routing_csv_ints_beyond_int64_are_one_line(tmp_path, capsys, no_world, field, text):
    row = {"layer": "0", "token": "1", "e0": "3", "e1": "2"}
    row[field] = text
    path = tmp_path / "big.csv"
    path.write_text("layer,token,e0,e1\n" + ",".join(row.values()) + "\n0,2,7,5\n")
    col = 1 + len(",".join(list(row.values())[: list(row).index(field)] + [""]))
    t0 = time.monotonic()
    assert cli_main(["run", "--routing", str(path)]) == 2
    line = _one_line(capsys, f"tritonep run: error: DataError: {path}:2:{col}: column '{field}': {text} is outside "
                             f"the 64-bit integer range")
    assert "int64" in line and time.monotonic() - t0 < 10


def test_routing_json_counts_beyond_2_53_are_one_line(tmp_path, capsys, no_world):
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"counts_per_layer": [[3, 10 ** 30]]}))
    assert cli_main(["run", "--routing", str(path)]) == 2
    _one_line(capsys, f"tritonep run: error: DataError: {path}:1:27: histogram 0, expert 1: {10 ** 30} routes")
    path.write_text(json.dumps({"counts_per_layer": [[2 ** 53, 2 ** 53]]}))  # each fits, their sum does not
    assert cli_main(["plan", "--routing", str(path)]) == 2
    _one_line(capsys, f"tritonep plan: error: DataError: {path}:1:23: histogram 0 counts {2 ** 54} routes in all")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU world's host memory")
def test_sizes_that_cannot_fit_are_refused_before_any_allocation(tmp_path, capsys, no_world):
    t0 = time.monotonic()
    assert cli_main(["run", "--hidden", "100000000"]) == 2
    line = _one_line(capsys, "tritonep run: error: ConfigError: --hidden 100000000, --intermediate 32, 64 experts")
    assert "of memory available" in line and "router 25.6 GB" in line, line
    path = tmp_path / "wide.csv"  # an id that fits int64 but makes E huge
    path.write_text("layer,token,e0,e1\n0,0,1000000000000,2\n0,1,7,5\n")
    assert cli_main(["run", "--routing", str(path)]) == 2
    _one_line(capsys, "tritonep run: error: ConfigError: --hidden 64, --intermediate 32, 1000000000004 experts")
    assert time.monotonic() - t0 < 10


def _settings(**kw):
    s = dict(hidden=7168, intermediate=2048, num_experts=256, topk=8, tokens=4096, total_tokens=8192,
             dispatch_wire="bf16", combine_wire="bf16", combine="push", balance="none", expert_alignment=1, check=True)
    s.update(kw)
    return s


def test_memory_bounds_name_the_parts_and_pass_what_fits():
    m = RunMemory(_settings(), 2, "cpu")
    assert m.router == 4 * 256 * 7168 and m.experts == 24 * 128 * 7168 * 2048
    assert m.reference == 24 * 256 * 7168 * 2048 + 4 * 8192 * 8 * 7168 + 8 * 8192 * 7168
    assert RunMemory(_settings(check=False), 2, "cpu").reference == 0
    check_host_memory(m, 2, cpu_world=True, available=2 * m.rank + m.reference + m.results)
    with pytest.raises(ConfigError, match=r"the ranks need at least .* GB each \(router"):
        check_host_memory(m, 2, cpu_world=True, available=2 * m.rank - 1)
    with pytest.raises(ConfigError, match="dense reference check needs at least"):
        check_host_memory(m, 2, cpu_world=False, available=m.results - 1)
    check_device_memory(m, free=2 * m.rank, sharing=2)
    with pytest.raises(ConfigError, match="shared by 2 ranks"):
        check_device_memory(m, free=2 * m.rank - 2, sharing=2)
    with pytest.raises(ConfigError, match="on cuda:0"):
        check_device_memory(m, free=m.rank, sharing=1, total=m.reference - 1)


def test_bench_world_size_below_one_is_refused_by_the_parser(capsys):
    for argv in (["bench", "dispatch", "--world-size", "0"], ["bench", "moe", "--soak", "1", "--world-size", "-2"]):
        with pytest.raises(SystemExit) as ei:
            cli_main(argv)
        assert ei.value.code == 2
        _one_line(capsys, "tritonep bench: error: argument --world-size: ")


@pytest.mark.parametrize("flag", ["--tokens", "--iters"])
def test_bench_tokens_and_iters_below_one_are_refused_by_the_parser(capsys, flag):
    with pytest.raises(SystemExit) as ei:
        cli_main(["bench", "moe", "--profile", "cpu-smoke", flag, "0"])
    assert ei.value.code == 2
    _one_line(capsys, f"tritonep bench: error: argument {flag}: ")


def test_tritonep_without_a_command_names_the_commands(capsys):
    with pytest.raises(SystemExit) as ei:
        cli_main([])
    assert ei.value.code == 2
    line = _one_line(capsys, "tritonep: error: the following arguments are required: ")
    assert "{run,bench,plan,env}" in line and "cmd" not in line.split("(see")[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
@pytest.mark.parametrize("value", ["0", "false"])
def test_interpreter_turned_off_without_a_gpu_is_explained(monkeypatch, capsys, no_world, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    for argv in (["run"], ["bench", "dispatch", "--soak", "1"]):
        assert cli_main(argv) == 2
        line = _one_line(capsys, f"tritonep {argv[0]}: error: ConfigError: TRITON_INTERPRET={value} asks Triton to "
                                 f"compile the kernels for a GPU, but this machine has no CUDA GPU")
        assert "unset TRITON_INTERPRET" in line
    assert cli_main(["plan"]) == 0  # the planner's plan runs no kernel: nothing to refuse
    capsys.readouterr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the profile")
@pytest.mark.slow  # a CPU world of every wire and backend: ~6 s on 2 cores
def test_cpu_smoke_profile_runs_from_the_cli(tmp_path, capsys):
    out_json = tmp_path / "smoke.json"
    assert cli_main(["bench", "dispatch", "--profile", "cpu-smoke", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "CPU world of 2 ranks" in out and "tritonep[nccl].dispatch.bf16" in out and "FAILED" not in out, out
    rows = [r for rs in json.loads(out_json.read_text())["rows"] for r in rs]
    assert rows and all(r["checked"] for r in rows)
    # one row per point: on a CPU the graph and eager timings are one eager call, shown once
    for rs in json.loads(out_json.read_text())["rows"]:
        ops = [(r["op"], r["mode"]) for r in rs]
        assert len(ops) == len(set(ops)), ops


def test_train_example_plots_into_its_output_folder(tmp_path):
    """``--plot`` draws OUT/loss.png (default out/train_moe, git-ignored); the tracked docs image is never a target:
    the old form ``--plot docs/train_moe_loss.png`` is refused by the parser."""
    pytest.importorskip("matplotlib")
    mod = load_script("examples/train_moe.py")
    args = mod.parse_args(["--plot"])
    assert mod.plot_path(args) == os.path.join("out", "train_moe", "loss.png")
    args = mod.parse_args(["--plot", "--out", str(tmp_path / "o")])
    mod.write_outputs(args, 0, [4.0, 3.0, 2.5], 4)
    assert (tmp_path / "o" / "loss.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as ei:
        mod.parse_args(["--plot", str(ROOT / "docs" / "train_moe_loss.png")])
    assert ei.value.code == 2


def test_train_example_plot_title_names_the_runs_dp_and_ep():
    """The loss curve's title says the split the run used (``--ep 4`` in the 4-rank CPU world is DP 1 x EP 4), and
    ``--help`` shows the usage lines (CPU world, torchrun, checkpoint and resume) with every default."""
    mod = load_script("examples/train_moe.py")
    assert "DP 2 x EP 2" in mod.plot_title(mod.parse_args([]), 4)
    assert "DP 1 x EP 4" in mod.plot_title(mod.parse_args(["--ep", "4"]), 4)
    assert "DP 4 x EP 2" in mod.plot_title(mod.parse_args([]), 8)
    text = _help_of(mod)
    for part in ("no GPU: a 4-rank CPU world", "--resume --ckpt out/ck --ep 4", "default 300", "default 3e-3"):
        assert part in text, part


def _help_of(mod) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        mod.parse_args(["--help"])
    return buf.getvalue()
