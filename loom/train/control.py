"""Run control: resuming, signals and early exits, when to checkpoint, and what to say when a run diverges or
stops.

Everything here decides *whether* and *when*; the step runners (steps.py) decide *how* a step runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from loom.config import Config
from loom.errors import UserError
from loom.parallel.distributed import full_tensor
from loom.train.checkpoint import Checkpointer, TrainState, list_checkpoints, verify_everywhere

STOP_RECORD = "stopped.json"  # the main rank writes it after an early stop's checkpoint is complete (launch.py)
LAUNCHED_AT = "LOOM_LAUNCHED_AT"  # the launcher's start (time.time()), passed to its workers: train.exit_after_minutes


def launch_time() -> float:
    """When this launch began: the launcher's clock when it started workers, else now."""
    return float(os.environ.get(LAUNCHED_AT) or time.time())


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


def resume_note(saved_steps: int, cfg: Config, step: int) -> str:
    """What a resume with another train.steps than the checkpoint's run does, in words ("" for the same)."""
    new, o = cfg.train.steps, cfg.optim
    if new == saved_steps:
        return ""
    lr = ""
    if o.decay != "constant" and not o.decay_steps:  # lr_at decays over train.steps - warmup
        old_decay, new_decay = max(1, saved_steps - o.warmup_steps), max(1, new - o.warmup_steps)
        lr = (f"; the learning rate now decays over {new_decay} steps, not {old_decay} (set "
              f"optim.decay_steps={old_decay} to keep the checkpoint's schedule)")
    if new > saved_steps:
        return (f"note: train.steps={new} extends the checkpoint's run of {saved_steps} steps: steps {step + 1}..{new} "
                f"read what a run planned for {new} steps reads (the data order does not depend on train.steps){lr}")
    if step >= new:
        return (f"note: train.steps={new} shrinks the checkpoint's run of {saved_steps} steps, and the checkpoint is "
                f"at step {step}: nothing is left to train")
    return (f"note: train.steps={new} shrinks the checkpoint's run of {saved_steps} steps: it now stops after step "
            f"{new}; steps {step + 1}..{new} read what they would have read{lr}")


class RunControl:
    """Signals (SIGTERM/SIGINT finish the step, checkpoint and stop), the early exits (`train.exit_after_minutes`,
    `train.exit_after_steps`: the same), the checkpoint interval, and the stop after
    `train.max_skipped_consecutive` non-finite steps."""

    def __init__(self, cfg: Config, layout, device: torch.device, started: float | None = None):
        """`started`: when this launch began (time.time(); `launch_time`), for train.exit_after_minutes."""
        self.cfg, self.layout, self.device = cfg, layout, device
        self.started = time.time() if started is None else started
        self.stop_signal: int | None = None
        self.stop_reason = ""  # why the run stops early, in words
        self.steps_taken = 0  # by this launch
        self.skipped_steps = self.skipped_in_a_row = 0
        self.folded: tuple[bool, bool] | None = None  # (signal, late) on any rank, from the step's all-reduce

    def _late(self) -> tuple[bool, float]:
        t = self.cfg.train
        minutes = (time.time() - self.started) / 60
        return bool(t.exit_after_minutes) and minutes >= t.exit_after_minutes, minutes

    def local_flags(self) -> list[float]:
        """This rank's stop flags (a signal arrived; train.exit_after_minutes reached), for the trainer to sum over
        the ranks in the step's one all-reduce, with the loss (`fold_flags`): the stop check costs no collective
        and no host synchronisation of its own."""
        return [float(self.stop_signal is not None), float(self._late()[0])]

    def fold_flags(self, summed: list[float]) -> None:
        """The flags of `local_flags` summed over every rank: (any rank got a signal, any rank is late)."""
        self.folded = (summed[0] > 0, summed[1] > 0)

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
        """Whether to stop after `step`: a SIGTERM/SIGINT arrived, or this launch reached train.exit_after_minutes
        (on any rank), or train.exit_after_steps (the same count on every rank). Every rank stops after the same
        step; the last step of the run is no early exit. Under several ranks the verdict is the flags the step's
        all-reduce carried (`fold_flags`: a signal that arrives after it stops the run after the next step); a
        step that made no optimizer step (an RL step with nothing to learn from) checks in a collective of its own."""
        t = self.cfg.train
        self.steps_taken += 1
        late, minutes = self._late()
        signalled = self.stop_signal is not None
        if self.layout.distributed:
            if self.folded is None:
                beacon.mark(f"step {step}: stop check")
                import torch.distributed as dist

                flags = torch.tensor(self.local_flags(), device=self.device)
                dist.all_reduce(flags)
                self.fold_flags(flags.tolist())
            (signalled, late), self.folded = self.folded, None
        if signalled:
            self.stop_reason = f"signal {self.stop_signal or 'on another rank'}"
        elif step >= t.steps:
            return False
        elif late:
            on_this = bool(t.exit_after_minutes) and minutes >= t.exit_after_minutes
            self.stop_reason = (f"train.exit_after_minutes={t.exit_after_minutes:g} ({minutes:.2f} minutes since the "
                                f"launch{'' if on_this else ' on this rank; reached on another'})")
        elif t.exit_after_steps and self.steps_taken >= t.exit_after_steps:
            self.stop_reason = f"train.exit_after_steps={t.exit_after_steps} ({self.steps_taken} steps in this launch)"
        else:
            return False
        return True

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
