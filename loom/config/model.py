"""The model section (`model.*`): the architecture of a decoder-only transformer and its checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from loom.config.section import Section, below_one, finite_non_negative, finite_positive, non_negative, positive
from loom.errors import UserError
from loom.rules import divisors


@dataclass
class MoEConfig(Section):
    """Mixture of experts, the `model.moe.*` keys (loom/models/moe.py); checked by ModelConfig, which knows
    the layer count. experts=0: every MLP dense."""

    experts: int = 0
    top_k: int = 2
    ffn_hidden: int = 0  # per expert; 0: model.ffn_hidden
    shared_experts: int = 0  # always-on, each moe.ffn_hidden
    shared_gate: bool = False  # sigmoid gate (Qwen2-MoE)
    router: Literal["softmax", "sinkhorn", "sigmoid_bias"] = "softmax"
    renormalize: bool = False  # gates over the k chosen
    bias_update_rate: float = 1e-3  # sigmoid_bias
    load_balance: Literal["batch", "sequence"] = "batch"
    load_balance_coeff: float = 0.01
    z_loss_coeff: float = 0.0
    capacity_factor: float = 0.0  # 0: dropless
    drop_policy: Literal["probs", "position"] = "probs"
    # Which layers are MoE: layer i when i >= moe.first_dense and i % moe.interval == 0 (DeepSeek's rule).
    interval: int = 1
    first_dense: int = 0


@dataclass
class ModelConfig(Section):
    """Architecture of a decoder-only transformer (Llama 2/3 by default, GPT-3 through options)."""

    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 4  # grouped-query attention when smaller than heads
    ffn_hidden: int = 352
    vocab_size: int = 1024
    max_seq_len: int = 2048  # RoPE table / learned position table size
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    position: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    # Llama 3.1+ long-context RoPE ("llama3": low frequencies divided by rope_factor, high ones kept, a
    # smooth ramp between, around the original context rope_original_max_len); "none": plain RoPE.
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool = False
    bias: bool = False  # biases in linear layers (GPT-3 style)
    qkv_bias: bool = False  # biases on the query/key/value projections only (Qwen2 / Qwen2.5)
    qk_norm: bool = False  # RMSNorm over each query/key head after projection, before RoPE (Qwen3)
    # `model.head_dim`: size of one attention head; 0 means hidden / heads (Qwen3 decouples them).
    explicit_head_dim: int = field(default=0, metadata={"key": "head_dim"})
    attention: Literal["sdpa", "math"] = "sdpa"
    dropout: float = 0.0  # after embeddings and after both sub-blocks
    attn_dropout: float = 0.0  # on attention probabilities
    init_std: float = 0.02
    # Mixture of experts (`model.moe.*`, loom/models/moe.py). moe.experts=0: every MLP dense.
    moe: MoEConfig = field(default_factory=MoEConfig)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe.experts > 0 and i >= self.moe.first_dense and i % self.moe.interval == 0

    @property
    def moe_layers(self) -> int:
        if not self.moe.experts:
            return 0
        first = -(-self.moe.first_dense // self.moe.interval) * self.moe.interval  # first multiple >= first_dense
        return len(range(first, self.layers, self.moe.interval))  # the layers is_moe_layer accepts

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    def validate(self) -> None:
        positive("model", self, "layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size", "max_seq_len")
        if self.explicit_head_dim < 0:
            raise UserError(f"model.head_dim={self.explicit_head_dim} must be >= 0 (0: model.hidden / model.heads)")
        if self.hidden % self.heads and not self.explicit_head_dim:
            raise UserError(
                f"model.hidden={self.hidden} is not divisible by model.heads={self.heads}; "
                f"valid head counts: {', '.join(map(str, divisors(self.hidden)))}"
            )
        if self.heads % self.kv_heads:
            raise UserError(
                f"model.kv_heads={self.kv_heads} does not divide model.heads={self.heads}; "
                f"valid: {', '.join(map(str, divisors(self.heads)))}"
            )
        if self.position == "rope" and self.head_dim % 2:
            raise UserError(f"RoPE needs an even head dimension; model.head_dim (default model.hidden/model.heads) "
                            f"= {self.head_dim}")
        self._validate_rope_scaling()
        if self.bias and self.qkv_bias:
            raise UserError("model.qkv_bias=true with model.bias=true: model.bias already puts biases on every "
                            "linear layer; set one of them (qkv_bias: query/key/value only, as Qwen2)")
        below_one("model", self, "dropout", "attn_dropout")
        finite_positive("model", self, "norm_eps", "rope_theta", "init_std")
        self._validate_moe()

    def _validate_rope_scaling(self) -> None:
        """Llama 3.1's scaling, with transformers' bounds: rope_factor >= 1 (it divides the low frequencies;
        1 leaves them as they are), 0 < rope_low_freq_factor < rope_high_freq_factor (the ramp between the
        two bands divides by their difference) and an original context of at least one token. The one check
        of these values: a Hugging Face config.json is checked here too (loom.interop.hf_config)."""
        if self.rope_scaling != "llama3":
            return
        if not (self.rope_factor >= 1 and math.isfinite(self.rope_factor)):
            raise UserError(f"model.rope_factor={self.rope_factor} must be a finite number >= 1 (Llama 3.1: 8.0)")
        finite_positive("model", self, "rope_low_freq_factor", "rope_high_freq_factor")
        if not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise UserError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                            f"model.rope_low_freq_factor={self.rope_low_freq_factor} (Llama 3.1: 4.0 and 1.0)")
        positive("model", self, "rope_original_max_len")

    def _validate_moe(self) -> None:
        moe = self.moe
        if self.moe.experts < 0:
            raise UserError(f"model.moe.experts={self.moe.experts} must be >= 0 (0: dense MLPs, no experts)")
        if not self.moe.experts:
            return
        if not 1 <= self.moe.top_k <= self.moe.experts:
            raise UserError(f"model.moe.top_k={self.moe.top_k} must be in 1..model.moe.experts={self.moe.experts}")
        non_negative("model.moe", moe, "ffn_hidden", "shared_experts", "first_dense")
        positive("model.moe", moe, "interval")
        if self.moe_layers == 0:
            raise UserError(f"model.moe.first_dense={self.moe.first_dense} with model.moe.interval={self.moe.interval} "
                            f"leaves no MoE layer among model.layers={self.layers}; valid first_dense: "
                            f"0..{self.layers - 1}")
        finite_non_negative("model.moe", moe, "bias_update_rate", "load_balance_coeff", "z_loss_coeff",
                            "capacity_factor")
        if 0 < self.moe.capacity_factor * self.moe.top_k < 1e-9:
            raise UserError(f"model.moe.capacity_factor={self.moe.capacity_factor} is too small; 0 means dropless")
        if self.moe.shared_gate and not self.moe.shared_experts:
            raise UserError("model.moe.shared_gate=true gates the shared experts, but model.moe.shared_experts=0; "
                            "set model.moe.shared_experts >= 1 or model.moe.shared_gate=false")
