"""Building a config in three layers, later wins: the dataclass defaults, a TOML file from `configs/` (or
any path), then `section.key=value` overrides (the command line's `--section.key=value`) or a nested dict."""

from __future__ import annotations

import difflib
import functools
import tomllib
import typing
from pathlib import Path
from typing import Any

from loom.config.schema import SECTIONS, Config
from loom.config.section import leaves
from loom.config.toml_io import coerce, flat_items
from loom.errors import UserError, closest

CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "configs"


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
                validate: bool = True) -> Config:
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
    return cfg.validate() if validate else cfg


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
        for key, value in flat_items(values):
            set_value(cfg, f"{section}.{key}", value, parse_text=False)


# Names other trainers give to loom's keys (Hugging Face TrainingArguments, TRL, torchtitan, Megatron-LM).
OTHER_NAMES = {
    "learning_rate": "optim.lr", "lr": "optim.lr", "min_learning_rate": "optim.min_lr", "min_lr": "optim.min_lr",
    "weight_decay": "optim.weight_decay", "warmup": "optim.warmup_steps", "warmup_steps": "optim.warmup_steps",
    "lr_warmup_iters": "optim.warmup_steps", "max_grad_norm": "train.grad_clip", "clip_grad": "train.grad_clip",
    "max_norm": "train.grad_clip", "max_steps": "train.steps", "train_iters": "train.steps",
    "training_steps": "train.steps", "batch_size": "train.global_batch", "global_batch_size": "train.global_batch",
    "micro_batch_size": "train.micro_batch", "per_device_train_batch_size": "train.micro_batch",
    "seq_length": "train.seq_len", "max_seq_length": "train.seq_len", "max_length": "train.seq_len",
    "seed": "train.seed", "bf16": "train.dtype", "dtype": "train.dtype",
    "tensor_model_parallel_size": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp",
    "context_parallel_size": "parallel.cp", "expert_model_parallel_size": "parallel.ep",
    "data_parallel_shard_degree": "parallel.dp_shard", "data_parallel_replicate_degree": "parallel.dp_replicate",
    "num_layers": "model.layers", "hidden_size": "model.hidden", "num_attention_heads": "model.heads",
    "num_key_value_heads": "model.kv_heads", "intermediate_size": "model.ffn_hidden",
    "save_steps": "checkpoint.interval", "eval_steps": "train.eval_interval", "logging_steps": "train.log_interval",
    "output_dir": "--run-dir", "model_name_or_path": "train.init_from", "resume_from_checkpoint": "checkpoint.resume",
    # TRL and PEFT (SFTConfig, DPOConfig, GRPOConfig, LoraConfig, TRL's script arguments)
    "fp16": "train.dtype", "lr_scheduler_type": "optim.decay", "num_train_epochs": "train.steps",
    "warmup_ratio": "optim.warmup_steps", "gradient_accumulation_steps": "train.global_batch",
    "gradient_checkpointing": "recompute.mode", "adam_beta1": "optim.beta1", "adam_beta2": "optim.beta2",
    "adam_epsilon": "optim.eps", "torch_compile": "train.compile", "packing": "sft.packing",
    "report_to": "log.wandb", "run_name": "log.wandb_name", "r": "lora.rank", "lora_r": "lora.rank",
    "use_peft": "lora.rank", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "target_modules": "lora.targets", "lora_target_modules": "lora.targets", "num_generations": "rl.group_size",
    "max_completion_length": "rl.max_new_tokens",
}
# How such a setting is written in loom where its value does not carry over as it is.
TRANSLATIONS = {
    "bf16": "--train.dtype=bfloat16",
    "fp16": "--train.dtype=bfloat16 (loom trains in float32 or bfloat16)",
    "lr_scheduler_type": "--optim.decay=cosine, linear or constant (after optim.warmup_steps, down to optim.min_lr)",
    "num_train_epochs": "--train.steps=N: loom counts optimizer steps, N = epochs x examples / train.global_batch "
                        "(an SFT run states its rows per epoch as it starts)",
    "warmup_ratio": "--optim.warmup_steps=N, N = ratio x train.steps",
    "gradient_accumulation_steps": "--train.global_batch=G and --train.micro_batch=M: loom accumulates G / (M x "
                                   "data-parallel ranks) micro-batches per step",
    "gradient_checkpointing": "--recompute.mode=full (or selective)",
    "use_peft": "--lora.rank=R (e.g. 16; 0 trains every weight)",
    "report_to": "--log.wandb=true (Weights & Biases; TensorBoard is log.tensorboard)",
}


def other_name(name: str) -> str:
    """How another trainer's setting `name` (`learning_rate`, `bf16`, `lora_r`) is written in loom, e.g.
    "--optim.lr=VALUE"; "" for a name loom does not know."""
    key = OTHER_NAMES.get(name)
    return "" if key is None else TRANSLATIONS.get(name, f"{key} VALUE" if key.startswith("--") else f"--{key}=VALUE")


def suggest_key(cfg: Config, section: str, key: str) -> str:
    """' (did you mean X?)': the same name in another section (`train.min_lr` -> `optim.min_lr`), else the loom
    key another trainer's name stands for (`train.learning_rate` -> `optim.lr`), else the closest name in this
    section, else the closest in any section."""
    everywhere = {f"{name}.{k}": k for name, obj in cfg.sections().items() for k, *_ in leaves(obj)}
    same = [dotted for dotted, leaf in everywhere.items() if leaf == key]
    guess = same[0] if same else OTHER_NAMES.get(key.rsplit(".", 1)[-1])
    for scope in ({d: k for d, k in everywhere.items() if d.startswith(f"{section}.")}, everywhere):
        if guess:
            break
        match = difflib.get_close_matches(key, list(scope.values()), n=1, cutoff=0.6)
        guess = next(d for d, k in scope.items() if k == match[0]) if match else None
    leaf = key.rsplit(".", 1)[-1]
    how = f" write {TRANSLATIONS[leaf]}" if not same and leaf in TRANSLATIONS else ""
    return f" (did you mean {guess!r}?{how})" if guess else ""


@functools.cache
def _type_hints(cls: type) -> dict:
    """A config section's resolved field types (`typing.get_type_hints` evaluates every annotation string on each
    call: 0.5 ms a key, most of a config's load time)."""
    return typing.get_type_hints(cls)


_KEYS: dict[type, dict] = {}


def _keys(obj) -> dict:
    """A section's keys -> (the attributes from the section to the field's owner, the field), in `leaves`' order;
    made once per section class (its nested sections are fields of fixed classes), not once per key set."""
    keys = _KEYS.get(type(obj))
    if keys is None:
        keys = _KEYS[type(obj)] = {k: (tuple(path.split(".")[:-1]), f) for k, path, _, f in leaves(obj)}
    return keys


def set_value(cfg: Config, dotted: str, value: Any, parse_text: bool) -> None:
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        raise UserError(f"unknown config section {section!r}{closest(section, SECTIONS)}; valid: {', '.join(SECTIONS)}")
    obj = getattr(cfg, section)
    fields = _keys(obj)  # `moe.experts`: a nested section's field
    if key not in fields:
        raise UserError(f"unknown config key {dotted!r}{suggest_key(cfg, section, key)}; valid keys in [{section}]: "
                        f"{', '.join(fields)}")
    owners, f = fields[key]
    owner = obj
    for name in owners:
        owner = getattr(owner, name)
    hint = _type_hints(type(owner))[f.name]
    setattr(owner, f.name, coerce(dotted, value, hint, parse_text))
