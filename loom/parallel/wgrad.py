"""Megatron's gradient-accumulation fusion for loom's distributed optimizer (loom/parallel/distopt.py): a linear
layer whose backward writes its weight gradient into the optimizer's fp32 buffer instead of returning it, and the
probe of whether this device's GEMM writes an fp32 result from 16-bit inputs itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


class LinearIntoBuffer(torch.autograd.Function):
    """y = x W^T (+ b) whose backward gives x its gradient as F.linear's would (DTensor placements included) and
    adds W's straight into the optimizer's fp32 buffer (`into(dy, x)` on local tensors) instead of returning it:
    Megatron's gradient-accumulation fusion. A bias (plain tensors only: `_fuse_linears`) gets its gradient as
    F.linear gives it, the sum of dy over the tokens, through autograd as any parameter. `node`: the weight's
    AccumulateGrad node; a backward that does not run it (`torch.autograd.grad` for inputs only, as
    torch.distributed.pipelining's first step does to learn its gradients' shapes) adds nothing."""

    @staticmethod
    def forward(ctx, x, weight, bias, into, node):
        ctx.save_for_backward(x, weight)
        ctx.into, ctx.node = into, node
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        db = dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        if torch._C._will_engine_execute_node(ctx.node):
            local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
            ctx.into(local(dy), local(x))
        return dx, None, db, None, None


def fused_out_dtype_works(device: torch.device) -> bool:
    """Whether this device's addmm takes 16-bit inputs into an fp32 result (`out_dtype`, CUDA): the weight gradient
    then accumulates in the GEMM itself; elsewhere it is computed, then added."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        c = torch.ones(2, 2, dtype=torch.float32, device=device)
        torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return bool(c[0, 0].item() == 3.0)
    except (RuntimeError, TypeError):
        return False
