"""Progress lines of a command whose work runs in a world of rank processes.

Rank 0 appends one line per finished piece of work (a layer of ``tritonep run``) to a progress file; the command's
own process, which waits for the world, prints each new line on stderr as it arrives (the worlds call its
:meth:`ProgressLines.poll` about every 0.5 s while they wait). So the progress shows on a terminal and in a log alike,
and the ranks never write to the terminal themselves.
"""

from __future__ import annotations

import os
import sys
import tempfile

__all__ = ["ProgressLines", "report"]


def report(path: str | None, text: str) -> None:
    """Append one progress line to ``path`` (a rank's side; ``None``: no progress wanted)."""
    if not path:
        return
    with open(path, "a") as f:
        f.write(text.replace("\n", " ") + "\n")


class ProgressLines:
    """The command's side: a progress file for the ranks, and :meth:`poll` printing its new lines.

    Args:
        prefix: what starts every printed line (``"tritonep run: "``).
        stream: where to print (default: ``sys.stderr``).
    """

    def __init__(self, prefix: str, stream=None):
        fd, self.path = tempfile.mkstemp(prefix="tritonep_progress_", suffix=".txt")
        os.close(fd)
        self.prefix = prefix
        self.stream = stream
        self._pos = 0

    def poll(self) -> None:
        """Print every complete line the ranks added since the last call (never raises)."""
        try:
            with open(self.path) as f:
                f.seek(self._pos)
                text = f.read()
        except OSError:
            return
        done = text.rfind("\n") + 1
        if not done:
            return
        self._pos += len(text[:done].encode())
        out = self.stream or sys.stderr
        for line in text[:done].splitlines():
            print(f"{self.prefix}{line}", file=out, flush=True)

    def close(self) -> None:
        """Print what is left and remove the file."""
        self.poll()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
