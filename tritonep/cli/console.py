"""The rich console of the ``tritonep`` commands, as wide as the terminal."""

from __future__ import annotations

import shutil
import sys

__all__ = ["make_console"]


def make_console():
    """A :class:`rich.console.Console` for a command's tables and lines.

    On a terminal it takes the terminal's width, so rich wraps a long line at a word and a table's cells inside
    their column, and the terminal itself never breaks a line mid-list (a fixed width wider than the terminal did).
    Elsewhere (a log file, a pipe) there is no terminal to wrap: ``COLUMNS`` or 140, at least 120 columns.
    """
    from rich.console import Console

    if sys.stdout.isatty():
        return Console()
    return Console(width=max(shutil.get_terminal_size((140, 24)).columns, 120))
