"""Parallelism applied to a plain model: `parallelize` runs tensor/sequence parallel, then FSDP2."""

from __future__ import annotations

import torch
from torch import nn

from loom.config import Config
from loom.parallel.dims import MeshPlace, build_layout, validate_layout


def parallelize(model: nn.Module, layout: MeshPlace, cfg: Config, compute_dtype: torch.dtype | None,
                layer_plan: dict[str, str] | None = None) -> nn.Module:
    """TP(+SP) over the `tp` mesh dimension, then activation recomputation, then data parallelism over
    `(dp_replicate, dp_shard)` — torchtitan's order. `model` is the whole model or one pipeline stage.
    `layer_plan` ({layer: none|selective|full}) overrides `cfg.recompute` (the budget planner's output).
    """
    from loom.parallel.recompute import apply_recompute

    if layout.tp > 1:
        from loom.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, layout.submesh("tp"), cfg.parallel.sp)
    apply_recompute(model, cfg, layer_plan)
    if layout.dp_size > 1:
        from loom.parallel.data import apply_data_parallel

        p = cfg.parallel
        names = [n for n, size in (("dp_replicate", p.dp_replicate), ("dp_shard", p.dp_shard)) if size > 1]
        if names == ["dp_replicate"]:
            names = ["dp_replicate", "dp_shard"]  # FSDP2 replicates over a 2-D mesh with a shard group of 1
        # Pipeline stages keep their gathered parameters through the step (see loom/parallel/data.py).
        apply_data_parallel(model, layout.submesh(*names), compute_dtype, reshard_after_forward=layout.pp == 1)
    return model


__all__ = ["MeshPlace", "build_layout", "parallelize", "validate_layout"]
