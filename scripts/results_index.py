"""Index of the benchmark results: one JSON-lines history per benchmark and machine kind, and a README of the latest.

Every result file of a device run stays as it was written under ``benchmarks/results/`` (the raw file, named
``<benchmark>_<machine>[_<label>]_<YYYY-MM-DD>.json``). This script keeps two things derived from them:

* ``benchmarks/results/history/<benchmark>.<machine>.jsonl``: one line per run, oldest first: ``date``, ``label``,
  ``raw`` (the raw file), ``commit``, ``command``, ``gpu``, ``world_size``, ``versions``, ``checked`` and ``rows``
  (the benchmark's rows, ranks flattened with a ``rank`` field; torch.profiler text tables stay in the raw file).
  ``commit``: for a run indexed from a raw file already in git, the commit that added that file; for a run added
  with ``add``, HEAD of the checkout that added it (``+`` when it had uncommitted changes).
* ``benchmarks/results/README.md``: per history the latest run's rows, its command and file, then the logs.

Usage (repository root)::

    python scripts/results_index.py add $OUT/ep.json --machine h200x1 [--label final] [--bench ep_bench]
    python scripts/results_index.py add $OUT/peer.json --machine h200x1 --command "torchrun ... peer_bench.py ..."
    python scripts/results_index.py rebuild   # every history and the README again from the raw files
    python scripts/results_index.py check     # exit 1 if a history or the README is out of date (CI, no git)

``add`` copies a run's JSON to its raw name, appends its line to its history and rewrites the README; the
benchmark is read from the command in the file (``benchmarks/ep_bench.py`` -> ``ep_bench``) unless ``--bench``
names it. A JSON that holds no command (eager_profile, peer_bench, moe_graph_bench, host_cost and host_primitives write
none) takes
it from ``--command "..."``, kept in ``benchmarks/results/commands.jsonl`` (one ``{"raw", "command"}`` a line; the
raw file stays as written). Commit the raw file, the history, commands.jsonl and the README together.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HISTORY = RESULTS / "history"
README = RESULTS / "README.md"

PREFIXES = {"ep_bench": "ep_bench", "eager_profile": "eager_profile", "kernel_breakdown": "kernel_breakdown",
            "moe_bench": "moe_bench", "moe_graph_bench": "moe_graph_bench", "peer_bench": "peer_bench",
            "host_cost": "host_cost", "planner": "planner_bench", "tritonep_run": "tritonep_run",
            "host_primitives": "host_primitives"}
"""Raw-file name prefix -> benchmark (the planner's files are ``planner_*``, written by planner_bench.py)."""
COLUMNS = {
    "ep_bench": ("profile", "op", "mode", "num_sms", "tokens", "hidden", "variant", "geometry", "us", "logical_gbps",
                 "nvlink_gbps", "checked"),
    "kernel_breakdown": ("profile", "variant", "wire", "op", "mode", "tokens", "geometry", "us", "checked"),
    "eager_profile": ("tokens", "backend", "dispatch_graph_us", "combine_graph_us", "dispatch_eager_us",
                      "combine_eager_us", "dispatch_host_us", "combine_host_us"),
    "planner_bench": ("world_size", "num_experts", "tokens", "topk", "mode", "num_programs", "block", "launches",
                      "graph_us", "eager_us", "checked"),
    "moe_bench": None,  # the rank's timings: every key
    "tritonep_run": ("layer", "tokens", "balancedness", "dispatch_ms", "gemm_ms", "combine_ms", "step_ms"),
    "moe_graph_bench": ("tokens", "shape", "world_size", "eager_us", "graph_us", "eager_over_graph", "checked"),
    "peer_bench": ("T", "tep_round_eager_us", "tep_round_graph_us", "tep_sync_free_round_eager_us",
                   "mae_round_eager_us", "mae_round_graph_us", "eager_tep_over_mae", "checked"),
    "host_cost": ("name", "us"),  # the file's {name: us} rows, one row each
    "host_primitives": ("name", "us"),  # likewise
}
"""README columns of each benchmark's rows (rank 0's rows only)."""
MAX_README_ROWS = 40
_NAME = re.compile(r"^(?P<stem>.+?)_(?P<date>\d{4}-\d{2}-\d{2})$")
_MACHINE = re.compile(r"^h200(x\d+)?$")


def parse_name(path: Path) -> dict:
    """``{bench, machine, label, date}`` of a raw file name; ValueError for a name that does not follow the rule."""
    m = _NAME.match(path.stem)
    if not m:
        raise ValueError(f"{path.name}: not <benchmark>_<machine>[_<label>]_<YYYY-MM-DD>.json")
    stem = m.group("stem")
    bench = next((b for p, b in PREFIXES.items() if stem == p or stem.startswith(p + "_")), None)
    if bench is None:
        raise ValueError(f"{path.name}: unknown benchmark (known prefixes: {', '.join(PREFIXES)})")
    prefix = next(p for p in PREFIXES if stem == p or stem.startswith(p + "_"))
    parts = stem[len(prefix) + 1:].split("_") if stem != prefix else []
    machine = next((p for p in parts if _MACHINE.match(p)), None)
    if machine is None:
        raise ValueError(f"{path.name}: no machine kind (h200x1, h200x2, ...) in the name")
    label = "_".join(p for p in parts if p != machine and not re.fullmatch(r"w\d+", p))
    return dict(bench=bench, machine=machine if "x" in machine else machine + "x1", label=label, date=m.group("date"))


def _log_command(path: Path) -> str | None:
    """The command of a device step's log next to the raw file (``=== [hh:mm:ss] CMD (limit Ns)``)."""
    log = path.with_suffix(".log")
    if log.is_file():
        m = re.match(r"=== \[[\d:]+\] (.+?) \(limit \d+s\)", log.read_text(errors="replace").split("\n", 1)[0])
        if m:
            return m.group(1)
    return None


def _commands_file() -> Path:
    return RESULTS / "commands.jsonl"


def recorded_commands() -> dict:
    """``{raw file name: command}`` of the raw files whose JSON holds no command (``add --command`` records it in
    ``benchmarks/results/commands.jsonl``, one ``{"raw": ..., "command": ...}`` a line, the raw file untouched)."""
    f = _commands_file()
    if not f.is_file():
        return {}
    return {ln["raw"]: ln["command"] for ln in map(json.loads, f.read_text().splitlines()) if ln}


def _own_command(data) -> str | None:
    if not isinstance(data, dict):
        return None
    meta = data.get("meta") or data.get("cfg") or {}
    return data.get("command") or (meta.get("command") if isinstance(meta, dict) else None)


def normalize(path: Path) -> dict:
    """The history fields a raw file holds (all but ``commit``): meta, command and the flattened rows."""
    data = json.loads(path.read_text())
    name = parse_name(path)
    meta = {}
    if isinstance(data, dict):
        meta = (data.get("meta") or data.get("cfg") or data.get("info")
                or {k: v for k, v in data.items() if not isinstance(v, list)})
    rows: list = []
    if isinstance(data, list):
        rows = data
    elif "rows" in data:
        rows = data["rows"]
        if isinstance(rows, dict):  # host_cost, host_primitives: {name: us}
            rows = [dict(name=k, us=v) for k, v in rows.items()]
    elif "ranks" in data:
        rows = [dict({k: v for k, v in r.items() if not k.startswith("profile.")}, rank=i)
                for i, r in enumerate(data["ranks"])]
    elif "layers" in data:
        rows = data["layers"]
    if rows and all(isinstance(r, list) for r in rows):  # one list per rank
        rows = [dict(r, rank=i) for i, rs in enumerate(rows) for r in rs]
    command = _own_command(data) or recorded_commands().get(path.name) or _log_command(path)
    versions = {k: meta.get(k, data.get(k) if isinstance(data, dict) else None) for k in ("torch", "triton", "nccl")}
    checked = meta.get("checked") if "checked" in meta else (all(r.get("checked", False) for r in rows)
                                                             if rows and all("checked" in r for r in rows) else None)
    gpu = meta.get("gpu") or (data.get("gpu") if isinstance(data, dict) else None)
    if gpu is None and rows and len({r.get("gpu") for r in rows}) == 1:
        gpu = rows[0].get("gpu")
    world = meta.get("world_size") or (data.get("world_size") if isinstance(data, dict) else None)
    if world is None and rows and len({r.get("world_size") for r in rows}) == 1:  # every row names the same world
        world = rows[0].get("world_size")
    return dict(date=name["date"], label=name["label"], raw=str(path.relative_to(ROOT)), command=command, gpu=gpu,
                world_size=world, versions={k: v for k, v in versions.items() if v}, checked=checked, rows=rows)


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _added_in(path: Path) -> tuple[str | None, int]:
    """(short commit that added ``path``, its commit time); (None, now) for a file not in git."""
    out = _git("log", "--diff-filter=A", "--format=%h %ct", "--", str(path.relative_to(ROOT))).splitlines()
    if not out:
        return None, int(datetime.datetime.now().timestamp())
    sha, t = out[-1].split()
    return sha, int(t)


def _head() -> str:
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return _git("rev-parse", "--short", "HEAD") + ("+" if dirty else "")


def _raw_files() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.json"))


def read_histories() -> dict:
    """``{(bench, machine): [line, ...]}`` of the committed histories."""
    out = {}
    for f in sorted(HISTORY.glob("*.jsonl")):
        bench, machine = f.stem.split(".")
        out[(bench, machine)] = [json.loads(ln) for ln in f.read_text().splitlines() if ln.strip()]
    return out


def rebuilt() -> dict:
    """Every history from the raw files; ``commit`` kept from the committed history where the raw file is already
    indexed, else the commit that added the file (git)."""
    known = {ln["raw"]: ln for lines in read_histories().values() for ln in lines}
    entries = []
    for p in _raw_files():
        name = parse_name(p)
        line = normalize(p)
        rel = line["raw"]
        if rel in known:
            line["commit"], order = known[rel]["commit"], None
        else:
            line["commit"], order = _added_in(p)
        entries.append((name["bench"], name["machine"], line, order))
    out = {}
    for bench, machine, line, _ in entries:
        out.setdefault((bench, machine), []).append(line)
    pos = {ln["raw"]: i for lines in read_histories().values() for i, ln in enumerate(lines)}
    times = {e[2]["raw"]: e[3] for e in entries}
    for lines in out.values():  # oldest first: date, then the committed order, then when git added the file
        lines.sort(key=lambda ln: (ln["date"], pos.get(ln["raw"], 10 ** 9), times.get(ln["raw"]) or 0, ln["raw"]))
    return {k: [_ordered(ln) for ln in v] for k, v in out.items()}


def _ordered(line: dict) -> dict:
    keys = ("date", "label", "raw", "commit", "command", "gpu", "world_size", "versions", "checked", "rows")
    return {k: line.get(k) for k in keys}


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"  # ratios near 1 keep 3 decimals
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:60]
    text = "" if v is None else str(v).replace("|", "/")
    return text if len(text) <= 80 else text[:77] + "..."  # e.g. a capture error (the history line has it whole)


def readme(histories: dict) -> str:
    """The README: per benchmark and machine the latest run (its command, file and rank 0's rows), then the logs."""
    out = ["# Benchmark results", "",
           "Generated by `python scripts/results_index.py rebuild` from the raw files in this folder (do not edit:",
           "`python scripts/results_index.py add RUN.json --machine h200x1` indexes a new run; docs: the script's",
           "docstring and benchmarks/README.md). Every run of a benchmark on a machine kind is one line of",
           "`history/<benchmark>.<machine>.jsonl`; below, the latest run of each. Times are microseconds (`*_us`) or",
           "milliseconds (`*_ms`); `checked`: the run compared every point with the reference oracles.", ""]
    for (bench, machine), lines in sorted(histories.items()):
        last = lines[-1]
        out += [f"## {bench} on {machine}", "",
                f"Latest of {len(lines)} run(s): `{Path(last['raw']).name}` ({last['date']}"
                + (f", {last['label']}" if last["label"] else "") + f", commit {last['commit'] or 'not in git'}).",
                "", "```", last["command"] or "(command not recorded in the raw file)", "```", ""]
        rows = [r for r in last["rows"] if r.get("rank", 0) == 0]
        cols = COLUMNS.get(bench) or [k for k in rows[0] if k != "rank"] if rows else []
        cols = [c for c in cols if any(c in r for r in rows)]
        if rows:
            out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows[:MAX_README_ROWS]]
            if len(rows) > MAX_README_ROWS:
                out.append(f"\n({len(rows) - MAX_README_ROWS} more rows in the history line.)")
            out.append("")
    logs = sorted(RESULTS.glob("*.log"), key=lambda p: (p.stem[-10:], p.name))
    out += ["## Logs", "", "Device logs kept as they were written (GPU test runs, profiles, the raw files' steps):", ""]
    out += [f"- {p.stem[-10:]}: `{p.name}`" for p in logs]
    return "\n".join(out) + "\n"


def _write(histories: dict) -> None:
    HISTORY.mkdir(exist_ok=True)
    for (bench, machine), lines in histories.items():
        (HISTORY / f"{bench}.{machine}.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    README.write_text(readme(histories))


def check() -> list[str]:
    """What is out of date (no git needed): a raw file missing from the histories or indexed twice, a history line
    whose rows or fields differ from its raw file, a README not generated from the histories."""
    problems = []
    hist = read_histories()
    seen = {}
    for (bench, machine), lines in hist.items():
        for ln in lines:
            seen.setdefault(ln["raw"], []).append((bench, machine))
            p = ROOT / ln["raw"]
            if not p.is_file():
                problems.append(f"{bench}.{machine}: {ln['raw']} does not exist")
                continue
            want = normalize(p)
            name = parse_name(p)
            if (name["bench"], name["machine"]) != (bench, machine):
                problems.append(f"{ln['raw']} is in history/{bench}.{machine}.jsonl, its name says "
                                f"{name['bench']}.{name['machine']}")
            for k, v in want.items():
                if json.dumps(ln.get(k), sort_keys=True) != json.dumps(v, sort_keys=True):
                    problems.append(f"{bench}.{machine}: {ln['raw']}: {k} differs from the raw file")
    for p in _raw_files():
        rel = str(p.relative_to(ROOT))
        if len(seen.get(rel, [])) != 1:
            problems.append(f"{rel} is indexed {len(seen.get(rel, []))} times (want 1): "
                            "python scripts/results_index.py add / rebuild")
    if not README.is_file() or README.read_text() != readme(hist):
        problems.append("benchmarks/results/README.md is not the one generated from the histories: "
                        "python scripts/results_index.py rebuild")
    return problems


def _bench_of(data, path: Path, command: str | None = None) -> str:
    command = _own_command(data) or command or ""
    m = re.search(r"benchmarks/(\w+)\.py", command)
    if m and m.group(1) in COLUMNS:
        return m.group(1)
    if "tritonep.cli" in command or "tritonep run" in command:
        return "tritonep_run"
    raise SystemExit(f"{path}: cannot tell the benchmark from its command {command!r}; pass --bench")


def add(src: Path, machine: str, label: str = "", bench: str | None = None, date: str | None = None,
        command: str | None = None) -> Path:
    """Copy a run's JSON to its raw name under benchmarks/results/, append its history line, rewrite the README.

    ``command``: the command that wrote a JSON holding none (recorded in ``commands.jsonl`` under the raw name; the
    raw file stays as written). Returns:
        the raw file's path. Raises SystemExit naming the problem (unknown benchmark, a raw file of that name
        already there, a machine kind not like ``h200x2``, ``command`` given for a JSON that holds another).
    """
    data = json.loads(Path(src).read_text())
    own = _own_command(data)
    if command and own and command != own:
        raise SystemExit(f"{src}: holds its own command {own!r}; --command {command!r} differs")
    bench = bench or _bench_of(data, src, command)
    if not _MACHINE.match(machine) or "x" not in machine:
        raise SystemExit(f"--machine {machine!r}: a machine kind like h200x1 or h200x2")
    date = date or datetime.date.today().isoformat()
    prefix = next(p for p, b in PREFIXES.items() if b == bench)
    dst = RESULTS / "_".join([prefix, machine] + ([label] if label else []) + [date])
    dst = dst.with_suffix(".json")
    if dst.exists():
        raise SystemExit(f"{dst.relative_to(ROOT)} exists: pick another --label")
    shutil.copyfile(src, dst)
    if command and not own:
        with _commands_file().open("a") as f:
            f.write(json.dumps(dict(raw=dst.name, command=command)) + "\n")
    hist = read_histories()
    line = _ordered(dict(normalize(dst), commit=_head()))
    hist.setdefault((bench, machine), []).append(line)
    _write(hist)
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="index a new run's JSON")
    a.add_argument("json", type=Path)
    a.add_argument("--machine", required=True, help="machine kind, e.g. h200x1 (one H200), h200x2")
    a.add_argument("--label", default="", help="what distinguishes this run from others of the day (a word)")
    a.add_argument("--bench", choices=sorted(COLUMNS), help="the benchmark (default: from the file's command)")
    a.add_argument("--date", help="YYYY-MM-DD of the run (default: today)")
    a.add_argument("--command", help="the command that wrote the JSON, when the JSON holds none (kept in "
                   "benchmarks/results/commands.jsonl)")
    sub.add_parser("rebuild", help="every history and the README from the raw files")
    sub.add_parser("check", help="exit 1 if a history or the README is out of date")
    args = ap.parse_args(argv)
    if args.cmd == "add":
        print(add(args.json, args.machine, args.label, args.bench, args.date, args.command).relative_to(ROOT))
    elif args.cmd == "rebuild":
        _write(rebuilt())
    else:
        problems = check()
        print("\n".join(problems) or "benchmark results index up to date")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
