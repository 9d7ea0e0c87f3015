"""CPU smoke run of benchmarks/deep_ep_compat.py: its sides run and its checks pass (times mean nothing here)."""

import importlib.util

import pytest

from tests import ROOT


@pytest.mark.slow  # a 2-rank CPU world timing four round trips in the interpreter: ~15 s on 2 cores
def test_deep_ep_compat_benchmark_cpu_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("deep_ep_compat", ROOT / "benchmarks" / "deep_ep_compat.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    assert mod.main(["--cpu", "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())
    assert rows and all(r["checked"] and r["compat_exact"] and r["rows_exact"] for r in rows)
