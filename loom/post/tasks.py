"""Verifiable tasks made locally (no downloads): prompts with a checkable answer, for RL with exact-match
rewards and for the SFT that precedes it.

`addition:N` (in `rl.prompts`, `rl.valid_prompts` or `sft.data`) is N problems "A+B=" whose completion is
the sum's digits: {"prompt": "123+45=", "answer": "168"} for RL (the answer goes to the reward function),
{"prompt": "123+45=", "completion": "168"} for SFT. Operands have 1 to `DIGITS` digits, drawn so that
every length is equally likely. Deterministic in (N, seed): the SFT set (seed 0), the RL training prompts
(seed 1) and the held-out prompts (seed 2) are different draws. One problem in ten (by a hash of its text)
is held out: the held-out prompts are drawn among those only and the training sets never hold one, so no
evaluation prompt is ever trained on, whatever the sizes.

`addition_noisy:N` is the same problems with a noisy labeller: in SFT sets 40% of the completions are wrong
(the sum plus or minus 1 to 9). `addition_carryless:N` has a labeller with a systematic error instead: on
60% of the problems whose sum needs a carry, the SFT completion drops every carry (38+45= -> "73", 7+5= ->
"2"), so a model fine-tuned on it learns the carry-less answer as the likelier one where a carry is due,
while the true sum keeps 40% of the mass: the situation a verifier and RL are for (the RL demo,
bench/rl_demo.py). As RL or held-out prompts both tasks carry the true sums.

`exact_match(prompt, completion, answer)` is the reward: 1.0 when the completion, without surrounding
white space, is the answer, else 0.0.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from loom.errors import UserError

DIGITS = 2
TASKS = ("addition", "addition_noisy", "addition_carryless")
NOISE = 0.4  # addition_noisy: the share of SFT completions that are wrong
CARRYLESS = 0.6  # addition_carryless: the share of SFT problems with a carry whose completion drops it
SEEDS = {"sft": 0, "rl": 1, "valid": 2}
VERSION = 2  # of the generator: part of the cached file's name


def _operand(rng: random.Random) -> int:
    digits = rng.randint(1, DIGITS)
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10 ** digits)


def held_out(prompt: str) -> bool:
    """One problem in ten, the same in every draw: the held-out ones."""
    return hashlib.sha256(prompt.encode()).digest()[0] % 10 == 0


def addition(n: int, seed: int, valid: bool):
    """n problems as (prompt, answer) strings: held-out ones when `valid`, else never a held-out one."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        a, b = _operand(rng), _operand(rng)
        prompt = f"{a}+{b}="
        if held_out(prompt) == valid:
            out.append((prompt, str(a + b)))
    return out


def carryless(prompt: str) -> str:
    """The digit-wise sum of "A+B=" with every carry dropped: 38+45= -> "73", 7+5= -> "2"."""
    a, b = prompt.rstrip("=").split("+")
    width = max(len(a), len(b))
    digits = [(int(x) + int(y)) % 10 for x, y in zip(a.zfill(width), b.zfill(width))]
    return str(int("".join(map(str, digits))))


def exact_match(prompt: str, completion: str, answer: str, **_) -> float:
    """1.0 when the completion (white space stripped) is exactly the answer, else 0.0."""
    return float(completion.strip() == str(answer).strip())


def parse(spec: str, where: str) -> tuple[str, int] | None:
    """("addition", N) for a task spec "addition:N", None for anything else (a file path)."""
    name, sep, count = spec.partition(":")
    if not sep or name not in TASKS:
        return None
    if not count.isdigit() or int(count) < 1:
        raise UserError(f"{where} entry {spec!r}: {name}:N needs a positive number of problems, e.g. {name}:2000")
    return name, int(count)


def write(path: Path, name: str, n: int, role: str) -> Path:
    """Write `n` problems of task `name` for `role` ("sft", "rl" or "valid") as .jsonl, atomically."""
    problems = addition(n, SEEDS[role], role == "valid")
    if name == "addition_noisy" and role == "sft":  # a noisy labeller: 40% of the answers are off by 1 to 9
        rng = random.Random(SEEDS[role] + 100)
        problems = [(p, str(abs(int(a) + rng.choice([-1, 1]) * rng.randint(1, 9))) if rng.random() < NOISE else a)
                    for p, a in problems]
    if name == "addition_carryless" and role == "sft":  # a labeller who forgets carries, 60% of the time
        rng = random.Random(SEEDS[role] + 200)
        problems = [(p, c if (c := carryless(p)) != a and rng.random() < CARRYLESS else a) for p, a in problems]
    key = "completion" if role == "sft" else "answer"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"prompt": p, key: a}) + "\n" for p, a in problems))
    tmp.replace(path)
    return path


def materialise(spec: str, role: str, where: str) -> str:
    """The .jsonl path for a task spec (written into the cache once), or `spec` unchanged if it is not one."""
    parsed = parse(spec, where)
    if parsed is None:
        return spec
    from loom.data.tokenizer import cache_dir

    name, n = parsed
    path = cache_dir() / "tasks" / f"{name}-v{VERSION}-d{DIGITS}-{role}-{n}.jsonl"
    return str(path if path.is_file() else write(path, name, n, role))
