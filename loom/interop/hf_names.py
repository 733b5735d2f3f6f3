"""Hugging Face <-> loom tensor names, for Llama / Qwen2 / Qwen3 / Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints.

loom's Transformer uses the same rotate-half RoPE layout as Hugging Face Llama, so conversion is a
renaming of tensors:

    model.embed_tokens.weight                      tok_embeddings.weight
    model.layers.N.self_attn.{q,k,v,o}_proj.*      layers.N.attention.{wq,wk,wv,wo}.*
    model.layers.N.mlp.{gate,up,down}_proj.*       layers.N.feed_forward.{w1,w3,w2}.*
    model.layers.N.input_layernorm.weight          layers.N.attention_norm.weight
    model.layers.N.post_attention_layernorm.weight layers.N.ffn_norm.weight
    model.norm.weight                              norm.weight
    lm_head.weight                                 output.weight (absent when embeddings are tied)

Qwen2/2.5 (biases on q/k/v) and Qwen3 dense (per-head q/k RMSNorm, `self_attn.q_norm` and `k_norm` <->
`attention.q_norm`/`k_norm`) map the same way.

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
the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from loom.errors import UserError

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


def hf_expert_name(name: str, mixtral: bool) -> str | None:
    """For loom's stacked experts (`layers.N.feed_forward.experts.w1`): the Hugging Face name of one
    expert's nn.Linear weight, with `{}` for the expert's number, in Mixtral's spelling (`block_sparse_moe.
    experts.{}.w1.weight`) or Qwen's (`mlp.experts.{}.gate_proj.weight`). None for any other tensor."""
    m = _LOOM_EXPERTS_RE.fullmatch(name)
    if not m:
        return None
    layer, weight = m.groups()
    return (f"model.layers.{layer}.block_sparse_moe.experts.{{}}.{weight}.weight" if mixtral
            else f"model.layers.{layer}.mlp.experts.{{}}.{_QWEN_EXPERT[weight]}.weight")


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
