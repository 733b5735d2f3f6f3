"""Multi-turn RL with environments and tools (`rl.environment=module:Class`, `rl.max_turns`).

An environment is a class with

    reset(record) -> first observation   # the prompt record's fields ({"prompt", "answer", ...})
    step(completion) -> (text, reward, done)

made once per episode (each completion of a group is an episode of its own). `reset` returns the model's first
input: a string (used as is, like a prompt) or a list of {"role", "content"} messages (rendered by
`rl.template` with a generation prompt). After each model turn `step` gets the turn's text (without its stop
token) and answers with the environment's text, a reward and whether the episode is over; the text is
appended to the transcript, as a new message of role "user" rendered by the chat template when `rl.template`
is set (closing the model's turn if it did not close it itself), as is without one. An episode ends when `step`
says done, after `rl.max_turns` model turns, or when the transcript fills the engine's max_len. Its reward is
the sum of the rewards `step` returned (plus `rl.reward` of the whole transcript, if set).

Every turn of every episode runs in one `Engine.generate` call per turn (continuous batching across episodes);
a group's first turn shares its prompt's prefill and blocks (rl.engine_paged), as single-turn rollouts do.
Later turns are new requests whose prompt is the transcript so far: with rl.engine_paged the engine's prefix
cache (loom/infer/prefix_cache.py) finds the earlier turns' whole blocks, and only the rest is prefilled.

Training sees prompt + transcript as one row; only the model's own tokens carry loss (`Episode.model_mask`,
`rollouts.rows_of`): the environment's tokens are labels left out, with no log-prob. Tools: loom/post/rl/tools.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import numbers
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from loom.errors import UserError

MARK = "loom-turn-marker"
STEP_THREADS = 8  # environments stepped at once (each episode's own instance)


class Environment(Protocol):
    def reset(self, record: dict) -> str | list[dict]: ...

    def step(self, completion: str) -> tuple[str, float, bool]: ...


@dataclass
class Episode:
    """One multi-turn rollout: `tokens` (everything after the prompt: model turns and environment text), the
    engine's log-prob of each (0.0 on environment tokens), `model_mask` (1 on the model's own tokens), the
    summed reward, the number of model turns, the environment's texts, why it ended."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    observations: list[str] = field(default_factory=list)
    finish_reason: str = ""  # "done" (the environment's), "turns" (rl.max_turns), "context" (max_len)

    def text(self, decode) -> str:
        """The transcript after the prompt, environment text included."""
        return decode(self.tokens)


def load_environment(spec: str, key: str = "rl.environment"):
    """`package.module:Class` -> the class; UserError naming what is wrong."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UserError(f"{key}={spec!r} must be package.module:Class, e.g. loom.post.rl.tools:Calculator or "
                        "loom.post.rl.tools:PythonTool")
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{key}={spec!r}: cannot import {module_name!r}: {e}; put it in the current directory or on "
                        "PYTHONPATH, or name loom.post.rl.tools:Calculator / loom.post.rl.tools:PythonTool") from None
    except Exception as e:
        raise UserError(f"{key}={spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "reset", None)) or not callable(getattr(cls, "step", None)):
        raise UserError(f"{key}={spec!r}: {module_name} has no class {name!r} with reset(record) and "
                        "step(completion) -> (text, reward, done)")
    return cls


class Turns:
    """Text <-> tokens of the turns: the first observation's ids, and the ids of an environment text that follows
    a model turn (per `template`: None, text as is; else a chat template's "user" message)."""

    def __init__(self, tokenizer, template=None):
        self.tokenizer, self.template = tokenizer, template
        if template is not None:
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": MARK}]
            rendered = template.render(probe)
            self.close = rendered[rendered.index(MARK) + len(MARK):] if MARK in rendered else ""

    def first(self, observation, where: str) -> list[int]:
        if isinstance(observation, str) and observation:
            return self.tokenizer.encode(observation)
        if isinstance(observation, list) and observation and all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in observation):
            if self.template is None:
                raise UserError(f"{where}: reset returned chat messages; they need rl.template (chatml, llama3, auto "
                                "or a file)")
            return self.tokenizer.encode(self.template.render(observation, add_generation_prompt=True))
        raise UserError(f"{where}: reset(record) must return the model's first input: a non-empty string or a list "
                        f"of {{\"role\", \"content\"}} messages, not {observation!r:.80}")

    def reply(self, text: str, closed: bool) -> list[int]:
        """The ids of the environment's `text` after a model turn; `closed`: the turn ended with its stop token."""
        if self.template is None:
            return self.tokenizer.encode(text) if text else []
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": MARK},
                 {"role": "user", "content": text}]
        rendered = self.template.render(probe, add_generation_prompt=True)
        after = rendered[rendered.index(MARK) + len(MARK):]
        end = self.close.rstrip()  # the end-of-turn marker, which a closed turn already holds as its stop token
        if closed and end and after.startswith(end):
            after = after[len(end):]
        return self.tokenizer.encode(after)


def _checked(result, where: str) -> tuple[str, float, bool]:
    if (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], str)
            and isinstance(result[1], numbers.Real) and math.isfinite(float(result[1]))):
        return result[0], float(result[1]), bool(result[2])
    raise UserError(f"{where}: step(completion) must return (text: str, reward: finite number, done: bool), "
                    f"not {result!r:.120}")


def run_episodes(engine, env_class, records: list[dict], wheres: list[str], params: list, turns: Turns,
                 max_turns: int, decode) -> list[Episode]:
    """One episode per record, `params[i]` its sampling parameters (turn t draws with seed + t x 1000003), all
    episodes' turn t in one `engine.generate` call, then their `step`s on up to STEP_THREADS threads (each
    episode has its own instance). An environment that raises, or returns something other
    than (str, number, bool), is bad input naming the class and the record."""
    name = f"{env_class.__module__}:{env_class.__qualname__}"
    envs, episodes = [], []
    for record, where in zip(records, wheres):
        env = env_class()
        try:
            first = env.reset(dict(record))
        except Exception as e:
            raise UserError(f"rl.environment={name}: reset raised {type(e).__name__}: {e}, on {where}") from None
        envs.append(env)
        episodes.append(Episode(turns.first(first, f"rl.environment={name} on {where}")))
    active = list(range(len(episodes)))
    for turn in range(max_turns):
        chosen, contexts, sampling = [], [], []
        for i in active:
            context = episodes[i].prompt + episodes[i].tokens
            room = engine.max_len - len(context)
            if room < 1:
                episodes[i].finish_reason = "context"
                continue
            p = params[i]
            seed = None if p.seed is None else (p.seed + turn * 1_000_003) % (1 << 62)
            chosen.append(i)
            contexts.append(context)
            sampling.append(dataclasses.replace(p, max_new_tokens=min(p.max_new_tokens, room), seed=seed))
        if not chosen:
            break
        done = engine.generate(contexts, sampling)

        def step(i: int, c) -> tuple[str, float, bool]:
            try:
                result = envs[i].step(c.text(decode))
            except UserError:
                raise
            except Exception as e:
                raise UserError(f"rl.environment={name}: step raised {type(e).__name__}: {e}, on {wheres[i]} (a tool's "
                                "failures are the environment's to turn into a reward of 0 with a reason)") from None
            return _checked(result, f"rl.environment={name} on {wheres[i]}")

        # the episodes' environments step side by side (a tool's subprocess waits, not this one)
        with ThreadPoolExecutor(min(STEP_THREADS, len(chosen))) as pool:
            results = list(pool.map(step, chosen, done))
        active = []
        for i, c, (text, reward, finished) in zip(chosen, done, results):
            ep = episodes[i]
            ep.tokens += c.tokens
            ep.logprobs += c.logprobs
            ep.model_mask += [1] * len(c.tokens)
            ep.turns += 1
            ep.reward += reward
            ep.observations.append(text)
            if finished:
                ep.finish_reason = "done"
                continue
            if turn == max_turns - 1:
                ep.finish_reason = "turns"
                continue
            ids = turns.reply(text, closed=c.finish_reason == "stop" and not c.stop_string)
            if len(ep.prompt) + len(ep.tokens) + len(ids) >= engine.max_len:
                ep.finish_reason = "context"
                continue
            ep.tokens += ids
            ep.logprobs += [0.0] * len(ids)
            ep.model_mask += [0] * len(ids)
            active.append(i)
    for ep in episodes:
        ep.finish_reason = ep.finish_reason or "turns"
    return episodes
