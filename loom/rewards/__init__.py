"""Verifiable rewards, composable with weights: `rl.reward=math:1.0,format:0.2` is 1.0 x the math reward plus
0.2 x the format reward. Every reward is a function f(prompt, completion, **fields) -> float, the record's other
fields (e.g. "answer") as keywords, as a user's `package.module:function` is; a term of `rl.reward` is a
built-in name or such a callable, with an optional `:weight` (1.0 when left out).

Built in (`BUILTIN`):

- `math`: 1.0 when the completion's final answer equals the record's `answer` mathematically (1/2 = 0.5 =
  \\frac{1}{2}, a \\boxed{...} answer preferred), checked by Hugging Face's `math-verify`
  (`pip install math-verify`, loom's `rl` extra), else 0.0.
- `exact_match`: 1.0 when the completion without surrounding white space is the record's `answer`, else 0.0.
- `format`: 1.0 when the whole completion (white space stripped) matches the regular expression
  `rl.format_pattern` (re.fullmatch, `.` matching newlines too), else 0.0.
- `length`: DAPO's soft overlong penalty: 0 up to `rl.max_new_tokens - rl.length_buffer` tokens, then falling
  linearly to -1 at `rl.max_new_tokens` (Yu et al. 2025, eq. 13).

A reward that raises on a record, or returns something other than a finite number, is bad input naming the
reward and the record (loom/post/rl/rewards.py, exit 2), as a user's function is.

Torch-free: `combine` builds the weighted sum; loading a user's callable is the caller's (`load`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

from loom.errors import UserError

Reward = Callable[..., float]


@dataclass(frozen=True)
class Settings:
    """What the built-in rewards read from `rl.*`."""

    format_pattern: str = r"<think>.*</think>\s*<answer>.*</answer>"
    max_tokens: int = 16  # rl.max_new_tokens
    length_buffer: int = 4
    # ids of a text, for the length reward (None: it counts characters)
    count_tokens: Callable[[str], int] | None = None


def _answer(name: str, fields: dict) -> str:
    if "answer" not in fields:
        raise ValueError(f"the {name} reward needs the record's \"answer\" field (this record has: "
                       f"{', '.join(fields) or 'no other field'})")
    return str(fields["answer"])


def exact_match(prompt: str, completion: str, **fields) -> float:
    """1.0 when the completion, white space stripped, is the record's answer."""
    return float(completion.strip() == _answer("exact_match", fields).strip())


_verifier = None


def _math_verify():
    global _verifier
    if _verifier is None:
        try:
            import math_verify
        except ImportError:
            raise UserError("the math reward (rl.reward=math...) checks answers with math-verify, which is not "
                            "installed: pip install math-verify (or loom's extra: pip install -e \".[rl]\")") from None
        _verifier = math_verify
    return _verifier


def math_reward(prompt: str, completion: str, **fields) -> float:
    """1.0 when math-verify finds the completion's answer equal to the record's answer."""
    mv = _math_verify()
    answer = _answer("math", fields).strip()
    gold = mv.parse(answer) or mv.parse(f"${answer}$")
    if not gold:
        raise ValueError(f"math-verify cannot read the record's answer {answer!r} as a number or expression")
    predicted = mv.parse(completion)
    return float(bool(predicted) and mv.verify(gold, predicted))


class FormatReward:
    def __init__(self, pattern: str):
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise UserError(f"rl.format_pattern={pattern!r} is not a valid regular expression: {e}") from None

    def __call__(self, prompt: str, completion: str, **fields) -> float:
        return float(self.regex.fullmatch(completion.strip()) is not None)


class LengthReward:
    """DAPO's soft overlong punishment of a completion of n tokens: 0 while n <= max - buffer, then
    (max - buffer - n) / buffer, down to -1 at n >= max."""

    def __init__(self, max_tokens: int, buffer: int, count_tokens=None):
        if not 0 < buffer <= max_tokens:
            raise UserError(f"the length reward needs 0 < rl.length_buffer <= rl.max_new_tokens; got "
                            f"rl.length_buffer={buffer}, rl.max_new_tokens={max_tokens}")
        self.max, self.buffer, self.count = max_tokens, buffer, count_tokens or len

    def __call__(self, prompt: str, completion: str, **fields) -> float:
        n = self.count(completion)
        return max(-1.0, min(0.0, (self.max - self.buffer - n) / self.buffer))


BUILTIN = {
    "math": lambda s: math_reward,
    "exact_match": lambda s: exact_match,
    "format": lambda s: FormatReward(s.format_pattern),
    "length": lambda s: LengthReward(s.max_tokens, s.length_buffer, s.count_tokens),
}
EXAMPLE = "math:1.0,format:0.2"


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse(spec: str, key: str = "rl.reward") -> list[tuple[str, float]]:
    """`rl.reward` -> [(built-in name or package.module:function, weight), ...]; UserError naming what is wrong
    and what is valid."""
    valid = (f"give comma-separated terms NAME[:WEIGHT], NAME one of {', '.join(BUILTIN)} or a Python callable "
             f"that must be package.module:function, e.g. {key}={EXAMPLE} or {key}=loom.post.tasks:exact_match")
    terms = []
    for term in spec.split(","):
        term = term.strip()
        name, weight = term, 1.0
        head, sep, tail = term.rpartition(":")
        if sep and _number(tail) is not None:
            name, weight = head.strip(), _number(tail)
        elif sep and tail.strip() and not tail.strip().isidentifier():
            raise UserError(f"{key}={spec!r}: the weight {tail!r} of {head!r} is not a finite number; {valid}")
        if not name:
            raise UserError(f"{key}={spec!r}: an empty term; {valid}")
        if name not in BUILTIN and ":" not in name:
            raise UserError(f"{key}={spec!r}: unknown reward {name!r}; {valid}")
        if name in (n for n, _ in terms):
            raise UserError(f"{key}={spec!r}: {name!r} is named twice; give it once with the sum of its weights")
        terms.append((name, weight))
    return terms


def user_callables(spec: str) -> list[str]:
    """The `package.module:function` terms of `rl.reward`."""
    return [name for name, _ in parse(spec) if name not in BUILTIN]


class TermError(Exception):
    """A term of a combined reward failed on a record (the message names the term)."""


class Combined:
    """sum of weight x reward over the terms; a term that fails says which term it was."""

    def __init__(self, terms: list[tuple[str, float, Reward]]):
        self.terms = terms

    def parts(self, prompt: str, completion: str, **fields) -> dict[str, float]:
        out = {}
        for name, _, fn in self.terms:
            try:
                out[name] = fn(prompt, completion, **fields)
            except UserError:
                raise
            except Exception as e:
                raise TermError(f"its term {name} raised {type(e).__name__}: {e}") from e
        return out

    def __call__(self, prompt: str, completion: str, **fields) -> float:
        parts = self.parts(prompt, completion, **fields)
        for name, value in parts.items():
            if not (isinstance(value, (int, float)) and math.isfinite(float(value))):
                return value  # the caller names the bad value
        return float(sum(weight * float(parts[name]) for name, weight, _ in self.terms))


def combine(spec: str, settings: Settings, load: Callable[[str], Reward]) -> Reward:
    """The reward `rl.reward` names: a lone callable of weight 1 itself, else a `Combined` of the terms (built-in
    rewards made from `settings`, callables loaded by `load`)."""
    terms = parse(spec)
    if len(terms) == 1 and terms[0][1] == 1.0 and terms[0][0] not in BUILTIN:
        return load(terms[0][0])
    return Combined([(name, weight, BUILTIN[name](settings) if name in BUILTIN else load(name))
                     for name, weight in terms])
