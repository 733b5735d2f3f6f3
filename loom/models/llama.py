"""A decoder-only transformer in plain PyTorch: Llama 2/3 by default, GPT-3 style through options.

No process groups and no `if tp > 1` here: parallelism is applied to a built model by
`loom.parallel`. Layers live in a `ModuleDict` keyed "0".."L-1" so a pipeline stage can drop the
layers, the embedding or the head it does not own; `forward` skips whatever is `None`.

Weight names follow one convention (tok_embeddings, layers.N.attention.wq/wk/wv/wo,
layers.N.feed_forward.w1/w2/w3, attention_norm, ffn_norm, norm, output) so tensor-parallel plans and
checkpoint conversion can address them. Rotary embeddings use the "rotate half" pairing (dimension i
with i + d/2), the layout of Hugging Face Llama checkpoints, so conversion is a plain copy.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.models import doc_attention
from loom.models.init import canonical_name, fill, to_empty_keeping_ties
from loom.models.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype, as Llama does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def build_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(head_dim: int, max_len: int, theta: float, scaling: ModelConfig | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of shape [max_len, head_dim], computed in float64 then stored as float32.

    The sine's first half is negated: rotating half (x1, x2) -> (-x2, x1) then becomes swapping the
    halves and multiplying by this table, see `apply_rope`. `scaling`: a model config whose
    `rope_scaling` is "llama3" rescales the frequencies as Llama 3.1 does.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None and scaling.rope_scaling == "llama3":
        inv_freq = llama3_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    sin = angles.sin()
    return torch.cat([angles, angles], dim=-1).cos().float(), torch.cat([-sin, sin], dim=-1).float()


def llama3_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's long-context RoPE: wavelengths longer than original_len / low_freq_factor are slowed by
    `rope_factor`, those shorter than original_len / high_freq_factor kept, and the band between blended
    linearly in original_len / wavelength."""
    low, high, factor = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor
    wavelen = 2 * math.pi / inv_freq
    ratio = cfg.rope_original_max_len / wavelen
    smooth = ((ratio - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def token_rope(rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the rotary tables (cos, signed sin) [max_len, d] at each token's position [b, s] -> [b, 1, s, d]."""
    return tuple(t[positions].unsqueeze(1) for t in rope)


class KVCache(Protocol):
    """Keys and values kept across forwards (a generation engine's slab, loom/infer/kv.py): each attention
    layer hands it this forward's queries, keys and values and gets the attention output back."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [b, heads, s, d], k/v [b, kv_heads, s, d] -> [b, heads, s, d]."""


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos/signed_sin: [seq, head_dim] from `rope_tables`.

    x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1), computed as swap(x) * signed_sin:
    the same products (negation is exact), one copy instead of slices, a negation and a concatenation
    (whose backward zero-fills two full-size buffers).
    """
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
    return (x * cos + swapped * signed_sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.kind = cfg.attention
        self.attn_dropout = cfg.attn_dropout
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.wq = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=cfg.bias)
        # Qwen3: RMSNorm over each head's query and key, right after the projection (before RoPE).
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        # The attention core (scores, softmax, dropout, weighted values) as a replaceable callable, so
        # that recomputation can wrap exactly this part from outside the model.
        self.core = attention_core
        # wq, wk, wv laid end to end in one tensor (their weights its views), set by a generation engine on a
        # GPU (loom/infer/fuse.py): one product instead of three when no gradient is recorded
        self.fused_qkv: torch.Tensor | None = None
        self.fused_qkv_bias: torch.Tensor | None = None

    def forward(self, x, rope, cache: KVCache | None = None, layer_id: int = 0, doc_ids=None, positions=None):
        """`doc_ids` [batch, seq] (int): tokens attend only to earlier tokens of the same document (packed
        sequences); `positions` [batch, seq]: each token's rotary position (restarting per document, a
        context-parallel rank's chunks, a generation engine's slots); without them 0..seq-1. `rope`: the rotary
        tables [max_len, head_dim], or each token's rows of them [batch, 1, seq, head_dim] (`token_rope`, which
        a generation engine's forward gathers once for all layers)."""
        bsz, seqlen, _ = x.shape
        # Head counts come from the weights so a tensor-parallel shard (fewer local heads) works as is.
        if self.fused_qkv is not None and not torch.is_grad_enabled():
            q, k, v = F.linear(x, self.fused_qkv, self.fused_qkv_bias).split(
                [self.wq.weight.shape[0], self.wk.weight.shape[0], self.wv.weight.shape[0]], -1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        q = q.view(bsz, seqlen, -1, self.head_dim)
        k = k.view(bsz, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(bsz, seqlen, -1, self.head_dim).transpose(1, 2)
        if rope is not None and rope[0].dim() == 4:  # each token's tables [b, 1, s, d], gathered by the caller
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        elif rope is not None and positions is not None:  # per token: [b, s] -> tables [b, 1, s, d]
            cos, signed_sin = token_rope(rope, positions.to(x.device))
            q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
        elif rope is not None:  # positions 0..seqlen-1
            cos, signed_sin = (t[:seqlen] for t in rope)
            q, k = apply_rope(q, cos, signed_sin), apply_rope(k, cos, signed_sin)
        if cache is not None:
            # The generation engine's slab: each row writes its keys and values into its own slot at its
            # `positions` and attends to that slot alone.
            out = cache.attend(layer_id, q, k, v)
            return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))
        dropout = self.attn_dropout if self.training else 0.0
        if doc_ids is None:
            out = self.core(q, k, v, self.kind, dropout)
        else:
            out = self.core(q, k, v, self.kind, dropout, doc_ids.to(x.device))
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


def attention_core(q, k, v, kind: str, dropout: float, doc_ids=None) -> torch.Tensor:
    """Causal attention. q: [b, hq, s_q, d]; k, v: [b, hkv, s_k, d] with hq a multiple of hkv.

    Queries sit at the last s_q of the s_k key positions (a context-parallel chunk against a key prefix).
    `doc_ids` [b, >= s_k] (the document of each key position; queries take theirs from the same row):
    a query attends only to keys of its own document, a block-diagonal causal mask: a dense boolean mask to
    SDPA, or on a GPU inside a compiled block FlexAttention's block-sparse mask (loom/models/doc_attention.py).
    """
    s_q, s_k = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if doc_ids is not None and kind == "sdpa" and doc_attention.wanted(q, dropout):  # no dense mask (GPU, compiled)
        return doc_attention.flex_document_attention(q, k, v, doc_ids)
    if kind == "sdpa" and doc_ids is None and s_q < s_k and q.is_cuda:
        # A context-parallel chunk against its key prefix: causal aligned bottom-right, which the fused kernels
        # take as a flag (torch's CausalBias: flash, else memory-efficient attention), with no [s_q, s_k] mask
        # materialised and kept for backward. A CPU has no such kernel: the dense mask below.
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(s_q, s_k), dropout_p=dropout,
                                              enable_gqa=gqa)
    mask = _causal_mask(s_q, s_k, q.device)
    if doc_ids is not None:
        mask = mask & document_mask(doc_ids, s_q, s_k)
    if kind == "sdpa":  # SDPA shares each key/value head across its query group itself
        if s_q == s_k and doc_ids is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
    if gqa:
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    # "math": the softmax (and its dropout) materialised, as in Korthikanti et al.
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    # An additive mask: unlike masked_fill, adding a constant keeps nothing for backward.
    bias = torch.zeros(mask.shape, dtype=scores.dtype, device=q.device)
    scores = scores + bias.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # kernels accumulate in fp32; the stored output keeps q's dtype
    if dropout > 0:
        probs = torch.native_dropout(probs, dropout, True)[0]  # 1-byte mask, as Dropout above
    return torch.matmul(probs, v)


def document_mask(doc_ids: torch.Tensor, s_q: int, s_k: int) -> torch.Tensor:
    """Boolean [b, 1, s_q, s_k]: True where query i (position s_k - s_q + i) and key j share a document.
    `doc_ids` [b, n >= s_k] holds the document of positions 0..n-1 of each row."""
    keys = doc_ids[:, :s_k]
    return (keys[:, s_k - s_q:, None] == keys[:, None, :]).unsqueeze(1)


def _causal_mask(s_q: int, s_k: int, device) -> torch.Tensor:
    """Boolean [s_q, s_k], True where the query may attend (key position <= query position)."""
    q_pos = torch.arange(s_k - s_q, s_k, device=device)
    return torch.arange(s_k, device=device)[None, :] <= q_pos[:, None]


class FeedForward(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)) or GELU (w2(gelu(w1 x)))."""

    def __init__(self, cfg: ModelConfig, ffn_hidden: int | None = None):
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        f = ffn_hidden or cfg.ffn_hidden
        self.w1 = nn.Linear(cfg.hidden, f, bias=cfg.bias)
        self.w2 = nn.Linear(f, cfg.hidden, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.hidden, f, bias=cfg.bias) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class Dropout(nn.Module):
    """Dropout that keeps a 1-byte mask for backward on every device (`nn.Dropout` on CPU keeps a mask
    in the activation dtype), as activation-memory accounting assumes."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        # Under tensor or context parallelism, this rank's random stream (loom/parallel/rng.py `install`);
        # None: the default generator.
        self.stream = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        if self.stream is None:
            return torch.native_dropout(x, self.p, True)[0]
        return self._streamed(x)

    @torch.compiler.disable  # seeds a generator from the rank's stream: eager inside a compiled block
    def _streamed(self, x: torch.Tensor) -> torch.Tensor:
        with self.stream(x):
            return torch.native_dropout(x, self.p, True)[0]


def _dropout(p: float) -> nn.Module:
    return Dropout(p) if p > 0 else nn.Identity()


def build_moe(cfg: ModelConfig) -> MoE:
    """A mixture-of-experts MLP; its shared experts are one FeedForward, shared_experts x moe.ffn_hidden wide."""
    n, ffn = cfg.moe.shared_experts, cfg.moe.ffn_hidden or cfg.ffn_hidden
    return MoE(cfg, FeedForward(cfg, n * ffn) if n else None)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = build_norm(cfg)
        self.attention = Attention(cfg)
        self.ffn_norm = build_norm(cfg)
        # A mixture of experts in place of the MLP on the layers model.moe.* names (loom/models/moe.py).
        self.feed_forward = build_moe(cfg) if cfg.is_moe_layer(layer_id) else FeedForward(cfg)
        self.dropout = _dropout(cfg.dropout)

    def forward(self, x, rope, cache: KVCache | None = None, doc_ids=None, positions=None):
        a = self.attention(self.attention_norm(x), rope, cache, self.layer_id, doc_ids=doc_ids, positions=positions)
        h = x + self.dropout(a)
        return h + self.dropout(self.feed_forward(self.ffn_norm(h)))


class Transformer(nn.Module):
    # Parameters of modules a recipe adds on top of the trunk (a reward model's `score`, PPO's `value`): not in
    # pretrained weights, so they keep their initialisation; tensor parallelism replicates their modules.
    fresh_parameters: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.hidden) if cfg.position == "learned" else None
        self.embed_dropout = _dropout(cfg.dropout)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.layers)})
        self.norm = build_norm(cfg)
        self.output = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if cfg.position == "rope":
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            self.rope_cos = self.rope_sin = None
        if self.tok_embeddings.weight.device.type != "meta":  # built on meta: initialised once materialised
            self.init_weights(int(torch.randint(0, 2**62, ()).item()))

    def init_spec(self, name: str) -> tuple[str, float]:
        """How parameter `name` starts: ("normal", std) weights, output projections of each block scaled by
        1/sqrt(2L) (GPT-2); ("ones", 0) norm weights; ("zeros", 0) biases. Stacked experts [E, ...] draw
        each element like a dense layer's (std per element, whatever E), their output projection w2 scaled as
        a dense w2; the router's weight [E, hidden] is drawn with init_std."""
        if name.endswith(("bias", "lora_B")):  # LoRA: B = 0, so an adapted model starts as its base
            return "zeros", 0.0
        if name.endswith("lora_A"):
            return "kaiming_uniform", 0.0
        if "norm" in name.rsplit(".", 2)[-2]:
            return "ones", 0.0
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            return "normal", self.cfg.init_std / math.sqrt(2 * self.cfg.layers)
        return "normal", self.cfg.init_std

    def init_name(self, name: str) -> str:
        """The name that seeds parameter `name`: a tied LM head is the embedding (a pipeline's last stage
        holds its own copy of it, which must start equal)."""
        name = canonical_name(name)
        return "tok_embeddings.weight" if self.cfg.tie_embeddings and name == "output.weight" else name

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Every parameter from `seed` and its name alone (loom/models/init.py): the same weights whatever
        the layout; `loom.parallel.materialize` fills a rank's shards with exactly these values."""
        for name, p in self.named_parameters():
            name = self.init_name(name)
            fill(p, tuple(p.shape), (0,) * p.dim(), seed, name, *self.init_spec(name))

    def reset_buffers(self) -> None:
        """Recompute the rotary tables (non-persistent buffers) on their device, in fp32; zero the MoE routers'
        selection biases (a checkpoint, loaded after, restores them)."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers()
        if self.rope_cos is not None:
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.cfg)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, return_hidden: bool = False,
                doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] (int) -> logits [batch, seq, vocab].

        A pipeline stage without the embedding takes hidden states [batch, seq, hidden] instead, and a
        stage without the head returns hidden states. `return_hidden=True` stops before the LM head
        (after the final norm): a loss that applies the head itself, chunk by chunk, takes it from there.

        Positions: token i of a row sits at position i, unless `positions` [batch, seq] says otherwise: each
        token's position in its document for packed sequences (several documents per row, numbered by
        `doc_ids` [batch, seq], attention staying inside each), a context-parallel rank's own tokens (its
        batch's `positions` entry, sharded with the tokens: loom/parallel/context.py `shard_batch`, the whole
        rows' `doc_ids`), or a generation engine's slots (`cache`, loom/infer/engine.py).
        """
        seqlen = tokens.shape[1]
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                pos = torch.arange(seqlen, device=h.device) if positions is None else positions.to(h.device)
                h = h + self.pos_embeddings(pos)
            h = self.embed_dropout(h)
        else:
            h = tokens
        # Attention slices the rotary tables itself: on a pipeline stage fed sequence-sharded hidden
        # states, only attention (after gathering the sequence) knows the full length.
        rope = (self.rope_cos, self.rope_sin) if self.rope_cos is not None else None
        if rope is not None and positions is not None and cache is not None:
            # A generation engine's step (per-token positions and a cache, no backward): each token's rotary
            # tables gathered once here, not in every layer (the host's work per op is a GPU's eager decode time).
            rope = token_rope(rope, positions.to(h.device))
        for layer in self.layers.values():
            h = layer(h, rope, cache, doc_ids=doc_ids, positions=positions)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None and not return_hidden:
            h = self.output(h)
        return h

    def num_params(self, exclude_embeddings: bool = False) -> int:
        seen, total = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if exclude_embeddings and name.startswith(("tok_embeddings", "pos_embeddings")):
                continue
            total += p.numel()
        return total


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int | None = None) -> Transformer:
    """Build and initialise a model once. With `seed` the weights depend on the seed alone (not on the global
    RNG, the device or the layout); on the meta device only the structure is built."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if str(device) == "meta":
        return model.to(dtype=dtype)
    to_empty_keeping_ties(model, device)
    model.init_weights(int(torch.randint(0, 2**62, ()).item()) if seed is None else seed)
    model = model.to(dtype=dtype)
    model.reset_buffers()  # rotary tables stay fp32 whatever the parameter dtype
    return model
