"""The token datasets a pre-training run reads, from its config: `data.paths` split into training and
held-out documents (or `data.valid_paths`), else the embedded corpus.

Global batch `i` is samples `[i*B, (i+1)*B)` of the training dataset, so the data position of a run
is one number (consumed samples) and resuming is exact.
"""

from __future__ import annotations

import numpy as np

from loom.config import Config
from loom.errors import UserError
from loom.data.corpus_dataset import corpus_prefix
from loom.data.indexed import DocumentRange, IndexedDataset
from loom.data.dataset import split_range
from loom.data.samples import BlendedDataset, SampleDataset, TokenSamples
from loom.data.tokenizer import Tokenizer, cache_dir

VAL_SEED = 0  # the held-out samples are the same for every run of a given seq_len


def _samples(datasets: list, weights: list[float], seq_len: int, num_samples: int, seed: int, name: str):
    if len(datasets) == 1:
        return SampleDataset(datasets[0], seq_len, num_samples, seed, cache_dir() / "indices", name=name)
    weights = weights or [1.0] * len(datasets)
    total = sum(weights)
    parts = [
        SampleDataset(d, seq_len, int(np.ceil(w / total * num_samples * 1.005)) + 1, seed + i, cache_dir() / "indices",
                      name=f"{name}{i}")
        for i, (d, w) in enumerate(zip(datasets, weights))
    ]
    return BlendedDataset(parts, weights, num_samples, cache_dir() / "indices", name=f"{name}-blend")


def check_token_ids(dataset: IndexedDataset, vocab_size: int) -> None:
    """Every token id of `dataset` is below `vocab_size` (the largest id comes from the dataset's stats file,
    or one numpy pass); otherwise a UserError naming the file, the first offending document and the range."""
    if dataset.max_token_id() < vocab_size:
        return
    doc, token = dataset.first_token_at_least(vocab_size)
    raise UserError(
        f"{dataset.bin_path}: document {doc} holds token id {token}, but model.vocab_size={vocab_size} allows ids "
        f"0..{vocab_size - 1}; preprocess the data with the run's tokenizer (data.tokenizer) or raise model.vocab_size"
    )


def _split(cfg: Config, dataset: IndexedDataset, part: int) -> DocumentRange:
    """Part `part` (0 train, 1 valid) of `dataset` under data.split; UserError when it is empty."""
    lo, hi = split_range(cfg.data, len(dataset), part, "training documents" if part == 0 else "validation documents",
                         f"in {dataset.prefix} ({len(dataset)} documents)", "data.valid_paths (held-out datasets), or "
                         "a data.split with a non-zero share for it", "98,2,0")
    return DocumentRange(dataset, lo, hi)


def build_datasets(cfg: Config, tokenizer: Tokenizer) -> tuple[TokenSamples, TokenSamples]:
    """(train samples for the whole run, held-out samples for evaluation).

    Held-out data is `data.valid_paths` when given; else, for `data.paths`, the validation share of each
    dataset's documents under `data.split` (Megatron's train/valid/test split: contiguous document ranges,
    so nothing scored as validation is ever trained on); else the embedded corpus's held-out files. The
    held-out dataset's `source` says which, in words.
    """
    t, d = cfg.train, cfg.data
    given = [IndexedDataset(p) for p in d.paths]  # fail early, naming the file, before any model work
    valid_given = [IndexedDataset(p) for p in d.valid_paths]
    if given:
        train_parts = [_split(cfg, ds, 0) for ds in given]
    else:
        train_parts = [IndexedDataset(corpus_prefix(tokenizer, "train", d.corpus_max_bytes))]
    if valid_given:
        val_parts, source = valid_given, f"data.valid_paths ({', '.join(d.valid_paths)})"
    elif given:
        val_parts = [_split(cfg, ds, 1) for ds in given]
        ranges = "; ".join(f"{p.prefix}: documents {p.lo}..{p.hi - 1} of {len(p.base)}" for p in val_parts)
        source = f"data.split={d.split}, never trained on ({ranges})"
    else:
        val_parts = [IndexedDataset(corpus_prefix(tokenizer, "val", 0))]
        source = "the embedded corpus's held-out files (never trained on)"
    for ds in given + valid_given + ([] if given else train_parts) + ([] if given or valid_given else val_parts):
        check_token_ids(ds, cfg.model.vocab_size)
    train = _samples(train_parts, d.weights, t.seq_len, t.steps * t.global_batch, t.seed, "train")
    val = _samples(val_parts, [], t.seq_len, t.eval_samples, VAL_SEED, "val")
    val.source = source
    if d.document_mask:  # batches then carry doc_ids and positions
        train.document_eod = val.document_eod = tokenizer.require_eod(
            "data.document_mask=true", "set data.document_mask=false or use a tokenizer that has one")
    return train, val
