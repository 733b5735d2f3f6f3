"""Configuration: one dataclass per component, TOML files, dotted overrides, validation.

A config is built in three layers, later wins: the dataclass defaults, a TOML file from `configs/`
(or any path), then `--section.key=value` overrides from the command line. Every value is checked
while parsing: an unknown key names the closest valid one, a wrong type or an impossible value names
the field, the value and what would be valid (`UserError`, exit code 2).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loom.errors import UserError, closest
from loom.rules import check_layout, check_sizes, data_parallel_size, world_size
from loom.rules import divisors as _divisors

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama 2/3 by default, GPT-3 through options)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 4  # grouped-query attention when smaller than heads
    ffn_hidden: int = 352
    vocab_size: int = 1024
    max_seq_len: int = 2048  # RoPE table / learned position table size
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    position: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    # Llama 3.1+ long-context RoPE ("llama3": low frequencies divided by rope_factor, high ones kept, a
    # smooth ramp between, around the original context rope_original_max_len); "none": plain RoPE.
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool = False
    bias: bool = False  # biases in linear layers (GPT-3 style)
    qkv_bias: bool = False  # biases on the query/key/value projections only (Qwen2 / Qwen2.5)
    qk_norm: bool = False  # RMSNorm over each query/key head after projection, before RoPE (Qwen3)
    # `model.head_dim`: size of one attention head; 0 means hidden / heads (Qwen3 decouples them).
    explicit_head_dim: int = field(default=0, metadata={"key": "head_dim"})
    attention: Literal["sdpa", "math"] = "sdpa"
    dropout: float = 0.0  # after embeddings and after both sub-blocks
    attn_dropout: float = 0.0  # on attention probabilities
    init_std: float = 0.02
    # Mixture of experts (`model.moe.*`, loom/models/moe.py). moe.experts=0: every MLP dense.
    moe_experts: int = field(default=0, metadata={"key": "moe.experts"})
    moe_top_k: int = field(default=2, metadata={"key": "moe.top_k"})
    moe_ffn_hidden: int = field(default=0, metadata={"key": "moe.ffn_hidden"})  # per expert; 0: model.ffn_hidden
    moe_shared_experts: int = field(default=0, metadata={"key": "moe.shared_experts"})  # always-on, each moe.ffn_hidden
    moe_shared_gate: bool = field(default=False, metadata={"key": "moe.shared_gate"})  # sigmoid gate (Qwen2-MoE)
    moe_router: Literal["softmax", "sinkhorn", "sigmoid_bias"] = field(default="softmax",
                                                                       metadata={"key": "moe.router"})
    moe_renormalize: bool = field(default=False, metadata={"key": "moe.renormalize"})  # gates over the k chosen
    moe_bias_update_rate: float = field(default=1e-3, metadata={"key": "moe.bias_update_rate"})  # sigmoid_bias
    moe_load_balance: Literal["batch", "sequence"] = field(default="batch", metadata={"key": "moe.load_balance"})
    moe_load_balance_coeff: float = field(default=0.01, metadata={"key": "moe.load_balance_coeff"})
    moe_z_loss_coeff: float = field(default=0.0, metadata={"key": "moe.z_loss_coeff"})
    moe_capacity_factor: float = field(default=0.0, metadata={"key": "moe.capacity_factor"})  # 0: dropless
    moe_drop_policy: Literal["probs", "position"] = field(default="probs", metadata={"key": "moe.drop_policy"})
    # Which layers are MoE: layer i when i >= moe.first_dense and i % moe.interval == 0 (DeepSeek's rule).
    moe_interval: int = field(default=1, metadata={"key": "moe.interval"})
    moe_first_dense: int = field(default=0, metadata={"key": "moe.first_dense"})

    def is_moe_layer(self, i: int) -> bool:
        return self.moe_experts > 0 and i >= self.moe_first_dense and i % self.moe_interval == 0

    @property
    def moe_layers(self) -> int:
        if not self.moe_experts:
            return 0
        first = -(-self.moe_first_dense // self.moe_interval) * self.moe_interval  # first multiple >= first_dense
        return len(range(first, self.layers, self.moe_interval))  # the layers is_moe_layer accepts

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    def validate(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            _positive(f"model.{name}", getattr(self, name))
        if self.explicit_head_dim < 0:
            raise UserError(f"model.head_dim={self.explicit_head_dim} must be >= 0 (0: model.hidden / model.heads)")
        if self.hidden % self.heads and not self.explicit_head_dim:
            raise UserError(
                f"model.hidden={self.hidden} is not divisible by model.heads={self.heads}; "
                f"valid head counts: {', '.join(map(str, _divisors(self.hidden)))}"
            )
        if self.heads % self.kv_heads:
            raise UserError(
                f"model.kv_heads={self.kv_heads} does not divide model.heads={self.heads}; "
                f"valid: {', '.join(map(str, _divisors(self.heads)))}"
            )
        if self.position == "rope" and self.head_dim % 2:
            raise UserError(f"RoPE needs an even head dimension; model.head_dim (default model.hidden/model.heads) "
                            f"= {self.head_dim}")
        if self.rope_scaling == "llama3":
            for name in ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
                if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                    raise UserError(f"model.{name}={getattr(self, name)} must be a finite number > 0")
            if not self.rope_high_freq_factor > self.rope_low_freq_factor:
                raise UserError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                                f"model.rope_low_freq_factor={self.rope_low_freq_factor} (Llama 3.1: 4.0 and 1.0)")
            _positive("model.rope_original_max_len", self.rope_original_max_len)
        if self.bias and self.qkv_bias:
            raise UserError("model.qkv_bias=true with model.bias=true: model.bias already puts biases on every "
                            "linear layer; set one of them (qkv_bias: query/key/value only, as Qwen2)")
        for name in ("dropout", "attn_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise UserError(f"model.{name}={value} must be in [0, 1)")
        if self.rope_scaling == "llama3" and not (self.rope_high_freq_factor > self.rope_low_freq_factor > 0
                                                  and self.rope_factor >= 1 and self.rope_original_max_len > 0):
            raise UserError(
                f"model.rope_scaling=llama3 needs rope_high_freq_factor > rope_low_freq_factor > 0, rope_factor >= 1 "
                f"and rope_original_max_len > 0; got {self.rope_high_freq_factor}, {self.rope_low_freq_factor}, "
                f"{self.rope_factor}, {self.rope_original_max_len} (Llama 3.1: 4.0, 1.0, 8.0, 8192)")
        for name in ("norm_eps", "rope_theta", "init_std"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise UserError(f"model.{name}={getattr(self, name)} must be a finite number > 0")
        self._validate_moe()

    def _validate_moe(self) -> None:
        if self.moe_experts < 0:
            raise UserError(f"model.moe.experts={self.moe_experts} must be >= 0 (0: dense MLPs, no experts)")
        if not self.moe_experts:
            return
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise UserError(f"model.moe.top_k={self.moe_top_k} must be in 1..model.moe.experts={self.moe_experts}")
        for name in ("ffn_hidden", "shared_experts", "first_dense"):
            if getattr(self, f"moe_{name}") < 0:
                raise UserError(f"model.moe.{name}={getattr(self, f'moe_{name}')} must be >= 0")
        _positive("model.moe.interval", self.moe_interval)
        if self.moe_layers == 0:
            raise UserError(f"model.moe.first_dense={self.moe_first_dense} with model.moe.interval={self.moe_interval} "
                            f"leaves no MoE layer among model.layers={self.layers}; valid first_dense: "
                            f"0..{self.layers - 1}")
        for name in ("bias_update_rate", "load_balance_coeff", "z_loss_coeff", "capacity_factor"):
            value = getattr(self, f"moe_{name}")
            if not (value >= 0 and math.isfinite(value)):
                raise UserError(f"model.moe.{name}={value} must be a finite number >= 0")
        if 0 < self.moe_capacity_factor * self.moe_top_k < 1e-9:
            raise UserError(f"model.moe.capacity_factor={self.moe_capacity_factor} is too small; 0 means dropless")
        if self.moe_shared_gate and not self.moe_shared_experts:
            raise UserError("model.moe.shared_gate=true gates the shared experts, but model.moe.shared_experts=0; "
                            "set model.moe.shared_experts >= 1 or model.moe.shared_gate=false")


@dataclass
class ParallelConfig:
    """Parallel layout. The product of the sizes equals the number of processes."""

    tp: int = 1
    sp: bool = False
    pp: int = 1
    vpp: int = 1  # virtual stages (model chunks) per pipeline rank
    schedule: Literal["1f1b", "interleaved", "zero_bubble"] = "1f1b"
    first_stage_layers: int = 0  # uneven split: layers on the first / last stage (0: even split)
    last_stage_layers: int = 0
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    # Gradient accumulation over the micro-batches of a step under FSDP (dp_shard > 1): "sharded"
    # reduce-scatters every micro-batch's gradients, so a rank never holds more than its shard of them;
    # "unsharded" keeps full fp32 gradients until the last micro-batch and reduces once (fewer
    # collectives, the whole model's gradients in memory). Pipeline schedules always reduce once.
    grad_accum: Literal["sharded", "unsharded"] = "sharded"

    @property
    def world_size(self) -> int:
        return world_size(self)

    @property
    def dp(self) -> int:
        return data_parallel_size(self)

    def validate(self) -> None:
        check_sizes(self)  # the rest of the layout rules run in Config.validate (loom/rules.py)


@dataclass
class TrainConfig:
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
    compile: bool = False  # torch.compile each transformer block (composes with FSDP and recompute; not TP yet)
    loss_chunk: int = 0  # >0: LM head + cross-entropy this many tokens at a time, logits recomputed in backward
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"  # fp8 linear layers through torchao (CUDA, sm89+)
    threads: int = 0  # torch intra-op threads on CPU; 0 leaves torch's default
    max_skipped_consecutive: int = 5  # non-finite loss/grad steps skipped in a row before stopping (exit 3)
    collective_timeout_s: float = 600.0  # a collective waiting longer fails, naming the rank(s) behind
    # Start from pretrained weights: a Hugging Face model directory, a loom model directory or a loom
    # checkpoint (run, checkpoints/ or step-N directory). The architecture (model.*) and, unless
    # data.tokenizer names one with the same vocabulary, the tokenizer come from it; optimizer and step
    # start fresh. Empty: random initialisation from train.seed.
    init_from: str = ""

    def validate(self) -> None:
        for name in ("steps", "global_batch", "micro_batch", "seq_len", "eval_samples", "log_interval"):
            _positive(f"train.{name}", getattr(self, name))
        for name in ("eval_interval", "threads", "max_skipped_consecutive", "loss_chunk"):
            if getattr(self, name) < 0:
                raise UserError(f"train.{name}={getattr(self, name)} must be >= 0")
        if self.global_batch % self.micro_batch:
            valid = [d for d in _divisors(self.global_batch)]
            raise UserError(
                f"train.global_batch={self.global_batch} is not divisible by train.micro_batch="
                f"{self.micro_batch}; valid micro batches: {', '.join(map(str, valid))}"
            )
        if not (self.collective_timeout_s > 0 and math.isfinite(self.collective_timeout_s)):
            raise UserError(f"train.collective_timeout_s={self.collective_timeout_s} must be a finite number of seconds > 0")
        if self.grad_clip < 0 or not math.isfinite(self.grad_clip):
            raise UserError(f"train.grad_clip={self.grad_clip} must be a finite number >= 0 (0 disables)")


@dataclass
class OptimConfig:
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
        if not (0 <= self.weight_decay and math.isfinite(self.weight_decay)):
            raise UserError(f"optim.weight_decay={self.weight_decay} must be a finite number >= 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"optim.{name}={getattr(self, name)} must be in [0, 1)")
        if not (self.eps > 0 and math.isfinite(self.eps)):
            raise UserError(f"optim.eps={self.eps} must be a finite number > 0")
        for name in ("warmup_steps", "decay_steps"):
            if getattr(self, name) < 0:
                raise UserError(f"optim.{name}={getattr(self, name)} must be >= 0")


@dataclass
class DataConfig:
    # Empty: the embedded corpus (the Python standard library's .py files). Otherwise prefixes of
    # Megatron-style .bin/.idx datasets made by `loom preprocess`.
    paths: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # blending weights, one per path
    valid_paths: list[str] = field(default_factory=list)  # held-out datasets; default: data.split of data.paths
    # Megatron-style document split of each data.paths dataset into train, validation and test shares
    # (contiguous document ranges, deterministic); used for validation whenever data.valid_paths is empty.
    split: str = "969,30,1"
    tokenizer: str = "bpe"  # "bpe": byte-level BPE trained on the corpus; else a tokenizer.json path
    corpus_max_bytes: int = 0  # use only the first N bytes of the embedded corpus (0: all)
    prefetch: bool = True  # read the next step's batch in a background thread during the current step
    # Attention stays inside each document of a sample (documents end with the tokenizer's end-of-document
    # token) and positions restart at each document, as Llama 3 pretrained.
    document_mask: bool = False

    def validate(self) -> None:
        if self.weights and len(self.weights) != len(self.paths):
            raise UserError(
                f"data.weights has {len(self.weights)} entries but data.paths has {len(self.paths)}; "
                "give one weight per path or none"
            )
        if any(w < 0 for w in self.weights) or (self.weights and sum(self.weights) <= 0):
            raise UserError(f"data.weights={self.weights} must be >= 0 with a positive sum")
        if self.corpus_max_bytes < 0:
            raise UserError(f"data.corpus_max_bytes={self.corpus_max_bytes} must be >= 0 (0: all)")
        split_shares(self.split)

    def split_ranges(self, documents: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """(train, valid, test) document ranges [lo, hi) of a dataset of `documents` documents."""
        return split_ranges(split_shares(self.split), documents)


def split_shares(text: str) -> tuple[float, float, float]:
    """`data.split` ("969,30,1", "98,2", "1") as fractions (train, valid, test)."""
    try:
        parts = [float(x) for x in str(text).replace("/", ",").split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(not math.isfinite(x) or x < 0 for x in parts) or not parts[0] > 0:
        raise UserError(f"data.split={text!r} must be up to three shares train,valid,test of non-negative numbers "
                        "with a positive train share, e.g. 969,30,1 (Megatron's default) or 98,2,0")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return parts[0] / total, parts[1] / total, parts[2] / total


def split_ranges(shares: tuple[float, float, float], documents: int):
    """Contiguous document ranges for the shares, as Megatron cuts them (rounded cumulative bounds); a
    non-zero validation share gets at least one document, taken from the end of the training range."""
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + share)
    cut = [round(b * documents) for b in bounds]
    cut[-1] = documents
    if shares[1] > 0 and cut[2] == cut[1] and cut[1] >= 2:
        cut[1] -= 1
    return (cut[0], cut[1]), (cut[1], cut[2]), (cut[2], cut[3])


def check_data_lists(section: str, obj, train: str, valid: str, files: str, what: str) -> None:
    """A recipe's training and held-out data lists: no empty entry, and held-out data only beside training
    data. `files` says what an entry may be, `what` what the training list holds."""
    for name in (train, valid):
        if any(not str(p).strip() for p in getattr(obj, name)):
            raise UserError(f"{section}.{name}={getattr(obj, name)} holds an empty path; give {files}")
    if getattr(obj, valid) and not getattr(obj, train):
        raise UserError(f"{section}.{valid} is set but {section}.{train} is empty; give the training {what} in "
                        f"{section}.{train}")


@dataclass
class SFTConfig:
    """Supervised fine-tuning (loom/post/sft.py): non-empty `sft.data` makes a run an SFT run."""

    # .jsonl files of {"messages": [{"role", "content"}, ...]} or {"prompt", "completion"} records, or
    # prefixes written by `loom preprocess --sft`. Held out for validation: sft.valid_data when given, else
    # the data.split validation share of the examples (the last ones of the files).
    data: list[str] = field(default_factory=list)
    valid_data: list[str] = field(default_factory=list)
    # "auto": the chat_template of the tokenizer_config.json beside the tokenizer (data.tokenizer or
    # train.init_from); "llama3" or "chatml": built in; else a tokenizer_config.json or .jinja file.
    template: str = "auto"
    packing: bool = True  # several examples per sequence, attention and positions kept per example
    # Examples longer than train.seq_len + 1 tokens: "truncate" keeps the first seq_len + 1, "drop" skips them.
    overlong: Literal["truncate", "drop"] = "truncate"

    def validate(self) -> None:
        check_data_lists("sft", self, "data", "valid_data", ".jsonl files or prefixes written by `loom preprocess "
                         "--sft`", "examples")


@dataclass
class PrefConfig:
    """Preference training (loom/post/pref.py): non-empty `pref.data` makes a run a reward-model or DPO run."""

    # .jsonl files of {"prompt", "chosen", "rejected"} records: strings (plain text, as SFT's prompt and
    # completion) or lists of {"role", "content"} messages rendered with pref.template; "synthetic:N" makes N
    # pairs locally. Held out: pref.valid_data when given, else the data.split validation share of the pairs.
    data: list[str] = field(default_factory=list)
    valid_data: list[str] = field(default_factory=list)
    template: str = "auto"  # as sft.template
    recipe: Literal["auto", "dpo", "rm"] = "auto"  # auto: the command's (loom dpo, loom rm)
    loss: Literal["dpo", "ipo"] = "dpo"  # the DPO recipe's objective
    beta: float = 0.1  # DPO/IPO temperature

    def validate(self) -> None:
        check_data_lists("pref", self, "data", "valid_data", ".jsonl files of {\"prompt\", \"chosen\", \"rejected\"} "
                         "records or synthetic:N", "pairs")
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise UserError(f"pref.beta={self.beta} must be a finite number > 0 (DPO's usual values: 0.01 to 0.5)")


@dataclass
class RLConfig:
    """Online RL with the generation engine in the loop (loom/post/rl.py): non-empty `rl.prompts` makes a run
    an RL run (`loom rl`). Every setting of the objective is named here, none implied; the defaults are GRPO
    as Shao et al. (2024) wrote it, with DAPO's token-level aggregation."""

    # .jsonl files of {"prompt": str | [messages], ...}: every other field of a record goes to the reward
    # function as a keyword argument (e.g. "answer"); "addition:N" makes N problems locally (loom/post/tasks.py).
    prompts: list[str] = field(default_factory=list)
    valid_prompts: list[str] = field(default_factory=list)  # held out: greedy completions scored each evaluation
    template: str = "none"  # "none": a string prompt is the model's input as is; else as sft.template (chat)
    # Rewards: a Python callable "package.module:function" called as f(prompt, completion, **fields) -> float,
    # and/or a reward model (a `loom rm` run or checkpoint) scoring prompt + completion; both: their sum,
    # the model's score times reward_model_coef.
    reward: str = ""
    reward_model: str = ""
    reward_model_coef: float = 1.0
    algorithm: Literal["grpo", "ppo"] = "grpo"  # grpo: group baselines, no critic; ppo: value head + GAE
    group_size: int = 8  # completions per prompt; train.global_batch = prompts per step x group_size
    # Advantage (grpo): reward minus a baseline: "mean" (the group's mean, GRPO) or "rloo" (the mean of the
    # group's other samples); then divided by the group's std + std_eps ("std", GRPO) or not ("none", Dr. GRPO).
    baseline: Literal["mean", "rloo"] = "mean"
    scale: Literal["std", "none"] = "std"
    std_estimator: Literal["sample", "population"] = "sample"  # n - 1 (torch.std, TRL) or n
    std_eps: float = 1e-4
    drop_uniform_groups: bool = False  # leave out groups whose rewards are all equal (DAPO dynamic sampling)
    # Loss aggregation: "token" (every response token of the batch weighs the same, DAPO), "sequence" (mean
    # over each sequence's tokens, then over sequences, GRPO), "constant" (each sequence's sum / max_new_tokens,
    # Dr. GRPO).
    aggregation: Literal["token", "sequence", "constant"] = "token"
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    ratio: Literal["token", "sequence"] = "token"  # "sequence": GSPO's length-normalised sequence ratio
    kl_coef: float = 0.0  # 0: no reference policy is built
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # of KL(policy || reference); ppo folds it into the reward
    tis_cap: float = 0.0  # > 0: truncated importance sampling, min(p_trainer / p_engine, cap) per token
    epochs: int = 1  # passes over each step's rollouts
    minibatches: int = 1  # optimizer steps per pass (each on global_batch / minibatches sequences)
    # PPO: a value head on the policy's last hidden state; GAE; clipped value loss; the KL penalty per token.
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2
    value_coef: float = 0.5
    whiten_advantages: bool = True  # PPO: advantages to mean 0, std 1 over the global batch
    # Generation by loom's engine (loom/infer/engine.py), refitted from the policy after every update.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16  # train.seq_len must hold the longest prompt plus this
    engine_batch: int = 64  # engine slots: sequences decoded together
    # Decode steps through torch.compile in batch buckets: "auto" is on on a GPU (a CUDA graph per step) and off
    # on a CPU (compiling costs more than it saves there), decided by loom.infer.engine.resolve_compile; "on" /
    # "off" force it (true / false, as earlier configs wrote it, mean the same and are read as on / off).
    engine_compile: Literal["auto", "on", "off", "true", "false", True, False] = "auto"
    engine_sync_every: int = 8  # decode steps the engine runs on the device between reads back to the host

    def validate(self) -> None:
        check_data_lists("rl", self, "prompts", "valid_prompts", ".jsonl files of {\"prompt\": ...} records or "
                         "addition:N", "prompts")
        if self.prompts and not (self.reward or self.reward_model):
            raise UserError("an RL run needs a reward: rl.reward=package.module:function (e.g. "
                            "loom.post.tasks:exact_match) and/or rl.reward_model=RUN_OR_CHECKPOINT")
        if self.reward and ":" not in self.reward:
            raise UserError(f"rl.reward={self.reward!r} must be package.module:function, e.g. loom.post.tasks:exact_match")
        for name in ("group_size", "epochs", "minibatches", "max_new_tokens", "engine_batch", "engine_sync_every"):
            _positive(f"rl.{name}", getattr(self, name))
        for name in ("std_eps", "kl_coef", "tis_cap", "value_clip", "value_coef", "temperature", "clip_low",
                     "clip_high"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise UserError(f"rl.{name}={value} must be a finite number >= 0")
        if self.clip_low >= 1:
            raise UserError(f"rl.clip_low={self.clip_low} must be < 1 (the ratio's lower bound is 1 - clip_low)")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise UserError(f"rl.top_p={self.top_p} must be in (0, 1] and rl.top_k={self.top_k} >= 0")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise UserError(f"rl.{name}={getattr(self, name)} must be in [0, 1]")
        if self.tis_cap and self.tis_cap < 1:
            raise UserError(f"rl.tis_cap={self.tis_cap} must be >= 1 (a cap on p_trainer / p_engine), or 0 for off")
        self.engine_compile = {True: "on", False: "off", "true": "on", "false": "off"}.get(self.engine_compile,
                                                                                          self.engine_compile)


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0: only at the end)
    resume: bool = False  # continue from run-dir/checkpoints/latest
    keep_last: int = 0  # prune older checkpoints (0: keep all)
    fallback: bool = False  # on resume, skip a damaged latest checkpoint for the newest complete one
    save_final: bool = True
    # `checkpoint.async` in TOML and on the command line (`async` is a Python keyword): write in the
    # background while training continues.
    async_save: bool = field(default=False, metadata={"key": "async"})

    def validate(self) -> None:
        for name in ("interval", "keep_last"):
            if getattr(self, name) < 0:
                raise UserError(f"checkpoint.{name}={getattr(self, name)} must be >= 0")


@dataclass
class RecomputeConfig:
    """Activation recomputation (see loom/parallel/recompute.py)."""

    mode: Literal["none", "selective", "full", "budget"] = "none"
    method: Literal["uniform", "block"] = "uniform"  # full: every layer, or the first num_layers per stage
    num_layers: int = 0  # full + block: layers recomputed per pipeline stage (0: all)
    budget_gib: float = 0.0  # budget: activation memory per rank to fit in

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


@dataclass
class LogConfig:
    progress: Literal["auto", "rich", "plain", "none"] = "auto"
    tensorboard: bool = True  # scalars under run-dir/tensorboard when tensorboard is installed

    def validate(self) -> None:
        pass


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    pref: PrefConfig = field(default_factory=PrefConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    log: LogConfig = field(default_factory=LogConfig)
    name: str = "custom"

    def validate(self, measuring: bool = False) -> "Config":
        for section in SECTIONS:
            getattr(self, section).validate()
        check_layout(self, measuring=measuring)
        if self.sft.data and (self.data.paths or self.data.valid_paths):
            raise UserError("sft.data and data.paths/data.valid_paths are both set; an SFT run reads its examples "
                            "from sft.data (and sft.valid_data) only: clear data.paths and data.valid_paths")
        if self.pref.data and (self.sft.data or self.data.paths or self.data.valid_paths):
            raise UserError("pref.data is set together with sft.data or data.paths; a preference run (loom dpo, "
                            "loom rm) reads its pairs from pref.data (and pref.valid_data) only: clear the others")
        if self.rl.prompts and (self.pref.data or self.sft.data or self.data.paths or self.data.valid_paths):
            raise UserError("rl.prompts is set together with pref.data, sft.data or data.paths; an RL run (loom rl) "
                            "reads its prompts from rl.prompts (and rl.valid_prompts) only: clear the others")
        if self.train.seq_len > self.model.max_seq_len:
            raise UserError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                f"valid: 1..{self.model.max_seq_len} (or raise model.max_seq_len)"
            )
        return self

    def to_dict(self) -> dict:
        out = {}
        for section in SECTIONS:
            obj = getattr(self, section)
            values = dataclasses.asdict(obj)
            table: dict = {}
            for f in dataclasses.fields(obj):  # a dotted key (`moe.experts`) is a nested table, as TOML reads it
                *parents, leaf = key_of(f).split(".")
                node = table
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = values[f.name]
            out[section] = table
        return out

    def to_toml(self) -> str:
        return dumps_toml(self.to_dict())

    def default_run_dir(self) -> Path:
        """runs/NAME-YYYYmmdd-HHMMSS: where a run without --run-dir writes (here, not in the trainer, so that
        the launcher finds it without importing the training stack before its workers start)."""
        from datetime import datetime

        return Path("runs") / f"{self.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


SECTIONS = [f.name for f in dataclasses.fields(Config) if f.name != "name"]


def key_of(f: dataclasses.Field) -> str:
    """A field's key in TOML and overrides: its name, unless that is a Python keyword (metadata "key")."""
    return f.metadata.get("key", f.name)


# --- building ------------------------------------------------------------------------------------


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))


def resolve_config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise UserError(f"config file {name_or_path!r} does not exist")
        return path
    candidate = CONFIG_DIR / f"{name_or_path}.toml"
    if not candidate.is_file():
        names = available_configs()
        raise UserError(
            f"unknown config {name_or_path!r}{closest(name_or_path, names)}; "
            f"valid names: {', '.join(names)} (or a path to a .toml file)"
        )
    return candidate


def load_config(name_or_path: str | None = None, overrides: list[str] | dict | None = None,
                measuring: bool = False, validate: bool = True) -> Config:
    """Defaults, then the TOML file, then overrides (`section.key=value` strings or a nested dict).

    `validate=False` leaves the cross-field checks to the caller (train.init_from replaces the model first).
    """
    cfg = Config()
    if name_or_path:
        path = resolve_config_path(name_or_path)
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"config file {path} is not valid TOML: {exc}") from None
        cfg.name = path.stem
        apply_dict(cfg, data, source=str(path))
    if isinstance(overrides, dict):
        apply_dict(cfg, overrides, source="overrides")
    else:
        for item in overrides or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise UserError(f"override {item!r} must look like section.key=value, e.g. train.steps=100")
            set_value(cfg, key.strip().removeprefix("--"), value, parse_text=True)
    return cfg.validate(measuring) if validate else cfg


def config_from_dict(data: dict) -> Config:
    cfg = Config()
    apply_dict(cfg, data, source="checkpoint")
    return cfg.validate()


def apply_dict(cfg: Config, data: dict, source: str) -> None:
    for section, values in data.items():
        if section == "name":
            cfg.name = str(values)
            continue
        if not isinstance(values, dict):
            raise UserError(
                f"{source}: top-level key {section!r} must be a [section] table; "
                f"valid sections: {', '.join(SECTIONS)}"
            )
        for key, value in _flat_items(values):
            set_value(cfg, f"{section}.{key}", value, parse_text=False)


def _flat_items(values: dict, prefix: str = ""):
    """A section's keys, nested tables joined with dots: `[model.moe] experts = 8` is `moe.experts`."""
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _flat_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def set_value(cfg: Config, dotted: str, value: Any, parse_text: bool) -> None:
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        raise UserError(f"unknown config section {section!r}{closest(section, SECTIONS)}; valid: {', '.join(SECTIONS)}")
    obj = getattr(cfg, section)
    fields = {key_of(f): f for f in dataclasses.fields(obj)}
    if key not in fields:
        valid = [f"{section}.{k}" for k in fields]
        raise UserError(f"unknown config key {dotted!r}{closest(dotted, valid)}; valid keys in [{section}]: {', '.join(fields)}")
    hint = typing.get_type_hints(type(obj))[fields[key].name]
    setattr(obj, fields[key].name, coerce(dotted, value, hint, parse_text))


def coerce(name: str, value: Any, hint: Any, parse_text: bool) -> Any:
    """Convert `value` to the annotated type or raise a UserError naming field, value and valid form."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise UserError(f"{name}={value!r} is not valid; valid: {', '.join(map(str, choices))}")
        return value
    if origin is list:
        (inner,) = typing.get_args(hint)
        if parse_text and isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v]
        if not isinstance(value, list):
            raise UserError(f"{name}={value!r} must be a list (comma-separated on the command line)")
        return [coerce(name, v, inner, parse_text) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if parse_text and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise UserError(f"{name}={value!r} must be a boolean: true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if parse_text and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise UserError(f"{name}={value!r} must be an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if parse_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise UserError(f"{name}={value!r} must be a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise UserError(f"{name}={value!r} must be a string")
    raise TypeError(f"unsupported config type for {name}: {hint}")


def _positive(name: str, value: int) -> None:
    if value <= 0:
        raise UserError(f"{name}={value} must be a positive integer")


def dumps_toml(data: dict) -> str:
    """Minimal TOML writer for our nested config dicts (tables of scalars and lists)."""

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        raise TypeError(f"cannot write {type(v)} to TOML")

    def pairs(values: dict, prefix: str = ""):  # a nested table as dotted keys (`moe.experts = 8`)
        for k, v in values.items():
            if isinstance(v, dict):
                yield from pairs(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k} = {scalar(v)}"

    lines = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        lines.extend(pairs(values))
        lines.append("")
    return "\n".join(lines)
