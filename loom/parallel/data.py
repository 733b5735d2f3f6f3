"""Data parallelism with FSDP2 (`fully_shard`) over the `(dp_replicate, dp_shard)` mesh.

One mechanism covers the three styles:

- fully sharded (`dp_shard > 1`): parameters, gradients and optimizer state are split across the shard
  group; each block's parameters are all-gathered just before use and freed after, gradients are
  reduce-scattered block by block during backward (overlapping it);
- replicated (`dp_replicate > 1`, `dp_shard = 1`): the shard group has size 1, so every rank holds
  everything and gradients are all-reduced across replicas, again block by block during backward —
  DDP's communication pattern;
- hybrid (both > 1): sharded within a group, replicated across groups (HSDP).

Mixed precision: with `train.dtype=bfloat16` blocks compute in bf16 from bf16 copies of fp32 master
weights, and gradients are reduced in fp32. The optimizer always updates fp32 parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def apply_data_parallel(model: nn.Module, dp_mesh, compute_dtype: torch.dtype | None) -> None:
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduction on all but the last micro-batch of a step."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
