"""What the training loop reads: a `Dataset` of rows by position, with what it says about itself.

Every recipe's data (token samples, SFT examples, preference pairs, RL prompts) is a `Dataset`: the trainer
calls these methods and never asks what a dataset has. The defaults suit a dataset that has nothing to say.
"""

from __future__ import annotations

import torch

Batch = dict[str, torch.Tensor]


class Dataset:
    """Rows [0, len) of a run's training or held-out data.

    - `batch(start, count)`: rows [start, start + count) as a batch (`input_ids`, `labels`, and what the
      recipe's loss reads);
    - `source`: where the data comes from, in words (the banner's "validation" line for held-out data);
    - `summary(steps, global_batch)`: the banner's data line;
    - `epoch_steps(global_batch)`: {step: message} for the steps after which the data repeats;
    - `scored_bytes(tokenizer)`: the text the loss scores, when it scores every token (bits per byte and the
      compressors' reference in evaluation), else None.
    """

    source: str = ""

    def __len__(self) -> int:
        raise NotImplementedError

    def batch(self, start: int, count: int) -> Batch:
        raise NotImplementedError(f"{type(self).__name__} is not read in batches of rows")

    def summary(self, steps: int, global_batch: int) -> str:
        return f"{len(self)} rows ({self.source})" if self.source else f"{len(self)} rows"

    def epoch_steps(self, global_batch: int) -> dict[int, str]:
        return {}

    def scored_bytes(self, tokenizer) -> bytes | None:
        return None


def split_range(data, count: int, part: int, what: str, where: str, instead: str,
                example: str = "90,10") -> tuple[int, int]:
    """Items [lo, hi) of `count` in part `part` (0 training, 1 validation) of `data.split` (Megatron's split:
    contiguous ranges, so nothing held out is trained on); a UserError naming `what` is missing `where`, and
    what to give `instead`, when that part is empty."""
    from loom.errors import UserError

    lo, hi = data.split_ranges(count)[part]
    if hi <= lo:
        raise UserError(f"data.split={data.split} leaves no {what} {where}; give {instead}, e.g. {example}")
    return lo, hi


def held_out_split(data, count: int, what: str, where: str, instead: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """(training range, held-out range) of `count` items under `data.split`; UserError when nothing is held out
    (see `split_range`)."""
    return data.split_ranges(count)[0], split_range(data, count, 1, what, where, instead)


def first_passes(notes: dict[int, str], shown: int = 2) -> dict[int, str]:
    """The first `shown` of `epoch_steps`' notes; the last one shown says how many more passes follow (a run of
    hundreds of passes over a small set would print a line for each)."""
    steps = sorted(notes)
    if len(steps) <= shown:
        return dict(notes)
    kept = {step: notes[step] for step in steps[:shown]}
    rest = steps[shown:]
    kept[steps[shown - 1]] += f" ({len(rest)} more passes follow, by step {rest[-1]}; not announced)"
    return kept
