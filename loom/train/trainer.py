"""The training loop.

One optimizer step = `global_batch` sequences, run as `global_batch / micro_batch` forward/backward
passes whose gradients accumulate. The loss is the mean token loss over the whole global batch: each
micro-batch contributes its summed token loss divided by the global token count, so accumulation is
exact and independent of the micro-batch size.
"""

from __future__ import annotations

import contextlib
import gzip
import lzma
import math
import resource
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from loom import flops
from loom.config import Config
from loom.data.loader import batch, build_datasets, load_tokenizer
from loom.errors import UserError
from loom.models.llama import build_model
from loom.train.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
from loom.train.metrics import MetricsWriter, Progress
from loom.train.optim import build_optimizer
from loom.train.schedule import lr_at


def default_run_dir(cfg: Config) -> Path:
    return Path("runs") / f"{cfg.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device=cuda but no CUDA device is available; valid here: cpu, auto")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over all tokens, computed in fp32."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path | None = None, quiet: bool = False):
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else default_run_dir(cfg)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.quiet = quiet
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = pick_device(t.device)
        self.autocast_dtype = torch.bfloat16 if t.dtype == "bfloat16" else None

        resume_from = latest_checkpoint(self.ckpt_root) if cfg.checkpoint.resume else None
        if not cfg.checkpoint.resume and self.ckpt_root.is_dir() and any(self.ckpt_root.iterdir()):
            raise UserError(
                f"{self.run_dir} already holds checkpoints; pass --checkpoint.resume=true to continue that run "
                "or choose another --run-dir (nothing was changed)"
            )

        self.tokenizer = load_tokenizer(cfg)
        self.train_data, self.val_data = build_datasets(cfg, self.tokenizer)

        torch.manual_seed(t.seed)
        self.model = build_model(cfg.model, device=self.device, seed=t.seed)
        self.model.train()
        self.optimizer = build_optimizer(self.model, cfg.optim)
        # Forward and loss as one function, so that compilation can fuse the loss into the head.
        self.loss_sum = torch.compile(self._loss_sum) if t.compile else self._loss_sum

        self.state = TrainState()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer_path = self.run_dir / "tokenizer.json"
        if not self.tokenizer_path.exists():
            self.tokenizer.save(self.tokenizer_path)
        (self.run_dir / "config.toml").write_text(cfg.to_toml())
        if resume_from is not None:
            self.state = load_checkpoint(resume_from, self.model, self.optimizer, cfg)
        self.resumed_from = resume_from

        self.tokens_per_step = t.global_batch * t.seq_len
        self.flops_per_token = flops.train_flops_per_token(cfg.model, t.seq_len)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.peak_tflops = flops.device_peak_tflops(name)
        self._val_reference = None

    # --- one step ---------------------------------------------------------------------------------

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(x)
        return token_loss_sum(logits, y)

    def train_step(self) -> dict:
        t = self.cfg.train
        start = self.state.consumed_samples
        total_tokens = self.tokens_per_step
        lr = lr_at(self.state.step, self.cfg.optim, t.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for m in range(t.global_batch // t.micro_batch):
            x, y = batch(self.train_data, start + m * t.micro_batch, t.micro_batch)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            micro_loss = self.loss_sum(x, y)
            (micro_loss / total_tokens).backward()
            loss_sum += micro_loss.detach()
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.consumed_samples += t.global_batch
        return {"loss": (loss_sum / total_tokens).item(), "grad_norm": grad_norm.item(), "lr": lr}

    # --- evaluation -------------------------------------------------------------------------------

    def val_reference(self) -> dict:
        """Bits per byte of gzip -9 and xz -9 on exactly the held-out bytes the model is scored on."""
        if self._val_reference is None:
            text = b"".join(self.tokenizer.token_bytes(self.val_data[i][1:].tolist()) for i in range(len(self.val_data)))
            self._val_reference = {
                "bytes": len(text),
                "gzip_bpb": 8 * len(gzip.compress(text, compresslevel=9)) / len(text),
                "xz_bpb": 8 * len(lzma.compress(text, preset=9)) / len(text),
            }
        return self._val_reference

    @torch.no_grad()
    def evaluate(self) -> dict:
        ref = self.val_reference()
        was_training = self.model.training
        self.model.eval()
        total, count, mb = 0.0, 0, self.cfg.train.micro_batch
        for start in range(0, len(self.val_data), mb):
            x, y = batch(self.val_data, start, min(mb, len(self.val_data) - start))
            x, y = x.to(self.device), y.to(self.device)
            total += self.loss_sum(x, y).item()
            count += y.numel()
        self.model.train(was_training)
        return {
            "val_loss": total / count,
            "val_bpb": total / math.log(2) / ref["bytes"],
            "gzip_bpb": ref["gzip_bpb"],
            "xz_bpb": ref["xz_bpb"],
        }

    # --- the loop ---------------------------------------------------------------------------------

    def memory_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB

    def save(self) -> Path:
        return save_checkpoint(self.ckpt_root, self.model, self.optimizer, self.cfg, self.state,
                               self.tokenizer_path, self.cfg.checkpoint.keep_last)

    def fit(self) -> dict:
        t, ck = self.cfg.train, self.cfg.checkpoint
        resumed = self.resumed_from is not None
        metrics = MetricsWriter(self.run_dir, self.state.step if resumed else None, self.cfg.log.tensorboard)
        progress = Progress(self.cfg.log.progress, t.steps, self.state.step, t.log_interval, enabled=not self.quiet)
        if resumed:
            progress.message(f"resumed from {self.resumed_from} at step {self.state.step}")
        last_eval: dict = {}
        try:
            while self.state.step < t.steps:
                t0 = time.perf_counter()
                out = self.train_step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                tps = self.tokens_per_step / dt
                tflops = tps * self.flops_per_token / 1e12
                row = {
                    "step": self.state.step, **out, "tokens": self.state.consumed_samples * t.seq_len,
                    "tokens_per_s": tps, "tflops_per_device": tflops,
                    "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
                    "memory_gib": self.memory_gib(), "step_time_s": dt,
                }
                metrics.write(row)
                progress.update(row)
                if not math.isfinite(row["loss"]):
                    raise RuntimeError(f"loss became {row['loss']} at step {self.state.step}")
                last = self.state.step == t.steps
                if (t.eval_interval and self.state.step % t.eval_interval == 0) or last:
                    last_eval = {"step": self.state.step, **self.evaluate()}
                    metrics.write(last_eval)
                    progress.message(
                        f"eval step {self.state.step}: val_loss {last_eval['val_loss']:.4f}  val_bpb "
                        f"{last_eval['val_bpb']:.3f}  (gzip {last_eval['gzip_bpb']:.3f}, xz {last_eval['xz_bpb']:.3f})"
                    )
                if (ck.interval and self.state.step % ck.interval == 0) or (last and ck.save_final):
                    self.save()
        finally:
            progress.close()
            metrics.close()
        return last_eval
