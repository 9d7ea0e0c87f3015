"""The README's examples run and check themselves: the CPU EPBuffer example, and examples/torchrun_moe.py (its
``main(group)`` in a 2-rank CPU world); the README quotes the torchrun script as it is."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from tests import ROOT

README = (ROOT / "README.md").read_text()
EXAMPLE = ROOT / "examples" / "torchrun_moe.py"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def _load_example():
    spec = importlib.util.spec_from_file_location("torchrun_moe", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU world path (GPU: torchrun on the device machine)")
def test_torchrun_example_main_in_a_cpu_world():
    from tritonep.testing import run_cpu_world

    res = run_cpu_world(2, _load_example().main)  # main asserts its own checks; a failing rank raises RankError
    assert len(res) == 2
    for r in res:
        assert r["dispatch_err"] < 2e-2 and r["moe_err"] < 3e-2 and r["grad_x_norm"] > 0


def test_readme_quotes_the_torchrun_example_as_it_is():
    block = next(b for b in _python_blocks() if "def main(group" in b)
    src = EXAMPLE.read_text().splitlines()
    pos = 0
    for line in block.splitlines():
        if line.strip() in ("", "..."):
            continue  # elisions
        try:
            pos = src.index(line, pos) + 1  # every quoted line is in the script, in order
        except ValueError:
            pytest.fail(f"README line not in {EXAMPLE.name} (in this order): {line!r}")
    assert "torchrun --nproc-per-node 2 examples/torchrun_moe.py" in README


def test_readme_cpu_example_runs_and_checks_its_result(tmp_path):
    block = next(b for b in _python_blocks() if "run_cpu_world(2, rank_fn)" in b)
    assert "assert_close" in block  # the example checks, not only prints
    script = tmp_path / "readme_example.py"
    script.write_text(block)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "checked: [(16, 64), (16, 64)]" in p.stdout


def test_torchtitan_example_trains_in_a_cpu_world():
    """examples/torchtitan_moe.py: torchtitan's MoE layers with tritonep's dispatcher, 4 AdamW steps on 2 CPU ranks;
    main() asserts the loss falls; every rank sees the same all-reduced loss."""
    if os.environ.get("CI"):
        import torchtitan  # noqa: F401  (installed by scripts/setup.sh: never skipped in CI)
    else:
        pytest.importorskip("torchtitan")
    from tritonep.testing import run_cpu_world

    spec = importlib.util.spec_from_file_location("torchtitan_moe", ROOT / "examples" / "torchtitan_moe.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    losses = run_cpu_world(2, mod.main, timeout_s=400)
    assert losses[0] == losses[1] and losses[0][-1] < losses[0][0]
