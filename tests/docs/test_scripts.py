"""The README's scripts behave as it says: ``bash scripts/test.sh PATH`` runs only PATH (it used to append ``tests``
to every command line, so ``scripts/test.sh tests/docs -x`` ran the whole suite), and the benchmark drivers' ``--cpu``
runs start from a plain shell (they imported tritonep's kernels compiled before their CPU world, which refused them;
the tests of tests/bench call their ``main`` in a process that already has ``TRITON_INTERPRET=1``), and the examples'
``--help`` prints what the script does instead of running it."""

import os
import re
import subprocess
import sys

import pytest
import torch

from tests import ROOT

CPU_DRIVERS = ("ep_bench", "probes/kernel_breakdown", "planner_bench", "moe_bench")


@pytest.mark.slow  # 4-7 s on 2 cores (collection in a subprocess): CI's second step
def test_test_sh_with_a_path_collects_only_that_path():
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), "tests/docs/test_names.py", "--collect-only", "-q"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    files = set(re.findall(r"^(tests/\S+?): \d+$", p.stdout, flags=re.M))  # test.sh's -q and ours: "FILE: N" lines
    assert files == {"tests/docs/test_names.py"}, p.stdout


def test_benchmark_drivers_with_cpu_import_the_kernels_interpreted():
    """Each driver's module, loaded as ``python benchmarks/<driver>.py --cpu`` loads it (argv, TRITON_INTERPRET unset), leaves
    tritonep's kernels interpreted, which ``run_cpu_world`` requires."""
    code = ("import sys\n"
            "from tests import ROOT, load_script\n"
            f"for name in {CPU_DRIVERS!r}:\n"
            "    sys.argv = [str(ROOT / 'benchmarks' / (name + '.py')), '--cpu']\n"
            "    load_script('benchmarks/' + name + '.py', name.replace('/', '_'))\n"
            "import tritonep.device.common as c\n"
            "print('interpreted', c.kernels_interpreted())\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "interpreted True" in p.stdout, p.stdout + p.stderr


@pytest.mark.slow  # three subprocesses importing torch (and torchtitan): CI's second step
@pytest.mark.parametrize("example", ["torchrun_moe", "torchtitan_moe", "train_moe"])
def test_example_help_describes_and_runs_nothing(example):
    if example == "torchtitan_moe":
        pytest.importorskip("torchtitan")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / f"{example}.py"), "--help"], capture_output=True,
                       text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith(f"usage: {example}.py"), p.stdout
    assert "step 0" not in p.stdout and "world 2 on" not in p.stdout, p.stdout  # the runs' own lines: it ran nothing


@pytest.mark.slow  # imports torchtitan in a subprocess: CI's second step
def test_torchtitan_example_under_torchrun_without_gpu_says_so_in_one_line():
    """torchrun's environment (RANK set) without a GPU: one line naming the CPU command, no traceback (the dispatcher's
    triton backend has no symmetric heap outside a CPU world; it used to raise HeapError on every rank)."""
    pytest.importorskip("torchtitan")
    if torch.cuda.is_available():
        pytest.skip("the no-GPU path")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "torchtitan_moe.py")], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "python examples/torchtitan_moe.py" in p.stderr, p.stderr


def test_scripts_are_setup_tests_one_gpu_runner_and_tools():
    names = sorted(p.name for p in (ROOT / "scripts").iterdir() if p.is_file())
    assert len(names) <= 6 and {"setup.sh", "test.sh", "gpu.sh"} <= set(names), names
    assert not [n for n in names if n.startswith("gpu") and n != "gpu.sh"], names


def test_gpu_runner_header_lists_exactly_its_suites():
    """Every suite of scripts/gpu.sh's header has its case, and every case its header line (the usage a user reads
    is the runner's own)."""
    text = (ROOT / "scripts" / "gpu.sh").read_text()
    header = text[:text.index("set -uo pipefail")]
    listed = set()
    for line in header.splitlines():
        m = re.match(r"#   (\S+)\s", line)
        if m:
            listed |= set(m.group(1).split("/"))
    cases = set(re.findall(r"^\s+([a-z0-9|]+)\)", text, flags=re.M))
    cases = {c for group in cases for c in group.split("|")}
    assert listed - {"bash"} == cases, (sorted(listed), sorted(cases))


def test_no_file_names_a_script_that_is_gone():
    """Docs, tests, benchmarks and the library name only scripts and benchmark files that exist."""
    rx = re.compile(r"\b((?:scripts|benchmarks(?:/probes)?)/[A-Za-z0-9_]+\.(?:sh|py))\b")
    missing = []
    for folder in ("README.md", "docs", "tests", "benchmarks", "tritonep", "examples", "scripts", ".ci"):
        path = ROOT / folder
        files = [path] if path.is_file() else [f for f in path.rglob("*") if f.suffix in (".md", ".py", ".sh", "")
                                               and f.is_file() and "results" not in f.parts]
        for f in files:
            if "data" in f.relative_to(ROOT).parts[:2]:  # tritonep/data: the data's provenance names its own repos' files
                continue
            for name in set(rx.findall(f.read_text(errors="replace"))):
                if not (ROOT / name).is_file():
                    missing.append(f"{f.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_one_benchmark_script_per_question_and_one_shape_table():
    """benchmarks/: one script per question a user asks (dispatch / combine, MoE layer, planner, peers, the
    torchtitan layer, the host path); probes of past questions in benchmarks/probes/; no benchmark retypes the
    DeepSeek-V3 shape (they take it from tritonep/bench/profiles.py)."""
    top = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    assert top == ["deep_ep_compat", "eager_profile", "ep_bench", "moe_bench", "peer_bench", "planner_bench",
                   "titan_bench"], top
    for f in (ROOT / "benchmarks").rglob("*.py"):
        assert "7168" not in f.read_text(), f"{f.relative_to(ROOT)} retypes the DeepSeek-V3 hidden size"


def test_setup_prints_a_line_before_each_step():
    """scripts/setup.sh is silent pip work of a minute or more: every install step is announced on its own line first
    (``setup [i/N, t s]: what``), and the last line names the next commands."""
    lines = [ln.strip() for ln in (ROOT / "scripts" / "setup.sh").read_text().splitlines()]
    steps = [i for i, ln in enumerate(lines) if ln.startswith("say ")]
    assert [lines[i].split()[1] for i in steps] == ["1", "2", "3", "4", "5"], steps
    say = next(ln for ln in lines if ln.startswith("say()"))
    assert 'echo "setup [$1/5' in say, say
    installs = [i for i, ln in enumerate(lines) if "pip install" in ln and "--upgrade pip" not in ln]
    assert installs
    for i in installs:  # the nearest announcement before each install is a step of its own
        before = max(j for j in steps if j < i)
        assert not any("pip install" in lines[k] and "--upgrade pip" not in lines[k] for k in range(before + 1, i)), \
            (lines[before], lines[i])
    assert lines[-1].startswith('echo "setup done in') and "tritonep run" in lines[-1]
