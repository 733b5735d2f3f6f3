"""The training loop.

One optimizer step = `global_batch` sequences, run as `global_batch / micro_batch` forward/backward
passes whose gradients accumulate. The loss is the mean token loss over the whole global batch: each
micro-batch contributes its summed token loss divided by the global token count, so accumulation is
exact and independent of the micro-batch size.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import lzma
import math
import resource
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

from loom import flops
from loom.config import Config
from loom.data.loader import batch, build_datasets, load_tokenizer
from loom.errors import TrainingDiverged, UserError
from loom.models.llama import build_model
from loom.parallel import build_layout, parallelize
from loom.parallel.data import set_gradient_sync
from loom.parallel.tensor import loss_context
from loom.train.checkpoint import Checkpointer, TrainState, latest_checkpoint
from loom.train.hang import Beacon
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
    """Summed cross-entropy over all tokens, computed in fp32 (on vocabulary shards under TP)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def init_distributed(device: torch.device, timeout_s: float | None = None) -> None:
    """Join the process group when started by the launcher (torchrun sets WORLD_SIZE etc.).

    A collective that waits longer than `timeout_s` raises instead of hanging.
    """
    from datetime import timedelta

    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)


def _all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a (replicated) DTensor result such as the vocabulary-parallel loss."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clip_grad_norm(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Global gradient norm over every shard of every parameter; clip to max_norm (0: no clipping).

    With pipeline parallelism each rank holds some stages: squared norms are summed over `pp_group`.
    """
    params = [p for p in parameters if p.grad is not None]
    # Group by mesh: sharded (DTensor) gradients need their shards' norms combined across ranks;
    # plain gradients (replicated parameters such as norms under TP without SP) are whole on every rank.
    groups: dict = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [_local(torch.nn.utils.get_total_norm([p.grad for p in group])) for group in groups.values()]
    norm = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if pp_group is not None:
        norm = _all_reduce_sum(norm.double() ** 2, pp_group).sqrt().float()
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


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
        init_distributed(self.device, t.collective_timeout_s)
        self.beacon = Beacon(t.collective_timeout_s)
        # From here on every rank takes part in collectives (mesh groups, loading a checkpoint): one that
        # hangs becomes an error naming the rank that did not arrive, as in training.
        with self.beacon.naming_hangs():
            self._set_up(cfg)

    def _set_up(self, cfg: Config) -> None:
        t = cfg.train
        self.layout = build_layout(cfg, self.device.type)
        if self.device.type == "cuda" and self.layout.distributed:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.is_main = self.layout.is_main
        compute_dtype = torch.bfloat16 if t.dtype == "bfloat16" else None
        # bf16 compute: FSDP2 casts parameters per block when data-parallel, else autocast does it.
        self.autocast_dtype = compute_dtype if self.layout.dp_size == 1 else None

        # A worker restarted by the elastic launcher (--max-restarts) continues from the latest checkpoint.
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        resume = cfg.checkpoint.resume or restarted
        resume_from = latest_checkpoint(self.ckpt_root) if resume else None
        if not resume and self.ckpt_root.is_dir() and any(self.ckpt_root.iterdir()):
            raise UserError(
                f"{self.run_dir} already holds checkpoints; pass --checkpoint.resume=true to continue that run "
                "or choose another --run-dir (nothing was changed)"
            )

        self.tokenizer = load_tokenizer(cfg)
        self.train_data, self.val_data = build_datasets(cfg, self.tokenizer)

        torch.manual_seed(t.seed)
        # Every rank builds the same full model from the seed; parallelize keeps each rank's shards.
        model = build_model(cfg.model, device=self.device, seed=t.seed)
        model.train()
        self.layer_plan = None
        if cfg.recompute.mode == "budget":
            from loom.memory import plan_budget

            measure_on = self.device if self.layout.tp > 1 else "meta"
            self.layer_plan = plan_budget(cfg, self.layout, measure_on)["plan"]
        self.schedule = None
        if self.layout.pp > 1:
            self._setup_pipeline(model, compute_dtype)
        else:
            self.model = parallelize(model, self.layout, cfg, compute_dtype, self.layer_plan)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        # Forward and loss as one function, so that compilation can fuse the loss into the head.
        self.loss_sum = torch.compile(self._loss_sum) if t.compile else self._loss_sum

        self.state = TrainState()
        self.skipped_steps = self.skipped_in_a_row = 0
        self.stop_signal: int | None = None
        self.tokenizer_path = self.run_dir / "tokenizer.json"
        group = None
        if self.layout.distributed:  # checkpoint collectives get their own gloo group (async saves run them
            import torch.distributed as dist  # in a background thread, beside training's collectives)
            from datetime import timedelta

            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=t.collective_timeout_s))
        self.checkpointer = Checkpointer(self.ckpt_root, self.model, self.optimizer, cfg, self.tokenizer_path, group)
        if resume_from is not None:  # checked and loaded before anything in the run directory changes
            resume_from = self._resume(resume_from)
        self.resumed_from = resume_from
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.tokenizer.save(self.tokenizer_path)
            (self.run_dir / "config.toml").write_text(cfg.to_toml())

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

    def _resume(self, latest: Path) -> Path:
        """Load `latest`; with checkpoint.fallback, a damaged one gives way to the newest older complete one."""
        from loom.train.checkpoint import list_checkpoints, verify_everywhere

        candidates = [latest]
        if self.cfg.checkpoint.fallback:
            candidates += [p for p in reversed(list_checkpoints(self.ckpt_root)) if p != latest]
        self.beacon.mark("checkpoint load")
        for i, path in enumerate(candidates):
            try:
                if i + 1 < len(candidates):
                    verify_everywhere(path)  # before loading anything; load verifies again
                self.state = self.checkpointer.load(path)
                if i and self.is_main:
                    print(f"checkpoint {latest} is damaged; resumed from {path} (checkpoint.fallback=true)",
                          file=sys.stderr)
                return path
            except UserError:
                if i + 1 == len(candidates):
                    raise
        raise AssertionError("unreachable")

    def _setup_pipeline(self, model, compute_dtype) -> None:
        from loom.parallel.pipeline import RankView, build_schedule, split_stages

        cfg, layout, t = self.cfg, self.layout, self.cfg.train
        chunks, ids = split_stages(model, cfg, layout.pp_rank)
        self.chunks, self.stage_ids = chunks, ids
        for chunk in chunks:
            parallelize(chunk, layout, cfg, compute_dtype, self.layer_plan)
        self.model = RankView(chunks)
        self.model.pp_size = layout.pp
        num_stages = cfg.parallel.pp * cfg.parallel.vpp
        self.has_first, self.has_last = 0 in ids, num_stages - 1 in ids
        self.n_micro = t.global_batch // (layout.dp_size * t.micro_batch)
        self.loss_scale = 1.0
        self.pp_group = layout.submesh("pp").get_group()
        self.schedule, self.stages = build_schedule(chunks, ids, cfg, self.pp_group, self.device, self.n_micro,
                                                    self._pipeline_loss)

    def _pipeline_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return token_loss_sum(logits, y) * self.loss_scale

    def _pipeline_step(self, x, y) -> torch.Tensor:
        """One schedule step over this rank's batch; the summed token loss (0 off the last stage)."""
        from loom.parallel.pipeline import WaitTimer

        losses: list = []
        args = (x,) if self.has_first else ()
        kwargs = {"target": y, "losses": losses} if self.has_last else {}
        WaitTimer.seconds = 0.0
        t0 = time.perf_counter()
        with self._autocast():
            self.schedule.step(*args, **kwargs)
        elapsed = time.perf_counter() - t0
        # Bubble: time blocked on pipeline transfers over time computing, averaged over ranks.
        bubble = torch.tensor(WaitTimer.seconds / max(elapsed - WaitTimer.seconds, 1e-9), device=self.device)
        self.last_bubble = (_all_reduce_sum(bubble) / self.layout.world_size).item()
        if not losses:
            return torch.zeros((), device=self.device)
        return sum(_local(loss).detach() for loss in losses) / self.loss_scale

    def _pipeline_eval(self, x, y) -> torch.Tensor:
        from loom.parallel.pipeline import forward_through_stages

        with self._autocast():
            logits = forward_through_stages(self.chunks, self.stage_ids, self.cfg, self.pp_group, x)
        loss = _local(token_loss_sum(logits, y)).detach() if logits is not None else torch.zeros((), device=self.device)
        return _all_reduce_sum(loss, self.pp_group)  # only the last stage has it

    def _loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            logits = self.model(x)
        return token_loss_sum(logits, y)

    def train_step(self) -> dict:
        t, layout = self.cfg.train, self.layout
        total_tokens = self.tokens_per_step
        lr = lr_at(self.state.step, self.cfg.optim, t.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # This data-parallel rank's slice of the global batch, as micro-batches.
        per_rank = t.global_batch // layout.dp_size
        start = self.state.consumed_samples + layout.dp_rank * per_rank
        # Data-parallel reduction averages gradients over ranks; scale so the result is the sum.
        scale = layout.dp_size / total_tokens
        if self.schedule is not None:  # the pipeline schedule runs the micro-batches itself
            x, y = batch(self.train_data, start, per_rank)
            self.loss_scale = scale
            with loss_context(layout.tp):
                loss_sum = self._pipeline_step(x.to(self.device), y.to(self.device))
        else:
            loss_sum = torch.zeros((), device=self.device)
            n_micro = per_rank // t.micro_batch
            for m in range(n_micro):
                x, y = batch(self.train_data, start + m * t.micro_batch, t.micro_batch)
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                set_gradient_sync(self.model, m == n_micro - 1)
                with loss_context(layout.tp):
                    micro_loss = self.loss_sum(x, y)
                    (micro_loss * scale).backward()
                loss_sum += _local(micro_loss).detach()
        grad_norm = clip_grad_norm(self.model.parameters(), t.grad_clip,
                                   self.pp_group if self.schedule is not None else None)
        # Every rank of a TP group holds the same loss: sum over all ranks, divide by tp.
        loss = (_all_reduce_sum(loss_sum) / layout.tp / total_tokens).item()
        finite = math.isfinite(loss) and math.isfinite(grad_norm.item())  # same verdict on every rank
        if finite:
            self.optimizer.step()
            self.skipped_in_a_row = 0
        else:  # skip the update; the batch counts as consumed
            self.skipped_steps += 1
            self.skipped_in_a_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.consumed_samples += t.global_batch
        out = {"loss": loss, "grad_norm": grad_norm.item(), "lr": lr, "skipped_steps": self.skipped_steps}
        if self.schedule is not None:
            out["pipeline_bubble"] = self.last_bubble
        return out

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
        # Every rank scores the whole held-out set (all ranks of a layout take part in each forward).
        for start in range(0, len(self.val_data), mb):
            x, y = batch(self.val_data, start, min(mb, len(self.val_data) - start))
            x, y = x.to(self.device), y.to(self.device)
            with loss_context(self.layout.tp):
                if self.schedule is not None:
                    total += self._pipeline_eval(x, y).item()
                else:
                    total += _local(self.loss_sum(x, y)).item()
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

    def save(self) -> float:
        """Checkpoint the current step; the seconds the step loop was blocked (all of a synchronous save)."""
        self.beacon.mark(f"step {self.state.step}: checkpoint save")
        return self.checkpointer.save(self.state)

    def fit(self) -> dict:
        """Train to train.steps; a timed-out collective becomes a CollectiveTimeout naming the ranks behind."""
        with self.beacon.naming_hangs():
            return self._fit()

    def _fit(self) -> dict:
        t, ck = self.cfg.train, self.cfg.checkpoint
        resumed = self.resumed_from is not None
        metrics = MetricsWriter(self.run_dir, self.state.step if resumed else None, self.cfg.log.tensorboard,
                                enabled=self.is_main)
        progress = Progress(self.cfg.log.progress, t.steps, self.state.step, t.log_interval,
                            enabled=not self.quiet and self.is_main)
        if resumed:
            progress.message(f"resumed from {self.resumed_from} at step {self.state.step}")
        last_eval: dict = {}
        self.stopped_at = None

        def on_signal(signum, frame):
            if self.stop_signal is not None:  # asked twice: stop now
                raise KeyboardInterrupt
            self.stop_signal = signum

        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, on_signal)
        try:
            while self.state.step < t.steps:
                self.beacon.mark(f"step {self.state.step + 1}: train")
                t0 = time.perf_counter()
                out = self.train_step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                tps = self.tokens_per_step / dt
                tflops = tps * self.flops_per_token / 1e12 / self.layout.world_size  # per device
                row = {
                    "step": self.state.step, **out, "tokens": self.state.consumed_samples * t.seq_len,
                    "tokens_per_s": tps, "tflops_per_device": tflops,
                    "mfu": tflops / self.peak_tflops if self.peak_tflops else None,
                    "memory_gib": self.memory_gib(), "step_time_s": dt,
                }
                if self.skipped_in_a_row >= t.max_skipped_consecutive:
                    metrics.write(row)
                    progress.update(row)
                    self.checkpointer.wait()  # the last good checkpoint, if still being written, is kept
                    raise TrainingDiverged(self.diagnose())
                last = self.state.step == t.steps
                evaluate = (t.eval_interval and self.state.step % t.eval_interval == 0) or last
                if evaluate:
                    self.beacon.mark(f"step {self.state.step}: evaluation")
                    last_eval = {"step": self.state.step, **self.evaluate()}
                stop = self._stop_requested()
                if (ck.interval and self.state.step % ck.interval == 0) or (last and ck.save_final) or stop:
                    row["checkpoint_blocking_s"] = self.save()
                metrics.write(row)
                progress.update(row)
                if evaluate:
                    metrics.write(last_eval)
                    progress.message(
                        f"eval step {self.state.step}: val_loss {last_eval['val_loss']:.4f}  val_bpb "
                        f"{last_eval['val_bpb']:.3f}  (gzip {last_eval['gzip_bpb']:.3f}, xz {last_eval['xz_bpb']:.3f})"
                    )
                # A checkpoint becomes `latest` only after this step's rows are written, so a run killed at
                # any moment resumes with metrics.jsonl complete up to the checkpoint's step. A synchronous
                # save commits here; an asynchronous one at the first step after its write finished.
                self.checkpointer.poll()
                if stop:
                    self.checkpointer.wait()
                    self.stopped_at = self.state.step
                    if self.is_main:  # always shown, whatever the progress setting
                        print(f"stopped by signal {self.stop_signal or 'on another rank'} after step "
                              f"{self.state.step}; checkpoint saved. Resume with: loom train --config "
                              f"{self.cfg.name} --run-dir {self.run_dir} --checkpoint.resume=true",
                              file=sys.stderr, flush=True)
                    break
            self.checkpointer.wait()  # the last checkpoint is complete before the run ends
        finally:
            progress.close()
            metrics.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return last_eval

    def _stop_requested(self) -> bool:
        """A SIGTERM/SIGINT arrived (on any rank): every rank stops after the same step."""
        flag = torch.tensor(1.0 if self.stop_signal is not None else 0.0, device=self.device)
        if self.layout.distributed:
            self.beacon.mark(f"step {self.state.step}: stop check")
            import torch.distributed as dist

            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def diagnose(self) -> str:
        """Where the run went non-finite: non-finite parameters, and the first module whose forward
        output is non-finite on the current batch (this rank's view; the main rank reports)."""
        rank = self.layout.rank
        bad = [n for n, p in self.model.named_parameters() if not torch.isfinite(_local(p.detach())).all()]
        first = None
        if self.schedule is None:
            hooks = []

            def check(name):
                def hook(module, inputs, output):
                    nonlocal first
                    out = output[0] if isinstance(output, tuple) else output
                    if first is None and torch.is_tensor(out) and not torch.isfinite(_local(out.detach())).all():
                        first = name
                return hook

            for name, module in self.model.named_modules():
                if name:
                    hooks.append(module.register_forward_hook(check(name)))
            x, _ = batch(self.train_data, max(0, self.state.consumed_samples - self.cfg.train.global_batch),
                         self.cfg.train.micro_batch)
            with torch.no_grad(), self._autocast():
                self.model(x.to(self.device))
            for h in hooks:
                h.remove()
        where = (f"first non-finite output: {first}" if first else "forward outputs finite on the last batch")
        params = f"non-finite parameters: {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}" if bad else \
            "all parameters finite (the gradients or the loss overflowed)"
        return (f"stopped after {self.skipped_in_a_row} consecutive steps with a non-finite loss or gradient norm "
                f"(train.max_skipped_consecutive={self.cfg.train.max_skipped_consecutive}), at step {self.state.step}, "
                f"rank {rank}: {where}; {params}. Lower optim.lr, check the data, or resume from an earlier checkpoint")
