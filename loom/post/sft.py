"""The SFT recipe: the one training loop (loom/train/trainer.py) with SFT data and the masked loss.

`loom sft --config C` trains on chat / prompt-completion examples (loom/post/sft_data.py), usually from
`train.init_from`. The loss is the mean cross-entropy over the
supervised (assistant / completion) tokens of each global batch (`MaskedTokenCrossEntropy`); everything
else — layouts, checkpoints, resuming, metrics — is the trainer's.
"""

from __future__ import annotations

import numpy as np

from loom.config import Config
from loom.data.dataset import held_out_split
from loom.data.tokenizer import Tokenizer
from loom.errors import UserError
from loom.models.losses import MaskedTokenCrossEntropy, run_loss_chunk
from loom.post.chat import load_template
from loom.post.sft_data import Examples, SFTDataset, columns_of, prepare
from loom.train.recipe import Recipe


def template_for(cfg: Config):
    return load_template(cfg.sft.template, None if cfg.data.tokenizer == "bpe" else cfg.data.tokenizer)


def prepare_data(cfg: Config, tokenizer: Tokenizer) -> tuple[list[str], list[str]]:
    """(train prefixes, held-out prefixes): .jsonl files tokenized into the cache once."""
    template = template_for(cfg)
    columns = columns_of(cfg.sft)
    return prepare(cfg.sft.data, tokenizer, template, columns), prepare(cfg.sft.valid_data, tokenizer, template, columns)


def build_datasets(cfg: Config, tokenizer: Tokenizer) -> tuple[SFTDataset, SFTDataset]:
    """The run's training rows (train.steps x train.global_batch of them) and its held-out rows."""
    t, s = cfg.train, cfg.sft
    train_prefixes, valid_prefixes = prepare_data(cfg, tokenizer)
    examples = Examples(train_prefixes)
    if valid_prefixes:
        train_members, held = np.arange(len(examples)), Examples(valid_prefixes)
        valid_members, source = np.arange(len(held)), f"sft.valid_data ({', '.join(s.valid_data)})"
    else:  # data.split's validation share of the examples, never trained on
        (lo, hi), (vlo, vhi) = held_out_split(cfg.data, len(examples), "validation examples",
                                              f"of the {len(examples)} in sft.data",
                                              "sft.valid_data or a split with a validation share")
        train_members, valid_members, held = np.arange(lo, hi), np.arange(vlo, vhi), examples
        source = f"data.split={cfg.data.split}: examples {vlo}..{vhi - 1} of sft.data, never trained on"
    pad = tokenizer.eod_id or 0
    train = SFTDataset(examples, train_members, t.seq_len, s.packing, s.overlong, t.steps * t.global_batch,
                       t.seed, pad)
    val = SFTDataset(held, valid_members, t.seq_len, s.packing, s.overlong, None, 0, pad, shuffle=False)
    val.source = source
    return train, val


class SFT(Recipe):
    """`loom sft`: the examples, and the loss over their learned tokens only."""

    command = "sft"

    def check_settings(self, cfg: Config) -> None:
        if not cfg.sft.data:
            raise UserError("loom sft needs sft.data: .jsonl files of {\"messages\": [...]} or {\"prompt\", "
                            "\"completion\"} records (or prefixes from `loom preprocess --sft`), e.g. "
                            "--sft.data=chat.jsonl")

    def prepare_data(self, cfg: Config, tokenizer: Tokenizer) -> None:
        prepare_data(cfg, tokenizer)

    def datasets(self, cfg: Config, tokenizer: Tokenizer) -> tuple[SFTDataset, SFTDataset]:
        return build_datasets(cfg, tokenizer)

    def chat_template(self, cfg: Config):
        return template_for(cfg)

    def loss(self, cfg: Config) -> MaskedTokenCrossEntropy:
        return MaskedTokenCrossEntropy(run_loss_chunk(cfg))
