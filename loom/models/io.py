"""Model directories: what generation, conversion and `loom.load_model` read without the trainer.

A loom model directory holds `config.toml` (the full run config), when known `tokenizer.json` and the files
carried beside it (`TOKENIZER_FILES`: the chat template and special tokens of `tokenizer_config.json`,
`chat_template.jinja`, `generation_config.json`'s end-of-sequence ids), and the weights in one of two forms:

- `model.safetensors` (a converted model; a tied output weight is stored once, as `tok_embeddings.weight`);
- a sharded training checkpoint `run/checkpoints/step-N/` (`.metadata` + `*.distcp`, written by
  `torch.distributed.checkpoint` from any parallel layout): `read_sharded_weights` assembles the full
  weights in this one process, reading only the model's entries (not the optimizer's).

`resolve_model_dir` accepts a run directory, its `checkpoints/` directory, a step directory or a plain
model directory.
"""

from __future__ import annotations

import json
import os
import tomllib
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loom.config import Config, config_from_dict
from loom.errors import UserError
from loom.files import honour_umask
from loom.models.llama import Transformer, build_model

WEIGHTS = "model.safetensors"
CONFIG = "config.toml"
TOKENIZER = "tokenizer.json"
DCP_METADATA = ".metadata"  # marks a sharded (torch.distributed.checkpoint) checkpoint
# What makes a tokenizer a chat model's: its chat template, special tokens and stop ids travel with it.
TOKENIZER_FILES = (TOKENIZER, "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def copy_tokenizer_files(tokenizer_path: Path | str | None, dst: Path, names=TOKENIZER_FILES) -> list[str]:
    """Copy `tokenizer_path` (a tokenizer.json) and those of `names` that lie beside it into directory `dst`;
    the names copied."""
    if tokenizer_path is None or not Path(tokenizer_path).is_file():
        return []
    src = Path(tokenizer_path).parent
    copied = []
    for name in names:
        source = Path(tokenizer_path) if name == TOKENIZER else src / name
        target = Path(dst) / name
        if source.is_file() and (not target.exists() or not target.samefile(source)):
            target.write_bytes(source.read_bytes())
            honour_umask(target)
            copied.append(name)
    return copied


def save_model_dir(model: Transformer | dict, cfg: Config, path: Path, tokenizer_path: Path | str | None = None) -> None:
    """Write weights (a model or its full state dict), config and tokenizer (with the files carried beside it)
    into `path` (which must exist)."""
    path = Path(path)
    state = model if isinstance(model, dict) else model.state_dict()
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if cfg.model.tie_embeddings:
        state.pop("output.weight", None)
    save_file(state, str(path / WEIGHTS), metadata={"format": "pt", "producer": "loom"})
    honour_umask(path / WEIGHTS)
    (path / CONFIG).write_text(cfg.to_toml())
    copy_tokenizer_files(tokenizer_path, path)


def resolve_model_dir(path: str | Path) -> Path:
    """The model directory a user meant: follow run-dir -> checkpoints -> latest -> step-N."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"checkpoint {str(path)!r} does not exist; give a run directory, a "
                        "checkpoints/step-N directory or a converted model directory")
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if (p / "latest").is_file():
        name = (p / "latest").read_text().strip()
        p = p / name
        if not p.is_dir():
            raise UserError(f"{path}: 'latest' names {name!r}, which does not exist")
    if not ((p / WEIGHTS).is_file() or (p / DCP_METADATA).is_file()) or not (p / CONFIG).is_file():
        raise UserError(f"{p} is not a loom checkpoint: expected {CONFIG} and {WEIGHTS} or a sharded "
                        f"checkpoint ({DCP_METADATA} + *.distcp) in it")
    return p


def read_config(model_dir: Path) -> Config:
    try:
        return config_from_dict(tomllib.loads((Path(model_dir) / CONFIG).read_text()))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{Path(model_dir) / CONFIG} is corrupt: {exc}") from None


def load_model_dir(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model in eval mode, Config, directory) from any path `resolve_model_dir` accepts."""
    model_dir = resolve_model_dir(path)
    cfg = read_config(model_dir)
    model = build_model(cfg.model, device=device, dtype=dtype)
    if (model_dir / DCP_METADATA).is_file():
        read_sharded_weights(model_dir, model)
    else:
        load_weights(model, model_dir / WEIGHTS)
    return model.eval(), cfg, model_dir


def read_sharded_weights(ckpt_dir: Path, model: Transformer) -> None:
    """Fill `model` (one process, any dtype) from a sharded checkpoint saved in any layout."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    try:
        with warnings.catch_warnings():  # one process, no process group: DCP warns that it assumes so
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, checkpoint_id=Path(ckpt_dir), no_dist=True)
    except Exception as exc:  # CheckpointException: unreadable shard, missing entry, wrong shape
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"{ckpt_dir} cannot be read as this config's model ({first}); the checkpoint is "
                        "damaged or its config.toml does not match its weights") from None


def read_weights(file: Path, model: Transformer, partial: bool = False) -> dict[str, torch.Tensor]:
    """The state dict in `file`, checked against `model`'s names and (global) shapes.

    With `partial` (a pipeline stage, which holds some of the layers) only `model`'s names are read.
    """
    try:
        state = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{file} is corrupt or unreadable ({exc}); re-save or convert the checkpoint") from None
    if model.cfg.tie_embeddings:
        state.setdefault("output.weight", state.get("tok_embeddings.weight"))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = [] if partial else sorted(set(state) - set(expected))
    state = {k: v for k, v in state.items() if k in expected}
    if missing or unexpected:
        raise UserError(f"{file} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise UserError(f"{file}: {name} has shape {tuple(tensor.shape)}, config needs {tuple(expected[name].shape)}")
    return state


def load_weights(model: Transformer, file: Path) -> None:
    state = read_weights(file, model)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.copy_(state[name])


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
