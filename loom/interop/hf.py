"""Hugging Face Llama / Qwen2 / Qwen3 checkpoints <-> loom models.

A Hugging Face directory holds `config.json`, the weights as `model.safetensors` (or shards listed in
`model.safetensors.index.json`) and usually `tokenizer.json`. loom's Transformer uses the same
rotate-half RoPE layout as Hugging Face Llama, so conversion is a renaming of tensors:

    model.embed_tokens.weight                      tok_embeddings.weight
    model.layers.N.self_attn.{q,k,v,o}_proj.*      layers.N.attention.{wq,wk,wv,wo}.*
    model.layers.N.mlp.{gate,up,down}_proj.*       layers.N.feed_forward.{w1,w3,w2}.*
    model.layers.N.input_layernorm.weight          layers.N.attention_norm.weight
    model.layers.N.post_attention_layernorm.weight layers.N.ffn_norm.weight
    model.norm.weight                              norm.weight
    lm_head.weight                                 output.weight (absent when embeddings are tied)

Qwen2/2.5 (biases on q/k/v: `model.qkv_bias`) and Qwen3 dense (per-head q/k RMSNorm, `self_attn.q_norm`
and `k_norm` <-> `attention.q_norm`/`k_norm`: `model.qk_norm`; a head size decoupled from hidden/heads:
`model.head_dim`) map the same way.

Only what loom can compute exactly is accepted: a Llama (or Mistral without sliding window), Qwen2/2.5 or
Qwen3 with SiLU gated MLP, RMSNorm, RoPE plain or with Llama 3.1's scaling (`rope_type` 'llama3'). Anything else is refused with a UserError
naming the field, its value and what would be valid. Writes go to a temporary directory that is
renamed into place at the end, so a failure never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loom.config import Config, ModelConfig
from loom.errors import UserError
from loom.files import honour_umask

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
TARGETS = ("loom", "hf")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# Per-layer names: (Hugging Face module, loom module).
_LAYER_NAMES = [
    ("self_attn.q_proj", "attention.wq"),
    ("self_attn.k_proj", "attention.wk"),
    ("self_attn.v_proj", "attention.wv"),
    ("self_attn.o_proj", "attention.wo"),
    ("mlp.gate_proj", "feed_forward.w1"),
    ("mlp.up_proj", "feed_forward.w3"),
    ("mlp.down_proj", "feed_forward.w2"),
    ("input_layernorm", "attention_norm"),
    ("post_attention_layernorm", "ffn_norm"),
    ("self_attn.q_norm", "attention.q_norm"),
    ("self_attn.k_norm", "attention.k_norm"),
]
_HF_TO_LOOM_LAYER = dict(_LAYER_NAMES)
_LOOM_TO_HF_LAYER = {loom: hf for hf, loom in _LAYER_NAMES}
_GLOBAL_NAMES = [
    ("model.embed_tokens.weight", "tok_embeddings.weight"),
    ("model.norm.weight", "norm.weight"),
    ("lm_head.weight", "output.weight"),
]
_HF_TO_LOOM_GLOBAL = dict(_GLOBAL_NAMES)
_LOOM_TO_HF_GLOBAL = {loom: hf for hf, loom in _GLOBAL_NAMES}
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_LOOM_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")


# --- names ---------------------------------------------------------------------------------------


def is_hf_dir(path: str | Path) -> bool:
    """True when `path` is a directory with a Hugging Face `config.json`."""
    return (Path(path) / HF_CONFIG).is_file()


def hf_to_loom_name(name: str) -> str | None:
    """The loom name of a Hugging Face tensor; None for tensors loom ignores (rotary inv_freq)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name in _HF_TO_LOOM_GLOBAL:
        return _HF_TO_LOOM_GLOBAL[name]
    m = _HF_LAYER_RE.fullmatch(name)
    if m and m.group(2) in _HF_TO_LOOM_LAYER:
        return f"layers.{m.group(1)}.{_HF_TO_LOOM_LAYER[m.group(2)]}.{m.group(3)}"
    return name  # unknown: left as is so the strict check reports it


def loom_to_hf_name(name: str) -> str:
    if name in _LOOM_TO_HF_GLOBAL:
        return _LOOM_TO_HF_GLOBAL[name]
    m = _LOOM_LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LOOM_TO_HF_LAYER:
        return f"model.layers.{m.group(1)}.{_LOOM_TO_HF_LAYER[m.group(2)]}.{m.group(3)}"
    raise UserError(f"tensor {name!r} has no Hugging Face equivalent; only Llama/Qwen-shaped models export")


# --- configs -------------------------------------------------------------------------------------


def read_hf_config(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"Hugging Face model directory {str(path)!r} does not exist; give a directory "
                        f"with {HF_CONFIG} and {HF_WEIGHTS} (e.g. one written by save_pretrained)")
    if not (p / HF_CONFIG).is_file():
        raise UserError(f"{p} is not a Hugging Face model directory: no {HF_CONFIG} in it")
    try:
        data = json.loads((p / HF_CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{p / HF_CONFIG} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p / HF_CONFIG} must hold a JSON object")
    return data


ROPE_TYPES = ("default", "llama3")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _rope(hf: dict, where: str) -> dict:
    """RoPE settings (ModelConfig fields) from a config.json: transformers 4 keeps rope_theta at the top
    level and scaling in rope_scaling; transformers 5 puts both in rope_parameters."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for d in (params, scaling):
        if not isinstance(d, dict):
            raise UserError(f"{where}: rope_parameters/rope_scaling must be an object, got {d!r}")
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise UserError(f"{where}: RoPE scaling of type {rope_type!r} is unsupported by loom; valid: "
                        f"{', '.join(map(repr, ROPE_TYPES))} (plain RoPE, or Llama 3.1/3.2's scaling)")
    out = {"rope_theta": float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type == "llama3":
        try:
            out.update(rope_scaling="llama3", rope_factor=float(merged["factor"]),
                       rope_low_freq_factor=float(merged["low_freq_factor"]),
                       rope_high_freq_factor=float(merged["high_freq_factor"]),
                       rope_original_max_len=int(merged["original_max_position_embeddings"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{where}: rope scaling 'llama3' needs numeric factor, low_freq_factor, high_freq_factor "
                            f"and original_max_position_embeddings ({exc!r})") from None
    return out


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """A loom ModelConfig from a Hugging Face Llama, Mistral, Qwen2/2.5 or Qwen3 (dense) `config.json`."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"{where}: model_type {model_type!r} is not supported; valid: 'llama' "
                        "(or 'mistral' without sliding window), 'qwen2' (Qwen2 / Qwen2.5), 'qwen3' (dense)")

    def need(key):
        if key not in hf:
            raise UserError(f"{where}: required field {key!r} is missing")
        return hf[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    max_pos = int(hf.get("max_position_embeddings", 2048))
    if model_type == "mistral":
        window = hf.get("sliding_window")
        if window is not None and int(window) < max_pos:
            raise UserError(f"{where}: sliding_window={window} is unsupported by loom; valid: null (or >= "
                            f"max_position_embeddings={max_pos})")
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        raise UserError(f"{where}: use_sliding_window=true is unsupported by loom; valid: false (every Qwen2.5 "
                        "and Qwen3 release)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}: hidden_act={act!r} is unsupported; valid: 'silu' (SwiGLU MLP)")
    head_dim = int(hf.get("head_dim") or 0)
    if heads and head_dim * heads == hidden:
        head_dim = 0  # the default: hidden / heads
    attn_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    qkv_bias = qk_norm = False
    if model_type == "qwen2":  # biases on q, k, v (always), none on o and the MLP
        attn_bias, mlp_bias, qkv_bias = False, False, True
    elif model_type == "qwen3":
        if attn_bias:
            raise UserError(f"{where}: attention_bias=true is unsupported for qwen3 (biases on q, k, v and o but "
                            "not the MLP); valid: false, as every Qwen3 release")
        qk_norm = True
    if attn_bias != mlp_bias:
        raise UserError(f"{where}: attention_bias={str(attn_bias).lower()} with mlp_bias="
                        f"{str(mlp_bias).lower()} is unsupported; loom's bias option covers attention and MLP "
                        "together, valid: both false or both true")
    cfg = ModelConfig(
        layers=int(need("num_hidden_layers")),
        hidden=hidden,
        heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads),
        ffn_hidden=int(need("intermediate_size")),
        vocab_size=int(need("vocab_size")),
        max_seq_len=max_pos,
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        mlp="swiglu",
        position="rope",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bias=attn_bias,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        explicit_head_dim=head_dim,
        attn_dropout=float(hf.get("attention_dropout", 0.0)),
        init_std=float(hf.get("initializer_range", 0.02)),
        **_rope(hf, where),
    )
    try:
        cfg.validate()
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    return cfg


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A `config.json` dict that transformers loads: Qwen3 (q/k norm), Qwen2 (q/k/v biases) or Llama."""
    unsupported = []
    if cfg.norm != "rmsnorm":
        unsupported.append(f"model.norm={cfg.norm!r} (valid: 'rmsnorm')")
    if cfg.mlp != "swiglu":
        unsupported.append(f"model.mlp={cfg.mlp!r} (valid: 'swiglu')")
    if cfg.position != "rope":
        unsupported.append(f"model.position={cfg.position!r} (valid: 'rope')")
    if cfg.qk_norm and (cfg.bias or cfg.qkv_bias):
        unsupported.append("model.qk_norm=true with biases (valid: Qwen3, without biases)")
    if unsupported:
        raise UserError("only Llama-, Qwen2- and Qwen3-shaped models export to Hugging Face; this model has "
                        + ", ".join(unsupported))
    dtype_name = DTYPE_NAMES.get(dtype, "float32")
    model_type, arch = "llama", "LlamaForCausalLM"
    if cfg.qk_norm:
        model_type, arch = "qwen3", "Qwen3ForCausalLM"
    elif cfg.qkv_bias and not cfg.bias:  # with every bias on it is a Llama with attention_bias
        model_type, arch = "qwen2", "Qwen2ForCausalLM"
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    out = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4.x
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling != "none" else None,
        "rope_parameters": rope,  # transformers 5
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": cfg.attn_dropout,
        "initializer_range": cfg.init_std,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "use_cache": True,
    }
    if model_type != "llama":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.layers)
        del out["attention_bias"], out["mlp_bias"]
        if model_type == "qwen3":
            out["attention_bias"] = False
    return out


# --- weights -------------------------------------------------------------------------------------


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


def hf_to_loom_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in hf_state.items():
        new = hf_to_loom_name(name)
        if new is None or (cfg.tie_embeddings and new == "output.weight"):
            continue
        out[new] = tensor
    return out


def loom_to_hf_state(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in model.state_dict().items():
        if cfg.tie_embeddings and name == "output.weight":
            continue
        out[loom_to_hf_name(name)] = tensor.detach().cpu().contiguous()
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


# --- import / export -----------------------------------------------------------------------------


def hf_dtype(hf: dict) -> torch.dtype:
    """The dtype a config.json declares (float32 when absent or unknown)."""
    return DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32)


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
    state = hf_to_loom_state(load_hf_state_dict(p), model_cfg)
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
    """Write a Hugging Face Llama directory (config.json, safetensors weights, tokenizer) at out_dir."""
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
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER)
            (tmp / "tokenizer_config.json").write_text(
                json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    return out


def convert(src: str | Path, dst: str | Path, to: str, dtype: torch.dtype | None = None,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Convert between a Hugging Face Llama directory and a loom model directory.

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
