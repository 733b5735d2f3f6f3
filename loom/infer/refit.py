"""New weights into a generation engine's model in place (`Engine.refit`): every parameter keeps its address, so
key/value memory, compiled graphs and anything else that holds them stay valid."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from loom.errors import UserError
from loom.models.init import canonical_name
from loom.parallel.distributed import full_tensor


def copy_weights(model: nn.Module, source: nn.Module | dict, local: bool = False) -> int:
    """Copy `source` (a model or a state dict with loom's names: plain tensors, or DTensors of an FSDP/TP layout,
    gathered with `full_tensor`, so every rank of its mesh calls this together) into `model`'s parameters; a
    tensor-parallel `model` takes its own shard of each full tensor. `local`: `source` already holds this rank's
    shard of each parameter (its local tensor's shape), copied as is. Returns the tensors copied."""
    state = source.state_dict() if isinstance(source, nn.Module) else source
    state = {canonical_name(k): v for k, v in state.items()}
    params = dict(model.named_parameters())  # one entry per tensor: a tied head appears once
    missing = [name for name in params if name not in state]
    if missing:
        raise UserError(f"refit: the new weights lack {len(missing)} of the engine's parameters, e.g. "
                        f"{missing[:3]}; give the whole model's state dict (a pipeline stage holds only some "
                        "layers: gather them first)")
    for name, p in params.items():
        if local:
            dst = p.to_local() if isinstance(p, DTensor) else p
            if tuple(state[name].shape) != tuple(dst.shape):
                raise UserError(f"refit: {name}'s shard has shape {tuple(state[name].shape)}; this rank holds "
                                f"{tuple(dst.shape)}")
            dst.copy_(state[name])
            continue
        src = full_tensor(state[name])
        if tuple(src.shape) != tuple(p.shape):
            raise UserError(f"refit: {name} has shape {tuple(src.shape)}; the engine's model has {tuple(p.shape)}")
        if isinstance(p, DTensor):  # a tensor-parallel engine: this rank's shard of the full tensor
            src = distribute_tensor(src.to(p.device, p.dtype), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(src.to_local())
        else:
            p.copy_(src)
    return len(params)
