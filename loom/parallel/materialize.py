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


def released(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of `t`'s shape and dtype on `device` whose storage holds nothing (FSDP's way of keeping an
    unsharded parameter between uses): allocated, then resized to 0 bytes at once, one tensor at a time."""
    out = torch.empty_like(t, device=device)
    out.untyped_storage().resize_(0)
    return out


@torch.no_grad()
def release_parameters(module: nn.Module, device: torch.device) -> None:
    """Parameters on meta become `released` parameters on `device` (ties kept), buffers allocated there: for an
    optimizer that draws its own rows of every weight (loom/parallel/zero.py), so that no rank holds the whole
    model at start-up."""
    made: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None and (p._local_tensor if isinstance(p, DTensor) else p).is_meta:
                if id(p) not in made:
                    if isinstance(p, DTensor):  # (a routed expert under ep: its local part released)
                        t = DTensor.from_local(released(p._local_tensor, device), p.device_mesh, p.placements,
                                               run_check=False, shape=p.shape, stride=p.stride())
                    else:
                        t = released(p, device)
                    made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                mod._parameters[attr] = made[id(p)]
        for attr, b in mod._buffers.items():
            if b is not None and b.is_meta:
                mod._buffers[attr] = torch.empty_like(b, device=device)


@torch.no_grad()
def materialize(modules: list[nn.Module], device: torch.device, seed: int, rows_later: bool = False) -> None:
    """Allocate `modules` (parts of one model built on meta, already parallelised) on `device` and
    initialise every local shard from `seed`; recompute non-persistent buffers. `rows_later`: parameters are
    left `released` (no values, no memory), for an optimizer that fills its own rows from `seed`."""
    for module in modules:
        if rows_later:
            release_parameters(module, device)
            module.reset_buffers()
            continue
        to_empty_keeping_ties(module, device)
        for name, p in module.named_parameters():
            name = module.init_name(name)
            local, offset = local_slice(p)
            fill(local, tuple(p.shape), offset, seed, name, *module.init_spec(name))
        module.reset_buffers()
