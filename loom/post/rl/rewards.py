"""RL's rewards: `rl.reward` (a Python callable f(prompt, completion, **fields), or loom.rewards' built-in
rewards and callables with weights, e.g. math:1.0,format:0.2) and/or a reward model (`rl.reward_model`, a
`loom rm` run scoring prompt + completion), their sum."""

from __future__ import annotations

import importlib
import json
import math
import numbers
import os
import sys

import torch

from loom.build import torch_dtype
from loom.config import Config
from loom.data.tokenizer import Tokenizer
from loom.errors import UserError
from loom import rewards as builtin


def is_user_code(spec: str) -> bool:
    """Whether `rl.reward` names a module of the user's (outside loom)."""
    return bool(spec) and any(not name.startswith("loom.") for name in builtin.user_callables(spec))


def reward_function(cfg: Config, count_tokens=None):
    """`rl.reward` -> f(prompt, completion, **fields): a user's callable, or loom.rewards' weighted sum of
    built-in rewards and callables (`count_tokens`: text -> its token count, for the length reward)."""
    rl = cfg.rl
    settings = builtin.Settings(format_pattern=rl.format_pattern, max_tokens=rl.max_new_tokens,
                                length_buffer=rl.length_buffer, count_tokens=count_tokens)
    return builtin.combine(rl.reward, settings, load_callable)


def load_callable(spec: str):
    """`package.module:function` -> the function; UserError naming what is wrong. The current directory is on
    the import path (as for `python -m`), so a reward module beside the user imports without PYTHONPATH."""
    module_name, _, name = spec.partition(":")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)  # after everything else: the user's file never shadows an installed module
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):  # the module itself, not one it imports
            looked = ", ".join(p or "." for p in sys.path[:6]) + (", ..." if len(sys.path) > 6 else "")
            raise UserError(f"rl.reward={spec!r}: cannot import {module_name!r}: no such module in the current "
                            f"directory ({here}) or on the import path ({looked}); put {module_name.replace('.', '/')}.py in "
                            "the current directory or on PYTHONPATH, or name an installed module, e.g. "
                            "loom.post.tasks:exact_match") from None
        raise UserError(f"rl.reward={spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # the module itself raised while being imported: the user's code
        raise UserError(f"rl.reward={spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"rl.reward={spec!r}: {module_name} has no function {name!r}")
    return fn


def _excerpt(prompt: str, completion: str, fields: dict, width: int = 160) -> str:
    text = json.dumps({"prompt": prompt, "completion": completion, **fields}, ensure_ascii=False, default=str)
    return text if len(text) <= width else text[:width] + "..."


class Rewards:
    """The reward of each (prompt, completion): the callable's and/or the reward model's (times its coef)."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer, device: torch.device):
        rl = cfg.rl
        self.spec = rl.reward
        self.fn = reward_function(cfg, lambda text: len(tokenizer.encode(text))) if rl.reward else None
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

    def reward_of(self, prompt: str, completion: str, fields: dict, where: str) -> float:
        """The reward function's value for one completion; a failure of the user's function (an exception, a
        keyword it does not take, a value that is not a finite number) is bad input naming the function and
        the record `where`."""
        try:
            value = self.fn(prompt, completion, **fields)
        except UserError:
            raise
        except Exception as e:
            error = f"raised {type(e).__name__}: {e}"
        else:
            if isinstance(value, numbers.Real) and math.isfinite(float(value)):
                return float(value)
            error = f"returned {value!r} ({type(value).__name__}), not a finite number"
        raise UserError(f"the reward function rl.reward={self.spec} {error}, on {where}: "
                        f"{_excerpt(prompt, completion, fields)}. It is called as f(prompt, completion, **fields) "
                        f"with every other field of the record as a keyword (here: "
                        f"{', '.join(fields) or 'none'}) and must return a number")

    def __call__(self, texts: list[str], completions: list[str], fields: list[dict],
                 sequences: list[list[int]], records: list[str] | None = None) -> dict[str, torch.Tensor]:
        """`records`: where each prompt comes from, in words (for messages)."""
        out = {}
        total = torch.zeros(len(texts), dtype=torch.float64)
        if self.fn is not None:
            where = records or [f"completion {i}" for i in range(len(texts))]
            values = torch.tensor([self.reward_of(p, c, f, w) for p, c, f, w in zip(texts, completions, fields, where)],
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
