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

plus the LM head 2 * h * V once per token. Attention counts the full s x s score matrix (as
Korthikanti et al. and Megatron do), not the causal half. Recomputation is not counted here: it adds
hardware FLOPs (HFU) but not model FLOPs (MFU). Elementwise work (norms, softmax, RoPE) is ignored.
"""

from __future__ import annotations

from loom.config import ModelConfig

# Dense 16-bit tensor-core peak, TFLOP/s, per device (vendor datasheets, SXM parts).
PEAK_TFLOPS_BF16 = {
    "a100": 312.0,
    "h100": 989.0,
    "h200": 989.0,
}


def layer_forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    qkv = 2 * h * (a * d + 2 * g * d)
    scores_and_values = 2 * 2 * seq_len * a * d
    out = 2 * a * d * h
    mlp = 2 * (3 if cfg.mlp == "swiglu" else 2) * h * f
    return qkv + scores_and_values + out + mlp


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    return cfg.layers * layer_forward_flops_per_token(cfg, seq_len) + 2 * cfg.hidden * cfg.vocab_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Model FLOPs (forward + backward, no recomputation) per trained token."""
    return 3 * forward_flops_per_token(cfg, seq_len)


def device_peak_tflops(device_name: str | None) -> float | None:
    """Peak dense bf16 TFLOP/s of a device from its name, or None when unknown (e.g. a CPU)."""
    if not device_name:
        return None
    name = device_name.lower()
    for key, peak in PEAK_TFLOPS_BF16.items():
        if key in name:
            return peak
    return None
