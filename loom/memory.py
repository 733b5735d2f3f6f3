"""`loom memory`: measure what one training step keeps for backward and how many FLOPs it does.

Activation bytes are counted, not estimated: a `saved_tensors_hooks` ledger sees every tensor autograd
saves during the forward pass, attributes it to the module running, and counts each storage once
(views and tensors saved twice share a storage), leaving parameters out. Code that keeps tensors
outside autograd's saved tensors — a recomputation checkpoint keeps its inputs, sequence parallelism
keeps a shard in place of a gathered input — reports them to the ledger itself.

FLOPs are counted with `torch.utils.flop_counter.FlopCounterMode` over forward and backward of the
unsharded model (tensor, data and pipeline parallelism split matmuls without repeating them, so this
equals the sum over ranks); recomputation in backward shows up as hardware FLOPs.

On one process the model lives on the meta device: shapes, storages and FLOPs are exact with no
memory and no arithmetic, so a 405B configuration is measured in seconds.
"""

from __future__ import annotations

import torch

from loom.config import Config


def _storage_key(t: torch.Tensor):
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    st = local.untyped_storage()
    return st._cdata, st.nbytes()


class SavedTensorLedger:
    """Bytes saved for backward per module, each storage counted once, parameters and buffers excluded."""

    active: "SavedTensorLedger | None" = None

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.excluded = {_storage_key(t)[0] for t in [*model.parameters(), *model.buffers()]}
        self.seen: dict = {}  # storage -> label
        self.bytes: dict[str, int] = {}
        self.stack = ["outside"]
        self._handles = []

    def record(self, t: torch.Tensor) -> None:
        key, nbytes = _storage_key(t)
        if key in self.excluded or key in self.seen or nbytes == 0:
            return
        label = self.stack[-1]
        self.seen[key] = label
        self.bytes[label] = self.bytes.get(label, 0) + nbytes

    def _leave(self) -> None:  # a forward hook must return None (else it replaces the output)
        self.stack.pop()

    def _pack(self, t):
        self.record(t)
        return t

    def __enter__(self):
        for name, module in self.model.named_modules():
            if not name:
                continue
            self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self.stack.append(n)))
            self._handles.append(module.register_forward_hook(lambda m, a, o: self._leave()))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        SavedTensorLedger.active = self
        return self

    def __exit__(self, *exc):
        SavedTensorLedger.active = None
        self._hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()

    def per_layer(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for label, n in self.bytes.items():
            parts = label.split(".")
            key = ".".join(parts[:2]) if parts[0] == "layers" else "outside layers"
            out[key] = out.get(key, 0) + n
        return out

    def breakdown(self, layer: str) -> dict[str, int]:
        """Bytes by module inside one layer (`attention` includes its core)."""
        prefix = layer + "."
        out: dict[str, int] = {}
        for label, n in self.bytes.items():
            if label.startswith(prefix):
                part = label[len(prefix):].split(".")[0]
                out[part] = out.get(part, 0) + n
        return out


def _build(cfg: Config, device, layout=None):
    from loom.models.llama import build_model
    from loom.parallel import parallelize
    from loom.parallel.recompute import apply_recompute

    dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
    model = build_model(cfg.model, device=device, dtype=dtype, seed=None if str(device) == "meta" else 0)
    model.train()
    if layout is not None and layout.tp > 1:
        parallelize(model, layout, cfg, None)
    apply_recompute(model, cfg, budget_plan(cfg) if cfg.recompute.mode == "budget" else None)
    return model


def _batch(cfg: Config, device):
    t = cfg.train
    x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len), device=device)
    return x, torch.roll(x, -1, dims=1)


def measure_activations(cfg: Config, layout=None, device="meta") -> dict:
    """Saved bytes of one micro-batch's forward on this rank, per layer and per component."""
    from loom.parallel.tensor import loss_context
    from loom.train.trainer import token_loss_sum

    model = _build(cfg, device, layout)
    x, y = _batch(cfg, device)
    with loss_context(layout.tp if layout else 1):
        with SavedTensorLedger(model) as ledger:
            loss = token_loss_sum(model(x), y)
    per_layer = ledger.per_layer()
    layers = {k: v for k, v in per_layer.items() if k.startswith("layers.")}
    worst = max(layers, key=layers.get)
    del loss
    return {
        "layer_activation_bytes": layers[worst],
        "layers": layers,
        "outside_layers_bytes": per_layer.get("outside layers", 0),
        "breakdown": ledger.breakdown(worst),
        "total_activation_bytes": sum(per_layer.values()),
    }


def count_flops(cfg: Config) -> int:
    """Matmul FLOPs of forward + backward (incl. recomputation) of one micro-batch, unsharded model."""
    from torch.utils.flop_counter import FlopCounterMode

    from loom.train.trainer import token_loss_sum

    model = _build(cfg, "meta")
    x, y = _batch(cfg, "meta")
    with FlopCounterMode(display=False) as counter:
        token_loss_sum(model(x), y).backward()
    return counter.get_total_flops()


def step_flops(cfg: Config) -> dict:
    """Model and hardware FLOPs of one optimizer step, summed over all ranks."""
    from dataclasses import replace

    micro_batches = cfg.train.global_batch // cfg.train.micro_batch
    plain = replace(cfg, recompute=replace(cfg.recompute, mode="none"))
    return {
        "model_flops_per_step": count_flops(plain) * micro_batches,
        "hardware_flops_per_step": count_flops(cfg) * micro_batches,
    }


def state_bytes(cfg: Config, layout=None) -> dict:
    """Parameters, gradients and optimizer state per rank (fp32 master weights and gradients)."""
    model = _build(cfg, "meta", None)
    total = model.num_params()
    p = cfg.parallel
    per_rank = total / (p.tp * p.pp * p.dp_shard)
    moment_bytes = 4 if cfg.optim.state_dtype == "bfloat16" else 8
    return {"params_total": total, "params_bytes": per_rank * 4, "grads_bytes": per_rank * 4,
            "optimizer_bytes": per_rank * moment_bytes}


def budget_plan(cfg: Config) -> dict[str, str]:  # defined in loom.memory_budget once measured
    from loom.memory_budget import plan_budget

    return plan_budget(cfg)
