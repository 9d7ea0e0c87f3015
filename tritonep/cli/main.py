"""``tritonep`` entry point (argparse): ``run`` (the main job), ``bench``, ``plan``, ``env``.

Exit codes, the same for every subcommand: 0 = done (and every check passed); 1 = a check failed (wrong results), or
an unexpected crash (a bug: its traceback is printed); 2 = refused: a bad flag, file or configuration, or a library
error (:class:`tritonep.errors.TritonEPError`), also when a rank of a multi-rank world raised it; 130 / 143 =
interrupted by SIGINT / SIGTERM (every rank of the world killed, its temporary files removed). A refusal or an
interrupt is one line on stderr: ``tritonep CMD: error: ...`` / ``tritonep CMD: interrupted by SIGINT: ...``.
"""

from __future__ import annotations

import argparse
import signal
import sys

from .help import HelpFormatter

__all__ = ["main", "build_parser", "error_line", "check_environment", "use_interpreter_without_gpu",
           "check_interpreter"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``tritonep CMD: error: ...``, exit 2) instead of usage + error."""

    def error(self, message):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``tritonep`` parser with every subcommand registered (subparsers share the one-line error behaviour)."""
    ap = _Parser(
        prog="tritonep", formatter_class=HelpFormatter,
        description="Expert-parallel MoE dispatch/combine and virtual-expert balancing (Triton + symmetric memory). "
                    "Start with `tritonep run` (the main job, checked against a dense reference). Without a GPU "
                    "every command but the GPU benchmarks runs on the CPU: its ranks are forked processes, the kernels "
                    "run in Triton's interpreter. `tritonep CMD --help` for each command; docs/cli.md.",
        epilog="exit codes: 0 done and checked; 1 a check failed (or a crash); 2 refused: bad flag, file or "
               "configuration (one line on stderr); 130 / 143 interrupted by SIGINT / SIGTERM (every rank stopped)")
    # the metavar names the commands in the error of a bare `tritonep` (argparse would name the dest, "cmd")
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=_Parser, metavar="{run,bench,plan,env}")
    from . import bench, env, plan, run

    run.add_parser(sub)
    bench.add_parser(sub)
    plan.add_parser(sub)
    env.add_parser(sub)
    return ap


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def error_line(cmd: str, exc: BaseException) -> str | None:
    """The one-line refusal for ``exc``, or None when it is not a refusal (a bug: the caller shows the traceback).

    A :class:`tritonep.errors.TritonEPError` is a refusal; a :class:`tritonep.errors.RankError` is one when the
    rank's original exception is (the line then names the rank), and so is a world that timed out. Plain
    ``OSError`` (an unwritable ``--json`` path, ...) is one too.
    """
    from ..errors import RankError, TritonEPError
    from ..testing.world import WorldTimeout

    if isinstance(exc, WorldTimeout):
        return f"tritonep {cmd}: error: {_one_line(exc)}"
    if isinstance(exc, RankError):
        orig = getattr(exc, "original", None)
        if isinstance(orig, TritonEPError) and not isinstance(orig, RankError):
            rank = getattr(exc, "rank", "?")
            return f"tritonep {cmd}: error: {type(orig).__name__} (rank {rank}): {_one_line(orig)}"
        return None
    if isinstance(exc, TritonEPError):
        return f"tritonep {cmd}: error: {type(exc).__name__}: {_one_line(exc)}"
    if isinstance(exc, OSError):
        where = f" {exc.filename}" if getattr(exc, "filename", None) else ""
        return f"tritonep {cmd}: error:{where} {exc.strerror or _one_line(exc)}"
    return None


def _check_outputs(args) -> None:
    """Refuse a ``--json`` / ``--plot`` path whose folder does not exist or cannot be written, before any work.

    Raises:
        ConfigError: naming the flag and the path.
    """
    import os

    from ..errors import ConfigError

    for flag in ("json", "plot"):
        path = getattr(args, flag, "") or ""
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ConfigError(f"--{flag} {path}: the folder {folder} does not exist or is not writable")
        if os.path.isdir(path):
            raise ConfigError(f"--{flag} {path} is a folder; give a file name")


def check_environment() -> None:
    """Every ``TRITONEP_*`` value, parsed when the command starts, before any world or file is touched
    (:func:`tritonep.envs.check_all`, and TRITONEP_GEOMETRY through the kernel-tile table's own parser).

    Raises:
        ConfigError: the first bad value, naming the variable and the value.
    """
    from .. import envs
    from ..backends import kernel_tiles
    from ..errors import ConfigError

    envs.check_all()
    override = envs.geometry_override()
    if override:
        # TRITONEP_GEOMETRY's field checks, refusing here only what no configuration accepts: some entries are valid
        # for some configurations only (fc=1 alone needs the table's fused roles, >= 1024 tokens per rank on a GPU;
        # dec= needs max_tokens_per_rank <= 256), so it is applied to a decode-size config and to one whose table
        # tiles are the fused dispatch; what a run's own configuration refuses, its buffer refuses
        try:
            kernel_tiles("cpu", 2, 128, 1, 1, "bf16", override=override, source="TRITONEP_GEOMETRY")
        except ConfigError as small:
            try:
                kernel_tiles("cuda", 2, 128, 1024, 1, "bf16", override=override, source="TRITONEP_GEOMETRY")
            except ConfigError:
                raise small from None


def _fresh_line() -> str:
    """What starts the command's last line on stderr: on a terminal, a rank's own output may have left the line
    unfinished when the world was interrupted or failed, and only the parent is left to clear it; elsewhere
    nothing."""
    return "\r\033[K" if sys.stderr.isatty() else ""


def use_interpreter_without_gpu() -> None:
    """Set ``TRITON_INTERPRET=1`` when this process has no CUDA device (an explicit value wins).

    The command is a process entry point, so it may choose the environment; it does so before any kernel module is
    imported (Triton decides compiled vs interpreted when a kernel is decorated). Importing :mod:`tritonep` never
    touches the environment.
    """
    import torch

    from .. import envs

    if not torch.cuda.is_available() and envs.get("TRITON_INTERPRET") is None:
        from .env import INTERPRET_SET_BY_CLI

        envs.put("TRITON_INTERPRET", "1")
        envs.put(INTERPRET_SET_BY_CLI, "1")


_TRUE = ("1", "true", "yes", "on", "y")
"""Values Triton reads as true in ``TRITON_INTERPRET`` (case-insensitive)."""


def check_interpreter(cmd: str) -> None:
    """Refuse, in the command's own terms, a ``TRITON_INTERPRET`` that turns the interpreter off on a machine without a
    CUDA GPU (``run`` and ``bench`` run Triton kernels; ``plan`` and ``env`` run none).

    Raises:
        ConfigError: ``TRITON_INTERPRET`` is set to a false value (``0``, ``false``, ...) and torch sees no GPU.
    """
    import torch

    from .. import envs
    from ..errors import ConfigError

    value = envs.get("TRITON_INTERPRET")
    if cmd not in ("run", "bench") or value is None or torch.cuda.is_available():
        return
    if value.strip().lower() not in _TRUE:
        raise ConfigError(f"TRITON_INTERPRET={value} asks Triton to compile the kernels for a GPU, but this machine "
                          f"has no CUDA GPU: unset TRITON_INTERPRET (tritonep {cmd} then runs every rank's kernels in "
                          f"Triton's CPU interpreter) or set TRITON_INTERPRET=1")


def main(argv=None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the subcommand; returns the exit code (see module doc)."""
    from ..errors import RankError

    from ..testing.interrupts import command_signals

    use_interpreter_without_gpu()
    args = build_parser().parse_args(argv)
    try:
        with command_signals():  # SIGINT / SIGTERM: one line, exit 130 / 143 (every rank killed, temp files gone)
            check_environment()
            check_interpreter(args.cmd)
            _check_outputs(args)
            return int(args.func(args) or 0)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"{_fresh_line()}tritonep {args.cmd}: interrupted by {signal.Signals(signum).name}: every rank "
              f"stopped, temporary files removed", file=sys.stderr, flush=True)
        return 128 + signum
    except (RankError, Exception) as e:  # noqa: BLE001 - every library error becomes one line
        line = error_line(args.cmd, e)
        if line is None:
            if isinstance(e, RankError):  # a rank crashed on a bug: its message carries the rank's traceback
                print(f"{_fresh_line()}tritonep {args.cmd}: {e}", file=sys.stderr)
                return 1
            raise
        print(f"{_fresh_line()}{line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
