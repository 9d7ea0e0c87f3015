"""``tritonep`` entry point (argparse): ``run`` (the main job), ``bench``, ``plan``, ``env``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="tritonep",
        description="Expert-parallel MoE dispatch/combine and virtual-expert balancing (Triton + symmetric memory).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    from . import bench, env, plan, run

    run.add_parser(sub)
    bench.add_parser(sub)
    plan.add_parser(sub)
    env.add_parser(sub)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
