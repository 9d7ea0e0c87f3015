"""benchmarks/probes/stage_own_bench.py: ep_bench with the quantized wires' ``stage_own`` flipped, from a plain shell."""

import json
import os
import re
import subprocess
import sys

from tests import ROOT


def test_stage_own_flipped_runs_checked_and_says_so(tmp_path):
    out = tmp_path / "so.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "stage_own_bench.py"), "--stage-own", "1",
                        "--", "--cpu", "--wires", "mxfp4", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.search(r"stage_own=1 for .*mxfp4", p.stdout)  # no wire stages its own rows by default: flipped
    d = json.loads(out.read_text())
    assert d["meta"]["stage_own"] == 1 and d["meta"]["checked"] is True
    rows = [r for rank in d["rows"] for r in (rank if isinstance(rank, list) else [rank])]
    kept = [r for r in rows if r.get("op") == "tritonep.dispatch.mxfp4.kept"]
    assert kept and all(r["checked"] is True for r in rows)


def test_apply_stage_own_changes_only_the_wires_that_differ():
    from tests import load_script
    from tritonep.wire.formats import WIRES, get_wire

    so = load_script("benchmarks/probes/stage_own_bench.py", "_stage_own_bench")
    before = {n: get_wire(n).codec for n in WIRES}
    try:
        quantized = {n for n, c in before.items() if c.quantized}
        changed = so.apply_stage_own(True)
        assert set(changed) == {n for n in quantized if not before[n].stage_own} and changed
        assert all(get_wire(n).codec.stage_own for n in quantized)
        assert so.apply_stage_own(True) == []
        assert set(so.apply_stage_own(False)) == quantized
        assert all(not get_wire(n).codec.stage_own for n in quantized)
    finally:
        for n, c in before.items():
            object.__setattr__(get_wire(n), "codec", c)
    assert all(get_wire(n).codec is c for n, c in before.items())


def test_meta_edited_only_in_the_file_this_run_wrote_on_rank_0(tmp_path, monkeypatch):
    """The JSON gets ``stage_own`` only where ep_bench wrote it in this run, and only on rank 0 (the rank that writes
    it: another rank of a torchrun world would read it while it is written, or write an older file back)."""
    import tests
    from tritonep.wire.formats import WIRES, get_wire

    so = tests.load_script("benchmarks/probes/stage_own_bench.py", "_stage_own_bench")
    path = tmp_path / "so.json"
    writes = []

    class FakeBench:
        @staticmethod
        def main(rest):
            if writes[-1]:  # a size of its own each time (file times may be coarser than two writes apart)
                path.write_text(json.dumps(dict(meta=dict(checked=True), rows=[[]] * len(writes))))
            return 0

    monkeypatch.setattr(tests, "load_script", lambda *a, **k: FakeBench)
    before = {n: get_wire(n).codec for n in WIRES}
    try:
        path.write_text(json.dumps(dict(meta=dict(older=True), rows=[])))
        for rank, wrote, tagged in (("0", False, False), ("1", True, False), ("0", True, True)):
            monkeypatch.setenv("RANK", rank)
            writes.append(wrote)
            assert so.main(["--stage-own", "1", "--", "--json", str(path)]) == 0
            assert ("stage_own" in json.loads(path.read_text())["meta"]) is tagged, (rank, wrote)
    finally:
        for n, c in before.items():
            object.__setattr__(get_wire(n), "codec", c)
