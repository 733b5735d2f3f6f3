"""Errors that reach the user.

`UserError` is bad input: a config, an argument, a data file or a checkpoint. The CLI prints its
message (one paragraph, no traceback) and exits with code 2. Anything else is a bug and exits 1.
"""

from __future__ import annotations

import difflib


class UserError(Exception):
    """Bad input from the user; the message names what is wrong and what would be valid."""

    exit_code = 2


def closest(word: str, choices, n: int = 1) -> str:
    """A ' (did you mean X?)' suffix for the closest of `choices`, or '' when none is close."""
    match = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


class TrainingDiverged(Exception):
    """Too many consecutive non-finite steps; the message says where it went non-finite. Exit code 3."""

    exit_code = 3


class CollectiveTimeout(Exception):
    """A collective did not complete within train.collective_timeout_s, or a peer vanished; the message
    names the ranks that were behind (see loom/train/hang.py). Exit code 1."""

    exit_code = 1
