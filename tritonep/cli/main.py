"""``tritonep`` entry point (argparse): ``run`` (the main job), ``bench``, ``plan``, ``env``."""

from __future__ import annotations

import argparse

from .help import HelpFormatter
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tritonep", formatter_class=HelpFormatter,
        description="Expert-parallel MoE dispatch/combine and virtual-expert balancing (Triton + symmetric memory).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    from . import bench, env, plan, run

    run.add_parser(sub)
    bench.add_parser(sub)
    plan.add_parser(sub)
    env.add_parser(sub)
    return ap


def main(argv=None) -> int:
    """Parse ``argv`` and run the subcommand; a library error (bad layer, domain, size...) prints one line, exit 2."""
    from ..errors import RankError, TritonEPError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RankError as e:  # a rank failed: the first line names it; the traceback follows for debugging
        print(f"tritonep {args.cmd}: {e}", file=sys.stderr)
        return 1
    except TritonEPError as e:
        print(f"tritonep {args.cmd}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
