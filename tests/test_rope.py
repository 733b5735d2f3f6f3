"""The rotary embedding computes exactly the rotate-half formula of Hugging Face Llama, bit for bit."""

import pytest
import torch

from loom.models.llama import apply_rope, rope_tables


def _rotate_half_rope(x, head_dim, max_len, theta):
    # Hugging Face's formulation, tables in float64 then float32: x * cos + rotate_half(x) * sin.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().float(), angles.sin().float()
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_rotate_half_bitwise_forward_and_backward(dtype):
    torch.manual_seed(0)
    # [batch, seq, heads, dim] viewed as [batch, heads, seq, dim], as attention passes it
    base = torch.randn(2, 16, 3, 8).to(dtype)
    ours, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
    cos, signed_sin = rope_tables(8, 16, 10000.0)
    y = apply_rope(ours.transpose(1, 2), cos, signed_sin)
    y_ref = _rotate_half_rope(ref.transpose(1, 2), 8, 16, 10000.0)
    assert y.dtype == dtype
    assert torch.equal(y, y_ref)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    assert torch.equal(ours.grad, ref.grad)
