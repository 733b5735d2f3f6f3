"""AdamW with decoupled weight decay, off for norms and biases unless configured otherwise.

`optim.state_dtype=bfloat16` keeps both moments in bf16 (4 bytes per parameter instead of 8): each
update reads them into fp32, computes in fp32 and rounds back, so only storage is 16-bit. Parameters
the optimizer updates are always fp32 (the master weights; FSDP2 casts bf16 copies for compute).
Bytes per parameter held between steps (parameter + gradient + moments):
fp32 moments 4 + 4 + 8 = 16; bf16 moments 4 + 4 + 4 = 12 (see `state_bytes_per_param`).
Frozen parameters (LoRA's base, `requires_grad=False`, kept in train.dtype) are not given to the optimizer:
no moments, no master copy.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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


class AdamWLowPrecisionState(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter) storing exp_avg / exp_avg_sq in `state_dtype`, computing in fp32."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                 state_dtype: torch.dtype = torch.bfloat16):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype
        self.register_load_state_dict_post_hook(AdamWLowPrecisionState._restore_state_dtype)

    @staticmethod
    def _restore_state_dtype(optimizer) -> None:
        # Optimizer.load_state_dict casts state to the parameter dtype; the moments stay low-precision.
        for state in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(optimizer.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["step"] += 1
                step = state["step"].item()
                grad = p.grad.float()
                m = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
                if group["weight_decay"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v / (1 - beta2**step)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - beta1**step))
        return None


def optimizer_for_groups(groups: list[dict], optim: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over plain tensors in `groups` (the distributed optimizer's rows: loom/parallel/distopt.py)."""
    betas = (optim.beta1, optim.beta2)
    if optim.state_dtype == "bfloat16":
        return AdamWLowPrecisionState(groups, lr=optim.lr, betas=betas, eps=optim.eps)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=betas, eps=optim.eps, fused=device.type in ("cpu", "cuda"))


def build_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, optim)
    betas = (optim.beta1, optim.beta2)
    if optim.state_dtype == "bfloat16":
        return AdamWLowPrecisionState(groups, lr=optim.lr, betas=betas, eps=optim.eps)
    params = next(model.parameters())
    # The fused kernel is the fastest path on CPU and CUDA; sharded (DTensor) parameters take the
    # multi-tensor path.
    sharded = type(params).__name__ == "DTensor"
    return torch.optim.AdamW(
        groups, lr=optim.lr, betas=betas, eps=optim.eps,
        fused=not sharded and params.device.type in ("cpu", "cuda"),
        foreach=True if sharded else None,
    )


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def state_bytes_per_param(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes this rank holds per parameter it owns, measured from the live tensors (after a step)."""
    params = {id(p): p for p in model.parameters()}.values()
    owned = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    out = {
        "params": sum(_local_bytes(p) for p in params) / owned,
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None) / owned,
        "optimizer": sum(_local_bytes(v) for s in optimizer.state.values() for k, v in s.items()
                         if torch.is_tensor(v) and k != "step") / owned,
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def apply_hyperparameters(optimizer: torch.optim.Optimizer, optim: OptimConfig) -> None:
    """After loading a checkpoint: the configured betas, eps and weight decay win over the saved ones."""
    for group in optimizer.param_groups:
        group["betas"] = (optim.beta1, optim.beta2)
        group["eps"] = optim.eps
        if group["weight_decay"] > 0:
            group["weight_decay"] = optim.weight_decay
