"""Matmul FLOP counts and device peaks: the one source of truth for MFU, `loom memory` and the planner.

Convention (stated, because published numbers differ): we count the matrix multiplications of the
forward pass exactly for the configured architecture, at 2 FLOPs per multiply-add, and training as
3x the forward (backward = 2x forward). Per token of a sequence of length s, per layer:

    query projection            2 * h * (a * d)            (a heads of size d; a*d = h)
    key + value projections     2 * h * (2 * g * d)        (g key/value heads: GQA when g < a)
    attention scores  Q K^T     2 * s * a * d              (every query against all s keys)
    attention over values       2 * s * a * d
    output projection           2 * (a * d) * h
    MLP, SwiGLU (3 matrices)    2 * 3 * h * f
    MLP, GELU (2 matrices)      2 * 2 * h * f

plus the LM head 2 * h * V once per token. A mixture-of-experts MLP counts its active parameters only:
the router 2 * h * E and (top_k + shared experts) x the expert MLP at model.moe.ffn_hidden (dropless: a
capacity factor that drops tokens makes the real count lower). Attention counts the full s x s score matrix (as
Korthikanti et al. and Megatron do), not the causal half. Recomputation is not counted here: it adds
hardware FLOPs (HFU) but not model FLOPs (MFU). Elementwise work (norms, softmax, RoPE) is ignored.
"""

from __future__ import annotations

from loom.config import ModelConfig

# Dense tensor-core peak, TFLOP/s, per device and precision (vendor datasheets, SXM parts, no sparsity):
# the one table behind MFU in metrics.jsonl and the planner's hardware presets.
PEAK_TFLOPS = {
    "a100": {"bf16": 312.0, "fp16": 312.0},
    "h100": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0},
    "h200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0},
}


def layer_forward_flops_per_token(cfg: ModelConfig, seq_len: int, moe: bool = False) -> int:
    """One layer's forward matmul FLOPs per token; `moe`: the layer's MLP is model.moe.*'s mixture of experts,
    counted with its active experts only (top_k routed + shared) and the router."""
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    qkv = 2 * h * (a * d + 2 * g * d)
    scores_and_values = 2 * 2 * seq_len * a * d
    out = 2 * a * d * h
    matrices = 3 if cfg.mlp == "swiglu" else 2
    if moe:
        fe = cfg.moe.ffn_hidden or f
        mlp = 2 * h * cfg.moe.experts + 2 * matrices * h * fe * (cfg.moe.top_k + cfg.moe.shared_experts)
        if cfg.moe.shared_experts and cfg.moe.shared_gate:
            mlp += 2 * h
    else:
        mlp = 2 * matrices * h * f
    return qkv + scores_and_values + out + mlp


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    moe_layers = cfg.moe_layers
    layers = ((cfg.layers - moe_layers) * layer_forward_flops_per_token(cfg, seq_len)
              + moe_layers * layer_forward_flops_per_token(cfg, seq_len, moe=True))
    return layers + 2 * cfg.hidden * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Model FLOPs (forward + backward, no recomputation) per trained token."""
    return 3 * forward_flops_per_token(cfg, seq_len)


def device_peak_tflops(device_name: str | None, precision: str = "bf16") -> float | None:
    """Peak dense TFLOP/s of a device from its name, or None when unknown (e.g. a CPU)."""
    if not device_name:
        return None
    name = device_name.lower()
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(precision)
    return None


def layer_activation_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int = 1, sp: bool = False,
                           recompute: str = "none", act_bytes: int = 2) -> float:
    """Bytes one transformer layer keeps for backward on one rank, for loom's own implementation.

    The analytic twin of `loom memory`'s measurement (tests/test_memory.py checks one against the
    other), for the planner. `act_bytes` is the activation element size (2 for 16-bit). With
    LayerNorm/GELU/"math" attention and dropout this is Korthikanti et al.'s sbh(34 + 5as/h) (t = 1,
    1-byte masks); with RMSNorm/SwiGLU/SDPA it is sbh(20 + 4g/a + 8f/h) + 4bs(a + 2) (RMSNorm keeps an
    fp32 copy of its input, SDPA keeps no score matrix). Under TP without SP the norms, the inputs of
    attention and MLP and the hidden dropout masks are replicated; under SP everything is divided by t.
    """
    s, b, h, a, g, f = seq_len, micro_batch, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    e = act_bytes
    sp_div = tp if sp else 1
    if recompute == "full":
        return e * s * b * h / sp_div
    hidden_mask = s * b * h if cfg.dropout > 0 else 0  # one byte per element, after each sub-block
    if cfg.norm == "layernorm":
        norms = 2 * e * s * b * h  # each LayerNorm keeps its input (mean/rstd are negligible)
    else:
        norms = 2 * (4 + e) * s * b * h + 2 * 4 * b * s  # fp32 copy + normalised output + fp32 1/rms
    replicated = norms + 2 * e * s * b * h + 2 * hidden_mask  # + attention and MLP inputs, dropout masks
    q, kv, out = e * s * b * h, 2 * e * s * b * h * g / a, e * s * b * h
    mlp = (4 if cfg.mlp == "swiglu" else 2) * e * s * b * f
    sharded = q + kv + out + mlp  # split by heads / ffn over tp
    core = 0.0
    if recompute != "selective":
        if cfg.attention == "math":
            core = e * a * s * s * b  # softmax output
            if cfg.attn_dropout > 0:
                core += a * s * s * b + e * a * s * s * b  # mask + dropped probabilities
        else:
            core = 4 * a * s * b  # fp32 log-sum-exp of fused attention
    return replicated / sp_div + (sharded + core) / tp
