"""silu(a) * b that keeps only its two inputs for backward.

Autograd's own `F.silu(a) * b` keeps a (for silu's backward), silu(a) and b (for the product's): three tensors of
the MLP's width per row, beside the product itself, which the next matmul keeps. This keeps a and b and recomputes
silu(a) in backward (one elementwise pass), as fused SwiGLU kernels do (Megatron-Core's bias_swiglu, Liger's):
one tensor of the MLP's width per row less. loom's routed experts use it (loom/models/moe.py): between expert
parallelism's all-to-alls they run eagerly, where nothing else would drop it; `loom plan` prices their MLP at
3 widths per row (w1's and w3's outputs, the product), not 4 (loom/planner/memory.py). A compiled block traces it
like any other op (inductor chooses its saved set itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        sig = torch.sigmoid(a)
        silu = a * sig
        grad_a = grad * b * sig * (1 + a * (1 - sig)) if ctx.needs_input_grad[0] else None
        grad_b = grad * silu if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """silu(a) * b, keeping a and b only for backward (see the module docstring)."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        return _SwiGLU.apply(a, b)
    return F.silu(a) * b


class _WeightedSwiGLU(torch.autograd.Function):
    """silu(a) * b * g[:, None] (g: each row's fp32 gate weight), keeping a, b and g: the gate folded into the
    experts' activation, as Megatron-Core's weighted_bias_swiglu does, so the combine keeps no expert output."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b, g)
        return (F.silu(a) * b * g[:, None]).to(a.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b, g = ctx.saved_tensors
        sig = torch.sigmoid(a)
        p = a * sig * b
        acc = torch.promote_types(torch.promote_types(grad.dtype, g.dtype), torch.float32)  # fp32 or finer
        grad_g = (grad * p).sum(-1, dtype=acc).to(g.dtype) if ctx.needs_input_grad[2] else None
        dp = grad * g[:, None]
        grad_a = (dp * b * sig * (1 + a * (1 - sig))).to(a.dtype) if ctx.needs_input_grad[0] else None
        grad_b = (dp * a * sig).to(b.dtype) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, grad_g


def weighted_swiglu(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """silu(a) * b * g[:, None] in a's dtype, keeping a, b and g only for backward."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or g.requires_grad):
        return _WeightedSwiGLU.apply(a, b, g)
    return (F.silu(a) * b * g[:, None]).to(a.dtype)
