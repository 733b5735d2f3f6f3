"""Reward functions of tests/test_rl.py (importable by spawned ranks: PYTHONPATH=tests)."""


def ones(prompt: str, completion: str, **_) -> float:
    """The share of the completion's characters that are the digit 1: a reward a random policy can climb."""
    return completion.count("1") / max(len(completion), 1)


def needs_answer(prompt: str, completion: str, answer: str) -> float:
    """Fails unless the record's "answer" field is passed as a keyword."""
    return float(completion.strip() == answer)


def digit_share(prompt: str, completion: str, **_) -> float:
    """The share of a completion's characters that are digits: a reward that differs within a group."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))
