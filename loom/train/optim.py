"""AdamW with decoupled weight decay, off for norms and biases unless configured otherwise."""

from __future__ import annotations

import torch
from torch import nn

from loom.config import OptimConfig


def param_groups(model: nn.Module, optim: OptimConfig) -> list[dict]:
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        # 1-D parameters are norm scales/shifts and biases; embeddings and matrices are decayed.
        (no_decay if p.dim() < 2 and not optim.decay_norms_and_biases else decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    params = next(model.parameters())
    # The fused kernel is the fastest path on CPU and CUDA; sharded (DTensor) parameters take the
    # multi-tensor path.
    sharded = type(params).__name__ == "DTensor"
    return torch.optim.AdamW(
        param_groups(model, optim),
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        fused=not sharded and params.device.type in ("cpu", "cuda"),
        foreach=True if sharded else None,
    )
