"""Hugging Face `config.json` <-> loom's ModelConfig.

Only what loom can compute exactly is accepted: a Llama (or Mistral without sliding window), Qwen2/2.5
(biases on q/k/v: `model.qkv_bias`) or Qwen3 (q/k RMSNorm: `model.qk_norm`; a head size decoupled from
hidden/heads: `model.head_dim`) with SiLU gated MLP, RMSNorm, RoPE plain or with Llama 3.1's scaling
(`rope_type` 'llama3', its bounds checked by ModelConfig.validate as for a TOML config), and their
mixture-of-experts relatives Mixtral, Qwen2-MoE and Qwen3-MoE. Anything else is refused with a UserError
naming the field, its value and what would be valid.

MoE routing is softmax over all experts, top-k, renormalised over the k (Mixtral always, Qwen iff
`norm_topk_prob`), dropless: loom's `softmax` router with `moe.renormalize`. Which layers are MoE (Qwen's
`decoder_sparse_step` and `mlp_only_layers`) must be one loom's `moe.first_dense`/`moe.interval` express;
Qwen2-MoE's shared expert must be a multiple of the routed experts' width (`moe.shared_experts`).
`router_aux_loss_coef` becomes `moe.load_balance_coeff` (loom applies it per MoE layer to the Switch loss).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loom.config import ModelConfig, MoEConfig
from loom.errors import UserError

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def is_hf_dir(path: str | Path) -> bool:
    """The one rule telling a Hugging Face model directory from a loom one: a Hugging Face `config.json` and
    nothing of loom's (its `config.toml`, a run's `checkpoints/`, a checkpoints directory's `latest`), which wins
    where both are present (a loom directory may carry a config.json beside its own)."""
    from loom.models.io import CONFIG

    p = Path(path)
    loom = (p / CONFIG).is_file() or (p / "checkpoints").is_dir() or (p / "latest").is_file()
    return (p / HF_CONFIG).is_file() and not loom


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
    level and scaling in rope_scaling; transformers 5 puts both in rope_parameters. Only read here: their
    bounds are ModelConfig.validate's, as for a TOML config (`model_config_from_hf` runs it)."""
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


def _moe_from_hf(hf: dict, model_type: str, layers: int, need, where: str) -> MoEConfig:
    """The `model.moe` section of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json."""
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
    return MoEConfig(experts=experts, top_k=top_k, ffn_hidden=ffn, shared_experts=shared, shared_gate=shared > 0,
                     router="softmax", renormalize=renormalize,
                     load_balance_coeff=float(hf.get("router_aux_loss_coef", 0.001)), z_loss_coeff=0.0,
                     capacity_factor=0.0, first_dense=first_dense, interval=interval)


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
    moe = _moe_from_hf(hf, model_type, layers, need, where) if model_type in MOE_TYPES else MoEConfig()
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
        moe=moe,
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
    if cfg.moe.router != "softmax":
        problems.append(f"model.moe.router={cfg.moe.router!r} (valid: 'softmax', the routing transformers computes)")
    if cfg.moe.capacity_factor:
        problems.append(f"model.moe.capacity_factor={cfg.moe.capacity_factor} (valid: 0, dropless, as transformers)")
    if cfg.bias:
        problems.append("model.bias=true (valid: false)")
    if cfg.qk_norm:
        kind = "qwen3_moe"
        if cfg.moe.shared_experts:
            problems.append(f"model.moe.shared_experts={cfg.moe.shared_experts} with model.qk_norm=true (Qwen3-MoE "
                            "has no shared experts; valid: 0)")
        if cfg.qkv_bias:
            problems.append("model.qkv_bias=true with model.qk_norm=true (Qwen3-MoE has no biases; valid: false)")
    elif cfg.moe.shared_experts:
        kind = "qwen2_moe"
        if not cfg.moe.shared_gate:
            problems.append("model.moe.shared_gate=false (Qwen2-MoE gates its shared expert; valid: true)")
    else:
        kind = "mixtral"
        if cfg.qkv_bias:
            problems.append("model.qkv_bias=true without shared experts (Mixtral has no biases; valid: false, or "
                            "shared experts with a gate for Qwen2-MoE)")
        if cfg.moe_layers != cfg.layers:
            problems.append(f"model.moe.first_dense={cfg.moe.first_dense} with model.moe.interval={cfg.moe.interval} "
                            "(Mixtral's layers are all MoE; valid: 0 and 1, or model.qk_norm=true for Qwen3-MoE)")
        if not (cfg.moe.renormalize and cfg.moe.top_k > 1):
            problems.append(f"model.moe.renormalize={str(cfg.moe.renormalize).lower()} with model.moe.top_k="
                            f"{cfg.moe.top_k} (Mixtral renormalises its top-k gates; valid: true with top_k >= 2)")
    if problems:
        raise UserError("this mixture-of-experts model has no exact Hugging Face equivalent (Mixtral, Qwen2-MoE, "
                        "Qwen3-MoE): " + "; ".join(problems))
    return kind


def _moe_to_hf(cfg: ModelConfig, kind: str) -> dict:
    ffn = cfg.moe.ffn_hidden or cfg.ffn_hidden
    out = {"num_experts_per_tok": cfg.moe.top_k, "router_aux_loss_coef": cfg.moe.load_balance_coeff,
           "output_router_logits": False}
    if kind == "mixtral":
        return {**out, "num_local_experts": cfg.moe.experts, "intermediate_size": ffn, "router_jitter_noise": 0.0}
    out.update(num_experts=cfg.moe.experts, moe_intermediate_size=ffn, decoder_sparse_step=1,
               norm_topk_prob=cfg.moe.renormalize and cfg.moe.top_k > 1,  # loom leaves a top-1 gate as is
               mlp_only_layers=[i for i in range(cfg.layers) if not cfg.is_moe_layer(i)])
    if kind == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.moe.shared_experts * ffn, qkv_bias=cfg.qkv_bias)
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
    if cfg.moe.experts:
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
    if cfg.moe.experts:
        out.update(_moe_to_hf(cfg, model_type))
    return out


def hf_dtype(hf: dict) -> torch.dtype:
    """The dtype a config.json declares (float32 when absent or unknown)."""
    return DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32)
