"""Low-rank adapters (LoRA, Hu et al. 2021) on a built model: `apply_lora`, switching them off, merging.

`LoRALinear` is an `nn.Linear` whose `weight` and `bias` keep their names, so pretrained weights, tensor
names in checkpoints and conversion tables address the base exactly as before; it adds `lora_A` [rank, in]
and `lora_B` [out, rank] and computes W x + b + (alpha / rank) B A dropout(x). The adapter is a second
matmul chain beside the base one (not W + BA formed each step): the base weight is never written, so it can
stay frozen in the training dtype, and under FSDP the adapter's shards reduce their own gradients.

`apply_lora` runs on the meta model before the layout is applied (loom/build.py): it swaps the targeted
projections' class, adds the two parameters, freezes everything else except the recipe's fresh heads (a
reward or value head, which a LoRA run trains too) and casts the frozen weights to the training dtype. The
initial values come from the layout-independent initialisation (loom/models/init.py, `Transformer.init_spec`):
A Kaiming-uniform, B zero, PEFT's choice, so step 0 computes the base model.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import LoRAConfig
from loom.config.lora import loom_targets
from loom.errors import UserError
from loom.models.llama import Dropout

ADAPTER_NAMES = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update; `enabled=False` computes the base alone."""

    rank: int
    scale: float
    enabled: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return out
        a, b = self.lora_A, self.lora_B
        h = self.lora_dropout(x)
        if h.dtype != a.dtype and not torch.is_autocast_enabled(h.device.type):  # autocast casts by itself
            h = h.to(a.dtype)
        return out + (F.linear(F.linear(h, a), b) * self.scale).to(out.dtype)


def to_lora(linear: nn.Linear, rank: int, alpha: float, dropout: float, dtype: torch.dtype) -> LoRALinear:
    """Turn `linear` (on any device, meta included) into a LoRALinear in place; adapters in `dtype`."""
    linear.__class__ = LoRALinear
    device = linear.weight.device
    linear.lora_A = nn.Parameter(torch.empty(rank, linear.in_features, device=device, dtype=dtype))
    linear.lora_B = nn.Parameter(torch.empty(linear.out_features, rank, device=device, dtype=dtype))
    linear.rank, linear.scale = rank, alpha / rank
    linear.lora_dropout = Dropout(dropout) if dropout > 0 else nn.Identity()  # a 1-byte mask, as the model's
    if device.type != "meta":
        reset_adapter(linear)
    return linear


@torch.no_grad()
def reset_adapter(layer: LoRALinear) -> None:
    """PEFT's initialisation (one process, outside loom's seeded init): A Kaiming-uniform, B zero."""
    bound = 1 / math.sqrt(layer.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT draw
    layer.lora_A.uniform_(-bound, bound)
    layer.lora_B.zero_()


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Module name -> LoRALinear, in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def apply_lora(model: nn.Module, lora: LoRAConfig, frozen_dtype: torch.dtype) -> list[str]:
    """Adapters on `lora.targets` of every block; every other parameter frozen (in `frozen_dtype`) except the
    model's `fresh_parameters` (a recipe's heads). Returns the trained parameters' names."""
    names = loom_targets(lora.targets)
    for block in model.layers.values():
        for module_name, module in list(block.named_modules()):
            leaf = module_name.rsplit(".", 1)[-1]
            if leaf in names and type(module) is nn.Linear:
                to_lora(module, lora.rank, lora.alpha, lora.dropout, torch.float32)
    adapted = lora_layers(model)
    if not adapted:
        raise UserError(f"lora.targets={lora.targets} matched no linear layer of this model")
    fresh = set(model.fresh_parameters)
    trained = []
    for name, p in model.named_parameters():
        train = is_adapter(name) or name in fresh
        p.requires_grad_(train)
        if train:
            trained.append(name)
        elif p.dtype != frozen_dtype:
            p.data = p.data.to(frozen_dtype)
    # Adapters are not in pretrained weights: they keep their initialisation (loom/interop/pretrained.py).
    model.fresh_parameters = (*model.fresh_parameters, *(n for n in trained if is_adapter(n)))
    return trained


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trained parameters, all parameters), each tensor counted once."""
    seen, trained, total = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trained += p.numel() if p.requires_grad else 0
    return trained, total


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """The base model inside the block (DPO's and RL's reference): adapters computed out, nothing copied."""
    layers = list(lora_layers(model).values())
    before = [m.enabled for m in layers]
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m, on in zip(layers, before):
            m.enabled = on


def delta(layer: LoRALinear) -> torch.Tensor:
    """scale x B A, in float32, full (gathered from shards)."""
    from torch.distributed.tensor import DTensor

    a, b = (t.full_tensor() if isinstance(t, DTensor) else t for t in (layer.lora_A, layer.lora_B))
    return (b.detach().float() @ a.detach().float()) * layer.scale


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and turn the layers back into plain nn.Linear (one process,
    unsharded): the model computes what the adapted one did, with no LoRA left in it."""
    for layer in lora_layers(model).values():
        layer.weight.copy_((layer.weight.float() + delta(layer)).to(layer.weight.dtype))
        del layer.lora_A, layer.lora_B, layer.lora_dropout
        layer.__class__ = nn.Linear
    model.fresh_parameters = tuple(n for n in model.fresh_parameters if not is_adapter(n))
    return model


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as the merged model's (no lora_* entries; each adapted weight W + scale B A), for
    refitting an engine that has no adapters. The model is left untouched. A weight sharded by rows (FSDP's
    Shard(0), replicated elsewhere) is merged shard by shard, B's rows matching W's, and stays a DTensor: nobody
    holds more than its own shard plus A."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from loom.models.init import canonical_name

    state = {canonical_name(k): v for k, v in model.state_dict().items()}
    for name, layer in lora_layers(model).items():
        key = canonical_name(f"{name}.weight")
        w, b = layer.weight, layer.lora_B
        a = layer.lora_A.full_tensor() if isinstance(layer.lora_A, DTensor) else layer.lora_A
        rowwise = (isinstance(w, DTensor) and isinstance(b, DTensor) and w.device_mesh == b.device_mesh
                   and w.placements == b.placements and all(p in (Replicate(), Shard(0)) for p in w.placements))
        if rowwise:
            local = w.to_local().float() + (b.to_local().float() @ a.float()) * layer.scale
            state[key] = DTensor.from_local(local.to(w.dtype), w.device_mesh, w.placements, shape=w.shape,
                                            stride=w.stride())
        else:
            full = w.full_tensor() if isinstance(w, DTensor) else w
            state[key] = (full.float() + delta(layer)).to(full.dtype)
    return {k: v for k, v in state.items() if not is_adapter(k)}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Trained tensors only (adapters and fresh heads), by canonical name."""
    from loom.models.init import canonical_name

    return {canonical_name(n): p for n, p in model.named_parameters() if p.requires_grad}
