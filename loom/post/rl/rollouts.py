"""Rollouts: the engine that generates them, each completion's seed, and training rows of prompt + completion."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from loom.config import Config
from loom.models.losses import IGNORE
from loom.post.rl.prompts import engine_max_len


def rollout_engine(cfg: Config, model: nn.Module, decode=None):
    """The engine that generates the rollouts, on `model` (the engine's own copy of the policy). Decode steps are
    compiled per `rl.engine_compile`: "auto" (the default) is on on a GPU (a CUDA graph per step) and off on a
    CPU, decided by `loom.infer.step.resolve_compile` as for `loom generate`. `decode` (ids -> text) reads
    completions for `rl.stop`."""
    from loom.infer.engine import Engine

    rl = cfg.rl
    return Engine(model, max_batch=rl.engine_batch, max_len=engine_max_len(cfg), seed=cfg.train.seed,
                  compile=rl.engine_compile, sync_every=rl.engine_sync_every, decode=decode,
                  paged=rl.engine_paged)


def stops(cfg: Config, tokenizer) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Where rollouts stop: (ids, texts). Ids: the tokenizer's end-of-sequence ids and the chat template's
    end-of-turn token (`loom.post.chat.stop_token_ids`; the template is rl.template's when it names one, else
    the one carried beside the tokenizer). Texts: rl.stop, and the end-of-turn marker when the tokenizer has
    no token for it (`stop_texts`)."""
    from loom.post.chat import load_template, stop_texts, stop_token_ids

    template = None
    if cfg.rl.template not in ("none", "auto"):
        template = load_template(cfg.rl.template, None, "rl.template")
    return stop_token_ids(tokenizer, template), tuple(dict.fromkeys((*cfg.rl.stop, *stop_texts(tokenizer, template))))


def rollout_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of completion `index` of the global batch at `step`: the same in every layout."""
    digest = hashlib.sha256(f"{seed}/{step}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def rows_of(prompts: list[list[int]], completions, seq_len: int, pad: int,
            model_masks: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """Training rows of prompt + completion: `input_ids`, `labels` (IGNORE outside the completion),
    `mask` (1 on completion tokens) and `rollout_logp` (the engine's log-prob of each label), [rows, seq_len].
    `model_masks` (multi-turn episodes, loom/post/rl/environments.py): per completion token 1 where the model
    wrote it, 0 where the environment did; those are IGNORE labels too, so they carry no loss."""
    n = len(prompts)
    ids = torch.full((n, seq_len + 1), pad, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    rollout = torch.zeros(n, seq_len, dtype=torch.float32)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        seq = p + c.tokens
        ids[b, :len(seq)] = torch.tensor(seq)
        start = len(p) - 1  # label position of the first completion token
        labels[b, start:start + len(c.tokens)] = torch.tensor(c.tokens)
        rollout[b, start:start + len(c.tokens)] = torch.tensor(c.logprobs, dtype=torch.float32)
        if model_masks is not None:
            env = torch.tensor(model_masks[b], dtype=torch.bool).logical_not()
            labels[b, start:start + len(c.tokens)][env] = IGNORE
            rollout[b, start:start + len(c.tokens)][env] = 0.0
    return {"input_ids": ids[:, :-1].contiguous(), "labels": labels, "mask": (labels != IGNORE).float(),
            "rollout_logp": rollout}
