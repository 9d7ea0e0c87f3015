"""Write tests/slow_tests.txt from a pytest ``--durations`` log: every test at or over ``--min-s`` seconds
(setup + call + teardown) gets the ``slow`` marker (tests/conftest.py), so the default run (the README's test
command) stays under its 10-minute budget on a 2-core host and CI's second step runs the listed tests.

    bash scripts/test.sh --durations=0 > durations.log      # or -m "slow" to re-time the listed ones
    python scripts/slow_tests.py durations.log --min-s 3.0

Ids the log does not mention keep their line (a default run does not run the listed tests, so it cannot re-time
them); ids the log times under ``--min-s`` leave the list. Prints the default run's time the log implies with the
new list (the log's own total minus the newly listed tests).
"""

from __future__ import annotations

import argparse
import os
import re
from collections import defaultdict

LIST = os.path.join(os.path.dirname(__file__), "..", "tests", "slow_tests.txt")
HEADER = ("# Tests measured slowest on a 2-core CPU host: `seconds node-id` (setup + call + teardown; written by\n"
          "# scripts/slow_tests.py from a --durations log). tests/conftest.py marks them `slow`: the default run\n"
          "# deselects them (pyproject addopts); CI's second step runs them (.ci/run: -m \"soak or compile or slow\").\n")


def read_durations(path: str) -> tuple[dict, float | None]:
    """``({node id: seconds}, the run's total seconds or None)`` from a pytest log with ``--durations``."""
    per = defaultdict(float)
    total = None
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*([0-9.]+)s (setup|call|teardown)\s+(\S+)", line)
            if m:
                per[m.group(3)] += float(m.group(1))
            t = re.search(r" in ([0-9.]+)s", line)
            if t and ("passed" in line or "failed" in line):
                total = float(t.group(1))
    return dict(per), total


def read_list(path: str) -> dict:
    """``{node id: seconds}`` of the current list (empty if none)."""
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                parts = line.split("#", 1)[0].split()
                if len(parts) == 2:
                    out[parts[1]] = float(parts[0])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", help="a pytest log run with --durations=0 (or a large N)")
    ap.add_argument("--min-s", type=float, default=3.0, help="list tests at or over this many seconds")
    ap.add_argument("--out", default=LIST)
    a = ap.parse_args()
    dur, total = read_durations(a.log)
    old = read_list(a.out)
    new = {i: s for i, s in old.items() if i not in dur}
    added = {i: s for i, s in dur.items() if s >= a.min_s}
    new.update(added)
    with open(a.out, "w") as f:
        f.write(HEADER)
        for i, s in sorted(new.items(), key=lambda kv: (-kv[1], kv[0])):
            f.write(f"{s:7.2f} {i}\n")
    moved = sum(s for i, s in added.items() if i not in old)
    print(f"{len(new)} tests listed ({len(added)} from this log at >= {a.min_s} s, {len(new) - len(added)} kept)")
    if total is not None:
        print(f"the log's run: {total:.0f} s; without the newly listed tests: ~{total - moved:.0f} s")


if __name__ == "__main__":
    main()
