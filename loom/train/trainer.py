"""The training loop.

One optimizer step = `global_batch` sequences, run as `global_batch / micro_batch` forward/backward
passes whose gradients accumulate. The loss is the mean over the whole global batch of what the loss
function counts (tokens for cross-entropy): each micro-batch contributes its summed loss divided by the
global count, so accumulation is exact and independent of the micro-batch size.

The parts, each small enough to read on its own:
- the recipe (recipe.py): what a subcommand trains (data, loss, model extension, set-up, step, evaluation),
  the only way a recipe changes the loop;
- set-up (`Trainer.__init__`): devices and process groups, data, model (loom/build.py), the step runner, the
  optimizer, checkpoints and resuming;
- `batch_step`: one optimizer step over the next global batch through the step runner (steps.py: plain SPMD
  or a pipeline schedule);
- evaluation (evaluate.py) and run control (control.py: signals, checkpoint interval, divergence);
- `fit`: the loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from loom import flops
from loom.build import build_in_layout, compute_dtype
from loom.config import Config
from loom.config.advice import run_advice
from loom.data.indexed import fingerprint
from loom.data.dataset import Dataset, first_passes
from loom.data.tokenizer import load_tokenizer
from loom.errors import TrainingDiverged, UserError
from loom.models.io import TOKENIZER_FILES, atomic_write_text, copy_tokenizer_files, read_config
from loom.models.lora import trainable_count
from loom.models.moe import stats_metrics, take_stats, update_router_biases
from loom.parallel import place_in_mesh, rng
from loom.parallel.distributed import all_reduce_sum, clip_grad_norm, init_distributed, pick_device
from loom.train.banner import banner
from loom.train.checkpoint import Checkpointer, TrainState, check_compatible, latest_checkpoint
from loom.train.control import STOP_RECORD, RunControl, is_finite, launch_time, resume, resume_note
from loom.train.evaluate import Evaluator
from loom.train.hang import Beacon
from loom.train.host_memory import keep_freed_memory, return_freed_memory
from loom.train.metrics import MetricsWriter, Progress, Reporter
from loom.train.optim import build_optimizer
from loom.train.recipe import Recipe
from loom.train.schedule import lr_at
from loom.train.steps import BatchPrefetcher, build_runner, to_device_async


def valid_source(cfg: Config, val_data: Dataset) -> str:
    """Where the held-out samples come from, in words."""
    if val_data.source:
        return val_data.source
    if cfg.data.valid_paths:
        return f"data.valid_paths ({', '.join(cfg.data.valid_paths)})"
    if not cfg.data.paths:
        return "the embedded corpus's held-out files (never trained on)"
    return f"data.paths ({', '.join(cfg.data.paths)})"


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path | None = None, quiet: bool = False,
                 recipe: Recipe | None = None):
        """`recipe`: what this run trains (recipe.py); pre-training's by default."""
        self.started = launch_time()  # train.exit_after_minutes counts from here (or from the launcher's start)
        self.recipe = recipe or Recipe()
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir else cfg.default_run_dir()
        # A run that fails on bad input before its first step leaves no directory behind it made (`fit`).
        self.made_run_dir = not self.run_dir.exists()
        self.ckpt_root = self.run_dir / "checkpoints"
        self.quiet = quiet
        self.recompute_note = ""  # recompute.mode=auto's plan, in words (loom.memory.describe_plan)
        self.prediction: dict | None = None  # parallel.layout=auto: the planner's figures, on every step row
        self.step_times: list[float] = []  # this process's steps' wall times (the layout=auto summary)
        self.loss = self.recipe.loss(cfg)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.device = pick_device(cfg.train.device)
        if self.device.type == "cpu":  # the C library's malloc, tuned for the run (host_memory.py):
            if cfg.parallel.dp_shard * cfg.parallel.cp > 1:  # sharded weights: gathered blocks go back to the kernel
                return_freed_memory()
            else:  # no page faults for every step's large buffers
                keep_freed_memory()
        init_distributed(self.device, cfg.train.collective_timeout_s, self.run_dir / "nccl-trace")
        self.beacon = Beacon(cfg.train.collective_timeout_s)
        # From here on every rank takes part in collectives (mesh groups, loading a checkpoint): one that
        # hangs becomes an error naming the rank that did not arrive, as in training.
        with self.beacon.naming_hangs():
            self._set_up(cfg)

    def _set_up(self, cfg: Config) -> None:
        t = cfg.train
        self.layout = place_in_mesh(cfg, self.device.type)
        if self.device.type == "cuda" and self.layout.distributed:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.is_main = self.layout.is_main

        # A worker restarted by the elastic launcher (--max-restarts) continues from the latest checkpoint.
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        resume_from = latest_checkpoint(self.ckpt_root) if cfg.checkpoint.resume or restarted else None
        if cfg.checkpoint.resume and resume_from is None and not restarted:
            raise UserError(
                f"checkpoint.resume=true but {self.ckpt_root} holds no checkpoint to resume from; check --run-dir "
                f"(it should be the directory of the run to continue) or drop --checkpoint.resume=true to start a "
                "new run (nothing was changed)"
            )
        # Partial `.tmp-*` / `.old-*` directories of a save killed before it committed are not checkpoints (the next
        # save removes them): a run killed before its first checkpoint starts again with the same command.
        saved = [p for p in self.ckpt_root.iterdir() if not p.name.startswith((".tmp-", ".old-"))] \
            if self.ckpt_root.is_dir() else []
        if not (cfg.checkpoint.resume or restarted) and saved:
            raise UserError(
                f"{self.run_dir} already holds checkpoints; pass --checkpoint.resume=true to continue that run "
                "or choose another --run-dir (nothing was changed)"
            )
        if resume_from is not None and not cfg.checkpoint.fallback:  # refused before anything is built or written
            check_compatible(resume_from, cfg)  # (with fallback, the checkpoint loaded is checked when it loads)

        self.tokenizer = load_tokenizer(cfg)
        self.train_data, self.val_data = self.recipe.datasets(cfg, self.tokenizer)

        torch.manual_seed(t.seed)
        layer_plan = None
        if cfg.recompute.mode in ("budget", "auto"):
            from loom.memory import describe_plan, recompute_plan

            measure_on = self.device if self.layout.tp > 1 else "meta"
            plan = recompute_plan(cfg, self.layout, measure_on, self._auto_memory())
            layer_plan = plan["plan"]
            if cfg.recompute.mode == "auto":
                self.recompute_note = describe_plan(plan)

        def place(model):  # the runner applies the layout (pipeline stages, TP, FSDP) on meta
            model.train()
            self.num_params = model.num_params()
            return build_runner(model, cfg, self.layout, self.loss, self.device, compute_dtype(cfg), layer_plan)

        # A LoRA checkpoint holds the adapters only (checkpoint.py): a resumed LoRA run loads its base again.
        base = t.init_from if resume_from is None or cfg.lora.enabled else ""
        # Sharded weights without a model to load: no rank builds the whole model, the optimizer draws its rows.
        drawn = cfg.parallel.distributed_optimizer and cfg.parallel.distopt_shard_weights and not base
        self.runner = build_in_layout(cfg, self.device, place, extend=self.recipe.extend_model, init_from=base,
                                      mark=self.beacon.mark, adapters=True, rows_later=drawn)
        self.model = self.runner.model
        if cfg.parallel.distributed_optimizer:  # after the weights are in place: it keeps their fp32 master rows
            from loom.parallel.distopt import DistributedOptimizer
            from loom.parallel.zero import ShardedDistributedOptimizer

            from loom.train.optim import optimizer_for_groups

            kind = ShardedDistributedOptimizer if cfg.parallel.distopt_shard_weights else DistributedOptimizer
            self.optimizer = kind(self.runner.parts, cfg, self.layout, compute_dtype(cfg),
                                  lambda groups: optimizer_for_groups(groups, cfg.optim, self.device),
                                  seed=t.seed if drawn else None)
        else:
            self.optimizer = build_optimizer(self.model, cfg.optim)
        self.evaluator = Evaluator(self.runner, self.val_data, self.tokenizer, t.micro_batch)
        self.batches = BatchPrefetcher(self.rank_batch, pin=self.device.type == "cuda", background=cfg.data.prefetch)
        self.control = RunControl(cfg, self.layout, self.device, self.started)

        self.state = TrainState()
        self.tokenizer_path = self.run_dir / "tokenizer.json"
        group = None
        if self.layout.distributed:  # checkpoint collectives get their own gloo group (async saves run them
            import torch.distributed as dist  # in a background thread, beside training's collectives)
            from datetime import timedelta

            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=t.collective_timeout_s))
        data = {p: fingerprint(p) for p in dict.fromkeys(cfg.data.paths + cfg.data.valid_paths)}
        self.checkpointer = Checkpointer(self.ckpt_root, self.model, self.optimizer, cfg, self.tokenizer_path, group,
                                         data)
        if resume_from is not None:  # checked and loaded before anything in the run directory changes
            self.beacon.mark("checkpoint load")
            self.state, resume_from = resume(self.checkpointer, resume_from, self.ckpt_root, cfg.checkpoint.fallback,
                                             self.is_main)
        self.resumed_from = resume_from
        # A resume with another train.steps: what it reads and how the schedule changes, said at the start.
        self.resume_note = "" if resume_from is None else resume_note(read_config(resume_from).train.steps, cfg,
                                                                      self.state.step)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            source = self.tokenizer.path
            self.tokenizer.save(self.tokenizer_path)
            # A chat model's template, special tokens and stop ids travel with its tokenizer (loom.models.io).
            copy_tokenizer_files(source, self.run_dir, TOKENIZER_FILES[1:])
            self._carry_template(self.recipe.chat_template(cfg))
            (self.run_dir / "config.toml").write_text(cfg.to_toml())

        self.tokens_per_step = t.global_batch * t.seq_len
        self.flops_per_token = flops.train_flops_per_token(cfg.model, t.seq_len)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        self.peak_tflops = flops.device_peak_tflops(name)
        self.recipe.set_up(self)

    def _auto_memory(self) -> float | None:
        """The memory `recompute.mode=auto` plans for (loom.memory.auto_memory_bytes), the smallest of any rank's:
        recomputed layers rerun their collectives in backward, so the ranks of a layout must recompute the same
        layers. None for the other modes, or where no rank has a limit."""
        from loom.memory import auto_memory_bytes

        if self.cfg.recompute.mode != "auto":
            return None
        memory = auto_memory_bytes(self.cfg, self.device)  # None on every rank or on none (same device type)
        if self.layout.distributed and memory is not None:
            import torch.distributed as dist

            least = torch.tensor([memory], dtype=torch.float64, device=self.device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            memory = least.item()
        return memory

    def _carry_template(self, template) -> None:
        """The recipe's chat template (a built-in or a file the tokenizer did not come with) into the run
        directory's tokenizer_config.json, so that template=auto finds it in the next stage (SFT -> DPO, RL)."""
        config_file = self.run_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        if template is None or config.get("chat_template") or (self.run_dir / "chat_template.jinja").is_file():
            return
        config = {**template.special, **config, "chat_template": template.source}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        atomic_write_text(config_file, json.dumps(config, indent=2) + "\n")

    # --- one step ---------------------------------------------------------------------------------

    def rank_batch(self, consumed_samples: int) -> dict:
        """This data-parallel rank's slice of the global batch that starts at `consumed_samples`."""
        per_rank = self.cfg.train.global_batch // self.layout.dp_size
        return self.train_data.batch(consumed_samples + self.layout.dp_rank * per_rank, per_rank)

    def train_step(self) -> dict:
        """One step of the recipe, and its metrics."""
        return self.recipe.train_step(self)

    def batch_step(self) -> dict:
        """One optimizer step over the next global batch (pre-training's step, and SFT's and DPO's)."""
        t = self.cfg.train
        following = self.state.consumed_samples + t.global_batch if self.state.step + 1 < t.steps else None
        batch, data_wait = self.batches.get(self.state.consumed_samples, following)
        out = self.optimizer_step(batch)
        self.state.step += 1
        self.state.consumed_samples += t.global_batch
        return {**out, "data_wait_s": data_wait}

    def optimizer_step(self, batch: dict, total: float | None = None) -> dict:
        """Forward and backward over this rank's `batch`, then one optimizer step at the learning rate of the
        current step: the loss is the mean over what the loss counts in the whole global batch (every rank's
        batch; `total`, when the caller has already summed it: RL, which decides on it whether to step).
        Returns the step's loss, gradient norm, lr and statistics."""
        t, layout = self.cfg.train, self.layout
        lr = lr_at(self.state.step, self.cfg.optim, t.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if total is not None:
            scale = layout.grad_ranks / total
        elif self.loss.count_varies:  # every rank of a tensor/pipeline/context group holds the same data
            # Summed over the ranks on the device: the normaliser stays a device tensor (no host read before
            # the forward); the count (host data) travels by a non-blocking copy from pinned memory.
            count = torch.as_tensor(self.loss.count(batch), dtype=torch.float64)
            total = all_reduce_sum(to_device_async(count, self.device))
            total = total / (layout.tp * layout.pp * layout.cp)
            scale = (layout.grad_ranks / total).float()  # what grad_ranks / total (a Python float) multiplied by
            total = total.float()
        else:
            total = self.loss.count(batch) * layout.dp_size
            scale = layout.grad_ranks / total
        # Data-parallel reduction averages gradients over ranks (with cp > 1 over the dp x cp ranks, each
        # holding its chunks' part); scale so the result is the sum / total.
        loss_sum = self.runner.forward_backward(batch, scale)
        if hasattr(self.optimizer, "reduce_and_clip"):  # the distributed optimizer's reduced rows
            grad_norm = self.optimizer.reduce_and_clip(t.grad_clip)
        else:
            counted, shared = self.runner.norm_parameters()
            grad_norm = clip_grad_norm(counted, t.grad_clip, self.runner.grad_norm_group, shared)
        # The step's one all-reduce of numbers for the host, summed over all ranks: the loss (every rank of a TP
        # group holds the same loss, a cp rank its chunks': divided by tp), a recipe's statistics (DPO rewards and
        # accuracy: means over the global batch's counted units), the runner's per-rank numbers (the pipeline
        # bubble: a mean over ranks), the run-control flags (a stop asked for on any rank) and the MoE routing
        # records of the step's micro-batches (pipeline stages fill their own layers' rows; see
        # loom.models.moe.step_stats for tensor-parallel replicas).
        sums = self.loss.take_sums()
        local = self.runner.local_metrics()
        host = [*local.values(), *self.control.local_flags()] if layout.distributed else list(local.values())
        routing = take_stats(self.model)
        parts = [loss_sum.float().reshape(1)]
        if sums:
            parts.append(torch.stack([v.float() for v in sums.values()]))
        if host:
            parts.append(to_device_async(torch.tensor(host, dtype=torch.float32), self.device))
        if routing is not None:
            parts.append(routing.flatten())
        reduced = all_reduce_sum(torch.cat(parts))
        loss_t = reduced[0] / layout.tp / total
        recipe = [reduced[1:1 + len(sums)] / (layout.tp * layout.pp * layout.cp) / total] if sums else []
        tail = reduced[1 + len(sums):1 + len(sums) + len(host)]
        moe, loads = ({}, []) if routing is None else stats_metrics(reduced[-routing.numel():].view(routing.shape))
        # Everything reaches the host in one transfer: the step's only host synchronisation (skipping a non-finite
        # step needs the verdict before the update).
        values = torch.cat([torch.stack([loss_t.float(), grad_norm.float(), *(v.float() for v in moe.values())]),
                            *recipe, tail])
        loss, grad_norm_value, *rest = values.tolist()
        moe_values, rest = rest[:len(moe)], rest[len(moe):]
        recipe_values, rest = rest[:len(sums)], rest[len(sums):]
        local_values, flag_values = rest[:len(local)], rest[len(local):]  # flags: under several ranks only
        if layout.distributed:
            self.control.fold_flags(flag_values)
        finite = is_finite(loss, grad_norm_value)  # same verdict on every rank
        if finite:
            update_router_biases(self.model, loads)  # sigmoid_bias routers: after every applied step
            self.optimizer.step()
        self.control.count_step(finite)
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss, "grad_norm": grad_norm_value, "lr": lr,
                "skipped_steps": self.control.skipped_steps,
                **{k: v / layout.world_size for k, v in zip(local, local_values)},
                **dict(zip(moe, moe_values)), **dict(zip(sums, recipe_values))}

    def evaluate(self) -> dict:
        return self.recipe.evaluate(self)

    def memory_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB

    def save(self) -> float:
        """Checkpoint the current step; the seconds the step loop was blocked (all of a synchronous save)."""
        self.beacon.mark(f"step {self.state.step}: checkpoint save")
        return self.checkpointer.save(self.state)

    def timed_step(self) -> dict:
        """One step of the recipe and its metrics row, marked for hang reports. The step's time is the host's, with
        no synchronisation of its own: the step's one transfer (`optimizer_step`) waits for the device, and the
        update queued after it is counted in the next step's time (over a run, the times add up to the wall
        time; docs/training.md)."""
        self.beacon.mark(f"step {self.state.step + 1}: {self.recipe.command}")
        rng.begin_step(self.state.step)  # dropout's streams under tp or cp: the same on every rank, and on resume
        t0 = time.perf_counter()
        out = self.train_step()
        dt = time.perf_counter() - t0
        return {"step": self.state.step, **out, **self.recipe.throughput(self, out, dt),
                "memory_gib": self.memory_gib(), "step_time_s": dt}

    # --- the loop ---------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to train.steps; a timed-out collective becomes a CollectiveTimeout naming the ranks behind."""
        with self.beacon.naming_hangs(), self._no_trace_of_bad_input():
            t, control = self.cfg.train, self.control
            report = self._reporter()
            if (row := self.recipe.start(self)) is not None:  # a row before the first step (RL's starting point)
                report.metrics.write(row)
                report.progress.evaluation(row)
            last_eval: dict = {}
            self.stopped_at = None
            try:
                with control.signals():
                    while self.state.step < t.steps:
                        row = self.timed_step()
                        self.step_times.append(row["step_time_s"])
                        if self.prediction:
                            row.update(self.prediction)
                        step = self.state.step
                        if control.diverged:
                            report.step(row)
                            self._stop_diverged(step)
                        evaluation = None
                        if control.eval_due(step):
                            self.beacon.mark(f"step {step}: evaluation")
                            evaluation = last_eval = {"step": step, **self.evaluate()}
                        stop = control.stop_requested(self.beacon, step)
                        if control.save_due(step, stop):
                            row["checkpoint_blocking_s"] = self.save()
                        report.step(row, evaluation)
                        # A checkpoint becomes `latest` only after this step's rows are written, so a run killed at
                        # any moment resumes with metrics.jsonl complete up to the checkpoint's step. A synchronous
                        # save commits here; an asynchronous one at the first step after its write finished.
                        self.checkpointer.poll()
                        if stop:
                            self._stop_early(step)
                            break
                    self.checkpointer.wait()  # the last checkpoint is complete before the run ends
            finally:
                self.batches.close()
                report.close()
            return last_eval

    @contextlib.contextmanager
    def _no_trace_of_bad_input(self):
        """Bad input found before the first step ends (a user's reward function failing on the first rollouts)
        removes the run directory this run made: nothing half-written is left behind."""
        try:
            yield
        except UserError:
            if self.is_main and self.made_run_dir and self.state.step == 0 and self.resumed_from is None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    def _reporter(self) -> Reporter:
        t, resumed = self.cfg.train, self.resumed_from is not None
        metrics = MetricsWriter(self.run_dir, self.state.step if resumed else None, self.cfg.log.tensorboard,
                                enabled=self.is_main, config=self.cfg)
        progress = Progress(self.cfg.log.progress, t.steps, self.state.step, t.log_interval,
                            enabled=not self.quiet and self.is_main)
        progress.message(banner(self.cfg, self.recipe.command, self.layout, self.num_params, self.train_data,
                                self.run_dir, self.resumed_from, valid_source(self.cfg, self.val_data),
                                trained=trainable_count(self.model)[0]))
        if self.recompute_note:
            progress.message(self.recompute_note)
        for line in run_advice(self.cfg, self.recipe.command):
            progress.message(line)
        if resumed:
            progress.message(f"resumed from {self.resumed_from} at step {self.state.step}")
            if self.resume_note and self.is_main:  # always shown, whatever the progress setting
                print(self.resume_note, file=sys.stderr, flush=True)
        elif t.init_from:
            progress.message(f"weights from train.init_from={t.init_from}")
        report = Reporter(metrics, progress, self.ckpt_root, self.cfg.checkpoint.async_save,
                          first_passes(self.train_data.epoch_steps(t.global_batch)))
        return report

    def _stop_diverged(self, step: int) -> None:
        t = self.cfg.train
        self.checkpointer.wait()  # the last good checkpoint, if still being written, is kept
        last = self.train_data.batch(self.state.consumed_samples - t.global_batch, t.micro_batch)
        gather = getattr(self.optimizer, "gather_all", None)  # sharded weights (zero.py) are released between steps:
        if gather is not None:  # every rank gathers them whole before they are read
            gather()
        raise TrainingDiverged(self.control.diagnose(self.model, self.runner, last, step))

    def _stop_early(self, step: int) -> None:
        self.checkpointer.wait()
        self.stopped_at = step
        self._announce_stop()

    def resume_command(self) -> str:
        """A command that continues this run as printed: the run's own merged config.toml holds every
        override the run was started with."""
        world = self.layout.world_size
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        procs = "" if world == 1 else f" --nproc {local}" + (f" --nnodes {world // local} (with this node's "
                                                                "--node-rank and --rdzv-endpoint)" if local != world else "")
        return (f"loom {self.recipe.command} --config {shlex.quote(str(self.run_dir / 'config.toml'))} --run-dir "
                f"{shlex.quote(str(self.run_dir))}{procs} --checkpoint.resume=true")

    def _announce_stop(self) -> None:
        if self.is_main:  # always shown, whatever the progress setting
            atomic_write_text(self.run_dir / STOP_RECORD, json.dumps(
                {"step": self.state.step, "signal": self.control.stop_signal, "reason": self.control.stop_reason,
                 "resume_command": self.resume_command()}))
            how = "by" if self.control.stop_reason.startswith("signal") else "at"
            print(f"stopped {how} {self.control.stop_reason} after step {self.state.step}; checkpoint saved. "
                  f"Resume with: {self.resume_command()}", file=sys.stderr, flush=True)
