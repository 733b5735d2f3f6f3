"""Training from pretrained weights (`train.init_from=PATH`).

PATH is a Hugging Face model directory (config.json + safetensors), a loom model directory (config.toml +
model.safetensors, e.g. from `loom convert`) or a loom checkpoint (a run, its checkpoints/ directory or
a step-N directory: `torch.distributed.checkpoint` shards). Two steps:

- `resolve_init_from(cfg, overrides)` (before launch, in every process): the architecture (`model.*`)
  comes from PATH. A `model.*` override on the command line that contradicts it is refused; the keys
  that do not change the weights (`max_seq_len`, `attention`, `dropout`, `attn_dropout`, `init_std`) may be
  overridden. The tokenizer comes from PATH too, unless `data.tokenizer` names one with the same
  vocabulary (token -> id map).
- `load_pretrained(model, PATH)` (after the model is parallelised, in place of the weight initialisation):
  fills every parameter of this rank — a plain tensor, or a DTensor sharded by TP and/or FSDP — with
  exactly its slice of the source: safetensors files are read with `get_slice` at the shard's global
  offsets, loom checkpoints with a DCP load of the model entries only. No rank reads the whole model.
  Names and global shapes are checked against the config first (UserError naming the tensor).

Hugging Face and loom share the rotate-half RoPE layout, so no tensor is permuted: a slice of a Hugging
Face tensor is the same slice of the loom tensor. Routed experts, which loom stacks ([E, in, out]) and
Hugging Face stores one nn.Linear per expert (or fused), are read piece by piece (`loom.interop.hf_names.Piece`):
a rank holding some experts (or a slice of each) reads those elements only.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from loom.config import Config, ModelConfig, flat_values, leaves
from loom.errors import UserError
from loom.interop.hf_config import HF_CONFIG, HF_WEIGHTS, is_hf_dir, model_config_from_hf, read_hf_config
from loom.interop.hf_io import HF_INDEX, TOKENIZER
from loom.interop.hf_names import Piece, hf_pieces, loom_to_hf_name, piece_shape, read_piece
from loom.models.init import canonical_name
from loom.models.io import CONFIG, DCP_METADATA, WEIGHTS, read_config, resolve_model_dir

# Model keys that do not change the weights' names or shapes: an explicit override is kept.
FREE_KEYS = ("max_seq_len", "attention", "dropout", "attn_dropout", "init_std")


@dataclass
class Source:
    path: Path  # the directory holding the weights
    kind: str  # "hf", "loom" (model.safetensors with loom names) or "dcp" (a sharded loom checkpoint)
    model: ModelConfig
    tokenizer: Path | None


def describe_source(path: str | Path) -> Source:
    """What `train.init_from=path` points at: kind, architecture and tokenizer (reads only configs)."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"train.init_from={str(path)!r} does not exist or is not a directory; give a Hugging Face "
                        "model directory (config.json + *.safetensors), a loom model directory (config.toml + "
                        "model.safetensors) or a loom run / checkpoint directory")
    if is_hf_dir(p):
        model = model_config_from_hf(read_hf_config(p), where=str(p / HF_CONFIG))
        kind, directory = "hf", p
    else:
        try:
            directory = resolve_model_dir(p)
        except UserError as exc:
            raise UserError(f"train.init_from={str(path)!r}: {exc}") from None
        model = read_config(directory).model
        kind = "dcp" if (directory / DCP_METADATA).is_file() else "loom"
    tok = directory / TOKENIZER
    return Source(directory, kind, model, tok if tok.is_file() else None)


def _override_keys(overrides) -> set[str]:
    if isinstance(overrides, dict):
        return {f"model.{k}" for k in (overrides.get("model") or {})}
    return {item.partition("=")[0].strip().removeprefix("--") for item in overrides or []}


def resolve_init_from(cfg: Config, overrides=None) -> Config:
    """`cfg` with the architecture and tokenizer of `cfg.train.init_from` (unchanged when it is empty).

    `overrides` are the command line's `section.key=value` strings (or a nested dict): the `model.*` keys
    among them are the user's explicit choices, checked against PATH. Model values from a config file are
    replaced by PATH's (a config file is a template; PATH defines the network).
    """
    if not cfg.train.init_from:
        return cfg
    # Recorded absolute: a run's config.toml (and a LoRA run's base) names the same directory from anywhere.
    cfg.train.init_from = os.path.abspath(cfg.train.init_from)
    src = describe_source(cfg.train.init_from)
    explicit = _override_keys(overrides)
    model = copy.deepcopy(src.model)  # its nested sections (model.moe) too
    mine, theirs = flat_values(cfg.model), flat_values(src.model)
    for name, path, owner, f in leaves(model):
        key = f"model.{name}"
        if key not in explicit:
            continue
        if path in FREE_KEYS:
            setattr(owner, f.name, mine[path])
        elif mine[path] != theirs[path]:
            raise UserError(
                f"{key}={mine[path]!r} contradicts train.init_from={cfg.train.init_from}, whose model has "
                f"{name}={theirs[path]!r}; the architecture comes from the pretrained weights, so drop "
                f"--{key} (only {', '.join('model.' + k for k in FREE_KEYS)} may be changed)")
    cfg.model = model
    _resolve_tokenizer(cfg, src)
    return cfg.validate()


def _vocab(spec: str | Path) -> dict[str, int]:
    from loom.data.tokenizer import Tokenizer

    return Tokenizer.from_file(spec).tok.get_vocab(with_added_tokens=True)


def _resolve_tokenizer(cfg: Config, src: Source) -> None:
    spec = cfg.data.tokenizer
    if spec == "bpe":  # the default: PATH's own tokenizer
        if src.tokenizer is None:
            raise UserError(
                f"train.init_from={cfg.train.init_from} has no {TOKENIZER}, and data.tokenizer=bpe would train a new "
                "vocabulary the pretrained embeddings know nothing of; set data.tokenizer to the tokenizer.json the "
                "model was trained with")
        cfg.data.tokenizer = str(src.tokenizer)
        return
    if src.tokenizer is None or Path(spec).resolve() == src.tokenizer.resolve():
        return
    mine, theirs = _vocab(spec), _vocab(src.tokenizer)
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))
        token = diff[0][0]
        raise UserError(
            f"data.tokenizer={spec} has another vocabulary than train.init_from's {src.tokenizer} ({len(mine)} vs "
            f"{len(theirs)} tokens; e.g. {token!r} is id {mine.get(token)} vs {theirs.get(token)}), so token ids "
            "would index the wrong embeddings; drop data.tokenizer (PATH's tokenizer is used) or give a tokenizer "
            "with the same vocabulary")


def check_matches_source(cfg: Config) -> None:
    """UserError when `cfg.model` is not the architecture of `cfg.train.init_from` (a config built without
    `resolve_init_from`)."""
    src = describe_source(cfg.train.init_from)
    mine, theirs = flat_values(cfg.model), flat_values(src.model)
    diffs = [f"model.{n}: {mine[n]!r} here, {theirs[n]!r} in {src.path}"
             for n in mine if n not in FREE_KEYS and mine[n] != theirs[n]]
    if diffs:
        raise UserError(f"the model does not match train.init_from={cfg.train.init_from} ({'; '.join(diffs[:4])}); "
                        "take the architecture from it (loom train does: leave model.* unset)")


# --- weights ------------------------------------------------------------------------------------


def _expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Global name -> shape of every weight the source must hold (a tied head is the embedding)."""
    from loom.models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if cfg.tie_embeddings:
        shapes.pop("output.weight", None)
    return shapes


def _safetensors_index(src: Source) -> tuple[dict[str, Piece], dict[str, Path], dict[str, tuple[int, ...]]]:
    """(loom name -> Piece, name in the files -> file, name in the files -> shape) for a Hugging Face or loom
    safetensors directory; reads only the files' headers."""
    if (src.path / (WEIGHTS if src.kind == "loom" else HF_WEIGHTS)).is_file():
        files = {(WEIGHTS if src.kind == "loom" else HF_WEIGHTS): None}
    elif src.kind == "hf" and (src.path / HF_INDEX).is_file():
        try:
            weight_map = json.loads((src.path / HF_INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{src.path / HF_INDEX} is not a valid safetensors index ({exc!r})") from None
        files = dict.fromkeys(sorted(set(weight_map.values())))
    else:
        raise UserError(f"{src.path}: no weights found; expected {HF_WEIGHTS} or {HF_INDEX}")
    from safetensors import SafetensorError, safe_open

    file_of: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for fname in files:
        file = src.path / fname
        if not file.is_file():
            raise UserError(f"{src.path}: shard {fname} listed in {HF_INDEX} is missing")
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    file_of[name], shapes[name] = file, tuple(f.get_slice(name).get_shape())
        except (SafetensorError, OSError, ValueError) as exc:
            raise UserError(f"{file} is corrupt or unreadable ({exc})") from None
    pieces = hf_pieces(shapes, src.path) if src.kind == "hf" else {name: Piece((name,)) for name in shapes}
    return pieces, file_of, shapes


def _check_safetensors(pieces: dict[str, Piece], shapes: dict[str, tuple[int, ...]], cfg: ModelConfig, where: Path,
                       kind: str) -> None:
    def spelled(name: str) -> str:  # a name as the source spells it
        try:
            return loom_to_hf_name(name) if kind == "hf" else name
        except UserError:
            return name

    expected = _expected(cfg)
    if cfg.tie_embeddings:
        pieces.pop("output.weight", None)  # a tied head stored anyway is the embedding
    missing = sorted(set(expected) - set(pieces))
    unexpected = sorted(set(pieces) - set(expected))
    if missing or unexpected:
        raise UserError(f"{where}: weights do not match its config: missing {[spelled(n) for n in missing[:5]]}, "
                        f"unexpected {[pieces[n].names[0] for n in unexpected[:5]]}")
    for name, piece in pieces.items():
        shape = piece_shape(piece, shapes)
        if shape != expected[name]:
            raise UserError(f"{where}: {spelled(name) if piece.kind != 'copy' else piece.names[0]} has shape {shape}, "
                            f"its config needs {expected[name]}")


def local_slice(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's local tensor of `param`, the global index of that tensor in the full weight)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = param.to_local()
        assert tuple(local.shape) == tuple(shape), (tuple(local.shape), shape)
        return local, tuple(slice(o, o + s) for o, s in zip(offset, shape))
    return param, tuple(slice(0, s) for s in param.shape)


@torch.no_grad()
def load_pretrained(model: torch.nn.Module, path: str | Path) -> dict:
    """Fill `model` — whole, or a pipeline rank's view, already parallelised (plain tensors or DTensors
    with TP/FSDP placements) — with the weights at `path`, each rank reading only its slices.

    Every rank must call it (the DCP load of a loom checkpoint is a collective). `model.cfg` must be the
    source's architecture. Returns {"kind", "elements_read"} (this rank's count, for tests and logs).
    """
    src = describe_source(path)
    cfg: ModelConfig = model.cfg
    if src.kind == "dcp":
        saved = read_config(src.path)
        if saved.lora.enabled:  # a LoRA run: its base, then its adapters folded in
            return _load_lora_run(model, src, saved)
        return {"kind": "dcp", "elements_read": _load_dcp(model, src)}
    pieces, file_of, shapes = _safetensors_index(src)
    _check_safetensors(pieces, shapes, cfg, src.path, src.kind)
    from safetensors import safe_open

    read = 0
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(str(file), framework="pt")) for file in set(file_of.values())}

        def get(name: str):  # read lazily: indexing it reads only the asked-for elements
            return handles[file_of[name]].get_slice(name)

        for name, param in model.named_parameters():
            if canonical_name(name) in model.fresh_parameters:  # a recipe's new module (a reward head, adapters)
                continue
            key = "tok_embeddings.weight" if cfg.tie_embeddings and name == "output.weight" else name
            if key not in pieces:
                raise UserError(f"{src.path}: no weight for {name}")
            local, where = local_slice(param)
            if local.numel() == 0:
                continue
            piece = read_piece(pieces[key], get, where)
            local.copy_(piece)
            read += piece.numel()
    return {"kind": src.kind, "elements_read": read}


@torch.no_grad()
def _load_lora_run(model: torch.nn.Module, src: Source, saved: Config) -> dict:
    """`train.init_from` = a LoRA run (loom sft with lora.rank > 0, then loom dpo from it): the run's own base
    (its train.init_from) slice by slice, then W + (alpha / rank) B A on each adapted weight's slice. The
    adapters are small: every rank reads them whole (no collective) and keeps only its slices of the products."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    base = saved.train.init_from
    if not base:
        raise UserError(f"train.init_from={src.path} is a LoRA run whose base was initialised from train.seed, not "
                        f"loaded from a model directory; export it merged (loom convert {src.path} DIR --to hf "
                        "--merge) and start from DIR")
    if not Path(base).is_dir():
        raise UserError(f"train.init_from={src.path} is a LoRA run (adapters only); its base model, train.init_from="
                        f"{base} in its {CONFIG}, does not exist (any more): restore it, or export the run merged "
                        "where the base is available (loom convert RUN DIR --to hf --merge)")
    from loom.interop.fingerprint import check_same_base, recorded_base

    check_same_base(recorded_base(src.path), base, f"train.init_from={src.path} (a LoRA run)")
    out = load_pretrained(model, base)
    meta = FileSystemReader(str(src.path)).read_metadata().state_dict_metadata
    state = {key[len("model."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype) for key, m in meta.items()
             if key.startswith("model.") and key.endswith((".lora_A", ".lora_B"))
             and isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=src.path, no_dist=True)
    params = {canonical_name(n): p for n, p in model.named_parameters()}
    scale = saved.lora.alpha / saved.lora.rank
    for name in (k.removesuffix(".lora_A") for k in state if k.endswith(".lora_A")):
        weight = params.get(f"{name}.weight")
        if weight is None:  # a pipeline stage without this layer
            continue
        local, where = local_slice(weight)
        delta = (state[f"{name}.lora_B"].float()[where[0]] @ state[f"{name}.lora_A"].float()[:, where[1]]) * scale
        local.copy_((local.float() + delta).to(local.dtype))
    return {**out, "lora_run": str(src.path)}


def _load_dcp(model: torch.nn.Module, src: Source) -> int:
    """Model entries of a sharded loom checkpoint into this layout (DCP reads this rank's slices)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    fresh = model.fresh_parameters  # a recipe's new modules (a reward head) keep their init
    state = {k: v for k, v in get_model_state_dict(model).items() if k not in fresh}
    saved = FileSystemReader(str(src.path)).read_metadata().state_dict_metadata
    for name, tensor in state.items():
        meta = saved.get(f"model.{name}")
        if not isinstance(meta, TensorStorageMetadata):
            raise UserError(f"{src.path}: the checkpoint has no weight {name}; it does not match its config.toml")
        if tuple(meta.size) != tuple(tensor.shape):
            raise UserError(f"{src.path}: {name} has shape {tuple(meta.size)} in the checkpoint, its config needs "
                            f"{tuple(tensor.shape)}")
    distributed = dist.is_available() and dist.is_initialized()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": state}, checkpoint_id=src.path, no_dist=not distributed)
    set_model_state_dict(model, state, options=StateDictOptions(strict=not fresh))
    return sum(local_slice(t)[0].numel() for t in state.values())
