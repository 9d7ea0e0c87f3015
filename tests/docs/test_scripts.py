"""The README's scripts behave as it says: ``bash scripts/test.sh PATH`` runs only PATH (it used to append ``tests``
to every command line, so ``scripts/test.sh tests/docs -x`` ran the whole suite)."""

import os
import re
import subprocess
import sys

from tests import ROOT


def test_test_sh_with_a_path_collects_only_that_path():
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), "tests/docs/test_names.py", "--collect-only", "-q"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    files = set(re.findall(r"^(tests/\S+?): \d+$", p.stdout, flags=re.M))  # test.sh's -q and ours: "FILE: N" lines
    assert files == {"tests/docs/test_names.py"}, p.stdout
