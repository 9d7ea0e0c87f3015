"""CPU smoke run of benchmarks/deep_ep_compat.py: its sides run and its checks pass (times mean nothing here)."""

import pytest

from tests import load_script


@pytest.mark.slow  # a 2-rank CPU world timing four round trips in the interpreter: ~15 s on 2 cores
def test_deep_ep_compat_benchmark_cpu_smoke(tmp_path, capsys):
    mod = load_script("benchmarks/deep_ep_compat.py")
    out = tmp_path / "r.json"
    assert mod.main(["--cpu", "--json", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())
    assert rows and all(r["checked"] and r["compat_exact"] and r["rows_exact"] for r in rows)
