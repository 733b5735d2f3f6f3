"""The sections of a training run besides the model and its data: `parallel.*`, `train.*`, `optim.*`,
`checkpoint.*`, `recompute.*` and `log.*`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from loom.config.section import Section, below_one, finite_non_negative, finite_positive, non_negative, positive
from loom.errors import UserError
from loom.rules import check_sizes, data_parallel_size, divisors, world_size


@dataclass
class ParallelConfig(Section):
    """Parallel layout. The product of the sizes equals the number of processes."""

    tp: int = 1
    sp: bool = False
    pp: int = 1
    vpp: int = 1  # virtual stages (model chunks) per pipeline rank
    schedule: Literal["1f1b", "interleaved", "zero_bubble"] = "1f1b"
    first_stage_layers: int = 0  # uneven split: layers on the first / last stage (0: even split)
    last_stage_layers: int = 0
    # Count the embedding / the final norm + LM head + loss as one layer each in an even split (Megatron-Core's
    # --account-for-embedding/loss-in-pipeline-split): pp x vpp may reach layers + 2, a stage holding only them.
    embedding_in_split: bool = False
    loss_in_split: bool = False
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    # Gradient accumulation over the micro-batches of a step under FSDP (dp_shard > 1): "sharded"
    # reduce-scatters every micro-batch's gradients, so a rank never holds more than its shard of them;
    # "unsharded" keeps full fp32 gradients until the last micro-batch and reduces once (fewer
    # collectives, the whole model's gradients in memory). Pipeline schedules always reduce once.
    grad_accum: Literal["sharded", "unsharded"] = "sharded"
    # Megatron's distributed optimizer instead of FSDP (loom/parallel/distopt.py): weights whole on every rank in
    # the compute dtype, fp32 gradients in contiguous buffers reduce-scattered once per step, the fp32 master
    # weights and AdamW's moments split over the dp_shard x cp ranks.
    distributed_optimizer: bool = False
    # With it: the blocks' linear layers add their weight gradients straight into its fp32 buffer from the
    # backward's product (on CUDA inside the GEMM: Megatron's gradient-accumulation fusion), not via a 16-bit
    # gradient copied in afterwards; so does the chunked loss (train.loss_chunk) for an untied LM head, from its
    # forward's products (loom/parallel/headgrad.py).
    distopt_fused_wgrad: bool = True
    # With it: each rank keeps only its rows of the weights too (ZeRO-3, loom/parallel/zero.py): a unit's weights
    # are all-gathered straight into the parameters before it runs and released after, with none of FSDP2's
    # copies; gradients reduce-scattered per micro-batch as they complete.
    distopt_shard_weights: bool = False
    # "auto": the planner chooses the layout at launch for the world size and accelerator found, and every
    # metrics.jsonl step row carries its predicted_step_s / predicted_memory_gib (loom/planner/auto.py).
    layout: Literal["manual", "auto"] = "manual"
    auto_fix: str = ""  # with layout=auto: knobs fixed, in `loom plan --layout` syntax ("tp=2,recompute=none")
    auto_hardware: str = ""  # with layout=auto: a planner preset or profile JSON ("": this device, found)
    auto_memory_margin_gib: float | Literal["auto"] = "auto"  # GiB per process kept free (auto: 5% of its memory)
    # Expert parallelism: the token exchange pipelined in this many chunks, so that one chunk's all-to-all runs
    # while another's experts compute (loom/parallel/expert.py; 1: one exchange each way)
    ep_overlap_chunks: int = 1

    @property
    def world_size(self) -> int:
        return world_size(self)

    @property
    def dp(self) -> int:
        return data_parallel_size(self)

    def validate(self) -> None:
        check_sizes(self)  # the rest of the layout rules run in Config.validate (loom/rules.py)
        if self.ep_overlap_chunks < 1:
            raise UserError(f"parallel.ep_overlap_chunks={self.ep_overlap_chunks} must be >= 1 (1: no pipelining)")
        margin = self.auto_memory_margin_gib
        if margin != "auto" and not margin >= 0:
            raise UserError(f"parallel.auto_memory_margin_gib={margin} must be >= 0 (GiB kept free per process) or auto")
        if self.layout == "manual":
            given = [f"parallel.{k}={getattr(self, k)!r}" for k in ("auto_fix", "auto_hardware") if getattr(self, k)]
            if given:
                raise UserError(f"{', '.join(given)} only applies with parallel.layout=auto (the planner chooses the "
                                "layout); set parallel.layout=auto, or remove it")


@dataclass
class TrainConfig(Section):
    steps: int = 100
    global_batch: int = 8  # sequences per optimizer step
    micro_batch: int = 8  # sequences per forward/backward
    seq_len: int = 128
    seed: int = 1234
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    grad_clip: float = 1.0  # 0 disables clipping
    eval_interval: int = 0  # 0: evaluate only at the end
    eval_samples: int = 32  # held-out sequences per evaluation
    log_interval: int = 1
    compile: bool = False  # torch.compile each transformer block (every layout; tests/test_compile_layouts.py)
    # LM head + cross-entropy this many tokens at a time, its gradients computed in forward (memory-light); 0: the
    # whole micro-batch's logits; "auto": 8192 on a GPU where the layout takes it (tp = pp = 1), else 0
    loss_chunk: int | Literal["auto"] = "auto"
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"  # fp8 linear layers through torchao (CUDA, sm89+)
    threads: int = 0  # torch intra-op threads on CPU; 0 leaves torch's default
    max_skipped_consecutive: int = 5  # non-finite loss/grad steps skipped in a row before stopping (exit 3)
    collective_timeout_s: float = 600.0  # a collective waiting longer fails, naming the rank(s) behind
    # Start from pretrained weights: a Hugging Face model directory, a loom model directory or a loom
    # checkpoint (run, checkpoints/ or step-N directory). The architecture (model.*) and, unless
    # data.tokenizer names one with the same vocabulary, the tokenizer come from it; optimizer and step
    # start fresh. Empty: random initialisation from train.seed.
    init_from: str = ""
    # Stop before a scheduler's wall-clock limit (Megatron's --exit-duration-in-mins / --exit-interval): after the
    # first optimizer step at which this launch has run this many minutes (from the start of `loom train`) or taken
    # this many steps, save a checkpoint, print the command that resumes and exit 0. Counted per launch, so the
    # printed command runs another slice as long. 0: off.
    exit_after_minutes: float = 0.0
    exit_after_steps: int = 0

    def validate(self) -> None:
        positive("train", self, "steps", "global_batch", "micro_batch", "seq_len", "eval_samples", "log_interval")
        non_negative("train", self, "eval_interval", "threads", "max_skipped_consecutive", "exit_after_steps")
        finite_non_negative("train", self, "exit_after_minutes")
        if self.loss_chunk != "auto" and self.loss_chunk < 0:
            raise UserError(f"train.loss_chunk={self.loss_chunk} must be >= 0 (0: the whole micro-batch's logits) "
                            "or auto")
        if self.global_batch % self.micro_batch:
            raise UserError(
                f"train.global_batch={self.global_batch} is not divisible by train.micro_batch="
                f"{self.micro_batch}; valid micro batches: {', '.join(map(str, divisors(self.global_batch)))}"
            )
        if not (self.collective_timeout_s > 0 and math.isfinite(self.collective_timeout_s)):
            raise UserError(f"train.collective_timeout_s={self.collective_timeout_s} must be a finite number of seconds > 0")
        if self.grad_clip < 0 or not math.isfinite(self.grad_clip):
            raise UserError(f"train.grad_clip={self.grad_clip} must be a finite number >= 0 (0 disables)")


@dataclass
class OptimConfig(Section):
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    decay_norms_and_biases: bool = False
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 10
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    decay_steps: int = 0  # 0: decay over train.steps - warmup
    state_dtype: Literal["float32", "bfloat16"] = "float32"  # storage of the AdamW moments

    def validate(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"optim.lr={self.lr} must be a positive finite number, e.g. 3e-4")
        if not 0 <= self.min_lr <= self.lr:
            raise UserError(f"optim.min_lr={self.min_lr} must be in [0, optim.lr={self.lr}]")
        finite_non_negative("optim", self, "weight_decay")
        below_one("optim", self, "beta1", "beta2")
        finite_positive("optim", self, "eps")
        non_negative("optim", self, "warmup_steps", "decay_steps")


@dataclass
class CheckpointConfig(Section):
    interval: int = 0  # save every N steps (0: only at the end)
    resume: bool = False  # continue from run-dir/checkpoints/latest
    keep_last: int = 0  # prune older checkpoints (0: keep all)
    fallback: bool = False  # on resume, skip a damaged latest checkpoint for the newest complete one
    save_final: bool = True
    # `checkpoint.async` in TOML and on the command line (`async` is a Python keyword): write in the
    # background while training continues.
    async_save: bool = field(default=False, metadata={"key": "async"})
    # Keys of RESUME_GUARDED a resume may change on purpose (e.g. lora.alpha,sft.template); any other change of
    # them is refused on resume (loom/train/checkpoint.py: check_compatible), as it changes what was trained.
    allow_changes: list[str] = field(default_factory=list)

    def validate(self) -> None:
        non_negative("checkpoint", self, "interval", "keep_last")
        unknown = [k for k in self.allow_changes if k not in RESUME_GUARDED]
        if unknown:
            raise UserError(f"checkpoint.allow_changes names {', '.join(map(repr, unknown))}, which a resume may not "
                            f"change on purpose; valid: {', '.join(RESUME_GUARDED)} (the data order, the model and "
                            "lora.rank are fixed for the life of a run: start a new one, another --run-dir)")


# What a run trained on and with: a resume that changes one of them is refused unless checkpoint.allow_changes
# names it (the adapters' targets and scale, the examples and how they are rendered and packed).
RESUME_GUARDED = ("lora.targets", "lora.alpha", "sft.data", "sft.template", "sft.packing", "sft.overlong",
                  "pref.data", "pref.template", "rl.prompts", "rl.template")


@dataclass
class RecomputeConfig(Section):
    """Activation recomputation (see loom/parallel/recompute.py)."""

    mode: Literal["none", "selective", "full", "budget", "auto"] = "none"
    method: Literal["uniform", "block"] = "uniform"  # full: every layer, or the first num_layers per stage
    num_layers: int = 0  # full + block: layers recomputed per pipeline stage (0: all)
    budget_gib: float = 0.0  # budget: activation memory per rank to fit in
    # auto: the memory one rank may use (GiB); 0: the accelerator's free memory at start (a CPU: no limit).
    # The activation budget is what is left of it after the parameters, gradients, optimizer state and a
    # reserve (loom.memory.plan_auto).
    memory_gib: float = 0.0

    def validate(self) -> None:
        if self.num_layers < 0:
            raise UserError(f"recompute.num_layers={self.num_layers} must be >= 0")
        if self.mode == "full" and self.method == "uniform" and self.num_layers > 1:
            raise UserError(
                f"recompute.method=uniform recomputes every layer on its own; recompute.num_layers="
                f"{self.num_layers} applies to method=block (recompute the first N layers of each stage)"
            )
        if self.mode == "budget" and not self.budget_gib > 0:
            raise UserError(f"recompute.mode=budget needs recompute.budget_gib > 0 (got {self.budget_gib})")
        if not self.memory_gib >= 0:
            raise UserError(f"recompute.memory_gib={self.memory_gib} must be >= 0 (0: the accelerator's free memory)")
        if self.memory_gib and self.mode != "auto":
            raise UserError(f"recompute.memory_gib={self.memory_gib} is the memory recompute.mode=auto plans for; with "
                            f"recompute.mode={self.mode} it would be ignored: set recompute.mode=auto or drop it")


@dataclass
class LogConfig(Section):
    progress: Literal["auto", "rich", "plain", "none"] = "auto"
    tensorboard: bool = True  # scalars under run-dir/tensorboard when tensorboard is installed
    # Weights & Biases (loom/train/tracking.py; `pip install "loom[wandb]"`): every metrics.jsonl row at its
    # step and the resolved config, from rank 0; a resumed run continues the same W&B run (its id is kept
    # in run-dir/wandb_id). Files go to $WANDB_DIR, else the run directory.
    wandb: bool = False
    wandb_project: str = "loom"
    wandb_name: str = ""  # "": the run directory's name
    wandb_tags: list[str] = field(default_factory=list)
    wandb_mode: Literal["auto", "online", "offline"] = "auto"  # auto: $WANDB_MODE if set, else online

    def validate(self) -> None:
        if not self.wandb:
            return
        import importlib.util

        try:
            missing = importlib.util.find_spec("wandb") is None  # found before launch, without importing it
        except (ImportError, ValueError):  # a broken or blocked installation
            missing = True
        if missing:
            raise UserError('log.wandb=true needs the wandb package, which is not installed: pip install "loom[wandb]" '
                            "(or set log.wandb=false)")
        if not self.wandb_project.strip():
            raise UserError("log.wandb_project is empty; name the W&B project the run logs to (e.g. loom)")
