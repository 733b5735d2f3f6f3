"""A small chat dataset made locally (no downloads), for the demo, tests and bench/sft_packing.py.

`sft.data = ["synthetic:N"]` trains on N generated examples. Tasks a small model can learn and whose
answers follow from the question: arithmetic, reversing and sorting words, counting letters, upper-casing;
some conversations have a system message, some two user/assistant turns, every tenth record is
prompt/completion instead of messages. Lengths vary (a few to a few hundred tokens), as real chat sets do,
so packing has something to pack. Deterministic in (N, seed).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("apple river stone cloud tiger lamp orange music paper garden window silver rocket forest candle "
         "engine pepper marble ladder violet copper planet sugar bridge falcon ocean").split()
SYSTEMS = ("You are a helpful assistant.", "Answer briefly and exactly.", "You are a careful calculator and editor.")


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(1000), rng.randrange(1000)
        op = rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"What is {a} {op} {b}?", f"{a} {op} {b} = {value}."
    words = rng.sample(WORDS, rng.randint(2, 6 if kind != 4 else 24))
    text = " ".join(words)
    if kind == 1:
        return f"Reverse the order of these words: {text}", " ".join(reversed(words))
    if kind == 2:
        return f"Sort these words alphabetically: {text}", " ".join(sorted(words))
    if kind == 3:
        letter = rng.choice("aeiou")
        return (f"How many times does the letter {letter} appear in: {text}?",
                f"The letter {letter} appears {text.count(letter)} times.")
    return f"Write this in capital letters, then repeat it once: {text}", f"{text.upper()}\n{text.upper()}"


def records(n: int, seed: int = 0):
    rng = random.Random(seed)
    for i in range(n):
        question, answer = _task(rng)
        if i % 10 == 9:
            yield {"prompt": question + "\n", "completion": answer}
            continue
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.25:
            q2, a2 = _task(rng)
            messages += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
        yield {"messages": messages}


def write(path: str | Path, n: int, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records(n, seed)))
    tmp.replace(path)
    return path
