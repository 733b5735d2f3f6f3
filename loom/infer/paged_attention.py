"""Decode attention over paged keys and values that reads only each request's visible blocks.

`split_kv_decode` is flash-decoding written in torch ops: every visible block of every request is one split. Each
split computes its scores, their running max and the softmax-weighted sum of its values; the splits of a request
are then combined by their log-sum-exp (`scatter_reduce` / `index_add_` by request). Nothing is read for a
request beyond its own blocks (the last one partly masked), so a ragged batch reads the keys it holds, not the
longest request's length for every row. Its blocks are listed on the host once per decode window
(`PagedKV.prepare`), so no step reads anything back.

`reference_decode` is the float64 definition it is tested against.
"""

from __future__ import annotations

import math

import torch


def split_kv_decode(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, row: torch.Tensor, block: torch.Tensor,
                    start: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q [rows, kv_heads, queries, d] (the query heads of each key/value head folded into queries, one token each);
    K, V the pool [blocks, kv_heads, block_size, d]; the visible blocks as three [splits] tensors: the request
    `row` each belongs to, its `block` id and the `start` position of its first key; `positions` [rows]: the
    position of each request's query (it sees keys 0..position). -> [rows, kv_heads, queries, d].

    A split whose keys all lie past its request's position (a block reserved for later steps of the window)
    contributes nothing."""
    rows, kv_heads, queries, d = q.shape
    size = K.shape[2]
    k, v = K[block], V[block]  # [splits, kv_heads, size, d]: the only reads of the pool
    if q.dtype not in (torch.float32, torch.float64):  # bf16/fp16: softmax and sums in fp32
        q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q[row], k.transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [splits, kv, queries, size]
    seen = (start[:, None] + torch.arange(size, device=q.device)) <= positions[row][:, None]  # [splits, size]
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    # a split with nothing visible: max -inf -> a finite floor, so its weights are exp(-inf) = 0, not nan
    top = scores.amax(-1).clamp_min(torch.finfo(scores.dtype).min)  # [splits, kv, queries]
    p = torch.exp(scores - top[..., None])
    part, mass = torch.matmul(p, v), p.sum(-1)  # [splits, kv, queries, d], [splits, kv, queries]
    best = top.new_full((rows, kv_heads, queries), float("-inf"))
    best = best.scatter_reduce(0, row[:, None, None].expand_as(top), top, "amax")
    w = torch.exp(top - best[row])
    num = part.new_zeros(rows, kv_heads, queries, d).index_add_(0, row, part * w[..., None])
    den = mass.new_zeros(rows, kv_heads, queries).index_add_(0, row, mass * w)
    return num / den[..., None]


def reference_decode(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, tables: list[list[int]],
                     positions: list[int]) -> torch.Tensor:
    """The definition in float64: request b's keys are its blocks `tables[b]` laid end to end, positions
    0..positions[b]; softmax(q k^T / sqrt(d)) v per key/value head. Shapes as `split_kv_decode`."""
    out = []
    for b, (table, p) in enumerate(zip(tables, positions)):
        keys = K[table].double().transpose(0, 1).flatten(1, 2)[:, :p + 1]  # [kv, p + 1, d]
        values = V[table].double().transpose(0, 1).flatten(1, 2)[:, :p + 1]
        w = torch.softmax(q[b].double() @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        out.append(w @ values)
    return torch.stack(out)
