"""From a config to the tokenizer and the train / held-out sample datasets a run reads.

Global batch `i` is samples `[i*B, (i+1)*B)` of the training dataset, so the data position of a run
is one number (consumed samples) and resuming is exact.
"""

from __future__ import annotations

import numpy as np
import torch

from loom.config import Config
from loom.errors import UserError
from loom.data.corpus_dataset import corpus_prefix
from loom.data.indexed import IndexedDataset
from loom.data.sampler import BlendedDataset, SampleDataset
from loom.data.tokenizer import Tokenizer, cache_dir, get_tokenizer

VAL_SEED = 0  # the held-out samples are the same for every run of a given seq_len


def load_tokenizer(cfg: Config) -> Tokenizer:
    tok = get_tokenizer(cfg.data.tokenizer, cfg.model.vocab_size, cfg.data.corpus_max_bytes)
    if tok.vocab_size > cfg.model.vocab_size:
        raise UserError(
            f"the tokenizer ({cfg.data.tokenizer}) has {tok.vocab_size} tokens but model.vocab_size="
            f"{cfg.model.vocab_size}; set model.vocab_size >= {tok.vocab_size} or use a smaller tokenizer"
        )
    return tok


def _samples(prefixes: list[str], weights: list[float], seq_len: int, num_samples: int, seed: int, name: str):
    datasets = [IndexedDataset(p) for p in prefixes]
    if len(datasets) == 1:
        return SampleDataset(datasets[0], seq_len, num_samples, seed, cache_dir() / "indices", name=name)
    weights = weights or [1.0] * len(datasets)
    total = sum(weights)
    parts = [
        SampleDataset(d, seq_len, int(np.ceil(w / total * num_samples * 1.005)) + 1, seed + i, cache_dir() / "indices",
                      name=f"{name}{i}")
        for i, (d, w) in enumerate(zip(datasets, weights))
    ]
    return BlendedDataset(parts, weights, num_samples)


def build_datasets(cfg: Config, tokenizer: Tokenizer):
    """(train samples for the whole run, held-out samples for evaluation)."""
    t = cfg.train
    for p in cfg.data.paths + cfg.data.valid_paths:
        IndexedDataset(p)  # fail early, naming the file, before any tokenizer or model work
    train_prefixes = cfg.data.paths or [corpus_prefix(tokenizer, "train", cfg.data.corpus_max_bytes)]
    val_prefixes = cfg.data.valid_paths or (
        [corpus_prefix(tokenizer, "val", 0)] if not cfg.data.paths else cfg.data.paths
    )
    for prefix in train_prefixes + val_prefixes:
        ds = IndexedDataset(prefix)
        if len(ds) and int(ds.document_index[-1]) and ds.sizes.size:
            top = int(max(np.max(ds.get(i)) for i in range(min(len(ds), 64))))
            if top >= cfg.model.vocab_size:
                raise UserError(
                    f"{prefix}.bin holds token id {top} but model.vocab_size={cfg.model.vocab_size}; "
                    "preprocess with the run's tokenizer or raise model.vocab_size"
                )
    train = _samples(train_prefixes, cfg.data.weights, t.seq_len, t.steps * t.global_batch, t.seed, "train")
    val = _samples(val_prefixes, [], t.seq_len, t.eval_samples, VAL_SEED, "val")
    return train, val


def batch(dataset, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples [start, start+count) as (inputs, targets), each [count, seq_len] int64."""
    rows = np.stack([dataset[i] for i in range(start, start + count)])
    tokens = torch.from_numpy(rows.astype(np.int64))
    return tokens[:, :-1], tokens[:, 1:]
