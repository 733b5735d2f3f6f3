"""Reading .jsonl files (SFT examples, preference pairs, generation prompts) with errors that name the line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from loom.errors import UserError


def jsonl_records(path: str | os.PathLike, example: str) -> Iterator[tuple[str, object | None]]:
    """(where, record) for every line of a .jsonl file: `where` is "FILE, line N" for messages, `record` the
    parsed JSON value, or None for a blank line. A line that is not UTF-8 or not JSON is a UserError naming
    the file and line, and `example` (a valid record) shows what was expected."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}, line {lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise UserError(f"{where}: not UTF-8 text") from None
            if not line:
                yield where, None
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                                f"record such as {example}") from None
