"""argparse help formatter of the ``tritonep`` commands."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter", "EpilogTableFormatter"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` like argparse's, except when there is nothing to say (None, "", an empty list) or
    the help text already states its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, "", []) or "default" in text:
            return text
        return super()._get_help_string(action)


class EpilogTableFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`HelpFormatter` that prints the description and epilog as written (a table stays a table)."""
