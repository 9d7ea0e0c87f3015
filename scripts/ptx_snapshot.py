"""PTX snapshots of every kernel variant the CPU tests launch, to prove a device-code refactor changes no GPU code.

Three steps (run from the repository root with ``PYTHONPATH=.``):

    # 1. run CPU tests and record every interpreted launch (kernel, argument types, constexprs, num_warps)
    python scripts/ptx_snapshot.py record /tmp/launches.jsonl -- tests/ep/test_dispatch_combine.py \\
        tests/backends/triton/test_geometry.py tests/backends/triton/test_decode.py -x -q
    # 2. compile each recorded variant (and its HAS_TIMER=True GPU twin) for sm_90: one PTX file per variant
    python scripts/ptx_snapshot.py snapshot /tmp/launches.jsonl /tmp/ptx_before
    # ... edit the kernels, then snapshot the SAME launches again (and re-record to check the set is unchanged)
    python scripts/ptx_snapshot.py snapshot /tmp/launches.jsonl /tmp/ptx_after
    # 3. compare: exit 0 when every variant's PTX is identical but for debug info (.loc/.file, DWARF labels, comments)
    python scripts/ptx_snapshot.py compare /tmp/ptx_before /tmp/ptx_after
    python scripts/ptx_snapshot.py same-launches /tmp/launches.jsonl /tmp/launches_after.jsonl

The recorder, the compiler call and the normalization live in :mod:`tests.support.compile_check`
(``record_launches_to``, ``write_ptx``, ``compare_ptx_dirs``). No GPU is needed; the PTX files are not committed.
"""

from __future__ import annotations

import argparse
import os
import sys


def _record(args) -> int:
    import pytest

    from tests.support.compile_check import record_launches_to

    if os.path.exists(args.out):
        os.remove(args.out)
    os.environ.setdefault("TRITON_INTERPRET", "1")

    class _Plugin:
        def __init__(self):
            self._ctx = None

        def pytest_sessionstart(self, session):
            self._ctx = record_launches_to(args.out)
            self._ctx.__enter__()

        def pytest_sessionfinish(self, session, exitstatus):
            self._ctx.__exit__(None, None, None)

    rc = pytest.main(args.pytest_args, plugins=[_Plugin()])
    from tests.support.compile_check import read_records

    recs = read_records(args.out) if os.path.exists(args.out) else []
    errors = [r for r in recs if "error" in r]
    print(f"recorded {len(recs) - len(errors)} distinct launches ({len(errors)} recording errors) in {args.out}")
    return int(rc) or (1 if errors else 0)


def _snapshot(args) -> int:
    from tests.support.compile_check import read_records, with_gpu_twins, write_ptx

    recs = read_records(args.records)
    failures = write_ptx(recs, args.out_dir, jobs=args.jobs)
    n = len(with_gpu_twins(recs))
    for key, err in failures:
        print(f"FAILED {key}: {err}")
    print(f"{n - len(failures)} of {n} variants compiled for sm_90 into {args.out_dir}")
    return 1 if failures else 0


def _compare(args) -> int:
    from tests.support.compile_check import compare_ptx_dirs

    res = compare_ptx_dirs(args.before, args.after)
    for k, diff in res["different"].items():
        print(diff if args.verbose else f"DIFFERENT {k}")
    for k in res["only_before"]:
        print(f"only in {args.before}: {k}")
    for k in res["only_after"]:
        print(f"only in {args.after}: {k}")
    print(f"compared {res['compared']} variants: {len(res['identical'])} identical, {len(res['different'])} "
          f"different, {len(res['only_before'])} only before, {len(res['only_after'])} only after")
    return 0 if not (res["different"] or res["only_before"] or res["only_after"]) else 1


def _same_launches(args) -> int:
    from tests.support.compile_check import normalized, read_records, variant_key

    # each record as today's tree launches it (the kernel's module now, defaults left out recorded as the defaults)
    a = {variant_key(normalized(r)) for r in read_records(args.a) if "error" not in r}
    b = {variant_key(normalized(r)) for r in read_records(args.b) if "error" not in r}
    for k in sorted(a - b):
        print(f"only in {args.a}: {k}")
    for k in sorted(b - a):
        print(f"only in {args.b}: {k}")
    print(f"{len(a)} and {len(b)} distinct launches, {len(a & b)} in both")
    return 0 if a == b else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run pytest and record every interpreted kernel launch (JSON lines)")
    r.add_argument("out")
    r.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: the pytest arguments")
    s = sub.add_parser("snapshot", help="compile every recorded variant for sm_90, one PTX file each")
    s.add_argument("records")
    s.add_argument("out_dir")
    s.add_argument("-j", "--jobs", type=int, default=1, help="compiler processes at once (default 1)")
    c = sub.add_parser("compare", help="compare two snapshot folders (debug info ignored); exit 1 on a difference")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("-v", "--verbose", action="store_true", help="print the diff of every differing variant")
    q = sub.add_parser("same-launches", help="check that two record files hold the same launch variants")
    q.add_argument("a")
    q.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        args.pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    return {"record": _record, "snapshot": _snapshot, "compare": _compare, "same-launches": _same_launches}[args.cmd](
        args)


if __name__ == "__main__":
    sys.exit(main())
