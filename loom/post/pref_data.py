"""Preference data: .jsonl or .parquet pairs -> tokenized chosen and rejected examples -> batches of pair rows.

A record is {"prompt", "chosen", "rejected"}: either three strings (plain text, encoded as SFT encodes a
prompt and completion: prompt ids, then completion ids and the end-of-document token) or lists of
{"role", "content"} messages (the conversation so far, and the chosen and rejected replies: usually one
assistant message each), rendered with the chat template as SFT renders a conversation. Tokenizing reuses
SFT's machinery (loom/post/sft_data.py): each file is split into a chosen and a rejected SFT file in the
cache (line i of each is record i, so an error names the record's line; Parquet row r is line r + 1),
tokenized once into SFT prefixes. Files are read by loom/data/records.py (globs expanded, the
`pref.*_column` keys naming the columns); every malformed pair is counted before the run stops, the first
few named by file and line or row.

Scored tokens: the last assistant reply (or the completion) of each side; earlier assistant turns belong
to the shared conversation. A batch holds whole pairs: row 2i is pair i's chosen sequence, row 2i + 1 its
rejected one, so `train.global_batch` and `train.micro_batch` count sequences and must be even (twice the
pairs). Each row: `input_ids` = tokens[:-1], `labels` = tokens[1:] with IGNORE outside the scored reply,
`last` = the index of the row's last input position (a reward model reads its hidden state there), and,
once the reference pass has run (DPO), `ref_logps`: the frozen initial policy's summed log-probability of
the row's reply.

Pairs whose longer side exceeds `train.seq_len + 1` tokens are dropped (a truncated reply would be compared
as if complete), counted in the start banner.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

import numpy as np
import torch

from loom.data.dataset import Dataset
from loom.data.tokenizer import Tokenizer, cache_dir
from loom.errors import UserError
from loom.data.records import Malformed, expand, is_glob, is_parquet
from loom.data.records import records as read_records
from loom.models.losses import IGNORE
from loom.post.chat import ROLES, ChatTemplate
from loom.post.sft_data import Examples, prepare

FORMAT = "loom-pref-v1"


def _messages(value, where: str, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: \"{field}\" must be a non-empty list of {{\"role\", \"content\"}} messages when "
                        "the record is a conversation (or all of prompt, chosen and rejected strings)")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise UserError(f"{where}: {field}[{i}] = {json.dumps(m)[:120]} must be an object with \"role\" one of "
                            f"{', '.join(ROLES)} and a string \"content\"")
    return value


def split_record(record, where: str) -> tuple[dict, dict]:
    """A pair record -> (chosen, rejected) SFT records; UserError naming `where` for a malformed one."""
    keys = ("prompt", "chosen", "rejected")
    if not isinstance(record, dict) or any(k not in record for k in keys):
        got = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
        raise UserError(f"{where}: a preference record needs \"prompt\", \"chosen\" and \"rejected\"; it has {got}")
    prompt, chosen, rejected = (record[k] for k in keys)
    if all(isinstance(x, str) for x in (prompt, chosen, rejected)):
        if not chosen or not rejected:
            raise UserError(f"{where}: \"chosen\" and \"rejected\" must be non-empty strings")
        return {"prompt": prompt, "completion": chosen}, {"prompt": prompt, "completion": rejected}
    prompt = _messages(prompt, where, "prompt") if prompt != [] else []
    sides = [_messages(x, where, k) for x, k in ((chosen, "chosen"), (rejected, "rejected"))]
    for side, name in zip(sides, ("chosen", "rejected")):
        if side[-1]["role"] != "assistant":
            raise UserError(f"{where}: \"{name}\" must end with an assistant message (the reply being compared)")
    return {"messages": prompt + sides[0]}, {"messages": prompt + sides[1]}


COLUMNS = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"}


def pair_columns(pref) -> dict[str, str]:
    """{name a pair record has: column in the files} from the pref.*_column keys (pref: a PrefConfig)."""
    return {"prompt": pref.prompt_column, "chosen": pref.chosen_column, "rejected": pref.rejected_column}


def _split_file(path: Path, columns: dict[str, str] | None = None) -> tuple[Path, Path]:
    """The chosen and rejected SFT files of a pair file, written into the cache once per file version."""
    if not path.is_file():
        raise UserError(f"preference data file {path} does not exist; give .jsonl or .parquet files of {{\"prompt\", "
                        "\"chosen\", \"rejected\"} records, or synthetic:N")
    columns = columns or COLUMNS
    renamed = {k: v for k, v in columns.items() if k != v}  # in the key only when renamed: earlier entries stay valid
    stat = path.stat()
    key = hashlib.sha256(json.dumps([FORMAT, str(path.resolve()), stat.st_size, stat.st_mtime_ns]
                                    + ([renamed] if renamed else [])).encode()).hexdigest()
    out = [cache_dir() / "pref" / f"{path.stem}-{key[:16]}.{side}.jsonl" for side in ("chosen", "rejected")]
    if all(p.is_file() for p in out):
        return out[0], out[1]
    lines: tuple[list[str], list[str]] = ([], [])
    malformed = Malformed("preference pairs", "fix or remove such records, or name the columns with "
                          "pref.prompt_column, pref.chosen_column and pref.rejected_column")
    first_line = 1 if is_parquet(path) else 0  # Parquet rows count from 0, lines from 1
    rows = read_records(path, malformed, example='{"prompt": "...", "chosen": "...", "rejected": "..."}',
                        columns=list(columns.values()), rename=columns,
                        column_hint="name the columns with pref.prompt_column, pref.chosen_column and "
                        "pref.rejected_column")
    for index, where, record in rows:
        try:
            pair = split_record(record, where)
        except UserError as e:
            malformed.add(str(e), path)
            continue
        while len(lines[0]) < index + first_line - 1:  # blank lines keep line i of each side = record i
            lines[0].append("")
            lines[1].append("")
        for side, rec in zip(lines, pair):
            side.append(json.dumps(rec))
    malformed.check()
    if not any(lines[0]):
        raise UserError(f"{path}: no records; a preference data file needs at least one pair")
    out[0].parent.mkdir(parents=True, exist_ok=True)
    for p, side in zip(out, lines):
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text("\n".join(side) + "\n")
        tmp.replace(p)
    return out[0], out[1]


def prepare_pairs(specs: list[str], tokenizer: Tokenizer, template: ChatTemplate,
                  columns: dict[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(chosen prefixes, rejected prefixes) of the pair files `specs` ("synthetic:N" made locally, globs
    expanded)."""
    chosen, rejected = [], []
    for spec in [str(p) for entry in specs for p in (expand(entry, "pref.data") if is_glob(entry) else [entry])]:
        path = _synthetic(spec) if spec.startswith("synthetic:") else Path(spec)
        c, r = _split_file(path, columns)
        chosen += prepare([str(c)], tokenizer, template)
        rejected += prepare([str(r)], tokenizer, template)
    return chosen, rejected


class Pairs:
    """Tokenized pairs of some pair files: `get(i, side)` -> (ids, 0/1 mask of the scored reply)."""

    def __init__(self, chosen: list[str], rejected: list[str]):
        self.sides = (Examples(chosen), Examples(rejected))
        if len(self.sides[0]) != len(self.sides[1]):
            raise UserError(f"preference data: {len(self.sides[0])} chosen but {len(self.sides[1])} rejected examples "
                            "(a damaged cache?); delete the cache's pref/ and sft/ directories and run again")
        self.sizes = np.maximum(self.sides[0].sizes, self.sides[1].sizes)

    def __len__(self) -> int:
        return len(self.sides[0])

    def get(self, i: int, side: int) -> tuple[np.ndarray, np.ndarray]:
        examples = self.sides[side]
        ids, mask = examples.get(i, int(examples.sizes[i]))
        mask = mask.astype(np.uint8)
        learned = np.flatnonzero(mask)
        gaps = np.flatnonzero(np.diff(learned) > 1)  # the last contiguous run of learned tokens: the reply
        start = learned[gaps[-1] + 1] if len(gaps) else learned[0]
        mask[:start] = 0
        return ids.astype(np.int64), mask


class PairDataset(Dataset):
    """Rows (2 per pair) over pairs `members` of `pairs`: `batch(start, count)` is rows start..start+count-1.
    Training visits the pairs in a fresh seeded order each epoch; `num_rows` None: each pair once, in order."""

    def __init__(self, pairs: Pairs, members: np.ndarray, seq_len: int, num_rows: int | None, seed: int,
                 pad_id: int, shuffle: bool = True):
        self.pairs, self.seq_len, self.pad_id = pairs, seq_len, pad_id
        keep = pairs.sizes[members] <= seq_len + 1
        self.stats = {"pairs": int(len(members)), "dropped": int((~keep).sum())}
        self.members = members[keep]
        if len(self.members) == 0:
            raise UserError(f"no preference pair fits: all {len(members)} have a side longer than train.seq_len + 1 = "
                            f"{seq_len + 1} tokens; raise train.seq_len")
        n = len(self.members)
        self.rows = num_rows if num_rows is not None else 2 * n
        rng = np.random.RandomState(seed % 2**32)
        epochs = -(-self.rows // (2 * n))
        self.order = np.concatenate([rng.permutation(n) if shuffle else np.arange(n) for _ in range(epochs)])
        self.ref: torch.Tensor | None = None  # [pairs of `pairs`, 2]: the reference pass's log-probs (DPO)

    def __len__(self) -> int:
        return self.rows

    def used_pairs(self) -> np.ndarray:
        """The pairs (indices into `pairs`) some row of this dataset holds, in increasing order."""
        return np.unique(self.members[self.order[:self.rows // 2]])

    def pair_ids(self, start: int, count: int) -> np.ndarray:
        if start % 2 or count % 2:
            raise ValueError(f"rows {start}..{start + count - 1} split a pair")
        return self.members[self.order[start // 2:(start + count) // 2]]

    def rows_of(self, pair_ids) -> dict:
        """The batch of the given pairs (indices into `pairs`), chosen and rejected rows interleaved."""
        count, s = 2 * len(pair_ids), self.seq_len
        x = np.full((count, s), self.pad_id, dtype=np.int64)
        y = np.full((count, s), IGNORE, dtype=np.int64)
        last = np.zeros(count, dtype=np.int64)
        for r in range(count):
            ids, mask = self.pairs.get(int(pair_ids[r // 2]), r % 2)
            n = len(ids) - 1
            x[r, :n] = ids[:-1]
            y[r, :n] = np.where(mask[1:] > 0, ids[1:], IGNORE)
            last[r] = n - 1
        batch = {"input_ids": torch.from_numpy(x), "labels": torch.from_numpy(y), "last": torch.from_numpy(last)}
        if self.ref is not None:
            batch["ref_logps"] = self.ref[torch.as_tensor(np.asarray(pair_ids, dtype=np.int64))].flatten()
        return batch

    def batch(self, start: int, count: int) -> dict:
        return self.rows_of(self.pair_ids(start, count))

    def epoch_steps(self, global_batch: int) -> dict[int, str]:
        per_epoch = 2 * len(self.members)
        return {k * per_epoch // global_batch + 1: f"preference data: pass {k} complete, pairs repeat from here"
                for k in range(1, -(-self.rows // per_epoch)) if k * per_epoch < self.rows}

    def summary(self, steps: int, global_batch: int) -> str:
        st = self.stats
        return (f"{st['pairs']} preference pairs ({st['dropped']} dropped: a side longer than seq_len + 1 tokens), "
                f"2 rows per pair")


# --- a locally made preference set -------------------------------------------------------------------------------


def _wrong(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer to a synthetic task (loom/post/synthetic.py): another number, another order,
    lower case."""
    if m := re.fullmatch(r"(.* = )(-?\d+)\.", answer):
        value = int(m.group(2))
        return f"{m.group(1)}{value + rng.choice([-1, 1]) * rng.randint(1, max(9, abs(value) // 10))}."
    if m := re.fullmatch(r"(The letter \w appears )(\d+)( times\.)", answer):
        count = int(m.group(2))
        return f"{m.group(1)}{count + 1 if count == 0 or rng.random() < 0.5 else count - 1}{m.group(3)}"
    if "\n" in answer:  # upper-casing: one copy, or lower case
        first = answer.split("\n")[0]
        return first if rng.random() < 0.5 else f"{first.lower()}\n{first.lower()}"
    words = answer.split()
    wrong = words[:]
    while wrong == words:
        rng.shuffle(wrong)
    return " ".join(wrong)


def records(n: int, seed: int = 0):
    """n pairs: a synthetic task's question, its correct answer (chosen) and a wrong one (rejected); every
    tenth as plain prompt/completion strings, the rest as chat messages."""
    from loom.post.synthetic import _task

    rng = random.Random(seed)
    for i in range(n):
        question, answer = _task(rng)
        wrong = _wrong(answer, rng)
        if i % 10 == 9:
            yield {"prompt": question + "\n", "chosen": answer, "rejected": wrong}
        else:
            yield {"prompt": [{"role": "user", "content": question}],
                   "chosen": [{"role": "assistant", "content": answer}],
                   "rejected": [{"role": "assistant", "content": wrong}]}


def _synthetic(spec: str) -> Path:
    count = spec.removeprefix("synthetic:")
    if not count.isdigit() or int(count) < 1:
        raise UserError(f"pref.data entry {spec!r}: synthetic:N needs a positive number of pairs, e.g. synthetic:2000")
    path = cache_dir() / "pref" / f"synthetic-{int(count)}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records(int(count))))
        tmp.replace(path)
    return path
