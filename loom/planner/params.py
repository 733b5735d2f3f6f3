"""Parameter counts of a model, as loom/models builds it: per layer (dense and mixture-of-experts), the
routed experts, the embedding and the LM head, and the sizes the cost model reuses for every layout."""

from __future__ import annotations

from functools import lru_cache

from loom.config import ModelConfig
from loom.planner.workload import Workload


def _norm_params(cfg: ModelConfig) -> int:
    return cfg.hidden * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def _mlp_params(cfg: ModelConfig, f: int) -> int:
    """One MLP of width f: 3 (SwiGLU) or 2 matrices, and their biases with model.bias."""
    gated = cfg.mlp == "swiglu"
    return (3 if gated else 2) * cfg.hidden * f + (((2 if gated else 1) * f + cfg.hidden) if cfg.bias else 0)


def layer_params(cfg: ModelConfig, moe: bool = False) -> int:
    """One layer's parameters; `moe`: a mixture-of-experts layer (router, routed experts, shared experts and
    their gate), as loom/models/moe.py builds it."""
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    attn = h * (a + 2 * g) * d + a * d * h
    mlp = moe_mlp_params(cfg) if moe else _mlp_params(cfg, f)
    norms = 2 * _norm_params(cfg)
    bias = ((a + 2 * g) * d + h) if cfg.bias else 0
    bias += (a + 2 * g) * d if cfg.qkv_bias and not cfg.bias else 0  # Qwen2: q/k/v biases only
    qk_norm = 2 * d if cfg.qk_norm else 0  # Qwen3: one weight of head size for queries, one for keys
    return attn + mlp + norms + bias + qk_norm


def expert_params(cfg: ModelConfig) -> int:
    """The routed experts of one MoE layer (stacked w1, w3, w2: no biases), what expert parallelism shards."""
    return cfg.moe.experts * (3 if cfg.mlp == "swiglu" else 2) * cfg.hidden * (cfg.moe.ffn_hidden or cfg.ffn_hidden)


def moe_mlp_params(cfg: ModelConfig) -> int:
    """An MoE layer's MLP: the router [E, h], the routed experts, the shared experts (one MLP shared_experts x
    moe.ffn_hidden wide) and their sigmoid gate [1, h]."""
    fe = cfg.moe.ffn_hidden or cfg.ffn_hidden
    shared = _mlp_params(cfg, cfg.moe.shared_experts * fe) if cfg.moe.shared_experts else 0
    gate = cfg.hidden if cfg.moe.shared_experts and cfg.moe.shared_gate else 0
    return cfg.moe.experts * cfg.hidden + expert_params(cfg) + shared + gate


def average_layer(cfg: ModelConfig) -> tuple[float, float]:
    """(parameters outside the routed experts, routed-expert parameters) of the model's average layer: the
    planner prices a pipeline stage of n layers as n average layers (MoE layers spread evenly)."""
    moe = cfg.moe_layers
    dense = (cfg.layers - moe) * layer_params(cfg) + moe * (layer_params(cfg, moe=True) - expert_params(cfg))
    return dense / cfg.layers, moe * expert_params(cfg) / cfg.layers


def linear_weights(cfg: ModelConfig) -> int:
    """Weights of one (dense) layer's linear layers (the ones fp8 training casts)."""
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    return h * (a + 2 * g) * d + a * d * h + (3 if cfg.mlp == "swiglu" else 2) * h * f


def lora_params(cfg: ModelConfig, rank: int, targets: tuple) -> int:
    """The adapters' parameters over all layers: rank x (in + out) for every targeted projection (loom's names)."""
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    sizes = {"wq": (h, a * d), "wk": (h, g * d), "wv": (h, g * d), "wo": (a * d, h), "w1": (h, f), "w3": (h, f),
             "w2": (f, h)}
    return cfg.layers * sum(rank * sum(sizes[t]) for t in targets if t in sizes)


def embedding_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden + (cfg.max_seq_len * cfg.hidden if cfg.position == "learned" else 0)


def head_params(cfg: ModelConfig) -> int:
    # A tied head still needs its own copy on the last stage when pp > 1 (Megatron does the same).
    return cfg.vocab_size * cfg.hidden + _norm_params(cfg)


def total_params(cfg: ModelConfig) -> int:
    head = _norm_params(cfg) + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden)
    moe = cfg.moe_layers
    layers = (cfg.layers - moe) * layer_params(cfg) + moe * layer_params(cfg, moe=True)
    return layers + embedding_params(cfg) + head


@lru_cache(maxsize=1024)
def model_sizes(w: Workload) -> dict:
    """The parameter counts the cost model reuses for every layout of a workload (computed once)."""
    cfg = w.model
    dense_layer, expert_layer = average_layer(cfg)
    fe = cfg.moe.ffn_hidden or cfg.ffn_hidden
    # fp8 casts every linear weight: attention and dense MLPs, shared experts on MoE layers (routed experts apart).
    linear = linear_weights(cfg) - cfg.moe_layers / cfg.layers * (
        _mlp_params(cfg, cfg.ffn_hidden) - (_mlp_params(cfg, cfg.moe.shared_experts * fe) if cfg.moe.shared_experts else 0))
    return {"dense_layer": dense_layer, "expert_layer": expert_layer, "total": total_params(cfg),
            "experts": cfg.moe_layers * expert_params(cfg), "embedding": embedding_params(cfg),
            "head": head_params(cfg), "linear_layer": linear}
