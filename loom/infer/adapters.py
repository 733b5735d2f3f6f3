"""Many LoRA adapters on one base model, chosen per request (`loom serve --lora NAME=PATH`): requests of
different adapters (and of the base) are decoded in one batch, each row adding its own adapter's product.

    adapters = attach_adapters(model, {"a": "runs/lora-a", "b": "peft/b"})   # before the Engine is built
    engine = Engine(model, adapters=adapters)
    engine.submit(prompt, params, adapter="a")                               # None: the base

`attach_adapters` reads each adapter (a PEFT adapter directory, or a loom LoRA run or checkpoint), and turns
every base projection any of them adapts into a `MultiLoRALinear`: the base product W x + b, then for each
adapter present in the batch, over its rows only, x A_k^T B_k^T (scale folded into B_k). Rows of the base, or
of an adapter that does not adapt this projection, get nothing added. The engine binds the rows of each
forward (`AdapterRows.bind`: per token of the packed prefill, per row of a decode step) and clears them after,
so any forward it does not bind computes the base.

The result equals serving each merged model (W + scale B A) alone up to float rounding (tests/test_lora_serve.py,
fp32). The adapters are kept unmerged, in the base weight's dtype; the adapted projections are not packed by the
CPU decode kernel, and an engine with adapters runs eager (no compiled step, no fused q/k/v) with a slab (not
paged memory, whose shared prompts and prefix cache do not know adapters).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loom.errors import UserError


class AdapterRows:
    """Which rows of the current forward take which adapter: [(adapter index, row indices on the device)]."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.groups: list[tuple[int, torch.Tensor]] = []

    def __deepcopy__(self, memo):  # the CPU decode twin shares the binding (and the adapters) with the model
        return self

    def index(self, name: str | None) -> int | None:
        if name is None:
            return None
        if name not in self.names:
            raise UserError(f"no adapter {name!r}; this engine has {', '.join(self.names) or 'none'}")
        return self.names.index(name)

    def bind(self, per_row: list[int | None], device) -> None:
        """Rows (tokens of the flattened input) -> their adapter index, None for the base."""
        self.groups = []
        for k in sorted({k for k in per_row if k is not None}):
            rows = [i for i, a in enumerate(per_row) if a == k]
            self.groups.append((k, torch.tensor(rows, device=device)))

    def clear(self) -> None:
        self.groups = []


class LayerAdapters:
    """One projection's adapters: index -> (A [r, in], B [out, r] x scale), and the shared row binding."""

    def __init__(self, rows: AdapterRows):
        self.rows = rows
        self.pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __deepcopy__(self, memo):
        return self


class MultiLoRALinear(nn.Linear):
    """nn.Linear plus, per bound row, that row's adapter product (`LayerAdapters`)."""

    adapters: LayerAdapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        groups = self.adapters.rows.groups
        if not groups:
            return out
        flat_x, flat = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for k, rows in groups:
            pair = self.adapters.pairs.get(k)
            if pair is not None:
                a, b = pair
                flat.index_add_(0, rows, F.linear(F.linear(flat_x.index_select(0, rows), a), b))
        return out


def read_adapter(path: str | Path) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """[(loom weight name, A [r, in], B [out, r] x scale)] of a PEFT adapter directory or a loom LoRA run or
    checkpoint, float32."""
    from loom.interop.peft import is_lora_checkpoint, is_peft_dir, load_adapted, read_peft_dir

    if is_peft_dir(path):
        scale, pairs = read_peft_dir(path)
        return [(name, a.float(), b.float() * scale) for name, a, b in pairs]
    if not Path(path).exists() or not is_lora_checkpoint(path):
        raise UserError(f"--lora {path}: not a PEFT adapter directory (adapter_config.json) nor a loom LoRA run or "
                        "checkpoint (lora.rank > 0 in its config.toml)")
    from loom.models.lora import lora_layers

    model, _, _ = load_adapted(path)
    return [(f"{name}.weight", layer.lora_A.detach().float(), layer.lora_B.detach().float() * layer.scale)
            for name, layer in lora_layers(model).items()]


@torch.no_grad()
def attach_adapters(model: nn.Module, paths: dict[str, str]) -> AdapterRows:
    """Read each named adapter and put it on `model`'s projections (in place; see the module). Returns the
    binding the engine sets per forward."""
    rows = AdapterRows(tuple(paths))
    modules = dict(model.named_modules())
    for k, (name, path) in enumerate(paths.items()):
        for weight, a, b in read_adapter(path):
            module = modules.get(weight.removesuffix(".weight"))
            if not isinstance(module, nn.Linear) or not weight.endswith(".weight"):
                raise UserError(f"--lora {name}={path}: an adapter for {weight}, which the served model does not "
                                "have as a linear layer's weight")
            if (b.shape[0], a.shape[1]) != tuple(module.weight.shape) or a.shape[0] != b.shape[1]:
                raise UserError(f"--lora {name}={path}: the adapter of {weight} is {b.shape[0]}x{a.shape[1]} (rank "
                                f"{a.shape[0]}) but the served model's weight is {tuple(module.weight.shape)}: "
                                "another base model")
            if type(module) is nn.Linear:
                module.__class__ = MultiLoRALinear
                module.adapters = LayerAdapters(rows)
            w = module.weight
            module.adapters.pairs[k] = (a.to(w.device, w.dtype), b.to(w.device, w.dtype))
    return rows
