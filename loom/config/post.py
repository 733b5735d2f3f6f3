"""The post-training sections: `sft.*` (supervised fine-tuning), `pref.*` (reward models, DPO) and `rl.*`
(online RL with the generation engine in the loop). Which one a run is: its subcommand (loom/post/__init__.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from loom.config.data import check_data_lists
from loom.config.section import Section, finite_non_negative, positive, unit_interval
from loom.errors import UserError


def check_columns(section: str, obj: Section, *names: str) -> None:
    """Column keys: non-empty and distinct (two roles read from one column would be a silent mix-up)."""
    values = [getattr(obj, n) for n in names]
    for name, value in zip(names, values):
        if not isinstance(value, str) or not value.strip():
            raise UserError(f"{section}.{name}={value!r} must name a JSON key / Parquet column")
    if len(set(values)) < len(values):
        raise UserError(f"{section}: {', '.join(f'{n}={v!r}' for n, v in zip(names, values))} must name different "
                        "columns")


@dataclass
class SFTConfig(Section):
    """Supervised fine-tuning (`loom sft`, loom/post/sft.py): the examples it trains on."""

    # .jsonl or .parquet files (or globs of them) of {"messages": [{"role", "content"}, ...]} or {"prompt",
    # "completion"} records, or prefixes written by `loom preprocess --sft`. Held out for validation:
    # sft.valid_data when given, else the data.split validation share of the examples (the last ones of the files).
    data: list[str] = field(default_factory=list)
    valid_data: list[str] = field(default_factory=list)
    # The JSON keys / Parquet columns holding a record's conversation, or its prompt and completion.
    messages_column: str = "messages"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    # "auto": the chat_template of the tokenizer_config.json beside the tokenizer (data.tokenizer or
    # train.init_from); "llama3" or "chatml": built in; else a tokenizer_config.json or .jinja file.
    template: str = "auto"
    packing: bool = True  # several examples per sequence, attention and positions kept per example
    # Examples longer than train.seq_len + 1 tokens: "truncate" keeps the first seq_len + 1, "drop" skips them.
    overlong: Literal["truncate", "drop"] = "truncate"

    def validate(self) -> None:
        check_data_lists("sft", self, "data", "valid_data", ".jsonl or .parquet files (or globs) or prefixes written "
                         "by `loom preprocess --sft`", "examples")
        check_columns("sft", self, "messages_column", "prompt_column", "completion_column")


@dataclass
class PrefConfig(Section):
    """Preference training (`loom rm`, `loom dpo`, loom/post/pref.py): the pairs they train on."""

    # .jsonl or .parquet files (or globs of them) of {"prompt", "chosen", "rejected"} records: strings (plain
    # text, as SFT's prompt and completion) or lists of {"role", "content"} messages rendered with
    # pref.template; "synthetic:N" makes N pairs locally. Held out: pref.valid_data when given, else the
    # data.split validation share of the pairs.
    data: list[str] = field(default_factory=list)
    valid_data: list[str] = field(default_factory=list)
    prompt_column: str = "prompt"  # the JSON keys / Parquet columns of a pair
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    template: str = "auto"  # as sft.template
    recipe: Literal["auto", "dpo", "rm"] = "auto"  # auto: the command's (loom dpo, loom rm)
    loss: Literal["dpo", "ipo"] = "dpo"  # the DPO recipe's objective
    beta: float = 0.1  # DPO/IPO temperature

    def validate(self) -> None:
        check_data_lists("pref", self, "data", "valid_data", ".jsonl or .parquet files (or globs) of {\"prompt\", "
                         "\"chosen\", \"rejected\"} records or synthetic:N", "pairs")
        check_columns("pref", self, "prompt_column", "chosen_column", "rejected_column")
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise UserError(f"pref.beta={self.beta} must be a finite number > 0 (DPO's usual values: 0.01 to 0.5)")


@dataclass
class RLConfig(Section):
    """Online RL with the generation engine in the loop (`loom rl`, loom/post/rl/). Every setting of the objective is named here, none implied; the defaults are GRPO
    as Shao et al. (2024) wrote it, with DAPO's token-level aggregation."""

    # .jsonl or .parquet files (or globs of them) of {"prompt": str | [messages], ...}: every other field of a
    # record goes to the reward function as a keyword argument (e.g. "answer"); "addition:N" makes N problems
    # locally (loom/post/tasks.py).
    prompts: list[str] = field(default_factory=list)
    prompt_column: str = "prompt"  # the JSON key / Parquet column of the prompt
    valid_prompts: list[str] = field(default_factory=list)  # held out: greedy completions scored each evaluation
    template: str = "none"  # "none": a string prompt is the model's input as is; else as sft.template (chat)
    # Rewards: a Python callable "package.module:function" called as f(prompt, completion, **fields) -> float,
    # or built-in rewards and callables with weights, "math:1.0,format:0.2" (math, exact_match, format, length:
    # loom/rewards), and/or a reward model (a `loom rm` run or checkpoint) scoring prompt + completion; both:
    # their sum, the model's score times reward_model_coef.
    reward: str = ""
    format_pattern: str = r"<think>.*</think>\s*<answer>.*</answer>"  # the format reward's regex (re.fullmatch)
    length_buffer: int = 4  # the length reward: tokens before rl.max_new_tokens where its penalty starts
    reward_model: str = ""
    reward_model_coef: float = 1.0
    # Multi-turn episodes (loom/post/rl/environments.py): a class "package.module:Class" with reset(record) and
    # step(completion) -> (text, reward, done), e.g. loom.post.rl.tools:Calculator or :PythonTool; its rewards
    # (plus rl.reward's, if set) are the episode's; at most max_turns model turns; only model tokens carry loss.
    environment: str = ""
    max_turns: int = 4
    algorithm: Literal["grpo", "ppo"] = "grpo"  # grpo: group baselines, no critic; ppo: value head + GAE
    group_size: int = 8  # completions per prompt; train.global_batch = prompts per step x group_size
    # Advantage (grpo): reward minus a baseline: "mean" (the group's mean, GRPO) or "rloo" (the mean of the
    # group's other samples); then divided by the group's std + std_eps ("std", GRPO) or not ("none", Dr. GRPO).
    baseline: Literal["mean", "rloo"] = "mean"
    scale: Literal["std", "none"] = "std"
    std_estimator: Literal["sample", "population"] = "sample"  # n - 1 (torch.std, TRL) or n
    std_eps: float = 1e-4
    drop_uniform_groups: bool = False  # leave out groups whose rewards are all equal (DAPO dynamic sampling)
    # DAPO's dynamic sampling: groups whose rewards are all equal are replaced by informative groups of freshly
    # drawn prompts, for at most dynamic_sampling_max_rounds rounds per step (loom/post/rl/dynamic.py).
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 4
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
    # Text that ends a completion (cut before it), besides the tokenizer's end-of-sequence and the chat
    # template's end-of-turn tokens, where every completion stops (loom.post.chat.stop_token_ids).
    stop: list[str] = field(default_factory=list)
    engine_batch: int = 64  # engine slots: sequences decoded together
    # Decode steps through torch.compile in batch buckets: "auto" is on on a GPU (a CUDA graph per step) and off
    # on a CPU (compiling costs more than it saves there), decided by loom.infer.step.resolve_compile; "on" /
    # "off" force it (true / false, as earlier configs wrote it, mean the same and are read as on / off).
    engine_compile: Literal["auto", "on", "off", "true", "false", True, False] = "auto"
    engine_sync_every: int = 8  # decode steps the engine runs on the device between reads back to the host
    # Paged keys and values (loom/infer/paged.py): a group's prompt is prefilled once and its blocks shared by the
    # group_size completions; memory held by tokens in use, not engine_batch x the longest sequence.
    engine_paged: bool = False
    # Asynchronous RL (loom/post/rl/async_loop.py): "async" runs the engine on rl.generation_ranks ranks of
    # --nproc (the rest train), generation ahead of training by at most rl.max_staleness policy versions (older
    # rollouts are dropped); rl.tis_cap weights the loss by min(p_trainer / p_generator, cap). "sync": the
    # engine in the trainer's processes, generation then training (max_staleness 0 computes the same).
    mode: Literal["sync", "async"] = "sync"
    generation_ranks: int = 1
    # > 1: the generation ranks form rl.generation_ranks / generation_tp engine groups, each running one engine
    # sharded by tensor parallelism over its generation_tp ranks (as `loom serve --nproc` does)
    generation_tp: int = 1
    max_staleness: int = 1

    def validate(self) -> None:
        check_data_lists("rl", self, "prompts", "valid_prompts", ".jsonl or .parquet files (or globs) of "
                         "{\"prompt\": ...} records or addition:N", "prompts")
        check_columns("rl", self, "prompt_column")
        if self.prompts and not (self.reward or self.reward_model or self.environment):
            raise UserError("an RL run needs a reward: rl.reward=package.module:function (e.g. "
                            "loom.post.tasks:exact_match) and/or rl.reward_model=RUN_OR_CHECKPOINT")
        positive("rl", self, "dynamic_sampling_max_rounds", "max_turns")
        if self.dynamic_sampling and (self.algorithm != "grpo" or self.group_size < 2):
            raise UserError(f"rl.dynamic_sampling=true needs groups to compare: rl.algorithm=grpo with rl.group_size "
                            f">= 2 (here {self.algorithm}, {self.group_size}); a group of one is never informative")
        positive("rl", self, "group_size", "epochs", "minibatches", "max_new_tokens", "engine_batch",
                 "engine_sync_every", "generation_ranks", "generation_tp")
        if self.generation_tp > 1 and self.mode != "async":
            raise UserError(f"rl.generation_tp={self.generation_tp} shards the generation ranks' engines, which only "
                            "rl.mode=async has; with rl.mode=sync the engine is sharded as the trainer (parallel.tp)")
        if self.generation_ranks % self.generation_tp:
            valid = [d for d in range(1, self.generation_ranks + 1) if self.generation_ranks % d == 0]
            raise UserError(f"rl.generation_tp={self.generation_tp} must divide rl.generation_ranks="
                            f"{self.generation_ranks} (the generation ranks form groups of generation_tp ranks, one "
                            f"engine each); valid: {valid}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise UserError(f"rl.max_staleness={self.max_staleness!r} must be an integer >= 0 (policy versions a "
                            "rollout may lag the trainer by; 0: on-policy, as rl.mode=sync)")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise UserError(f"rl.stop={self.stop!r} must be a list of non-empty strings: comma-separated on the "
                            "command line (--rl.stop=END,DONE), a TOML list in a config file (stop = [\"\\n\\n\"])")
        finite_non_negative("rl", self, "std_eps", "kl_coef", "tis_cap", "value_clip", "value_coef", "temperature",
                            "clip_low", "clip_high")
        if self.clip_low >= 1:
            raise UserError(f"rl.clip_low={self.clip_low} must be < 1 (the ratio's lower bound is 1 - clip_low)")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise UserError(f"rl.top_p={self.top_p} must be in (0, 1] and rl.top_k={self.top_k} >= 0")
        unit_interval("rl", self, "gamma", "lam")
        if self.tis_cap and self.tis_cap < 1:
            raise UserError(f"rl.tis_cap={self.tis_cap} must be >= 1 (a cap on p_trainer / p_engine), or 0 for off")
        self.engine_compile = {True: "on", False: "off", "true": "on", "false": "off"}.get(self.engine_compile,
                                                                                          self.engine_compile)
