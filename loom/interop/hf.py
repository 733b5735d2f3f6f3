"""Hugging Face Llama / Qwen2 / Qwen3 / Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints <-> loom models.

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

Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) add, on their MoE layers:

    ...{block_sparse_moe,mlp}.gate.weight [E, hidden]     layers.N.feed_forward.router.weight
    ...experts.K.{w1,w3,w2}.weight (Mixtral) or           layers.N.feed_forward.experts.{w1,w3,w2}
       ...experts.K.{gate,up,down}_proj.weight (Qwen)       stacked over K and transposed: [E, in, out]
    ...experts.gate_up_proj [E, 2 ffn, hidden] and        the same, from the fused layout of transformers 5's
       ...experts.down_proj [E, hidden, ffn]                 modules (read, never written)
    mlp.shared_expert.{gate,up,down}_proj.weight          layers.N.feed_forward.shared.{w1,w3,w2}.weight
    mlp.shared_expert_gate.weight                         layers.N.feed_forward.shared_gate.weight

A loom tensor built from several Hugging Face tensors is described by a `Piece`, which reads any slice of
it from the sources (`read_piece`), so train.init_from can fill an expert-sharded parameter without reading
the others. Routing is softmax over all experts, top-k, renormalised over the k (Mixtral always, Qwen iff
`norm_topk_prob`), dropless: loom's `softmax` router with `moe.renormalize`. Which layers are MoE
(Qwen's `decoder_sparse_step` and `mlp_only_layers`) must be one loom's `moe.first_dense`/`moe.interval`
express; Qwen2-MoE's shared expert must be a multiple of the routed experts' width (`moe.shared_experts`).
`router_aux_loss_coef` becomes `moe.load_balance_coeff` (loom applies it per MoE layer to the Switch loss).

Only what loom can compute exactly is accepted: a Llama (or Mistral without sliding window), Qwen2/2.5 or
Qwen3 with SiLU gated MLP, RMSNorm, RoPE plain or with Llama 3.1's scaling (`rope_type` 'llama3'), and their
MoE relatives above. Anything else is refused with a UserError naming the field, its value and what would
be valid. Writes go to a temporary directory that is renamed into place at the end, so a failure never
leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
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

# Per-layer names: (Hugging Face module, loom module). Where a loom module has two spellings the last
# one is written (Mixtral's `block_sparse_moe` is written by `loom_to_hf_state` itself).
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
    ("block_sparse_moe.gate", "feed_forward.router"),
    ("mlp.gate", "feed_forward.router"),
    ("mlp.shared_expert.gate_proj", "feed_forward.shared.w1"),
    ("mlp.shared_expert.up_proj", "feed_forward.shared.w3"),
    ("mlp.shared_expert.down_proj", "feed_forward.shared.w2"),
    ("mlp.shared_expert_gate", "feed_forward.shared_gate"),
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
# Routed experts: one nn.Linear weight [out, in] per expert, or transformers 5's fused [E, out, in] tensors.
_HF_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                           r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_HF_FUSED_RE = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)"
                          r"(?:\.weight)?")
_LOOM_EXPERTS_RE = re.compile(r"layers\.(\d+)\.feed_forward\.experts\.(w1|w2|w3)")
_EXPERT_WEIGHT = {"w1": "w1", "w2": "w2", "w3": "w3", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_QWEN_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


# --- names ---------------------------------------------------------------------------------------


def is_hf_dir(path: str | Path) -> bool:
    """True when `path` is a directory with a Hugging Face `config.json`."""
    return (Path(path) / HF_CONFIG).is_file()


def hf_to_loom_name(name: str) -> str | None:
    """The loom name of a Hugging Face tensor that maps one to one; None for tensors loom ignores (rotary
    inv_freq). Routed experts map many to one: see `hf_pieces`."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name in _HF_TO_LOOM_GLOBAL:
        return _HF_TO_LOOM_GLOBAL[name]
    m = _HF_LAYER_RE.fullmatch(name)
    if m and m.group(2) in _HF_TO_LOOM_LAYER:
        return f"layers.{m.group(1)}.{_HF_TO_LOOM_LAYER[m.group(2)]}.{m.group(3)}"
    return name  # unknown: left as is so the strict check reports it


def loom_to_hf_name(name: str) -> str:
    """The Hugging Face name of a loom tensor (Qwen spelling; stacked experts as the pattern of their parts)."""
    if name in _LOOM_TO_HF_GLOBAL:
        return _LOOM_TO_HF_GLOBAL[name]
    m = _LOOM_LAYER_RE.fullmatch(name)
    if m and m.group(2) in _LOOM_TO_HF_LAYER:
        return f"model.layers.{m.group(1)}.{_LOOM_TO_HF_LAYER[m.group(2)]}.{m.group(3)}"
    m = _LOOM_EXPERTS_RE.fullmatch(name)
    if m:
        return f"model.layers.{m.group(1)}.mlp.experts.K.{_QWEN_EXPERT[m.group(2)]}.weight"
    raise UserError(f"tensor {name!r} has no Hugging Face equivalent; only Llama/Qwen/Mixtral-shaped models export")


@dataclass(frozen=True)
class Piece:
    """How one loom tensor is read from Hugging Face tensors.

    kind "copy": `names[0]` as is. "experts": loom's stacked [E, in, out] from one nn.Linear weight
    [out, in] per expert, `names[e]`. "fused": [E, in, out] from `names[0]` [E, rows, in], its rows
    `rows[0]:rows[1]` (gate and up share one tensor in transformers 5's layout)."""

    names: tuple[str, ...]
    kind: str = "copy"
    rows: tuple[int, int] | None = None


def hf_pieces(shapes: dict[str, tuple[int, ...]], where: str | Path = "weights") -> dict[str, Piece]:
    """loom name -> Piece for the Hugging Face tensors named in `shapes` (name -> shape). Names loom does
    not know map to themselves, so the strict checks report them; rotary inv_freq is dropped."""
    out: dict[str, Piece] = {}
    per_expert: dict[str, dict[int, str]] = {}
    for name, shape in shapes.items():
        m = _HF_EXPERT_RE.fullmatch(name)
        if m:
            loom = f"layers.{m.group(1)}.feed_forward.experts.{_EXPERT_WEIGHT[m.group(3)]}"
            per_expert.setdefault(loom, {})[int(m.group(2))] = name
            continue
        m = _HF_FUSED_RE.fullmatch(name)
        if m and len(shape) == 3:
            prefix = f"layers.{m.group(1)}.feed_forward.experts"
            if m.group(2) == "down_proj":
                out[f"{prefix}.w2"] = Piece((name,), "fused", (0, shape[1]))
            else:
                half = shape[1] // 2
                out[f"{prefix}.w1"] = Piece((name,), "fused", (0, half))
                out[f"{prefix}.w3"] = Piece((name,), "fused", (half, 2 * half))
            continue
        loom = hf_to_loom_name(name)
        if loom is not None:
            out[loom] = Piece((name,))
    for loom, found in per_expert.items():
        if sorted(found) != list(range(len(found))):
            raise UserError(f"{where}: the experts of {loom_to_hf_name(loom)} are numbered {sorted(found)}; "
                            f"expected 0..{len(found) - 1} with none missing")
        names = tuple(found[e] for e in range(len(found)))
        if len({tuple(shapes[n]) for n in names}) != 1:
            raise UserError(f"{where}: the experts of {loom_to_hf_name(loom)} differ in shape: "
                            f"{sorted({tuple(shapes[n]) for n in names})}")
        out[loom] = Piece(names, "experts")
    return out


def piece_shape(piece: Piece, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of the loom tensor a Piece builds."""
    first = tuple(shapes[piece.names[0]])
    if piece.kind == "experts":
        return (len(piece.names), first[1], first[0])
    if piece.kind == "fused":
        return (first[0], first[2], piece.rows[1] - piece.rows[0])
    return first


def read_piece(piece: Piece, get, where: tuple[slice, ...] | None = None) -> torch.Tensor:
    """The loom tensor of `piece`, or its slice `where` (slices with step 1, one per dimension).

    `get(name)` returns something indexable by a tuple of slices: a tensor, or a safetensors slice (so only
    the asked-for elements are read from disk)."""
    if piece.kind == "copy":
        source = get(piece.names[0])
        return source[where] if where is not None else source[:]
    if where is None:
        where = (slice(None),) * 3
    e, a, b = where  # expert, input row, output column of loom's [E, in, out]
    if piece.kind == "experts":
        return torch.stack([get(n)[b, a] for n in piece.names[e]]).transpose(1, 2)
    lo, hi = piece.rows
    rows = slice(lo + (b.start or 0), hi if b.stop is None else lo + b.stop)
    return get(piece.names[0])[e, rows, a].transpose(1, 2)


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
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


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


def _moe_layer_rule(hf: dict, layers: int, where: str) -> tuple[int, int]:
    """(moe.first_dense, moe.interval) for Qwen's rule: layer i is MoE unless listed in mlp_only_layers, and
    when (i + 1) % decoder_sparse_step == 0. Refused when loom's rule (i >= first_dense and
    i % interval == 0) gives another set of layers."""
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise UserError(f"{where}: decoder_sparse_step={step!r} must be an integer >= 1")
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise UserError(f"{where}: mlp_only_layers={only!r} must be a list of layer numbers")
    want = [i for i in range(layers) if i not in only and (i + 1) % step == 0]
    if not want:
        raise UserError(f"{where}: decoder_sparse_step={step} with mlp_only_layers={only} makes layers [] MoE: the "
                        f"model is dense; valid: at least one of the {layers} layers MoE")
    for interval in range(1, layers + 1):
        for first in range(layers):
            if [i for i in range(layers) if i >= first and i % interval == 0] == want:
                return first, interval
    raise UserError(f"{where}: decoder_sparse_step={step} with mlp_only_layers={only} makes layers {want} MoE, which "
                    "loom cannot express (layer i is MoE when i >= model.moe.first_dense and i % model.moe.interval "
                    "== 0); valid: e.g. decoder_sparse_step=1 with mlp_only_layers [] or a prefix [0, ..., k-1]")


def _moe_from_hf(hf: dict, model_type: str, layers: int, need, where: str) -> dict:
    """The `moe_*` ModelConfig fields of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json."""
    mixtral = model_type == "mixtral"
    experts = int(need("num_local_experts" if mixtral or "num_experts" not in hf else "num_experts"))
    if experts < 1:
        raise UserError(f"{where}: num_experts={experts} makes every layer dense; valid: >= 1 (or convert it as "
                        "a dense model)")
    top_k = int(hf.get("num_experts_per_tok", 2))
    renormalize = mixtral or bool(hf.get("norm_topk_prob", False))
    field = "model_type='mixtral'" if mixtral else "norm_topk_prob=true"
    if top_k == 1 and renormalize:
        raise UserError(f"{where}: num_experts_per_tok=1 with {field} gives every token's expert the weight 1, "
                        "which loom's softmax router (weight = the expert's probability for top-1) does not "
                        "compute; valid: num_experts_per_tok >= 2" + ("" if mixtral else " or norm_topk_prob=false"))
    jitter = float(hf.get("router_jitter_noise") or 0.0)
    if jitter:
        raise UserError(f"{where}: router_jitter_noise={jitter} is unsupported by loom (it would train with "
                        "other routing than transformers); valid: 0")
    ffn = int(need("intermediate_size" if mixtral else "moe_intermediate_size"))
    first_dense, interval = (0, 1) if mixtral else _moe_layer_rule(hf, layers, where)
    shared = 0
    if model_type == "qwen2_moe":
        size = int(hf.get("shared_expert_intermediate_size") or 0)
        if size <= 0 or ffn <= 0 or size % ffn:
            raise UserError(f"{where}: shared_expert_intermediate_size={size} must be a positive multiple of "
                            f"moe_intermediate_size={ffn}: loom's shared experts are model.moe.shared_experts "
                            "times model.moe.ffn_hidden wide (every Qwen2-MoE release: 4 or 8 times)")
        shared = size // ffn
    return dict(moe_experts=experts, moe_top_k=top_k, moe_ffn_hidden=ffn, moe_shared_experts=shared,
                moe_shared_gate=shared > 0, moe_router="softmax", moe_renormalize=renormalize,
                moe_load_balance_coeff=float(hf.get("router_aux_loss_coef", 0.001)), moe_z_loss_coeff=0.0,
                moe_capacity_factor=0.0, moe_first_dense=first_dense, moe_interval=interval)


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """A loom ModelConfig from a Hugging Face Llama, Mistral, Qwen2/2.5, Qwen3 (dense), Mixtral, Qwen2-MoE or
    Qwen3-MoE `config.json`."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(f"{where}: model_type {model_type!r} is not supported; valid: 'llama' "
                        "(or 'mistral' without sliding window), 'qwen2' (Qwen2 / Qwen2.5), 'qwen3' (dense), "
                        "'mixtral', 'qwen2_moe', 'qwen3_moe'")

    def need(key):
        if key not in hf:
            raise UserError(f"{where}: required field {key!r} is missing")
        return hf[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    max_pos = int(hf.get("max_position_embeddings", 2048))
    if model_type in ("mistral", "mixtral"):
        window = hf.get("sliding_window")
        if window is not None and int(window) < max_pos:
            raise UserError(f"{where}: sliding_window={window} is unsupported by loom; valid: null (or >= "
                            f"max_position_embeddings={max_pos})")
    if model_type.startswith(("qwen2", "qwen3")) and hf.get("use_sliding_window"):
        raise UserError(f"{where}: use_sliding_window=true is unsupported by loom; valid: false (every Qwen2.5 "
                        "and Qwen3 release)")
    windowed = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if windowed:
        raise UserError(f"{where}: layer_types holds {windowed[0]!r}; loom computes full causal attention only, "
                        "valid: every entry 'full_attention'")
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
    elif model_type == "qwen2_moe":  # biases on q, k, v unless qkv_bias=false
        attn_bias, mlp_bias, qkv_bias = False, False, bool(hf.get("qkv_bias", True))
    elif model_type == "mixtral":  # no biases at all
        attn_bias = mlp_bias = False
    elif model_type in ("qwen3", "qwen3_moe"):
        if attn_bias:
            raise UserError(f"{where}: attention_bias=true is unsupported for {model_type} (biases on q, k, v and o "
                            "but not the MLP); valid: false, as every Qwen3 release")
        qk_norm = True
    if attn_bias != mlp_bias:
        raise UserError(f"{where}: attention_bias={str(attn_bias).lower()} with mlp_bias="
                        f"{str(mlp_bias).lower()} is unsupported; loom's bias option covers attention and MLP "
                        "together, valid: both false or both true")
    layers = int(need("num_hidden_layers"))
    moe = _moe_from_hf(hf, model_type, layers, need, where) if model_type in MOE_TYPES else {}
    cfg = ModelConfig(
        layers=layers,
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
        **moe,
    )
    try:
        cfg.validate()
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    return cfg


def hf_moe_type(cfg: ModelConfig) -> str:
    """The Hugging Face model_type an MoE model exports as: 'qwen3_moe' (q/k norm), 'qwen2_moe' (shared
    experts) or 'mixtral'; refuses what none of them computes exactly."""
    problems = []
    if cfg.moe_router != "softmax":
        problems.append(f"model.moe.router={cfg.moe_router!r} (valid: 'softmax', the routing transformers computes)")
    if cfg.moe_capacity_factor:
        problems.append(f"model.moe.capacity_factor={cfg.moe_capacity_factor} (valid: 0, dropless, as transformers)")
    if cfg.bias:
        problems.append("model.bias=true (valid: false)")
    if cfg.qk_norm:
        kind = "qwen3_moe"
        if cfg.moe_shared_experts:
            problems.append(f"model.moe.shared_experts={cfg.moe_shared_experts} with model.qk_norm=true (Qwen3-MoE "
                            "has no shared experts; valid: 0)")
        if cfg.qkv_bias:
            problems.append("model.qkv_bias=true with model.qk_norm=true (Qwen3-MoE has no biases; valid: false)")
    elif cfg.moe_shared_experts:
        kind = "qwen2_moe"
        if not cfg.moe_shared_gate:
            problems.append("model.moe.shared_gate=false (Qwen2-MoE gates its shared expert; valid: true)")
    else:
        kind = "mixtral"
        if cfg.qkv_bias:
            problems.append("model.qkv_bias=true without shared experts (Mixtral has no biases; valid: false, or "
                            "shared experts with a gate for Qwen2-MoE)")
        if cfg.moe_layers != cfg.layers:
            problems.append(f"model.moe.first_dense={cfg.moe_first_dense} with model.moe.interval={cfg.moe_interval} "
                            "(Mixtral's layers are all MoE; valid: 0 and 1, or model.qk_norm=true for Qwen3-MoE)")
        if not (cfg.moe_renormalize and cfg.moe_top_k > 1):
            problems.append(f"model.moe.renormalize={str(cfg.moe_renormalize).lower()} with model.moe.top_k="
                            f"{cfg.moe_top_k} (Mixtral renormalises its top-k gates; valid: true with top_k >= 2)")
    if problems:
        raise UserError("this mixture-of-experts model has no exact Hugging Face equivalent (Mixtral, Qwen2-MoE, "
                        "Qwen3-MoE): " + "; ".join(problems))
    return kind


def _moe_to_hf(cfg: ModelConfig, kind: str) -> dict:
    ffn = cfg.moe_ffn_hidden or cfg.ffn_hidden
    out = {"num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": cfg.moe_load_balance_coeff,
           "output_router_logits": False}
    if kind == "mixtral":
        return {**out, "num_local_experts": cfg.moe_experts, "intermediate_size": ffn, "router_jitter_noise": 0.0}
    out.update(num_experts=cfg.moe_experts, moe_intermediate_size=ffn, decoder_sparse_step=1,
               norm_topk_prob=cfg.moe_renormalize and cfg.moe_top_k > 1,  # loom leaves a top-1 gate as is
               mlp_only_layers=[i for i in range(cfg.layers) if not cfg.is_moe_layer(i)])
    if kind == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.moe_shared_experts * ffn, qkv_bias=cfg.qkv_bias)
    return out


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """A `config.json` dict that transformers loads: Qwen3 (q/k norm), Qwen2 (q/k/v biases) or Llama; with
    experts Qwen3-MoE, Qwen2-MoE or Mixtral (`hf_moe_type`)."""
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
    if cfg.moe_experts:
        model_type = hf_moe_type(cfg)
        arch = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}[model_type]
    elif cfg.qk_norm:
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
        if model_type in ("qwen3", "qwen3_moe"):
            out["attention_bias"] = False
    if cfg.moe_experts:
        out.update(_moe_to_hf(cfg, model_type))
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


def hf_to_loom_state(hf_state: dict[str, torch.Tensor], cfg: ModelConfig,
                     where: str | Path = "weights") -> dict[str, torch.Tensor]:
    pieces = hf_pieces({name: tuple(t.shape) for name, t in hf_state.items()}, where)
    if cfg.tie_embeddings:
        pieces.pop("output.weight", None)
    return {name: read_piece(piece, hf_state.__getitem__) for name, piece in pieces.items()}


def loom_to_hf_state(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors in the layout transformers' save_pretrained writes: one nn.Linear weight per
    routed expert (Mixtral: block_sparse_moe.experts.K.w1/w2/w3; Qwen: mlp.experts.K.gate/up/down_proj)."""
    mixtral = bool(cfg.moe_experts) and hf_moe_type(cfg) == "mixtral"
    out = {}
    for name, tensor in model.state_dict().items():
        if cfg.tie_embeddings and name == "output.weight":
            continue
        tensor = tensor.detach().cpu()
        m = _LOOM_EXPERTS_RE.fullmatch(name)
        if m:
            layer, weight = m.groups()
            stem = (f"model.layers.{layer}.block_sparse_moe.experts.{{}}.{weight}" if mixtral
                    else f"model.layers.{layer}.mlp.experts.{{}}.{_QWEN_EXPERT[weight]}")
            for e, part in enumerate(tensor.unbind(0)):  # [in, out] -> nn.Linear's [out, in]
                out[stem.format(e) + ".weight"] = part.t().contiguous()
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
            shutil.copyfile(tokenizer_path, tmp / TOKENIZER)
            (tmp / "tokenizer_config.json").write_text(
                json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    return out


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
