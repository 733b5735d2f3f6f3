"""SFT data: .jsonl or .parquet conversations -> tokenized examples with a loss mask -> packed training rows.

Tokenized once (`prepare`): each example's token ids go to PREFIX.bin/.idx (Megatron's indexed format),
its 0/1 loss mask (1 on the tokens the model learns: assistant replies, completions) to
PREFIX.mask.bin/.idx, the position of its first learned token to PREFIX.first.npy, and what made it
(source files, tokenizer, template) to PREFIX.sft.json, written last. `loom preprocess --sft` writes such a
prefix; a run given .jsonl or .parquet files (or globs of them) makes one per file under the cache directory,
keyed by the file's size and modification time, the column names, the tokenizer and the template, so later
runs start without re-tokenizing. Files are read by loom/data/records.py: the `sft.*_column` keys name the
columns (a Parquet `messages` column is a list of structs with `role` and `content`), and every malformed
record is counted before the run stops, the first few named by file and line or row.

A row of the batch holds `train.seq_len` input positions. An example of n tokens fills n - 1 of them
(inputs = tokens[:-1], labels = tokens[1:], a label -100 where the mask is 0). Examples longer than
seq_len + 1 tokens are truncated to their first seq_len + 1 tokens or dropped (`sft.overlong`); examples
with no learned token left are dropped; both are counted in the start banner.

Packing (`sft.packing=true`): each epoch visits the examples in a fresh seeded order and fills rows greedily,
starting a new row when the next example does not fit, so a row holds several whole examples. The batch
then carries `doc_ids` (which example each position belongs to) and `positions` (the position inside it):
attention stays inside each example and rotary positions restart, so every example is computed exactly as
if it were alone in its row. Without packing a row is one example followed by padding (label -100).

Row i of the run is a pure function of i, the data and the seed, so resuming is exact.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from loom.data.dataset import Dataset
from loom.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from loom.data.tokenizer import Tokenizer, cache_dir
from loom.errors import UserError
from loom.data.records import Malformed, expand, is_glob, records
from loom.models.losses import IGNORE
from loom.post import tasks
from loom.post.chat import ChatTemplate, check_record, encode_chat, encode_completion

FORMAT = "loom-sft-v1"
# The rule that marks the learned tokens (loom.post.chat.encode_chat), in the cache key: cached prefixes made by an
# earlier rule are made again. 2: the whitespace after an end-of-turn marker is not learned.
MASK_RULE = 2


def _is_prefix(path: str) -> bool:
    return Path(path + ".sft.json").is_file()


EXAMPLE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
COLUMNS = {"messages": "messages", "prompt": "prompt", "completion": "completion"}


def columns_of(sft) -> dict[str, str]:
    """{name SFT reads: column in the files} from the sft.*_column keys (sft: an SFTConfig)."""
    return {"messages": sft.messages_column, "prompt": sft.prompt_column, "completion": sft.completion_column}


def iter_examples(path: Path, tokenizer: Tokenizer, template: ChatTemplate, columns: dict[str, str] | None = None):
    """(ids, mask) for each record of a .jsonl or .parquet file; after the whole file is read, a UserError
    naming the first malformed records by file and line (row) and counting them all."""
    if not path.is_file():
        raise UserError(f"SFT data file {path} does not exist; give .jsonl or .parquet files of {{\"messages\": "
                        "[...]} or {\"prompt\", \"completion\"} records, or a prefix written by `loom preprocess --sft`")
    columns = columns or COLUMNS
    malformed = Malformed("SFT records", "fix or remove such records, or name the columns with sft.messages_column, "
                          "sft.prompt_column and sft.completion_column")
    hint = ("name the columns with sft.messages_column (a list of {role, content}) or sft.prompt_column and "
            "sft.completion_column (strings)")
    for _, where, record in records(path, malformed, example=EXAMPLE, columns=list(columns.values()),
                                    rename=columns, column_hint=hint):
        try:
            conversation = check_record(record, where)
            if isinstance(conversation, tuple):
                ids, mask = encode_completion(tokenizer, *conversation)
            else:
                ids, mask = encode_chat(template, tokenizer, conversation, where)
            if len(ids) < 2 or not mask[1:].any():
                raise UserError(f"{where}: the record tokenizes to {len(ids)} tokens with no learned token after "
                                "the first; give the assistant reply or completion some text")
        except UserError as e:
            malformed.add(str(e), path)
            continue
        if not malformed:  # after the first malformed record the rest are only checked
            yield ids, mask
    malformed.check()


def write_prefix(files: list[Path], prefix: str | Path, tokenizer: Tokenizer, template: ChatTemplate,
                 columns: dict[str, str] | None = None) -> dict:
    """Tokenize `files` into the SFT prefix `prefix` (see the module docstring); returns its metadata."""
    prefix = Path(prefix)
    firsts, tokens, learned = [], 0, 0
    with IndexedDatasetBuilder(prefix, dtype=best_dtype(tokenizer.vocab_size)) as ids_out, \
            IndexedDatasetBuilder(f"{prefix}.mask", dtype=np.uint8) as mask_out:
        for path in files:
            for ids, mask in iter_examples(path, tokenizer, template, columns):
                ids_out.add_document(ids)
                mask_out.add_document(mask)
                firsts.append(int(np.argmax(mask[1:])) + 1)
                tokens += len(ids)
                learned += int(mask[1:].sum())
    if not firsts:
        raise UserError(f"{', '.join(map(str, files))}: no records; an SFT data file needs at least one example")
    np.save(f"{prefix}.first.npy", np.asarray(firsts, dtype=np.int64))
    meta = {"format": FORMAT, "sources": [str(p) for p in files], "examples": len(firsts), "tokens": tokens,
            "learned_tokens": learned, "tokenizer_sha256": tokenizer.sha256(), "template": template.name,
            "template_sha256": hashlib.sha256(template.source.encode()).hexdigest()}
    tmp = Path(f"{prefix}.sft.json.tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, f"{prefix}.sft.json")  # last: its presence marks a complete prefix
    return meta


def prepare(paths: list[str], tokenizer: Tokenizer, template: ChatTemplate,
            columns: dict[str, str] | None = None) -> list[str]:
    """SFT prefixes for `paths`: prefixes as given (their tokenizer checked), .jsonl and .parquet files (globs
    expanded) tokenized into the cache once each (reused while the file, columns, tokenizer and template are
    unchanged)."""
    out = []
    columns = columns or COLUMNS
    for spec in [str(p) for entry in paths for p in (expand(entry, "sft.data") if is_glob(entry) else [entry])]:
        if spec.startswith("synthetic:"):  # the locally generated chat set (loom/post/synthetic.py)
            spec = str(_synthetic(spec))
        spec = tasks.materialise(spec, "sft", "sft.data")  # a verifiable task's problems (loom/post/tasks.py)
        if _is_prefix(spec):
            meta = json.loads(Path(spec + ".sft.json").read_text())
            if meta.get("tokenizer_sha256") != tokenizer.sha256():
                raise UserError(f"SFT prefix {spec} was tokenized with another tokenizer than this run's "
                                f"({tokenizer.path or 'data.tokenizer'}); prepare it again with `loom preprocess "
                                "--sft` and this tokenizer, or give the .jsonl files")
            out.append(spec)
            continue
        path = Path(spec)
        if not path.is_file():
            raise UserError(f"sft.data entry {spec!r} is neither a .jsonl or .parquet file (or a glob of them) nor a "
                            "prefix written by `loom preprocess --sft` (PREFIX.sft.json); give one of those")
        stat = path.stat()
        # The columns join the key only when renamed, so default-named data keeps its earlier cache entries.
        renamed = {k: v for k, v in columns.items() if k != v}
        key = hashlib.sha256(json.dumps([FORMAT, str(path.resolve()), stat.st_size, stat.st_mtime_ns,
                                         tokenizer.sha256(), template.source, template.special]
                                        + ([renamed] if renamed else []) + [MASK_RULE]).encode()).hexdigest()
        prefix = cache_dir() / "sft" / f"{path.stem}-{key[:16]}"
        if not _is_prefix(str(prefix)):
            write_prefix([path], prefix, tokenizer, template, columns)
        out.append(str(prefix))
    return out


def _synthetic(spec: str) -> Path:
    from loom.post import synthetic

    count = spec.removeprefix("synthetic:")
    if not count.isdigit() or int(count) < 1:
        raise UserError(f"sft.data entry {spec!r}: synthetic:N needs a positive number of examples, e.g. synthetic:2000")
    path = cache_dir() / "sft" / f"synthetic-{int(count)}.jsonl"
    return path if path.is_file() else synthetic.write(path, int(count))


class Examples:
    """Tokenized examples of one or more SFT prefixes, numbered across them."""

    def __init__(self, prefixes: list[str]):
        self.parts = [(IndexedDataset(p), IndexedDataset(f"{p}.mask"), np.load(f"{p}.first.npy", mmap_mode="r"))
                      for p in prefixes]
        self.starts = np.cumsum([0] + [len(ids) for ids, _, _ in self.parts])
        self.sizes = np.concatenate([ids.sizes for ids, _, _ in self.parts]).astype(np.int64)
        self.first = np.concatenate([np.asarray(f) for _, _, f in self.parts]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def get(self, i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The first `n` tokens of example i and their mask."""
        part = int(np.searchsorted(self.starts, i, side="right")) - 1
        ids, mask, _ = self.parts[part]
        local = i - int(self.starts[part])
        return ids.get(local, 0, n), mask.get(local, 0, n)


class SFTDataset(Dataset):
    """Rows of `seq_len` positions over examples `members` of `examples`; `batch(start, count)` is the batch
    dict of rows start..start+count-1 (input_ids, labels, and with packing doc_ids and positions)."""

    def __init__(self, examples: Examples, members: np.ndarray, seq_len: int, packing: bool, overlong: str,
                 num_rows: int | None, seed: int, pad_id: int, shuffle: bool = True):
        self.examples, self.seq_len, self.packing, self.pad_id = examples, seq_len, packing, pad_id
        slots = examples.sizes[members] - 1  # input positions each example fills
        over = slots > seq_len
        if overlong == "truncate":
            slots = np.minimum(slots, seq_len)
            keep = examples.first[members] <= slots  # a learned label left inside the kept positions
        else:
            keep = ~over
        self.stats = {"examples": int(len(members)), "overlong": int(over.sum()),
                      "overlong_policy": overlong, "dropped": int((~keep).sum())}
        self.members, self.slots = members[keep], slots[keep]
        if len(self.members) == 0:
            raise UserError(f"no SFT example fits: all {len(members)} are longer than train.seq_len + 1 = "
                            f"{seq_len + 1} tokens (sft.overlong={overlong}) or keep no learned token; raise "
                            "train.seq_len or set sft.overlong=truncate")
        rng = np.random.RandomState(seed % 2**32)
        orders, bounds, epoch_rows = [], [0], []
        while num_rows is None or len(bounds) - 1 < num_rows:
            order = rng.permutation(len(self.members)) if shuffle else np.arange(len(self.members))
            cuts, offset = self._rows(self.slots[order]), bounds[-1]
            bounds.extend(offset + c for c in cuts[1:])
            orders.append(order)
            epoch_rows.append(len(cuts) - 1)
            if num_rows is None:
                break
        self.order, self.bounds = np.concatenate(orders), np.asarray(bounds, dtype=np.int64)
        self.rows = num_rows if num_rows is not None else len(self.bounds) - 1
        used = int(self.slots.sum())
        self.stats.update(rows_per_epoch=epoch_rows[0], tokens_per_epoch=used,
                          padding=1 - used / (epoch_rows[0] * seq_len))
        self.epoch_rows = np.cumsum(epoch_rows)

    def _rows(self, slots: np.ndarray) -> list[int]:
        """Row boundaries (indices into `slots`) of greedy packing, or one example per row."""
        if not self.packing:
            return list(range(len(slots) + 1))
        cuts, fill = [0], 0
        for i, n in enumerate(slots.tolist()):
            if fill + n > self.seq_len:
                cuts.append(i)
                fill = 0
            fill += n
        cuts.append(len(slots))
        return cuts

    def __len__(self) -> int:
        return self.rows

    def batch(self, start: int, count: int) -> dict:
        s = self.seq_len
        x = np.full((count, s), self.pad_id, dtype=np.int64)
        y = np.full((count, s), IGNORE, dtype=np.int64)
        docs = np.zeros((count, s), dtype=np.int64)
        pos = np.zeros((count, s), dtype=np.int64)
        for r in range(count):
            lo, hi = self.bounds[start + r], self.bounds[start + r + 1]
            at = 0
            for d, k in enumerate(self.order[lo:hi].tolist()):
                n = int(self.slots[k])
                ids, mask = self.examples.get(int(self.members[k]), n + 1)
                ids = ids.astype(np.int64)
                x[r, at:at + n] = ids[:n]
                y[r, at:at + n] = np.where(mask[1:] > 0, ids[1:], IGNORE)
                docs[r, at:at + n] = d
                pos[r, at:at + n] = np.arange(n)
                at += n
            docs[r, at:] = hi - lo  # padding: a document of its own
            pos[r, at:] = np.arange(s - at)
        batch = {"input_ids": torch.from_numpy(x), "labels": torch.from_numpy(y)}
        if self.packing:
            batch.update(doc_ids=torch.from_numpy(docs), positions=torch.from_numpy(pos))
        return batch

    def epoch_steps(self, global_batch: int) -> dict[int, str]:
        """{step: message} for the steps after which every example has been seen once more."""
        return {int(rows) // global_batch + 1: f"SFT data: pass {k} complete, examples repeat from here"
                for k, rows in enumerate(self.epoch_rows[:-1], start=1) if rows < self.rows}

    def summary(self, steps: int, global_batch: int) -> str:
        st = self.stats
        return (f"{st['examples']} examples ({st['overlong']} longer than seq_len + 1 tokens, "
                f"{st['dropped']} dropped, policy {st['overlong_policy']}), packing "
                f"{'on' if self.packing else 'off'}: {st['rows_per_epoch']} rows per epoch, "
                f"{100 * st['padding']:.1f}% padding")
