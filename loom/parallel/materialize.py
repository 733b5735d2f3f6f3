"""Materialise a model that was built and parallelised on the meta device: each rank allocates only the
shards it holds and fills them with exactly the values the whole model would hold there
(`loom/models/init.py`), so initial weights do not depend on the layout."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.models.init import fill, to_empty_keeping_ties


def local_slice(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The tensor this rank stores for parameter `p` and its offset in the full parameter."""
    if isinstance(p, DTensor):  # a shard (TP, FSDP or both) of the full parameter
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
        assert tuple(local.shape) == tuple(shape), (tuple(local.shape), shape)
        return local, tuple(offset)
    return p, (0,) * p.dim()


@torch.no_grad()
def materialize(modules: list[nn.Module], device: torch.device, seed: int) -> None:
    """Allocate `modules` (parts of one model built on meta, already parallelised) on `device` and
    initialise every local shard from `seed`; recompute non-persistent buffers."""
    for module in modules:
        to_empty_keeping_ties(module, device)
        for name, p in module.named_parameters():
            name = module.init_name(name)
            local, offset = local_slice(p)
            fill(local, tuple(p.shape), offset, seed, name, *module.init_spec(name))
        module.reset_buffers()
