"""RL's rewards: `rl.reward` (a Python callable f(prompt, completion, **fields)) and/or a reward model
(`rl.reward_model`, a `loom rm` run scoring prompt + completion), their sum."""

from __future__ import annotations

import importlib

import torch

from loom.build import torch_dtype
from loom.config import Config
from loom.data.tokenizer import Tokenizer
from loom.errors import UserError


def is_user_code(spec: str) -> bool:
    """Whether `rl.reward` names a module of the user's (outside loom)."""
    return bool(spec) and not spec.partition(":")[0].startswith("loom.")


def load_callable(spec: str):
    """`package.module:function` -> the function; UserError naming what is wrong."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"rl.reward={spec!r}: cannot import {module_name!r} ({e}); give package.module:function "
                        "importable from this environment, e.g. loom.post.tasks:exact_match") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"rl.reward={spec!r}: {module_name} has no function {name!r}")
    return fn


class Rewards:
    """The reward of each (prompt, completion): the callable's and/or the reward model's (times its coef)."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer, device: torch.device):
        rl = cfg.rl
        self.fn = load_callable(rl.reward) if rl.reward else None
        self.model = None
        self.coef = rl.reward_model_coef
        if rl.reward_model:
            from loom.post.pref import load_reward_model

            self.model, rm_cfg = load_reward_model(rl.reward_model, torch_dtype(cfg))
            if rm_cfg.model.vocab_size != cfg.model.vocab_size:
                raise UserError(f"rl.reward_model={rl.reward_model} has vocab_size {rm_cfg.model.vocab_size}, the "
                                f"policy {cfg.model.vocab_size}: it must read the policy's tokens (same tokenizer)")
            self.model.to(device)
            self.device = device

    def __call__(self, texts: list[str], completions: list[str], fields: list[dict],
                 sequences: list[list[int]]) -> dict[str, torch.Tensor]:
        out = {}
        total = torch.zeros(len(texts), dtype=torch.float64)
        if self.fn is not None:
            values = torch.tensor([float(self.fn(p, c, **f)) for p, c, f in zip(texts, completions, fields)],
                                  dtype=torch.float64)
            out["reward_fn"] = values
            total += values
        if self.model is not None:
            scores = self.score(sequences)
            out["reward_model"] = scores
            total += self.coef * scores
        out["reward"] = total
        return out

    @torch.no_grad()
    def score(self, sequences: list[list[int]], batch: int = 16) -> torch.Tensor:
        from loom.post.pref import rewards_at

        out = []
        for i in range(0, len(sequences), batch):
            rows = sequences[i:i + batch]
            width = max(map(len, rows))
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            for b, r in enumerate(rows):
                ids[b, :len(r)] = torch.tensor(r)
            last = torch.tensor([len(r) - 1 for r in rows], device=self.device)
            hidden = self.model(ids.to(self.device), return_hidden=True)  # causal: padding after `last` unseen
            out.append(rewards_at(hidden, last, self.model.score).double().cpu())
        return torch.cat(out)
