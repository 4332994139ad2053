"""Errors that are the user's input, not a bug: the CLI prints them as one line and exits 2.

Anything raised as one of these must name the input (file, line, field or path) in its message,
because the message is all the user sees (`-v` shows the traceback).
"""

from __future__ import annotations


class UserError(Exception):
    """Bad or unusable input: a path, a file, a setting, an unreachable package registry."""
