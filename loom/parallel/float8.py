"""fp8 linear layers through torchao (`train.fp8 = tensorwise | rowwise`), applied before TP and FSDP.

torchao's `convert_to_float8_training` swaps `nn.Linear` modules for `Float8Linear`, whose matmuls cast
inputs, weights and output gradients to float8 (e4m3 forward, e5m2 gradients with `tensorwise`; per-row
scales with `rowwise`) and accumulate in higher precision; parameters, gradients and optimizer state stay
as they were, so FSDP2 shards them as before and checkpoints keep their names. The LM head and any linear
whose dimensions are not multiples of 16 (the fp8 GEMM's alignment) stay in high precision, as torchtitan
does. On GPU fp8 GEMMs need compute capability 8.9 or newer (Ada, Hopper, Blackwell); on CPU, torch's
own `_scaled_mm` kernel runs them (slowly: it is there so that the code path is tested on CPU).
"""

from __future__ import annotations

from torch import nn

from loom.errors import UserError


def float8_unavailable(device_type: str | None = None, recipe: str = "tensorwise") -> str | None:
    """Why fp8 training with `recipe` cannot run on `device_type` (torchao missing, no CUDA, GPU too old,
    a CPU torch without the recipe's scaled matmul), or None.

    On a CPU the recipe's own `_scaled_mm` call is tried: `tensorwise` scales each operand by one number,
    `rowwise` by one number per row of the input and per column of the weight, which torch's CPU kernel
    accepts only from some releases on (2.13 does, 2.11 does not). Asking for the recipe matters: a probe
    of tensorwise scales says nothing about rowwise ones."""
    import torch

    if recipe not in ("tensorwise", "rowwise"):
        return f"unknown fp8 recipe {recipe!r}; valid: tensorwise, rowwise"
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        return f"torchao is not installed ({exc}); install loom with the [gpu] extra: pip install -e '.[gpu]'"
    if device_type == "cpu" or (device_type is None and not torch.cuda.is_available()):
        one = torch.ones(16, 16).to(torch.float8_e4m3fn)
        if recipe == "rowwise":
            scales = dict(scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
        else:
            scales = dict(scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.float32)
        try:
            torch._scaled_mm(one, one.t(), **scales)
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return (f"this torch ({torch.__version__}) has no CPU fp8 matmul with {recipe} scales "
                    f"(torch._scaled_mm: {first}); use a CUDA device")
        return None
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return f"fp8 matmuls need compute capability >= 8.9 (Ada/Hopper); this GPU has {major}.{minor}"
    return None


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """Which linears become fp8: not the LM head, and only dimensions the fp8 GEMM accepts."""
    if fqn == "output" or fqn.endswith(".output"):
        return False
    return isinstance(module, nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def apply_float8(model: nn.Module, recipe: str) -> None:
    """Convert `model`'s linears (per `fp8_filter`) to torchao Float8Linear with the named recipe."""
    device = next(model.parameters()).device.type
    if why := float8_unavailable(device, recipe):
        raise UserError(f"train.fp8={recipe} cannot run: {why}; set train.fp8=off")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_filter)
