"""One product for a decode step's query, key and value projections (`fuse_qkv`).

At decode the three projections of a layer are three small matrix-vector products: on the H200 at the 1B shape
(bench/results/device_check_h200_2026-11-26_c) the 2-8 MB weights of q, k and v each took 5.4-5.7 µs, 0.4-1.5 TB/s,
where the layer's 33 MB MLP products ran at about 3.2 TB/s. `fuse_qkv` lays each attention layer's wq, wk and wv
weights (and biases) end to end in one new tensor and makes each parameter a view of its slice (`p.data`), so
the parameters keep their identity (an optimizer holding them is unaffected), an in-place refit writes the fused
tensor, and no weight is stored twice. `Attention.forward` multiplies by the fused tensor once when it is set
and no gradient is being recorded (the fused tensor is not a parameter autograd knows), else as before."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _fusable(mods) -> bool:
    return all(type(m) is nn.Linear and not isinstance(m.weight, DTensor) for m in mods) and \
        len({(m.bias is None) for m in mods}) == 1 and len({(m.weight.dtype, m.weight.device) for m in mods}) == 1


def _lay_end_to_end(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One new tensor holding `tensors` (parameters) concatenated along dim 0; each becomes a view of its slice.
    The tensor is marked a static address, as parameters are: a CUDA-graph step reads it in place instead of
    copying it into the graph's inputs on every replay (a plain module attribute would be such an input)."""
    fused = torch.cat([t.detach() for t in tensors])
    start = 0
    for t in tensors:
        t.data = fused[start:start + t.shape[0]]
        start += t.shape[0]
    torch._dynamo.mark_static_address(fused)
    return fused


def check_fused(model: nn.Module) -> None:
    """Raise if a fused layer's projections no longer view its fused tensor (a `model.to(...)`, or anything else
    that replaced their storage after `fuse_qkv`): decode steps would multiply by stale weights."""
    for name, layer in model.layers.items():
        att = layer.attention
        if att.fused_qkv is not None and att.wq.weight.data_ptr() != att.fused_qkv.data_ptr():
            raise RuntimeError(f"layer {name}: its q/k/v weights were moved off the tensor the engine fused them "
                               "into (model.to(...) after building the Engine?); build the Engine after moving the model")


@torch.no_grad()
def fuse_qkv(model: nn.Module) -> int:
    """Fuse the query/key/value projections of every attention layer of `model` whose three are plain
    `nn.Linear`s (not tensor-parallel shards, not LoRA-wrapped) with matching biases, dtype and device; returns the
    layers fused. Idempotent: a layer already fused is counted and left alone."""
    fused = 0
    for layer in model.layers.values():
        att = layer.attention
        mods = (att.wq, att.wk, att.wv)
        if att.fused_qkv is not None:
            fused += 1
            continue
        if not _fusable(mods):
            continue
        att.fused_qkv = _lay_end_to_end([m.weight for m in mods])
        if att.wq.bias is not None:
            att.fused_qkv_bias = _lay_end_to_end([m.bias for m in mods])
        fused += 1
    return fused
