"""The benchmark results: one JSON per benchmark and GPU kind, the index of them, and the figures the docs quote.

``benchmarks/results/<benchmark>.<kind>.json`` holds the latest run of one benchmark on one kind of GPU machine
(older runs live in git's history only)::

    {"meta": {"benchmark", "kind", "command", "commit", "date", "gpu", "world_size", "torch", "triton", "checked",
              "note"?}, "data": <the JSON the benchmark wrote, as written>}

``kind``: the GPU model and count (``h200x1``: one H200, ``h200x2``: two), then, for ranks sharing one GPU, how
(``h200x1-mps2``: 2 ranks under MPS, ``h200x1-ts4``: 4 ranks time-sliced). ``command``: what makes the file again
on the current tree; ``commit``: the code that ran (``+``: the tree had changes on top of that commit); ``checked``:
every point was compared with the reference oracles (None: the benchmark predates the self-checks).

Usage (repository root)::

    python scripts/results_index.py add $OUT/ep_bench.json --kind h200x1          # replaces ep_bench.h200x1.json
    python scripts/results_index.py add $OUT/peer.json --kind h200x1 --commit 1a2b3c4
    python scripts/results_index.py rebuild     # the index (benchmarks/results/README.md) and the docs' figures
    python scripts/results_index.py check       # exit 1 if anything is out of date (a CPU test runs it)

``add`` reads the benchmark from the JSON's ``meta.command`` (``--bench`` overrides), takes ``meta`` as the run wrote
it (:func:`tritonep.bench.meta.run_meta`) and fills what the run could not know (``--commit`` when the GPU
machine's copy had no git, else this checkout's HEAD), writes the file, then rebuilds the index and the figures.
The figures (:data:`FIGURES`) are the table of docs/performance.md and the headline of the README, each generated
between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->`` from the files.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
MAX_FILES = 40
META_KEYS = ("benchmark", "kind", "command", "commit", "date", "gpu", "world_size", "torch", "triton", "checked")
"""Keys every result file's meta holds (``note`` optional)."""
_KIND = re.compile(r"^[a-z]\d+x\d+(-(mps|ts)\d+)?$")
_NAME = re.compile(r"^(?P<bench>[a-z0-9_]+)\.(?P<kind>[a-z0-9-]+)\.json$")

BENCHMARKS = {
    "ep_bench": ("benchmarks/ep_bench.py", ("profile", "op", "mode", "num_sms", "tokens", "variant", "us",
                                             "logical_gbps", "nvlink_gbps", "checked")),
    "eager_profile": ("benchmarks/eager_profile.py", ("tokens", "backend", "dispatch_graph_us", "dispatch_eager_us",
                                                       "dispatch_host_work_us", "combine_graph_us", "combine_eager_us",
                                                       "combine_host_us")),
    "moe_bench": ("benchmarks/moe_bench.py", None),
    "moe_bench_skew": ("benchmarks/moe_bench.py --skew", None),
    "moe_bench_graph": ("benchmarks/moe_bench.py --graph", ("tokens", "shape", "world_size", "eager_us", "graph_us",
                                                            "eager_over_graph", "checked")),
    "planner_bench": ("benchmarks/planner_bench.py", ("world_size", "num_experts", "tokens", "topk", "mode",
                                                      "num_programs", "launches", "graph_us", "eager_us", "checked")),
    "peer_bench": ("benchmarks/peer_bench.py", ("T", "tep_round_eager_us", "tep_round_graph_us",
                                                "tep_sync_free_round_eager_us", "mae_round_eager_us",
                                                "mae_round_graph_us", "eager_tep_over_mae", "checked")),
    "titan_bench": ("benchmarks/titan_bench.py", None),
    "deep_ep_compat": ("benchmarks/deep_ep_compat.py", ("T", "compat_eager_us", "tep_eager_us", "rows_eager_us",
                                                        "compat_worst_graph_us", "compat_over_tep_eager",
                                                        "compat_minus_tep_eager_us", "checked")),
    "cold_start": ("bash scripts/gpu.sh coldstart", ("world_size", "mps", "wall_s", "step_ms", "ok")),
    "tritonep_run": ("tritonep run", ("layer", "tokens", "balancedness", "dispatch_ms", "gemm_ms", "combine_ms",
                                      "step_ms", "ok")),
    "kernel_breakdown": ("benchmarks/probes/kernel_breakdown.py", ("variant", "wire", "op", "mode", "tokens", "us",
                                                                   "checked")),
    "ncu_kernels": ("benchmarks/probes/ncu_summary.py", ("label", "kernel", "duration_us", "dram_pct", "regs",
                                                         "spill_requests", "occupancy_pct", "stall_l1tex_cycles")),
    "host_cost": ("benchmarks/probes/host_cost.py", ("name", "us")),
    "collective_cost": ("benchmarks/probes/collective_cost.py", ("name", "us")),
    "host_primitives": ("benchmarks/probes/host_primitives.py", ("name", "us")),
}
"""Benchmark -> (the script that makes it, the index's columns of its rows; None: every key of rank 0's row)."""
MAX_INDEX_ROWS = 30


def _rows(bench: str, data) -> list[dict]:
    """Rank 0's rows of a benchmark's JSON (a list; ``rows`` as a list, a list per rank or a ``{name: us}`` dict;
    ``ranks``; ``layers``), each a flat dict."""
    if isinstance(data, list):
        rows = data
    elif "rows" in data:
        rows = data["rows"]
        if isinstance(rows, dict):
            rows = [dict(name=k, us=v) for k, v in rows.items()]
    elif "ranks" in data:
        rows = [{k: v for k, v in data["ranks"][0].items() if not k.startswith("profile.") and k != "checks"}]
    elif "layers" in data:
        rows = data["layers"]
    else:
        rows = []
    if rows and all(isinstance(r, list) for r in rows):  # one list per rank: rank 0's
        rows = rows[0]
    if bench == "tritonep_run":
        rows = [dict(r, ok=r.get("ok")) for r in rows]
    return [r for r in rows if isinstance(r, dict)]


def result_files() -> list[Path]:
    """Every result JSON under benchmarks/results, sorted by name."""
    return sorted(RESULTS.glob("*.json"))


def load(path: Path) -> dict:
    """A result file as ``{"meta": ..., "data": ...}``."""
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------------------------- figures
FIGURES = {
    "performance": [
        # (figure, file, selector over rank 0's rows, field, unit)
        ("dispatch, bf16, 4096 tokens/rank, EP2, table geometry (two kernels), graph", "ep_bench.h200x2.json",
         dict(profile="deepseek-v3", op="tritonep.dispatch.bf16", mode="graph", num_sms=0, variant=None), "us", "us"),
        ("dispatch, bf16, 4096 tokens/rank, EP2, fused one launch (40 sender + 88 expander programs: the default at >= "
         "1024 tokens)",
         "ep_bench.h200x2.json", dict(profile="deepseek-v3", op="tritonep.dispatch.bf16", variant="fs=40,fe=88"),
         "us", "us"),
        ("combine push, bf16, 4096 tokens/rank, EP2, graph", "ep_bench.h200x2.json",
         dict(profile="deepseek-v3", op="tritonep.combine.push.bf16", mode="graph", num_sms=0, variant=None), "us",
         "us"),
        ("dispatch, fp8 wire, 4096 tokens/rank, EP2, graph", "ep_bench.h200x2.json",
         dict(profile="deepseek-v3", op="tritonep.dispatch.fp8", mode="graph", num_sms=0, variant=None), "us", "us"),
        ("NCCL all_to_all_single alone (same bytes, no layout), 4096 tokens/rank, EP2", "ep_bench.h200x2.json",
         dict(profile="deepseek-v3", op="nccl.a2a", num_sms=0, variant=None), "us", "us"),
        ("NCCL pipeline dispatch a user writes (pack, all_to_all, unpack), 4096 tokens/rank, EP2",
         "ep_bench.h200x2.json", dict(profile="deepseek-v3", op="nccl.pipeline.dispatch", num_sms=0, variant=None),
         "us", "us"),
        ("dispatch, bf16, 4096 tokens, world 1 (no NVLink), graph", "ep_bench.h200x1.json",
         dict(profile="deepseek-v3", op="tritonep.dispatch.bf16", mode="graph"), "us", "us"),
        ("combine push, bf16, 4096 tokens, world 1, graph", "ep_bench.h200x1.json",
         dict(profile="deepseek-v3", op="tritonep.combine.push.bf16", mode="graph"), "us", "us"),
        ("decode dispatch (one launch), bf16, 128 tokens, world 1, graph", "ep_bench.h200x1.json",
         dict(profile="decode", op="tritonep.dispatch.bf16", mode="graph"), "us", "us"),
        ("decode combine push (one launch), bf16, 128 tokens, world 1, graph", "ep_bench.h200x1.json",
         dict(profile="decode", op="tritonep.combine.push.bf16", mode="graph"), "us", "us"),
        ("nccl backend, sync-free one-hop dispatch, 128 tokens, world 1, eager", "ep_bench.h200x1.json",
         dict(profile="decode", op="tritonep[nccl].dispatch_sync_free_onehop.bf16", mode="eager"), "us", "us"),
        ("the NCCL pipeline dispatch with its layout precomputed, 128 tokens, world 1", "ep_bench.h200x1.json",
         dict(profile="decode", op="nccl.pipeline.dispatch", mode="eager"), "us", "us"),
        ("eager dispatch, 128 tokens, world 1", "eager_profile.h200x1.json", dict(tokens=128, backend="triton"),
         "dispatch_eager_us", "us"),
        ("... the same dispatch replayed from a CUDA graph", "eager_profile.h200x1.json",
         dict(tokens=128, backend="triton"), "dispatch_graph_us", "us"),
        ("... its host work (CPU time per call, without waiting for the device)", "eager_profile.h200x1.json",
         dict(tokens=128, backend="triton"), "dispatch_host_work_us", "us"),
        ("eager dispatch, 4096 tokens, world 1", "eager_profile.h200x1.json", dict(tokens=4096, backend="triton"),
         "dispatch_eager_us", "us"),
        ("dispatch + combine round trip, 128 tokens, world 1, eager: tritonep", "peer_bench.h200x1.json",
         dict(T=128), "tep_round_eager_us", "us"),
        ("... torchtitan 0.3.0 MinimalAsyncEP, same inputs", "peer_bench.h200x1.json", dict(T=128),
         "mae_round_eager_us", "us"),
        ("dispatch + combine round trip, 4096 tokens, world 1, eager: tritonep", "peer_bench.h200x1.json",
         dict(T=4096), "tep_round_eager_us", "us"),
        ("... torchtitan 0.3.0 MinimalAsyncEP, same inputs", "peer_bench.h200x1.json", dict(T=4096),
         "mae_round_eager_us", "us"),
        ("MoE layer fwd+bwd (H 7168, I 2048, 256 experts, top-8, 4096 tokens/rank), EP2: tritonep",
         "moe_bench.h200x2.json", dict(), "tritonep.none", "s"),
        ("... the torch + NCCL layer a user writes, same run", "moe_bench.h200x2.json", dict(), "reference", "s"),
        ("MoE layer, OLMoE-skewed routing, EP2: balance='virtual' (an earlier version of the virtual layer)",
         "moe_bench_skew.h200x2.json", dict(), "tritonep.virtual", "s"),
        ("... balance='none', same run", "moe_bench_skew.h200x2.json", dict(), "tritonep.none", "s"),
        ("MoE layer step (sync-free), 4096 tokens, world 1: eager / one captured CUDA graph",
         "moe_bench_graph.h200x1.json", dict(tokens=4096), "eager_over_graph", "x"),
        ("virtual-expert planner, one launch, 4096 tokens x top-8, 256 experts, histograms of 8 ranks, graph",
         "planner_bench.h200x1.json", dict(world_size=8, mode="reference"), "graph_us", "us"),
    ],
}
"""Generated figure tables: name -> rows ``(figure, file, selector, field, unit)``. The selector picks the first of
rank 0's rows whose fields equal its values (``None``: the field is absent or null); unit ``s`` is shown in ms."""
FIGURES["headline"] = [FIGURES["performance"][i] for i in (1, 5, 8, 16, 17, 20, 21)]


FIGURE_DOCS = {"performance": ROOT / "docs" / "performance.md", "headline": ROOT / "README.md"}
"""Where each figure table lives."""


def select(rows: list[dict], selector: dict) -> dict:
    """The first row matching ``selector`` (KeyError naming the selector when none does)."""
    for r in rows:
        if all(r.get(k) == v for k, v in selector.items()):
            return r
    raise KeyError(f"no row matches {selector}")


def _value(v, unit: str) -> str:
    if unit == "s":
        return f"{v * 1e3:.1f} ms"
    if unit == "x":
        return f"{v:.3f}x"
    return f"{v:.1f} us"


def _where(meta: dict) -> str:
    """``2 x H200``, ``1 x H200, world 1``, ``1 x H200, 4 ranks time-sliced``, ``1 x H200, 2 ranks under MPS``."""
    m = re.match(r"^[a-z]\d+x(\d+)(?:-(mps|ts)(\d+))?$", meta["kind"])
    gpus, how, ranks = (m.group(1), m.group(2), m.group(3)) if m else ("?", None, None)
    text = f"{gpus} x {meta['gpu'].replace('NVIDIA ', '')}"
    if how:
        return text + f", {ranks} ranks " + ("under MPS" if how == "mps" else "time-sliced")
    return text + (", world 1" if meta["world_size"] == 1 else "")


def figures_table(name: str) -> str:
    """The markdown table of :data:`FIGURES` ``name`` from the result files, then each file's command."""
    out = ["| figure | value | GPUs | results file |", "|---|---|---|---|"]
    files = []
    for figure, file, selector, field, unit in FIGURES[name]:
        res = load(RESULTS / file)
        row = select(_rows(res["meta"]["benchmark"], res["data"]), selector)
        link = os.path.relpath(RESULTS / file, FIGURE_DOCS[name].parent)
        out.append(f"| {figure} | {_value(row[field], unit)} | {_where(res['meta'])} | [{file}]({link}) |")
        if file not in files:
            files.append(file)
    if name != "performance":  # a summary: the commands are docs/performance.md's
        return "\n".join(out + ["", "Every figure with its command: [docs/performance.md](docs/performance.md)."])
    out += ["", "Commands (each file's `meta`; the code that ran: its commit):", ""]
    for file in files:
        m = load(RESULTS / file)["meta"]
        out.append(f"- `{file}` ({m['date'][:10]}, commit {m['commit']}): `{m['command']}`")
    return "\n".join(out)


def _block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- figures:{name} -->\n)(.*?)(<!-- /figures:{name} -->)", re.S)


def render_doc(name: str, text: str) -> str:
    """``text`` with its ``figures:name`` block replaced by :func:`figures_table` (ValueError: no such block)."""
    pat = _block(name)
    if not pat.search(text):
        raise ValueError(f"no <!-- figures:{name} --> block")
    return pat.sub(lambda m: m.group(1) + figures_table(name) + "\n" + m.group(3), text)


# ------------------------------------------------------------------------------------------------------ index
def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 10 else f"{v:.1f}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:60]
    text = "" if v is None else str(v).replace("|", "/")
    return text if len(text) <= 80 else text[:77] + "..."


def index() -> str:
    """benchmarks/results/README.md: per file its meta and rank 0's rows."""
    out = ["# Benchmark results", "",
           "Generated by `python scripts/results_index.py rebuild` from the JSON files here: the latest run of each",
           "benchmark on each kind of GPU machine (older runs: git history). Each file is `{\"meta\": ..., \"data\": "
           "...}`;", "the file's docstring in scripts/results_index.py says what every field means. Times are "
           "microseconds", "(`*_us`, `us`) or milliseconds (`*_ms`); `checked`: every point was compared with the "
           "reference oracles.", ""]
    for path in result_files():
        res = load(path)
        m, bench = res["meta"], res["meta"]["benchmark"]
        out += [f"## {path.name}", "",
                f"{bench} on {m['gpu']} ({m['kind']}, world {m['world_size']}), {m['date'][:10]}, commit "
                f"{m['commit']}, torch {m['torch']}, Triton {m['triton']}, checked: {m['checked']}"
                + (f". {m['note']}" if m.get("note") else "") + ".", "", "```", m["command"], "```", ""]
        rows = _rows(bench, res["data"])
        cols = BENCHMARKS[bench][1] or [k for k in rows[0] if not isinstance(rows[0][k], (dict, list))] if rows \
            else []
        cols = [c for c in cols if any(c in r for r in rows)]
        if rows and cols:
            out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows[:MAX_INDEX_ROWS]]
            if len(rows) > MAX_INDEX_ROWS:
                out.append(f"\n({len(rows) - MAX_INDEX_ROWS} more rows in the file.)")
            out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def rebuild() -> None:
    """Write the index and every figure block."""
    INDEX.write_text(index())
    for name, doc in FIGURE_DOCS.items():
        doc.write_text(render_doc(name, doc.read_text()))


def check() -> list[str]:
    """What is out of date or broken: file names, meta, the file count, files that are not result JSON, the index
    and the figure blocks."""
    problems = []
    files = list(RESULTS.iterdir())
    extra = [p.name for p in files if p.suffix != ".json" and p.name != "README.md"]
    if extra:
        problems.append(f"benchmarks/results holds files that are not results: {extra} (logs stay out of git)")
    if len(files) > MAX_FILES:
        problems.append(f"benchmarks/results holds {len(files)} files (at most {MAX_FILES}: the latest run of each "
                        f"benchmark and GPU kind)")
    for path in result_files():
        m = _NAME.match(path.name)
        if not m or m.group("bench") not in BENCHMARKS or not _KIND.match(m.group("kind")):
            problems.append(f"{path.name}: not <benchmark>.<kind>.json with a known benchmark "
                            f"({', '.join(BENCHMARKS)}) and a kind like h200x1 or h200x1-mps2")
            continue
        res = load(path)
        meta = res.get("meta", {})
        missing = [k for k in META_KEYS if k not in meta or (meta[k] is None and k != "checked")]
        if missing or "data" not in res:
            problems.append(f"{path.name}: meta lacks {missing}" if missing else f"{path.name}: no data")
            continue
        if (meta["benchmark"], meta["kind"]) != (m.group("bench"), m.group("kind")):
            problems.append(f"{path.name}: meta says {meta['benchmark']}.{meta['kind']}")
    if not problems:
        if not INDEX.is_file() or INDEX.read_text() != index():
            problems.append("benchmarks/results/README.md is not the generated index: python scripts/results_index.py "
                            "rebuild")
        for name, doc in FIGURE_DOCS.items():
            try:
                if render_doc(name, doc.read_text()) != doc.read_text():
                    problems.append(f"{doc.relative_to(ROOT)}: its figures:{name} block differs from the results: "
                                    f"python scripts/results_index.py rebuild")
            except (ValueError, KeyError, FileNotFoundError) as e:
                problems.append(f"{doc.relative_to(ROOT)}: figures:{name}: {e}")
    return problems


# ------------------------------------------------------------------------------------------------------- add
def bench_of(command: str) -> str:
    """The benchmark a command ran (``benchmarks/moe_bench.py --graph`` -> ``moe_bench_graph``)."""
    if re.search(r"tritonep(\.cli\.main)? run\b", command):
        return "tritonep_run"
    m = re.search(r"benchmarks/(?:probes/)?(\w+)\.py", command)
    if not m or m.group(1) not in BENCHMARKS:
        raise SystemExit(f"cannot tell the benchmark from the command {command!r}; pass --bench")
    bench = m.group(1)
    if bench == "moe_bench":
        bench = "moe_bench_graph" if "--graph" in command.split() else "moe_bench_skew" if "--skew" in \
            command.split() else bench
    return bench


def _git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def _head() -> str:
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return _git("rev-parse", "--short", "HEAD") + ("+" if dirty else "")


def wrap(data, kind: str, bench: str | None = None, command: str | None = None, commit: str | None = None,
         date: str | None = None, note: str | None = None, **known) -> dict:
    """A result file's content from a benchmark's JSON ``data``: its ``meta`` (written by the run, see
    :func:`tritonep.bench.meta.run_meta`) completed by the arguments and by what the data holds (GPU, versions,
    world size, checks).

    Raises:
        SystemExit: a kind not like ``h200x1``; no command; a command that names no known benchmark.
    """
    if not _KIND.match(kind):
        raise SystemExit(f"--kind {kind!r}: the GPU model and count, e.g. h200x1, h200x2, h200x1-mps2")
    own = data.get("meta", {}) if isinstance(data, dict) else {}
    first = {}
    for r in (data if isinstance(data, list) else data.get("rows") if isinstance(data, dict) else None) or []:
        if isinstance(r, dict):
            first = r
            break
    command = command or own.get("command") or (data.get("command") if isinstance(data, dict) else None)
    if not command:
        raise SystemExit("the JSON holds no command: pass --command")
    bench = bench or bench_of(command)
    if bench not in BENCHMARKS:
        raise SystemExit(f"unknown benchmark {bench!r} (known: {', '.join(BENCHMARKS)})")
    rows = _rows(bench, data)

    def pick(key):
        for src in (known, own, data if isinstance(data, dict) else {}, first):
            if src.get(key) is not None:
                return src[key]
        return None

    checked = pick("checked")
    if checked is None and rows and all("checked" in r for r in rows):
        checked = all(r["checked"] for r in rows)
    if checked is None and bench == "tritonep_run" and rows:
        checked = all(r.get("ok") for r in rows)
    meta = dict(benchmark=bench, kind=kind, command=command, commit=commit or own.get("commit") or _head(),
                date=date or own.get("date") or datetime.date.today().isoformat(), gpu=pick("gpu"),
                world_size=pick("world_size"), torch=pick("torch"), triton=pick("triton"), checked=checked)
    for k in ("cuda", "nccl"):
        if pick(k):
            meta[k] = pick(k)
    if note:
        meta["note"] = note
    return dict(meta=meta, data=data)


def add(src: Path, kind: str, bench: str | None = None, command: str | None = None, commit: str | None = None,
        date: str | None = None, note: str | None = None) -> Path:
    """Write ``src``'s run as ``benchmarks/results/<benchmark>.<kind>.json`` (replacing the previous run), then
    rebuild the index and the figures. Returns the file. Raises SystemExit as :func:`wrap`, or when the meta is
    incomplete (pass the missing fields)."""
    res = wrap(json.loads(Path(src).read_text()), kind, bench, command, commit, date, note)
    missing = [k for k in META_KEYS if res["meta"].get(k) is None and k != "checked"]
    if missing:
        raise SystemExit(f"{src}: the run recorded no {missing}; rerun with a benchmark that writes meta")
    dst = RESULTS / f"{res['meta']['benchmark']}.{kind}.json"
    dst.write_text(json.dumps(res, indent=1) + "\n")
    rebuild()
    return dst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="make a run's JSON the current result of its benchmark and GPU kind")
    a.add_argument("json", type=Path)
    a.add_argument("--kind", required=True, help="GPU model and count: h200x1, h200x2, h200x1-mps2, ...")
    a.add_argument("--bench", choices=sorted(BENCHMARKS), help="the benchmark (default: from the JSON's command)")
    a.add_argument("--command", help="the command, when the JSON holds none")
    a.add_argument("--commit", help="the code that ran (default: the JSON's, else this checkout's HEAD)")
    a.add_argument("--date", help="YYYY-MM-DD of the run (default: the JSON's, else today)")
    a.add_argument("--note", help="one sentence a reader of the figures needs")
    sub.add_parser("rebuild", help="the index and the docs' figure blocks from the files")
    sub.add_parser("check", help="exit 1 if a file, the index or a figure block is out of date")
    args = ap.parse_args(argv)
    if args.cmd == "add":
        print(add(args.json, args.kind, args.bench, args.command, args.commit, args.date, args.note)
              .relative_to(ROOT))
    elif args.cmd == "rebuild":
        rebuild()
    else:
        problems = check()
        print("\n".join(problems) or "benchmark results up to date")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
