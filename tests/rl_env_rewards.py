"""Reward functions of tests/test_rl_dynamic.py and tests/test_rl_environments.py (importable by spawned ranks)."""


def mostly_constant(prompt: str, completion: str, **_) -> float:
    """0 for every completion of a prompt whose first operand is not a multiple of 4 (a group that carries no gradient),
    else a number read off the completion's characters (different completions nearly always differ)."""
    if int(prompt.split("+")[0]) % 4:
        return 0.0
    return sum(map(ord, completion)) % 97 / 97


class CalcFirst:
    """loom's Calculator tool whose first turn is always a call on the prompt's sum (the tool answers
    " = VALUE"), so that every episode has environment tokens; later turns are the Calculator's own."""

    def reset(self, record):
        from loom.post.rl.tools import Calculator

        self.tool, self.expression = Calculator(), record["prompt"].rstrip("=")
        return self.tool.reset(record)

    def step(self, completion):
        if self.expression is not None:
            call, self.expression = "calc " + self.expression, None
            return self.tool.step(call)
        return self.tool.step(completion)


class BadStep:
    """Breaks the environment contract: step returns a number, not (text, reward, done)."""

    def reset(self, record):
        return record["prompt"]

    def step(self, completion):
        return 1.0
