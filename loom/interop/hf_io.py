"""Hugging Face checkpoints <-> loom models: reading and writing the weights, `import_hf`, `export_hf` and
`loom convert`.

A Hugging Face directory holds `config.json` (loom.interop.hf_config), the weights as `model.safetensors`
(or shards listed in `model.safetensors.index.json`) and usually `tokenizer.json`; tensors are renamed by
loom.interop.hf_names. Writes go to a temporary directory that is renamed into place at the end, so a
failure never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loom.config import Config, ModelConfig
from loom.errors import UserError
from loom.files import honour_umask
from loom.interop.hf_config import (HF_CONFIG, HF_WEIGHTS, hf_config_from_model, hf_dtype, hf_moe_type,
                                    model_config_from_hf, read_hf_config)
from loom.interop.hf_names import hf_expert_name, hf_pieces, loom_to_hf_name, read_piece

HF_INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
TARGETS = ("loom", "hf")


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{file} is corrupt or unreadable ({exc})") from None


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face directory (single file or sharded), under their HF names."""
    p = Path(path)
    if (p / HF_WEIGHTS).is_file():
        return _load_safetensors(p / HF_WEIGHTS)
    if (p / HF_INDEX).is_file():
        try:
            index = json.loads((p / HF_INDEX).read_text())
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{p / HF_INDEX} is not a valid safetensors index ({exc!r})") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (p / f).is_file()]
        if missing:
            raise UserError(f"{p}: shards listed in {HF_INDEX} are missing: {', '.join(missing)}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(_load_safetensors(p / f))
        return state
    others = sorted(x.name for x in p.glob("*.bin")) if p.is_dir() else []
    hint = f" (found {', '.join(others)}: re-save with save_pretrained(..., safe_serialization=True))" if others else ""
    raise UserError(f"{p}: no weights found; expected {HF_WEIGHTS} or {HF_INDEX}{hint}")


def hf_to_loom_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig,
                     where: str | Path = "weights") -> dict[str, torch.Tensor]:
    pieces = hf_pieces({name: tuple(t.shape) for name, t in hf_state.items()}, where)
    if cfg.tie_embeddings:
        pieces.pop("output.weight", None)
    return {name: read_piece(piece, hf_state.__getitem__) for name, piece in pieces.items()}


def loom_to_hf_state(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors in the layout transformers' save_pretrained writes: one nn.Linear weight per
    routed expert (Mixtral: block_sparse_moe.experts.K.w1/w2/w3; Qwen: mlp.experts.K.gate/up/down_proj)."""
    mixtral = bool(cfg.moe.experts) and hf_moe_type(cfg) == "mixtral"
    out = {}
    for name, tensor in model.state_dict().items():
        if cfg.tie_embeddings and name == "output.weight":
            continue
        tensor = tensor.detach().cpu()
        expert = hf_expert_name(name, mixtral)
        if expert:
            for e, part in enumerate(tensor.unbind(0)):  # [in, out] -> nn.Linear's [out, in]
                out[expert.format(e)] = part.t().contiguous()
            continue
        hf_name = loom_to_hf_name(name)
        if mixtral:
            hf_name = hf_name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
        out[hf_name] = tensor.contiguous()
    return out


def _load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    """Strict copy of `state` (loom names) into `model`; mismatches raise a UserError."""
    expected = dict(model.state_dict())
    if model.cfg.tie_embeddings:
        expected.pop("output.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise UserError(f"{where}: weights do not match config.json: missing {_hf_names(missing)}, "
                        f"unexpected {_hf_names(unexpected)}")
    with torch.no_grad():
        for name, param in expected.items():
            tensor = state[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise UserError(f"{where}: {loom_to_hf_name(name)} has shape {tuple(tensor.shape)}, "
                                f"config.json needs {tuple(param.shape)}")
            param.copy_(tensor)


def _hf_names(names: list[str], limit: int = 5) -> list[str]:
    """Names for a message, in Hugging Face spelling where one exists."""
    out = []
    for name in names[:limit]:
        try:
            out.append(loom_to_hf_name(name))
        except UserError:
            out.append(name)
    return out + ([f"... {len(names) - limit} more"] if len(names) > limit else [])


def import_hf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(loom Transformer in eval mode, Config, tokenizer.json path or None) from a Hugging Face dir."""
    from loom.models.llama import build_model

    p = Path(path)
    hf = read_hf_config(p)
    model_cfg = model_config_from_hf(hf, where=str(p / HF_CONFIG))
    cfg = Config(model=model_cfg)
    cfg.name = p.resolve().name
    cfg.train.seq_len = min(cfg.train.seq_len, model_cfg.max_seq_len)
    cfg.validate()
    state = hf_to_loom_state(load_hf_state_dict(p), model_cfg, p)
    model = build_model(model_cfg, device=device, dtype=dtype)
    _load_into(model, state, p)
    tokenizer = p / TOKENIZER
    return model.eval(), cfg, (tokenizer if tokenizer.is_file() else None)


def _check_free(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"output {dst} already exists and is not an empty directory; choose a new path "
                        "or remove it first")


@contextlib.contextmanager
def _atomic_dir(dst: Path):
    """Yield a fresh temporary directory that becomes `dst` when the block succeeds."""
    dst = Path(dst)
    _check_free(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():
            dst.rmdir()
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def export_hf(model: torch.nn.Module, cfg: Config, out_dir: str | Path, tokenizer_path: str | Path | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write a Hugging Face directory (config.json, safetensors weights, tokenizer) at out_dir: Llama, Qwen2,
    Qwen3, Mixtral, Qwen2-MoE or Qwen3-MoE, whichever computes what `model` computes."""
    if max_shard_bytes <= 0:
        raise UserError(f"max_shard_bytes={max_shard_bytes} must be > 0")
    dtype = next(model.parameters()).dtype
    hf_config = hf_config_from_model(cfg.model, dtype)  # refuses non-Llama models before writing
    state = loom_to_hf_state(model, cfg.model)
    out = Path(out_dir)
    with _atomic_dir(out) as tmp:
        (tmp / HF_CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
        shards = _shards(state, max_shard_bytes)
        metadata = {"format": "pt", "producer": "loom"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / HF_WEIGHTS), metadata=metadata)
            honour_umask(tmp / HF_WEIGHTS)
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata=metadata)
                honour_umask(tmp / fname)
                weight_map.update({name: fname for name in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / HF_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if tokenizer_path is not None and Path(tokenizer_path).is_file():
            write_hf_tokenizer(Path(tokenizer_path), tmp)
    return out


def write_hf_tokenizer(tokenizer_path: Path, out: Path) -> None:
    """tokenizer.json and the files carried beside it (loom.models.io.TOKENIZER_FILES) into a Hugging Face
    directory, completed so that transformers' AutoTokenizer reads it whole: tokenizer_config.json names a
    tokenizer class that needs only tokenizer.json and keeps the chat template (or chat_template.jinja comes
    along) and `eos_token`; generation_config.json holds `eos_token_id` (the eos token's id and the
    end-of-document token's)."""
    from loom.data.tokenizer import Tokenizer
    from loom.models.io import copy_tokenizer_files

    copied = copy_tokenizer_files(tokenizer_path, out)
    tok = Tokenizer.from_file(out / TOKENIZER)
    config_file, generation_file = out / "tokenizer_config.json", out / "generation_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if "tokenizer_config.json" in copied else {}
    # The model's own class (Qwen2Tokenizer, ...) may want vocabulary files loom does not carry; this one reads
    # tokenizer.json alone and tokenizes the same.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    eod = None if tok.eod_id is None else tok.tok.id_to_token(tok.eod_id)
    if not config.get("eos_token") and eod is not None:
        config["eos_token"] = eod
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    honour_umask(config_file)
    if "generation_config.json" not in copied:
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        ids = [i for i in dict.fromkeys((tok.tok.token_to_id(eos) if isinstance(eos, str) else None, tok.eod_id))
               if i is not None]
        if ids:
            generation_file.write_text(json.dumps({"eos_token_id": ids if len(ids) > 1 else ids[0]}, indent=2) + "\n")
            honour_umask(generation_file)


def convert(src: str | Path, dst: str | Path, to: str, dtype: torch.dtype | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Convert between a Hugging Face directory (Llama, Qwen2/3, Mixtral, Qwen2/3-MoE) and a loom model directory.

    to="loom": `src` is a Hugging Face directory; `dst` becomes a loom model directory (weights in the
    dtype config.json declares unless `dtype` is given). to="hf": `src` is a loom run directory,
    checkpoint or model directory; `dst` becomes a Hugging Face directory (float32 unless `dtype`).
    """
    from loom.models.io import TOKENIZER as LOOM_TOKENIZER
    from loom.models.io import load_model_dir, save_model_dir

    if to not in TARGETS:
        raise UserError(f"convert target {to!r} is not valid; valid: {', '.join(TARGETS)}")
    dst = Path(dst)
    _check_free(dst)
    if to == "loom":
        hf = read_hf_config(src)
        model, cfg, tokenizer = import_hf(src, dtype=dtype or hf_dtype(hf))
        with _atomic_dir(dst) as tmp:
            save_model_dir(model, cfg, tmp, tokenizer_path=tokenizer)
        return dst
    model, cfg, model_dir = load_model_dir(src, dtype=dtype or torch.float32)
    tokenizer = model_dir / LOOM_TOKENIZER
    export_hf(model, cfg, dst, tokenizer_path=tokenizer if tokenizer.is_file() else None,
              max_shard_bytes=max_shard_bytes)
    return dst
