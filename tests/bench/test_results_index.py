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
    for bad in ("ep_bench_h200x1.json", "peer_bench_h200x1_2026-12-01.json", "ep_bench_final_2026-12-01.json"):
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
