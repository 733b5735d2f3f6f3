"""Run control: resuming, signals, when to checkpoint, and what to say when a run diverges or stops.

Everything here decides *whether* and *when*; the step runners (steps.py) decide *how* a step runs.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
from pathlib import Path

import torch

from loom.config import Config
from loom.errors import UserError
from loom.parallel.distributed import full_tensor
from loom.train.checkpoint import Checkpointer, TrainState, list_checkpoints, verify_everywhere

STOP_RECORD = "stopped.json"  # the main rank writes it after a signal stop's checkpoint is complete (launch.py reads it)


def resume(checkpointer: Checkpointer, latest: Path, root: Path, fallback: bool, is_main: bool) -> tuple[TrainState, Path]:
    """Load `latest`; with checkpoint.fallback, a damaged one gives way to the newest older complete one."""
    candidates = [latest]
    if fallback:
        candidates += [p for p in reversed(list_checkpoints(root)) if p != latest]
    for i, path in enumerate(candidates):
        try:
            if i + 1 < len(candidates):
                verify_everywhere(path)  # before loading anything; load verifies again
            state = checkpointer.load(path)
            if i and is_main:
                print(f"checkpoint {latest} is damaged; resumed from {path} (checkpoint.fallback=true)",
                      file=sys.stderr)
            return state, path
        except UserError:
            if i + 1 == len(candidates):
                raise
    raise AssertionError("unreachable")


class RunControl:
    """Signals (SIGTERM/SIGINT finish the step, checkpoint and stop), the checkpoint interval, and the
    stop after `train.max_skipped_consecutive` non-finite steps."""

    def __init__(self, cfg: Config, layout, device: torch.device):
        self.cfg, self.layout, self.device = cfg, layout, device
        self.stop_signal: int | None = None
        self.skipped_steps = self.skipped_in_a_row = 0

    @contextlib.contextmanager
    def signals(self):
        """While training, a first SIGTERM/SIGINT asks for a stop after the current step; a second stops now."""

        def on_signal(signum, frame):
            if self.stop_signal is not None:
                raise KeyboardInterrupt
            self.stop_signal = signum

        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def stop_requested(self, beacon, step: int) -> bool:
        """A SIGTERM/SIGINT arrived (on any rank): every rank stops after the same step."""
        flag = torch.tensor(1.0 if self.stop_signal is not None else 0.0, device=self.device)
        if self.layout.distributed:
            beacon.mark(f"step {step}: stop check")
            import torch.distributed as dist

            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def count_step(self, finite: bool) -> None:
        """Book a step: a non-finite one is skipped (no update; its batch counts as consumed)."""
        if finite:
            self.skipped_in_a_row = 0
        else:
            self.skipped_steps += 1
            self.skipped_in_a_row += 1

    @property
    def diverged(self) -> bool:
        return self.skipped_in_a_row >= self.cfg.train.max_skipped_consecutive

    def save_due(self, step: int, stop: bool) -> bool:
        ck = self.cfg.checkpoint
        last = step == self.cfg.train.steps
        return bool((ck.interval and step % ck.interval == 0) or (last and ck.save_final) or stop)

    def eval_due(self, step: int) -> bool:
        t = self.cfg.train
        return bool((t.eval_interval and step % t.eval_interval == 0) or step == t.steps)

    def diagnose(self, model, runner, batch, step: int) -> str:
        """Where the run went non-finite: non-finite parameters, and the first module whose forward
        output is non-finite on `batch` (this rank's view; the main rank reports)."""
        bad = [n for n, p in model.named_parameters() if not torch.isfinite(full_tensor(p.detach())).all()]
        first = runner.first_non_finite(batch)
        where = f"first non-finite output: {first}" if first else "forward outputs finite on the last batch"
        params = (f"non-finite parameters: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}" if bad else
                  "all parameters finite (the gradients or the loss overflowed)")
        limit = self.cfg.train.max_skipped_consecutive
        return (f"stopped after {self.skipped_in_a_row} consecutive steps with a non-finite loss or gradient norm "
                f"(train.max_skipped_consecutive={limit}), at step {step}, rank {self.layout.rank}: {where}; "
                f"{params}. Lower optim.lr, check the data, or resume from an earlier checkpoint")


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)
