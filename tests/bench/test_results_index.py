"""The benchmark results (scripts/results_index.py): one JSON per benchmark and GPU kind with its meta, no logs, at
most 40 files; the index and the figure tables of docs/performance.md and the README are the ones the files give;
``add`` makes a run the current result of its benchmark and kind."""

import json
import re
import shutil

import pytest

from tests import ROOT, load_script


def _index():
    return load_script("scripts/results_index.py", "_results_index")


def test_committed_results_index_and_figures_are_up_to_date():
    assert _index().check() == []


def test_every_figure_is_the_value_in_its_file():
    """Each row of docs/performance.md's generated table shows the selected row's field of the file it names (a
    second path to the same numbers: the table read back, the JSON read directly)."""
    idx = _index()
    text = (ROOT / "docs" / "performance.md").read_text()
    block = text[text.index("<!-- figures:performance -->"):text.index("<!-- /figures:performance -->")]
    lines = [ln for ln in block.splitlines() if ln.startswith("| ") and not ln.startswith("| figure |")]
    assert len(lines) == len(idx.FIGURES["performance"])
    for line, (figure, file, selector, field, unit) in zip(lines, idx.FIGURES["performance"]):
        data = json.loads((ROOT / "benchmarks" / "results" / file).read_text())
        rows = data["data"]["rows"][0] if file.startswith("ep_bench") else None
        if rows is None:
            rows = idx._rows(data["meta"]["benchmark"], data["data"])
        row = next(r for r in rows if all(r.get(k) == v for k, v in selector.items()))
        assert line.startswith(f"| {figure} |") and f"(../benchmarks/results/{file})" in line, line
        shown = line.split(" | ")[1]
        v = row[field]
        want = f"{v * 1e3:.1f} ms" if unit == "s" else f"{v:.3f}x" if unit == "x" else f"{v:.1f} us"
        assert shown == want, (figure, shown, want)


def test_the_folder_holds_results_only():
    files = sorted(p.name for p in (ROOT / "benchmarks" / "results").iterdir())
    assert len(files) <= 40, files
    assert all(f.endswith(".json") or f == "README.md" for f in files), files
    assert not [f for f in files if re.search(r"\d{4}-\d{2}-\d{2}", f)], files  # no dated names


def test_check_finds_what_is_wrong(tmp_path, monkeypatch):
    idx = _index()
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    docs = tmp_path / "docs"
    docs.mkdir()
    monkeypatch.setattr(idx, "ROOT", tmp_path)
    monkeypatch.setattr(idx, "RESULTS", results)
    monkeypatch.setattr(idx, "INDEX", results / "README.md")
    monkeypatch.setattr(idx, "FIGURE_DOCS", {})
    shutil.copy(ROOT / "benchmarks" / "results" / "planner_bench.h200x1.json", results)
    idx.rebuild()
    assert idx.check() == []
    (results / "run.log").write_text("a log")
    assert any("not results" in p for p in idx.check())
    (results / "run.log").unlink()
    shutil.copy(results / "planner_bench.h200x1.json", results / "planner_bench_2026-12-01.json")
    assert any("not <benchmark>.<kind>.json" in p for p in idx.check())
    (results / "planner_bench_2026-12-01.json").unlink()
    bad = json.loads((results / "planner_bench.h200x1.json").read_text())
    bad["meta"]["torch"] = None
    (results / "planner_bench.h200x1.json").write_text(json.dumps(bad))
    assert any("meta lacks ['torch']" in p for p in idx.check())


def test_add_replaces_the_result_and_rebuilds(tmp_path, monkeypatch):
    idx = _index()
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    doc = tmp_path / "perf.md"
    doc.write_text("# x\n\n<!-- figures:t -->\nold\n<!-- /figures:t -->\n")
    monkeypatch.setattr(idx, "ROOT", tmp_path)
    monkeypatch.setattr(idx, "RESULTS", results)
    monkeypatch.setattr(idx, "INDEX", results / "README.md")
    monkeypatch.setattr(idx, "FIGURE_DOCS", {"t": doc})
    monkeypatch.setitem(idx.FIGURES, "t", [("planner at W=2", "planner_bench.h100x1.json",
                                            dict(world_size=2, mode="reference"), "graph_us", "us")])
    monkeypatch.setattr(idx, "_head", lambda: "abc1234+")
    raw = json.loads((ROOT / "benchmarks" / "results" / "planner_bench.h200x1.json").read_text())["data"]
    run = tmp_path / "planner.json"
    run.write_text(json.dumps(dict(meta=dict(command="python benchmarks/planner_bench.py --json x.json",
                                             torch="2.11.0+cu130", triton="3.6.0", gpu="NVIDIA H100 80GB HBM3",
                                             date="2026-12-09T10:00:00+00:00", commit=None, world_size=1),
                                   rows=raw["rows"])))
    dst = idx.add(run, "h100x1")
    assert dst.name == "planner_bench.h100x1.json"
    m = json.loads(dst.read_text())["meta"]
    assert (m["benchmark"], m["kind"], m["commit"], m["checked"], m["gpu"]) == (
        "planner_bench", "h100x1", "abc1234+", True, "NVIDIA H100 80GB HBM3")
    assert idx.check() == []
    assert "| planner at W=2 | 13.3 us | 1 x H100 80GB HBM3, world 1 |" in doc.read_text()
    assert "## planner_bench.h100x1.json" in (results / "README.md").read_text()
    row = next(r for r in raw["rows"] if r["world_size"] == 2 and r["mode"] == "reference")
    row["graph_us"] = 99.0  # a newer run replaces the file; the figure follows it
    run.write_text(json.dumps(dict(meta=dict(command="python benchmarks/planner_bench.py", torch="2.11",
                                             triton="3.6.0", gpu="NVIDIA H100 80GB HBM3", date="2026-12-10",
                                             world_size=1),
                                   rows=raw["rows"])))
    idx.add(run, "h100x1", commit="def5678")
    assert "| planner at W=2 | 99.0 us |" in doc.read_text() and len(list(results.glob("*.json"))) == 1
    with pytest.raises(SystemExit, match="--kind"):
        idx.add(run, "H100")
    run.write_text(json.dumps(dict(rows=[])))
    with pytest.raises(SystemExit, match="no command"):
        idx.add(run, "h100x1")


def test_benchmark_is_read_from_the_command():
    idx = _index()
    assert idx.bench_of("torchrun --nproc-per-node 1 benchmarks/moe_bench.py --graph --tokens 128") == \
        "moe_bench_graph"
    assert idx.bench_of("python benchmarks/moe_bench.py --skew") == "moe_bench_skew"
    assert idx.bench_of("python benchmarks/probes/host_cost.py --json x") == "host_cost"
    assert idx.bench_of("python -m tritonep.cli.main run --steps 3") == "tritonep_run"
    with pytest.raises(SystemExit, match="--bench"):
        idx.bench_of("python " + "benchmarks/" + "unknown.py")
