"""Records as data arrives: JSON-lines and Parquet files, named by path or glob.

One reader behind `loom preprocess`, sft.data, pref.data and rl.prompts. `records(path, ...)` yields
(index, where, record) for each row: `where` names it in messages, "FILE, line N" for JSON lines (lines
counted from 1, blank lines skipped) and "FILE, row N" for Parquet (rows counted from 0 across row groups,
as pyarrow and pandas index them). A Parquet file is streamed a record batch at a time
(`ParquetFile.iter_batches`), reading only the columns asked for, so memory is bounded by a row group
whatever the file's size. Columns may be renamed to the names a reader expects (`rename`, from the
`*_column` config keys), so a record looks the same whichever file it came from.

A malformed row (not JSON, a missing or null column, a value of the wrong type) goes to `Malformed`, which
counts them: a reader keeps scanning to count them all but stops using rows after the first, then raises
one UserError naming the first few by file and row, and how many there were.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

from loom.errors import UserError

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
SUFFIXES = JSON_SUFFIXES + PARQUET_SUFFIXES
BATCH_ROWS = 1024  # rows decoded at a time from a Parquet row group: bounded memory for long documents


def is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def expand(spec: str, what: str) -> list[Path]:
    """The files a data entry names: a path as is, a glob's matches in sorted order (`**` recursive).
    A glob that matches no file is a UserError naming `what` (the config key or option)."""
    if not is_glob(spec):
        return [Path(spec)]
    files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
    if not files:
        raise UserError(f"{what} entry {spec!r} matches no file; give .jsonl or .parquet files, or a glob such as "
                        "data/train-*.parquet that matches some")
    return files


def is_parquet(path: Path) -> bool:
    return Path(path).suffix.lower() in PARQUET_SUFFIXES


class Malformed:
    """Malformed rows seen while reading some data: `add` one (its message names file and row), `check`
    raises them together as one UserError (the first `SHOW` named, and the count)."""

    SHOW = 5

    def __init__(self, what: str, hint: str = ""):
        self.what, self.hint = what, hint
        self.count = 0
        self.first: list[str] = []
        self.files: set[str] = set()

    def add(self, message: str, path: Path | str | None = None) -> None:
        self.count += 1
        if path is not None:
            self.files.add(str(path))
        if len(self.first) < self.SHOW:
            self.first.append(message)

    def __bool__(self) -> bool:
        return self.count > 0

    def check(self) -> None:
        if not self.count:
            return
        if self.count == 1:
            raise UserError(self.first[0] + (f". {self.hint}" if self.hint else ""))
        files = f" in {len(self.files)} file{'s' if len(self.files) != 1 else ''}" if self.files else ""
        more = f"; and {self.count - len(self.first)} more" if self.count > len(self.first) else ""
        raise UserError(f"{self.count} malformed {self.what}{files} (nothing was used): " + "; ".join(self.first) + more
                        + (f". {self.hint}" if self.hint else ""))


def _renamed(record, rename: dict[str, str] | None):
    """`record` with each source column renamed to the name a reader expects ({expected: source})."""
    if not rename or not isinstance(record, dict):
        return record
    out = dict(record)
    for expected, source in rename.items():
        if source != expected and source in out:
            out.pop(expected, None)
            out[expected] = out.pop(source)
    return out


def _json_lines(path: Path, malformed: Malformed, example: str) -> Iterator[tuple[int, str, object]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}, line {lineno}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                malformed.add(f"{where}: not UTF-8 text", path)
                continue
            if not line:
                continue
            try:
                yield lineno, where, json.loads(line)
            except json.JSONDecodeError as e:
                malformed.add(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one record "
                              f"such as {example}", path)


def _parquet_rows(path: Path, columns: list[str] | None, column_hint: str) -> Iterator[tuple[int, str, dict]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        # pre_buffer off, a buffered stream: iter_batches otherwise keeps every pre-buffered row group's
        # bytes until the file is closed, so memory grows with the file (measured: bench/parquet_preprocess.py).
        pf = pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)
    except (pyarrow.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None
    names = pf.schema_arrow.names
    wanted = None
    if columns is not None:
        wanted = [c for c in dict.fromkeys(columns) if c in names]
        if not wanted:
            wanted_text = repr(columns[0]) if len(columns) == 1 else "of " + ", ".join(map(repr, columns))
            raise UserError(f"{path} has no column {wanted_text} (its columns: {', '.join(names) or 'none'}); "
                            f"{column_hint}")
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=wanted):
            for record in batch.to_pylist():
                yield row, f"{path}, row {row}", record
                row += 1
    except (pyarrow.ArrowException, OSError) as e:  # a damaged page: the file cannot be read past here
        raise UserError(f"{path}, row {row}: the Parquet file cannot be read on from here ({e})") from None


def records(path: Path, malformed: Malformed, *, example: str, columns: list[str] | None = None,
            rename: dict[str, str] | None = None, column_hint: str = "") -> Iterator[tuple[int, str, object]]:
    """(index, where, record) for each row of a .jsonl/.json or .parquet file (see the module docstring).
    `columns`: the Parquet columns to read (None: all), of which at least one must exist; `rename`:
    {name a reader expects: column in the file}. Rows that are not JSON go to `malformed`; a record
    of a JSON-lines file may be any JSON value (the reader checks it)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist; give .jsonl or .parquet files (or globs of them) of records "
                        f"such as {example}")
    if is_parquet(path):
        rows = _parquet_rows(path, columns, column_hint)
    elif path.suffix.lower() in JSON_SUFFIXES:
        rows = _json_lines(path, malformed, example)
    else:
        raise UserError(f"{path} has suffix {path.suffix!r}; valid: {', '.join(SUFFIXES)} (JSON lines or Parquet)")
    for index, where, record in rows:
        yield index, where, _renamed(record, rename)
