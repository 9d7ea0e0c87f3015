"""``--routing PATH`` of ``tritonep run`` / ``tritonep plan`` (a user's own routing file), the one-line refusals
(exit 2) of every subcommand, and the load plots."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tritonep.cli.main import main as cli_main


def _cli(*argv, timeout=300, env=None):
    env = dict(os.environ, COLUMNS="200", **(env or {}))
    p = subprocess.run([sys.executable, "-m", "tritonep.cli.main", *argv], capture_output=True, text=True,
                       timeout=timeout, env=env)
    return p.returncode, p.stdout, p.stderr


def write_trace_csv(path, layers, tokens, num_experts, topk, seed=0, scores=True):
    """A CSV in the packaged trace's format from random routing: distinct ids per token, random positive scores."""
    g = torch.Generator().manual_seed(seed)
    cols = ["layer", "token"] + [f"e{k}" for k in range(topk)] + ([f"s{k}" for k in range(topk)] if scores else [])
    lines = [",".join(cols)]
    for layer in layers:
        for t in range(tokens):
            ids = torch.randperm(num_experts, generator=g)[:topk].tolist()
            sc = sorted(torch.rand(topk, generator=g).tolist(), reverse=True)
            lines.append(",".join([str(layer), str(t)] + [str(e) for e in ids]
                                  + ([f"{s:.6f}" for s in sc] if scores else [])))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_run_on_a_random_csv_trace_passes(tmp_path):
    """The acceptance test of --routing: a CSV written here from random routing runs through `tritonep run` and passes."""
    csv = write_trace_csv(tmp_path / "mine.csv", layers=[0, 5], tokens=24, num_experts=8, topk=2)
    out_json = tmp_path / "run.json"
    rc, out, err = _cli("run", "--routing", csv, "--world-size", "2", "--tokens", "8", "--json", str(out_json))
    assert rc == 0, out + err
    assert "all checks passed" in out and "E=8" in out and "16 tokens per layer (8 per rank)" in out, out
    res = json.loads(out_json.read_text())
    assert [r["layer"] for r in res["layers"]] == [0, 5] and all(r["ok"] for r in res["layers"])
    assert res["settings"]["num_experts"] == 8 and res["settings"]["topk"] == 2  # both read from the file
    assert all(r["tokens"] == 16 for r in res["layers"])


def test_run_on_a_json_histogram_with_more_experts(tmp_path, capsys):
    h = tmp_path / "h.json"
    h.write_text(json.dumps({"layers": [4], "topk": 2, "counts_per_layer": [[30, 10, 5, 1, 0, 9]]}))
    rc = cli_main(["run", "--routing", str(h), "--world-size", "2", "--tokens", "4", "--num-experts", "8"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "all checks passed" in out.out and "E=8, top-2" in out.out
    # progress: one line per layer on stderr from the command's own process (a log shows the run advancing)
    err = out.err.splitlines()
    want = ["tritonep run: 2 ranks started; running 1 layer (forward + backward)",
            "tritonep run: layer 4 done (1 of 1) in ",
            "tritonep run: checking 1 layer against the dense single-process reference"]
    assert len(err) == len(want) and all(e.startswith(w) for e, w in zip(err, want)), err


def test_run_without_check_says_so(tmp_path, capsys):
    """``--no-check`` runs no reference: the table and the last line say "not checked", never "pass", and the JSON's
    ``ok`` is None (a timing-only run must not read as a verified one)."""
    h = tmp_path / "h.json"
    h.write_text(json.dumps({"layers": [4], "topk": 2, "counts_per_layer": [[30, 10, 5, 1, 0, 9]]}))
    out_json = tmp_path / "run.json"
    rc = cli_main(["run", "--routing", str(h), "--world-size", "2", "--tokens", "4", "--num-experts", "8",
                   "--no-check", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "not checked" in out and "outputs not checked (--no-check)" in out, out
    assert "pass" not in out and "all checks passed" not in out, out
    assert [r["ok"] for r in json.loads(out_json.read_text())["layers"]] == [None]


REFUSALS = {  # case: (file text, or None for the random trace of 10 tokens x top-2 over 16 experts; flags; pattern)
    "num_experts_too_small": (None, ["--num-experts", "8"], r"{csv}:\d+:\d+: expert id \d+ does not fit "
                                                            r"--num-experts=8"),
    "tokens_beyond_trace": (None, ["--tokens", "6"], r"--tokens 6: 2 ranks x 6 = 12 tokens per layer, but the trace "
                                                     r"{csv} has 10 tokens per layer"),
    "topk_differs": (None, ["--topk", "3"], r"--topk 3: .* K=2"),
    "bad_layer": (None, ["--layers", "1"], r"--layers 1: no layer 1 in the trace .* \(its layers: 0\)"),
    "ragged_row": ("layer,token,e0,e1\n0,0,1,2\n0,1,1\n", [], r"{csv}:3:6: row has 3 fields"),
    "missing_column": ("layer,e0\n0,1\n", [], r"{csv}:1:9: the header lacks column 'token'"),
    "id_out_of_range": ("layer,token,e0\n0,0,99\n", ["--num-experts", "16"],
                        r"{csv}:2:5: expert id 99 does not fit --num-experts=16"),
    "empty": ("", [], r"{csv}:1:1: empty file"),
    "missing_file": ("absent", [], r"absent\.csv: cannot read the routing file"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_run_refuses_bad_files_and_flags_in_one_line(tmp_path, capsys, case):
    text, extra, pattern = REFUSALS[case]
    csv = write_trace_csv(tmp_path / "t.csv", layers=[0], tokens=10, num_experts=16, topk=2, scores=False)
    if text == "absent":
        csv = str(tmp_path / "absent.csv")
    elif text is not None:
        (tmp_path / "t.csv").write_text(text)
    rc = cli_main(["run", "--routing", csv, "--world-size", "2", *extra])
    out = capsys.readouterr()
    assert rc == 2, out.out + out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tritonep run: error: DataError: "), out.err
    assert re.search(pattern.format(csv=re.escape(csv)), lines[0]), lines[0]


def test_flame_num_experts_larger_is_fine_smaller_refused(capsys):
    from tritonep.cli.main import build_parser
    from tritonep.cli.plan import counts_for

    args = build_parser().parse_args(["plan", "--routing", "flame", "--world-size", "4", "--num-experts", "128"])
    counts = counts_for(args)  # no modulo: ids keep their value, experts 64.. get no routes
    assert counts.shape == (4, 128) and int(counts[:, 64:].sum()) == 0 and int(counts.sum()) == 2048 * 6
    assert cli_main(["plan", "--routing", "flame", "--num-experts", "32"]) == 2
    assert "needs --num-experts >= 64" in capsys.readouterr().err


def test_plan_on_a_csv_and_a_json_file(tmp_path, capsys):
    csv = write_trace_csv(tmp_path / "t.csv", layers=[1, 2], tokens=40, num_experts=8, topk=2)
    out_json = tmp_path / "plan.json"
    rc = cli_main(["plan", "--routing", csv, "--layer", "2", "--world-size", "4", "--json", str(out_json)])
    assert rc == 0, capsys.readouterr()
    res = json.loads(out_json.read_text())
    assert sum(res["before"]) == 80 and sum(res["after"]) == 80 and len(res["before"]) == 4
    assert cli_main(["plan", "--routing", csv, "--world-size", "4", "--tokens", "11"]) == 2
    assert "has 40 tokens per layer" in capsys.readouterr().err
    h = tmp_path / "h.json"
    h.write_text("[50, 0, 10, 3, 1, 1, 2, 30]")
    rc = cli_main(["plan", "--routing", str(h), "--world-size", "2", "--tokens", "100", "--topk", "2",
                   "--json", str(out_json)])
    assert rc == 0, capsys.readouterr()
    res = json.loads(out_json.read_text())
    assert sum(res["before"]) == 2 * 100 * 2


def test_every_refusal_is_one_line_exit_2(capsys):
    for argv, head in [(["run", "--world-size", "0"], "tritonep run: error: ConfigError: --world-size 0"),
                       (["run", "--routing", "olmoe", "--domain", "reddit"], "tritonep run: error: DataError: "
                                                                            "--domain 'reddit'"),
                       (["bench", "planner", "--soak", "2"], "tritonep bench: error: ConfigError: --soak is for"),
                       (["bench", "moe", "--soak", "-1"], "tritonep bench: error: ConfigError: --soak -1"),
                       (["plan", "--world-size", "3", "--num-experts", "64"], "tritonep plan: error: ConfigError: "
                                                                              "--num-experts 64 is not a multiple of "
                                                                              "--world-size 3"),
                       (["plan", "--json", "/nonexistent/dir/p.json"], "tritonep plan: error: ConfigError: --json "
                                                                       "/nonexistent/dir/p.json: the folder")]:
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(head), (argv, err)
    with pytest.raises(SystemExit) as ei:  # argparse refusals: one line too
        cli_main(["run", "--balance", "sideways"])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice: 'sideways'" in err[0], err


def test_rank_error_from_a_cpu_world_is_one_line_exit_2():
    rc, out, err = _cli("bench", "dispatch", "--soak", "1", env={"TRITONEP_CPU_HEAP_BYTES": "4096"})
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tritonep bench: error: LayoutError (rank "), err
    assert "Traceback" not in out + err


@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_bench_moe_soak_checks_the_layer():
    rc, out, err = _cli("bench", "moe", "--soak", "2")
    assert rc == 0, out + err
    assert "MoE soak: 2 forward+backward steps x 2 ranks" in out and "all within tolerance" in out, out


def test_bench_dispatch_soak_on_three_ranks():
    rc, out, err = _cli("bench", "dispatch", "--soak", "1", "--world-size", "3")  # 8 experts: rounded up to 9
    assert rc == 0, out + err
    assert "'E': 9" in out and "all equal to the reference" in out, out


def test_plots_side_by_side_legend_outside(tmp_path, capsys):
    from tritonep.cli.run import _plot

    rows = [dict(layer=layer, rank_loads=[10, 10, 10, 10], rank_loads_before=[4, 12, 16, 8]) for layer in (2, 3)]
    path = tmp_path / "run.png"
    _plot(rows, 4, str(path), title="a long title " * 12)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path = tmp_path / "plan.png"
    assert cli_main(["plan", "--world-size", "4", "--plot", str(path)]) == 0, capsys.readouterr()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
