"""The benchmark results index (scripts/results_index.py): every raw result file is one line of its history, the
lines hold the raw files' rows, the README is the one the histories give; ``add`` indexes a new run."""

import importlib.util
import json
import shutil

import pytest

from tests import ROOT


def _index():
    spec = importlib.util.spec_from_file_location("_results_index", ROOT / "scripts" / "results_index.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_histories_and_readme_are_up_to_date():
    assert _index().check() == []


def test_names_give_benchmark_machine_label_and_date():
    idx = _index()
    p = ROOT / "benchmarks" / "results"
    assert idx.parse_name(p / "ep_bench_h200x1_w1_final2_2026-12-01.json") == dict(
        bench="ep_bench", machine="h200x1", label="final2", date="2026-12-01")
    assert idx.parse_name(p / "planner_one_launch_h200_2026-12-01.json") == dict(
        bench="planner_bench", machine="h200x1", label="one_launch", date="2026-12-01")
    assert idx.parse_name(p / "moe_graph_bench_h200x1_session4_2026-12-01.json") == dict(
        bench="moe_graph_bench", machine="h200x1", label="session4", date="2026-12-01")
    assert idx.parse_name(p / "peer_bench_h200x1_2026-12-01.json")["bench"] == "peer_bench"
    assert idx.parse_name(p / "host_cost_h200x1_s4_2026-12-01.json")["bench"] == "host_cost"
    for bad in ("ep_bench_h200x1.json", "titan_bench_h200x1_2026-12-01.json", "ep_bench_final_2026-12-01.json"):
        with pytest.raises(ValueError):
            idx.parse_name(p / bad)


def test_add_indexes_a_new_run(tmp_path, monkeypatch):
    idx = _index()
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    raw = ROOT / "benchmarks" / "results" / "planner_two_level_final_h200_2026-12-01.json"
    shutil.copy(raw, results / raw.name)
    for name, value in dict(ROOT=tmp_path, RESULTS=results, HISTORY=results / "history",
                            README=results / "README.md").items():
        monkeypatch.setattr(idx, name, value)
    monkeypatch.setattr(idx, "_added_in", lambda path: ("abc1234", 0))
    monkeypatch.setattr(idx, "_head", lambda: "def5678+")
    idx._write(idx.rebuilt())
    assert idx.check() == []
    run = tmp_path / "planner.json"
    data = json.loads(raw.read_text())
    data["rows"] = data["rows"][:2]
    run.write_text(json.dumps(data))
    dst = idx.add(run, "h200x1", label="rerun", date="2026-12-02")
    assert dst.name == "planner_h200x1_rerun_2026-12-02.json"
    lines = [json.loads(ln) for ln in (results / "history" / "planner_bench.h200x1.jsonl").read_text().splitlines()]
    assert [(ln["label"], ln["commit"]) for ln in lines] == [("two_level_final", "abc1234"), ("rerun", "def5678+")]
    assert lines[-1]["rows"] == data["rows"] and lines[-1]["command"] == data["command"]
    assert "planner_h200x1_rerun_2026-12-02.json" in (results / "README.md").read_text()
    assert idx.check() == []
    (results / "planner_h200x1_rerun_2026-12-02.json").write_text(json.dumps(dict(data, rows=data["rows"][:1])))
    assert any("rows differs" in p for p in idx.check())
    with pytest.raises(SystemExit, match="exists"):
        idx.add(run, "h200x1", label="rerun", date="2026-12-02")


def test_new_kinds_and_recorded_commands(tmp_path, monkeypatch):
    """moe_graph_bench / peer_bench rows as written, host_cost's {name: us} flattened to name/us rows; a command
    given to ``add`` for a JSON that holds none lives in commands.jsonl and survives check and rebuild."""
    idx = _index()
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    for name, value in dict(ROOT=tmp_path, RESULTS=results, HISTORY=results / "history",
                            README=results / "README.md").items():
        monkeypatch.setattr(idx, name, value)
    monkeypatch.setattr(idx, "_added_in", lambda path: ("abc1234", 0))
    monkeypatch.setattr(idx, "_head", lambda: "def5678")
    host = tmp_path / "host.json"
    host.write_text(json.dumps(dict(info=dict(gpu="H200", torch="2.11"), rows={"launch.jit.4args": 18.8,
                                                                              "launch.c_ints.4args": 5.4})))
    peer = tmp_path / "peer.json"
    peer.write_text(json.dumps([dict(T=128, world_size=1, gpu="H200", tep_round_eager_us=329.2,
                                     mae_round_graph_us="capture failed: RuntimeError: " + "x" * 200,
                                     checked=True)]))
    graph = tmp_path / "graph.json"
    graph.write_text(json.dumps(dict(torch="2.11", gpu="H200", rows=[dict(
        tokens=128, shape="deepseek-v3", world_size=1, eager_us=21880.3, graph_us=21645.2, eager_over_graph=1.0109,
        checked=True)])))
    cmd = "python benchmarks/host_cost.py --json out.json"
    dst = idx.add(host, "h200x1", label="s4", date="2026-12-01", command=cmd)
    assert dst.name == "host_cost_h200x1_s4_2026-12-01.json" and dst.read_text() == host.read_text()
    idx.add(peer, "h200x1", date="2026-12-01", command="torchrun benchmarks/peer_bench.py")  # bench from the command
    idx.add(graph, "h200x1", date="2026-12-01", bench="moe_graph_bench", command="torchrun x.py")
    hist = idx.read_histories()
    (h,), (p,), (g,) = (hist[(bench, "h200x1")] for bench in ("host_cost", "peer_bench", "moe_graph_bench"))
    assert h["rows"] == [dict(name="launch.jit.4args", us=18.8), dict(name="launch.c_ints.4args", us=5.4)]
    assert (h["command"], h["gpu"], h["versions"]) == (cmd, "H200", {"torch": "2.11"})
    assert (p["world_size"], p["gpu"], p["checked"], p["command"]) == (1, "H200", True,
                                                                      "torchrun benchmarks/peer_bench.py")
    assert (g["world_size"], g["checked"]) == (1, True)
    text = (results / "README.md").read_text()
    assert "| launch.c_ints.4args | 5.4 |" in text and "| 1.011 | True |" in text
    assert "capture failed: RuntimeError: xxx" in text and "x" * 100 not in text  # long cells cut in the README
    assert idx.check() == []
    idx._write(idx.rebuilt())
    assert idx.check() == [] and idx.read_histories() == hist
    (results / "commands.jsonl").write_text("")  # the command is nowhere else: check names the line
    assert any("command differs" in q for q in idx.check())
    own = tmp_path / "own.json"
    own.write_text(json.dumps(dict(command="python benchmarks/moe_bench.py", rows=[])))
    with pytest.raises(SystemExit, match="holds its own command"):
        idx.add(own, "h200x1", date="2026-12-01", command="python benchmarks/other.py")
