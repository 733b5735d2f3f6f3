"""Two environments for `rl.environment` (loom/post/rl/environments.py): a calculator on the synthetic addition
task, and a Python tool that runs the model's code in a sandboxed subprocess.

Both read a prompt record with an "answer" field. A model turn is either a tool call or the final answer:
the answer scores 1.0 when it is exactly the record's answer (white space stripped), else 0.0, and ends the
episode; a call scores 0.0 and its result (or why it failed) is the environment's text for the next turn.

- `Calculator`: a call is `calc EXPRESSION` (e.g. "calc 38+45"); the expression is arithmetic on integers and
  decimals (+ - * / // % **, parentheses), evaluated by walking its syntax tree (never `eval`), powers and
  results kept small; the text is " = VALUE\n" (or " = error: why\n").
- `PythonTool`: a call is a ```python fenced block; the code runs in `run_python`'s sandbox and the text is
  its output (or the reason it failed), truncated.

`run_python(code)`: a fresh `python -I -S` in its own session and temporary directory, with resource limits
set in the child before it starts (resource.setrlimit): address space (`memory_mb`), CPU seconds, the size of
any file it writes (its stdout and stderr are files, so endless output stops at `max_output` bytes), open
files, no core dumps, and no new processes (RLIMIT_NPROC; run as root, the child first becomes the unprivileged
user `nobody`, since the kernel does not apply that limit to root, with an interpreter `nobody` may run:
`interpreter`; failing that, a weaker guard removes os.fork and its kin before the code runs, `NO_FORK`). The wall-clock `timeout_s` ends it and every
process of its session with SIGKILL. Bad code, infinite loops, fork bombs, huge output and crashes come back as
`Result(ok=False, reason=...)`, never as an exception.
"""

from __future__ import annotations

import ast
import operator
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


@dataclass
class Result:
    ok: bool
    output: str  # stdout (truncated), or the reason it failed
    reason: str = ""  # "" when it ran and exited 0


NOBODY = 65534


# Without the unprivileged user (root, and no interpreter `nobody` may run): the code runs after this, which
# takes process creation out of reach of ordinary code (a guard, not a wall: RLIMIT_NPROC is the wall).
NO_FORK = ("import os as _os\nfor _n in ('fork', 'forkpty', 'posix_spawn', 'posix_spawnp', 'system', 'execv', "
           "'execve'):\n    hasattr(_os, _n) and delattr(_os, _n)\ndel _os, _n\n")


def _world_runnable(path: str) -> bool:
    """Whether a user with no privileges can run `path`: every directory above it searchable by others."""
    path = os.path.realpath(path)
    if not os.path.isfile(path) or not os.stat(path).st_mode & 0o001:
        return False
    parent = os.path.dirname(path)
    while parent and parent != os.path.dirname(parent):
        if not os.stat(parent).st_mode & 0o001:
            return False
        parent = os.path.dirname(parent)
    return True


def interpreter() -> tuple[str, bool]:
    """(the Python that runs tool code, whether it runs as `nobody`). Not root: this one, as this user (where
    RLIMIT_NPROC binds). Root: an interpreter `nobody` can run (this one's real file, else the system's)."""
    if os.geteuid() != 0:
        return sys.executable, False
    for path in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if _world_runnable(path):
            return os.path.realpath(path), True
    return sys.executable, False


def _limits(memory_mb: int, cpu_s: int, output: int, drop: bool):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (1, 1))  # 1, not 0: no core dump to a pipe (core_pattern |...) either
        if drop:  # RLIMIT_NPROC does not bind root
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    return apply


def _kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: str, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def run_python(code: str, timeout_s: float = 2.0, memory_mb: int = 256, max_output: int = 1000) -> Result:
    """Run `code` in a sandboxed `python -I -S` (see the module docstring); never raises for what the code does."""
    work = tempfile.mkdtemp(prefix="loom-tool-")
    try:
        os.chmod(work, 0o777)
        script = os.path.join(work, "main.py")
        python, drop = interpreter()
        with open(script, "w", encoding="utf-8") as f:
            f.write(code if drop or os.geteuid() != 0 else NO_FORK + code)
        os.chmod(script, 0o644)
        out_path, err_path = os.path.join(work, "out"), os.path.join(work, "err")
        cap = max_output + 1  # one byte over the limit tells truncated output from output that fits
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen([python, "-I", "-S", script], cwd=work, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=err, start_new_session=True, close_fds=True,
                                        env={"PATH": "/usr/bin:/bin", "PYTHONIOENCODING": "utf-8"},
                                        preexec_fn=_limits(memory_mb, max(1, int(timeout_s + 0.999)), cap * 4, drop))
            except (OSError, subprocess.SubprocessError) as e:
                return Result(False, f"error: could not start the sandbox: {e}", "sandbox")
            try:
                code_ = proc.wait(timeout=timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_session(proc.pid)  # whatever it left running
            if timed_out:
                code_ = proc.wait()
        output, truncated = _read(out_path, max_output)
        errors, _ = _read(err_path, 4 * max_output)
        if truncated:
            output += f"\n[output truncated at {max_output} bytes]"
        if timed_out:
            return Result(False, f"error: timed out after {timeout_s:g} s\n{output}", "timeout")
        if code_ < 0:
            sig = signal.Signals(-code_).name
            why = {"SIGXFSZ": f"output over the limit ({max_output} bytes)", "SIGXCPU": "CPU time limit",
                   "SIGKILL": "killed (CPU time or memory limit)"}.get(sig, f"crashed ({sig})")
            return Result(False, f"error: {why}\n{output}", "output" if sig == "SIGXFSZ" else "crash")
        if code_ != 0:
            last = errors.strip().splitlines()[-1:] or [f"exit status {code_}"]
            if "File too large" in last[0]:  # Python ignores SIGXFSZ: the write past RLIMIT_FSIZE fails instead
                return Result(False, f"error: output over the limit ({max_output} bytes)\n{output}", "output")
            return Result(False, f"error: {last[0]}\n{output}", "error")
        return Result(True, output)
    finally:
        shutil.rmtree(work, ignore_errors=True)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def calculate(expression: str):
    """The value of an arithmetic expression (ValueError / ZeroDivisionError on anything else)."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 1e6):
                raise ValueError("power too large")
            result = _OPS[type(node.op)](a, b)
            if abs(result) > 1e30:
                raise ValueError("result too large")
            return result
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression.strip()!r}") from None
    result = value(tree.body)
    return int(result) if isinstance(result, float) and result.is_integer() else result


class _AnswerTool:
    """Shared by the two tools: the record's answer, and a final answer's reward."""

    def reset(self, record: dict):
        if "answer" not in record:
            raise ValueError(f"the record has no \"answer\" field (it has: {', '.join(record)})")
        self.answer = str(record["answer"]).strip()
        self.calls = 0
        return record["prompt"]

    def final(self, completion: str) -> tuple[str, float, bool]:
        return "", float(completion.strip() == self.answer), True


class Calculator(_AnswerTool):
    """`calc EXPRESSION` -> " = VALUE\\n"; anything else is the final answer."""

    CALL = re.compile(r"\s*calc\s+(.+?)\s*", re.DOTALL)

    def step(self, completion: str) -> tuple[str, float, bool]:
        call = self.CALL.fullmatch(completion)
        if call is None:
            return self.final(completion)
        self.calls += 1
        try:
            return f" = {calculate(call.group(1))}\n", 0.0, False
        except (ValueError, ZeroDivisionError, OverflowError) as e:
            return f" = error: {e}\n", 0.0, False


class PythonTool(_AnswerTool):
    """A ```python block -> its output in the sandbox (`run_python`); anything else is the final answer."""

    CALL = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)
    timeout_s, memory_mb, max_output = 2.0, 256, 1000

    def step(self, completion: str) -> tuple[str, float, bool]:
        call = self.CALL.search(completion)
        if call is None:
            return self.final(completion)
        self.calls += 1
        result = run_python(call.group(1), self.timeout_s, self.memory_mb, self.max_output)
        self.reason = result.reason
        return f"\n```output\n{result.output.rstrip()}\n```\n", 0.0, False
