"""Batch generation files for `loom generate --input/--output`: read prompt records, write completion records.

Input: `.jsonl` (or `.parquet`), one `{"prompt": str}` or chat `{"messages": [{"role", "content"}, ...]}` per line (the caller
renders a conversation with the model's chat template and its generation prompt; blank lines are skipped).
Output, in input order: each input record with `completion`, `tokens`, `logprobs` and `finish_reason` set
(replacing fields of those names), where `tokens` are the generated ids (a stop token that ended the
sequence included, its text left out of `completion`, which also ends before a stop string), `logprobs` the
log-probability of each under the model at temperature 1, and `finish_reason` "stop" or "length". The
output appears only when complete: it is written to a temporary file beside it and renamed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from loom.data.records import Malformed, records
from loom.errors import UserError
from loom.files import honour_umask

def read_prompts(path: str | os.PathLike) -> list[tuple[str, dict]]:
    """(where, record) of every record of a .jsonl or .parquet file: a string "prompt" or a non-empty list
    "messages"; bad records are all counted and the first named by file and line (row for Parquet)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--input {str(path)!r} does not exist or is not a file; give a .jsonl file with one "
                        '{"prompt": "..."} or {"messages": [...]} record per line')
    malformed = Malformed("prompt records")
    out = []
    for _, where, record in records(p, malformed, example='{"prompt": "Once upon a time"}'):
        ok = isinstance(record, dict) and (isinstance(record.get("prompt"), str) or (
            "prompt" not in record and isinstance(record.get("messages"), list) and record["messages"]))
        if not ok:
            got = (f"a record without \"prompt\" or \"messages\" (keys: {sorted(record)})" if isinstance(record, dict)
                   and "prompt" not in record and "messages" not in record else f"{json.dumps(record)[:80]}")
            malformed.add(f'{where}: expected a record with a string "prompt" or a non-empty list of chat '
                          f'"messages", got {got}', p)
        elif not malformed:
            out.append((where, record))
    malformed.check()
    if not out:
        raise UserError(f'--input {p} holds no records; give one {{"prompt": "..."}} per line')
    return out


def write_records(path: str | os.PathLike, records: list[dict]) -> None:
    """Write `records` as .jsonl to `path` atomically (a temporary file in the same directory, renamed)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        honour_umask(tmp)  # mkstemp makes it private
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

