"""`loom preprocess`: tokenize JSON-lines, Parquet or text files into an indexed dataset.

Inputs: a `.jsonl`/`.json` file (one JSON object per line, the text under `--json-key`), a `.parquet` file
(the text in the column `--json-key` names, also spelt `--column`; streamed a record batch at a time, so a
file larger than memory works), a `.txt` file (the whole file is one document), a directory (all such
files below it, in sorted order) or a glob of files (`data/*.parquet`, sorted). Records are validated in
the main process, so errors name the file and line (row for Parquet), every malformed record is counted
and the first few named; tokenization runs in `workers` processes, results taken in input order, so the
output is byte-identical for any worker count. Nothing is held per document but its size in the index.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pathlib
import sys
from collections import deque
from contextlib import closing, nullcontext
from typing import Iterator

from loom.data.indexed import IndexedDatasetBuilder, best_dtype
from loom.data.records import PARQUET_SUFFIXES, Malformed, expand, is_glob, records
from loom.data.tokenizer import Tokenizer
from loom.errors import UserError

JSON_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt",)
SUFFIXES = JSON_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES
CHUNK_DOCS = 64  # documents per tokenization task


def input_files(inputs: str) -> list[pathlib.Path]:
    """The files to tokenize: `inputs` itself, a glob's matches, or every .jsonl/.json/.parquet/.txt below a
    directory; sorted."""
    if is_glob(inputs):
        files = expand(inputs, "--input")
        bad = [p for p in files if p.suffix not in SUFFIXES]
        if bad:
            raise UserError(f"--input {inputs!r} matches {bad[0]}, whose suffix {bad[0].suffix!r} is not one of "
                            f"{', '.join(SUFFIXES)}; narrow the glob (e.g. *.parquet)")
        return files
    root = pathlib.Path(inputs)
    if root.is_dir():
        files = sorted(
            (p for p in root.rglob("*") if p.is_file() and p.suffix in SUFFIXES),
            key=lambda p: p.relative_to(root).as_posix(),
        )
        if not files:
            raise UserError(f"input directory {root} holds no {', '.join('*' + s for s in SUFFIXES)} files")
        return files
    if not root.exists():
        raise UserError(f"input {root} does not exist; give a .jsonl, .json, .parquet or .txt file, a directory "
                        "or a glob")
    if root.suffix not in SUFFIXES:
        raise UserError(f"input {root} has unknown suffix {root.suffix!r}; valid: {', '.join(SUFFIXES)}, a directory "
                        "or a glob")
    return [root]


def _record_texts(path: pathlib.Path, json_key: str, malformed: Malformed) -> Iterator[tuple[str, int]]:
    """(text, raw byte share) for each record of a JSON-lines or Parquet file. After the first malformed
    record the rest are only checked, so that all of them are counted before the error."""
    parquet = path.suffix in PARQUET_SUFFIXES
    share = 0
    if parquet:  # the progress bar counts file bytes: each row advances it by an equal share
        import pyarrow.parquet as pq

        share = path.stat().st_size // max(pq.ParquetFile(path).metadata.num_rows, 1)
    hint = "choose the column with --json-key (or --column)" if parquet else "choose one with --json-key"
    for _, where, record in records(path, malformed, example=f'{{"{json_key}": "..."}}', columns=[json_key],
                                    column_hint=hint):
        if not isinstance(record, dict):
            malformed.add(f"{where}: expected a JSON object with a {json_key!r} key, got {type(record).__name__}", path)
            continue
        if json_key not in record:
            keys = ", ".join(map(repr, record)) or "none"
            malformed.add(f"{where}: no key {json_key!r} (keys here: {keys}); {hint}", path)
            continue
        text = record[json_key]
        if not isinstance(text, str):
            what = "null" if text is None else type(text).__name__
            malformed.add(f"{where}: {json_key!r} must be a string, got {what}", path)
            continue
        if not malformed:
            yield text, share or len(text)


def iter_texts(files: list[pathlib.Path], json_key: str) -> Iterator[tuple[str, int]]:
    """(document text, raw byte count) over all input files, in order; UserError after the last file
    when some record was malformed (named by file and line or row, and counted)."""
    malformed = Malformed("records", "fix or remove such records (nothing was written)")
    for path in files:
        if path.suffix in TEXT_SUFFIXES:
            raw = path.read_bytes()
            if not malformed:
                yield raw.decode("utf-8", errors="replace"), len(raw)
        else:
            yield from _record_texts(path, json_key, malformed)
    malformed.check()


def _chunks(texts: Iterator[tuple[str, int]], size: int) -> "Chunks":
    batch: list[str] = []
    nbytes = 0
    for text, n in texts:
        batch.append(text)
        nbytes += n
        if len(batch) == size:
            yield batch, nbytes
            batch, nbytes = [], 0
    if batch:
        yield batch, nbytes


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    import tokenizers

    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _worker_tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(tokenizer_json))


def _encode_chunk(texts: list[str]) -> list[list[int]]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_batch(texts)


def _progress(enabled: bool):
    if not (enabled and sys.stderr.isatty()):
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    return Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
        console=Console(stderr=True), transient=True,
    )


Chunks = Iterator[tuple[list[str], int]]  # (texts, raw bytes they came from)


def _encoded(tokenizer: Tokenizer, chunks: Chunks, workers: int) -> Iterator[tuple[list[list[int]], int]]:
    """(token ids per document, raw bytes) per chunk, in input order; `workers` > 1 uses processes."""
    if workers == 1:
        for texts, nbytes in chunks:
            yield tokenizer.encode_batch(texts), nbytes
        return
    ctx = multiprocessing.get_context("spawn")  # never fork after tokenizers' threads have started
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.tok.to_str(),)) as pool:
        pending: deque = deque()  # a bounded window of in-flight chunks keeps memory flat
        for texts, nbytes in chunks:
            pending.append((pool.apply_async(_encode_chunk, (texts,)), nbytes))
            if len(pending) >= 4 * workers:
                result, n = pending.popleft()
                yield result.get(), n
        while pending:
            result, n = pending.popleft()
            yield result.get(), n


def preprocess(
    inputs: str,
    output_prefix: str,
    tokenizer: Tokenizer,
    json_key: str = "text",
    workers: int = 1,
    append_eod: bool = False,
    progress: bool = True,
    overwrite: bool = False,
) -> dict:
    """Tokenize `inputs` into `output_prefix.bin/.idx`; returns {"documents", "tokens", "files"}."""
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    existing = [p for p in (pathlib.Path(output_prefix + s) for s in (".bin", ".idx")) if p.exists()]
    if existing and not overwrite:
        raise UserError(f"{', '.join(map(str, existing))} already exist{'s' if len(existing) == 1 else ''}; a run that "
                        "trains on them would change data without notice. Pass --overwrite to replace them, or "
                        "choose another --output-prefix (nothing was changed)")
    eod = [tokenizer.require_eod("--append-eod", "name one with --eod-token TOKEN")] if append_eod else []
    files = input_files(inputs)
    total_bytes = sum(p.stat().st_size for p in files)
    chunks = _chunks(iter_texts(files, json_key), CHUNK_DOCS)
    documents = tokens = 0
    with (
        IndexedDatasetBuilder(output_prefix, dtype=best_dtype(tokenizer.vocab_size)) as builder,
        _progress(progress) as bar,
        closing(_encoded(tokenizer, chunks, workers)) as encoded,
    ):
        task = bar.add_task("tokenizing", total=total_bytes) if bar is not None else None
        for batch, nbytes in encoded:
            for ids in batch:
                ids = ids + eod
                if ids:  # empty documents are dropped
                    builder.add_document(ids)
                    documents += 1
                    tokens += len(ids)
            if bar is not None:
                bar.update(task, advance=nbytes)
        if not documents:  # raised inside the builder's block: nothing is left behind
            raise UserError(f"{inputs}: no non-empty document in {len(files)} file{'s' if len(files) != 1 else ''}; "
                            "give files with text (a .parquet file's rows, a .jsonl file's records)")
    return {"documents": documents, "tokens": tokens, "files": len(files)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `loom preprocess` options."""
    parser.add_argument("--input", required=True,
                        help="a .jsonl/.json/.parquet/.txt file, a directory of them or a glob (quoted: "
                        "'data/*.parquet')")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--tokenizer", required=True, help="a config name (e.g. tiny) or a tokenizer.json path")
    parser.add_argument("--json-key", "--column", dest="json_key", default="text",
                        help="the JSON field or Parquet column holding the text (default: text)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: 1)")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    parser.add_argument("--eod-token", default=None,
                        help="the end-of-document token for --append-eod (default: the tokenizer's <|endoftext|>, "
                        "</s>, <|end_of_text|> or <eos>)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.bin/.idx")
    parser.add_argument("--sft", action="store_true",
                        help="SFT examples ({\"messages\"} or {\"prompt\", \"completion\"} records): writes the token ids "
                        "and their loss mask (PREFIX.mask.bin/.idx, PREFIX.first.npy, PREFIX.sft.json) for sft.data")
    parser.add_argument("--template", default="auto",
                        help="with --sft: the chat template, as sft.template (auto, llama3, chatml or a file)")
    for name in ("messages", "prompt", "completion"):
        parser.add_argument(f"--{name}-column", default=name,
                            help=f"with --sft: the field / column holding the {name} (as sft.{name}_column; default "
                            f"{name})")
