"""Text generation with a key/value cache: greedy at temperature 0, else top-k / top-p sampling."""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values per layer: [batch, kv_heads, max_len, head_dim]."""

    def __init__(self, layers, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layers}

    def update(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        end = start_pos + k.shape[2]
        self.k[layer_id][:, :, start_pos:end] = k
        self.v[layer_id][:, :, start_pos:end] = v
        return self.k[layer_id][:, :, :end], self.v[layer_id][:, :, :end]


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator=None) -> torch.Tensor:
    """logits [batch, vocab] -> token ids [batch]."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | None = None, seed: int | None = None) -> torch.Tensor:
    """prompt [batch, len] -> [batch, len + new] (stops early when every row produced eos_id)."""
    cfg = model.cfg
    batch, plen = prompt.shape
    total = min(plen + max_new_tokens, cfg.max_seq_len)
    param = next(model.parameters())
    cache = KVCache(model.layers.keys(), batch, cfg.kv_heads, total, cfg.head_dim, param.dtype, param.device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=param.device).manual_seed(seed)
    tokens = prompt.to(param.device)
    logits = model(tokens, cache=cache, start_pos=0)[:, -1]
    done = torch.zeros(batch, dtype=torch.bool, device=param.device)
    for pos in range(plen, total):
        nxt = sample_next(logits, temperature, top_k, top_p, generator)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        if eos_id is not None and bool(done.all()):
            break
        if pos + 1 < total:
            logits = model(nxt[:, None], cache=cache, start_pos=pos)[:, -1]
    return tokens
