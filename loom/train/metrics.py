"""Where a run reports: `metrics.jsonl`, TensorBoard scalars, Weights & Biases (`log.wandb`,
loom/train/tracking.py), and a progress display.

`metrics.jsonl` gets one JSON object per optimizer step (contract keys: step, loss, grad_norm, lr,
tokens, tokens_per_s, tflops_per_device, mfu, memory_gib; plus checkpoint_blocking_s on steps that
save; with MoE layers moe_load_balance_loss, moe_z_loss, moe_imbalance, moe_imbalance_max, moe_dropped)
and one per evaluation (step, val_loss, val_bpb, gzip_bpb, xz_bpb). On resume, rows past the resumed step are dropped so the file reads as one
uninterrupted run.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path


def _row_step(line: str) -> float:
    """The step of a metrics line; a line cut short by a crash sorts after every step (dropped)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


def hms(seconds: float) -> str:
    """Seconds as h:mm:ss."""
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class MetricsWriter:
    def __init__(self, run_dir: Path, resume_step: int | None, tensorboard: bool, enabled: bool = True,
                 config=None):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.file = None
        self.tb = None
        self.tracker = None
        if not enabled:  # only the main rank writes
            return
        if config is not None and config.log.wandb:  # imported only when asked for: wandb is an optional extra
            from loom.train.tracking import WandbTracker

            self.tracker = WandbTracker(config, run_dir, resumed=resume_step is not None)
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            keep = [ln for ln in self.path.read_text().splitlines() if _row_step(ln) <= resume_step]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        self.file = open(self.path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is optional
                self.tb = None

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and value is not None:
                    self.tb.add_scalar(key, value, row["step"])
        if self.tracker is not None:
            self.tracker.log(row)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.tracker is not None:
            self.tracker.close()


def recipe_summary(row: dict) -> str:
    """The post-training part of a progress line: DPO's pair accuracy and margin, a reward model's accuracy,
    RL's mean reward, its spread and the response length (empty for pre-training and SFT)."""
    if "reward_std" in row:  # RL
        return (f"  reward {row['reward']:.3f} (std {row['reward_std']:.3f})  response {row['response_length']:.1f} "
                f"tokens" + (f", {row['stopped']:.0%} stopped" if "stopped" in row else ""))
    if "accuracy" in row:  # DPO / IPO / reward model
        margin = f"  margin {row['margin']:.3f}" if "margin" in row else ""
        return f"  accuracy {row['accuracy']:.3f}{margin}"
    return ""


def moe_summary(row: dict) -> str:
    """The mixture-of-experts part of a progress line (empty for a dense model)."""
    if "moe_imbalance" not in row:
        return ""
    return (f"  moe aux {row['moe_load_balance_loss']:.3f} z {row['moe_z_loss']:.2f} imbalance "
            f"{row['moe_imbalance']:.2f} (max {row['moe_imbalance_max']:.2f}) dropped {row['moe_dropped']:.1%}")


class Progress:
    """A rich progress bar on a terminal, plain lines otherwise (or nothing)."""

    def __init__(self, mode: str, total: int, start: int, log_interval: int, enabled: bool = True):
        self.total, self.log_interval = total, log_interval
        self.enabled = enabled and mode != "none"
        self.bar = None
        self.t0 = time.perf_counter()
        self.start_step = start
        if self.enabled and (mode == "rich" or (mode == "auto" and sys.stderr.isatty())):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress
            from rich.progress import TextColumn, TimeRemainingColumn

            self.bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                TimeRemainingColumn(), transient=False,
            )
            self.task = self.bar.add_task("train", total=total, completed=start, loss=float("nan"), tps=0.0)
            self.bar.start()

    def update(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=row["step"], loss=row["loss"], tps=row["tokens_per_s"])
        elif (row["step"] % self.log_interval == 0 or row["step"] == self.total
              or row["step"] == self.start_step + 1):  # the first step shows at once
            done = row["step"] - self.start_step
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(done, 1) * (self.total - row["step"])
            print(
                f"step {row['step']:>6}/{self.total}  loss {row['loss']:.4f}  grad_norm {row['grad_norm']:.3f}  "
                f"lr {row['lr']:.2e}  {row['tokens_per_s']:,.0f} tok/s  eta {hms(eta)}{recipe_summary(row)}{moe_summary(row)}",
                flush=True,
            )

    def evaluation(self, row: dict) -> None:
        if "val_reward" in row:  # RL: greedy completions of the held-out prompts, scored by the run's reward
            self.message(f"eval step {row['step']}: val_reward {row['val_reward']:.4f} (held-out prompts, greedy), "
                         f"{row['val_reward_sampled']:.4f} (sampled)")
            return
        if "val_bpb" not in row:  # SFT: the loss over the held-out responses only
            self.message(f"eval step {row['step']}: val_loss {row['val_loss']:.4f} (held-out response tokens)")
            return
        self.message(f"eval step {row['step']}: val_loss {row['val_loss']:.4f}  val_bpb {row['val_bpb']:.3f}  "
                     f"(gzip {row['gzip_bpb']:.3f}, xz {row['xz_bpb']:.3f})")

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class Reporter:
    """One step's rows and messages: metrics.jsonl / TensorBoard, the progress line, and announcements
    (a checkpoint saved, a full pass over the training data)."""

    def __init__(self, metrics: MetricsWriter, progress: Progress, ckpt_root: Path, async_save: bool,
                 epochs: dict[int, str]):
        self.metrics, self.progress, self.ckpt_root = metrics, progress, ckpt_root
        self.async_save, self.epochs = async_save, epochs

    def step(self, row: dict, evaluation: dict | None = None) -> None:
        step = row["step"]
        self.metrics.write(row)
        self.progress.update(row)
        if "checkpoint_blocking_s" in row:
            how = "writing in the background" if self.async_save else "saved"
            self.progress.message(f"step {step}: checkpoint {self.ckpt_root / f'step-{step}'} ({how})")
        if step in self.epochs:
            self.progress.message(f"step {step}: {self.epochs[step]}")
        if evaluation:
            self.metrics.write(evaluation)
            self.progress.evaluation(evaluation)

    def close(self) -> None:
        self.progress.close()
        self.metrics.close()
