"""Batch generation files for `loom generate --input/--output`: read prompt records, write completion records.

Input: `.jsonl`, one `{"prompt": str}` per line (other keys are ignored; blank lines are skipped). Output, in
input order: `{"prompt", "completion", "tokens", "logprobs", "finish_reason"}`, where `tokens` are the
generated ids (a stop token that ended the sequence included, its text left out of `completion`) and
`logprobs` the log-probability of each under the model at temperature 1. The output appears only when
complete: it is written to a temporary file beside it and renamed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from loom.data.jsonl import jsonl_records
from loom.errors import UserError
from loom.files import honour_umask


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The "prompt" of every record of a .jsonl file; bad input names the file and line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--input {str(path)!r} does not exist or is not a file; give a .jsonl file with one "
                        '{"prompt": "..."} record per line')
    prompts = []
    for where, record in jsonl_records(p, '{"prompt": "Once upon a time"}'):
        if record is None:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            got = (f"a record without \"prompt\" (keys: {sorted(record)})" if isinstance(record, dict)
                   and "prompt" not in record else f"{json.dumps(record)[:80]}")
            raise UserError(f'{where}: expected a record with a string "prompt", got {got}')
        prompts.append(record["prompt"])
    if not prompts:
        raise UserError(f'--input {p} holds no records; give one {{"prompt": "..."}} per line')
    return prompts


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

