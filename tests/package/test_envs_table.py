"""Every TRITONEP_* variable is read in tritonep/envs.py, listed in its table, and only there; the documentation
names no variable that does not exist; ``tritonep env`` shows the ones that are set."""

import os
import re
import subprocess
import sys

import pytest
import torch

from tritonep import envs

from tests import ROOT

NAME = re.compile(r"\bTRITONEP_[A-Z0-9_]+")


def _table_names() -> list[str]:
    return re.findall(r"^\| (TRITONEP_[A-Z0-9_]+) \|", envs.__doc__, flags=re.M)


def test_table_variables_and_readers_agree():
    src = (ROOT / "tritonep" / "envs.py").read_text()
    assert sorted(_table_names()) == sorted(envs.VARIABLES)
    for name in envs.VARIABLES:
        assert any(f'{r}("{name}"' in src for r in ("_get", "_int_env", "_flag")), \
            f"{name} is in the table but envs.py never reads it"


def test_no_module_outside_envs_names_an_unknown_variable():
    bad = []
    for path in (ROOT / "tritonep").rglob("*.py"):
        if path.name == "envs.py" and path.parent.name == "tritonep":
            continue
        for m in NAME.finditer(path.read_text()):
            if m.group(0) not in envs.VARIABLES:
                bad.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert not bad, bad


def test_documentation_names_only_real_variables():
    docs = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [f"{p.relative_to(ROOT)}: {n}" for p in docs for n in set(NAME.findall(p.read_text()))
           if n not in envs.VARIABLES]
    assert not bad, bad


def test_force_no_p2p_is_read_through_envs(monkeypatch):
    monkeypatch.setenv("TRITONEP_FORCE_NO_P2P", "1")
    assert envs.force_no_p2p()
    monkeypatch.setenv("TRITONEP_FORCE_NO_P2P", "0")
    assert not envs.force_no_p2p()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only: the command sets the interpreter itself")
@pytest.mark.slow  # > 4 s on 2 cores: CI's second step
def test_env_command_shows_set_variables_and_who_set_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(COLUMNS="250", TRITONEP_GEOMETRY="bt=2,grid=8", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "tritonep.cli.main", "env"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert re.search(r"TRITONEP_GEOMETRY\s*│\s*bt=2,grid=8", out), out
    assert "set by the tritonep command" in out, out
    if env.get("NCCL_NVLS_ENABLE") != "0":  # multicast not disabled: the bare False says what is missing and why
        assert "GPU runs want them" in " ".join(out.split()), out
    env["TRITON_INTERPRET"] = "1"  # the user's own setting is shown as it is
    p = subprocess.run([sys.executable, "-m", "tritonep.cli.main", "env"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert p.returncode == 0 and "set by the tritonep command" not in p.stdout, p.stdout + p.stderr
