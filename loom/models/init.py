"""Initial weights that do not depend on the parallel layout.

Every parameter is defined by its name and the run's seed alone: the full tensor is cut into blocks of
rows (a fixed number of elements, whatever the layout), and each block is drawn from its own generator
seeded by (seed, parameter name, block index). A rank that holds any slice of a parameter (a tensor-
parallel shard, an FSDP shard, a pipeline stage's layers) draws only the blocks that overlap its slice
and keeps its part, so every layout starts from exactly the weights of one process, and no rank ever
materialises a parameter it does not hold (at most one block of rows beyond its slice).

Why not a seed checkpoint loaded through DCP (torchtitan's way): that needs one process to build and
save the whole model first, a step per model shape and a file on shared storage; this needs nothing
but the seed. Why not DTensor's random ops: on CPU and gloo they draw from each rank's own generator,
so the weights would depend on the layout.
"""

from __future__ import annotations

import math
import zlib

import torch

BLOCK_ELEMENTS = 1 << 20  # elements per block of rows (a row longer than this is a block by itself)
_MASK = (1 << 63) - 1


def block_rows(full_shape: tuple[int, ...]) -> int:
    row = 1
    for n in full_shape[1:]:
        row *= n
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def _block_seed(seed: int, name: str, block: int) -> int:
    h = zlib.crc32(name.encode())
    return (seed * 0x9E3779B97F4A7C15 + h * 0xBF58476D1CE4E5B9 + block * 0x94D049BB133111EB) & _MASK


def canonical_name(name: str) -> str:
    """The model's own parameter name, without wrappers' prefixes (compile, activation checkpointing)."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


@torch.no_grad()
def fill(out: torch.Tensor, full_shape: tuple[int, ...], offset: tuple[int, ...], seed: int, name: str,
         kind: str, std: float = 0.0) -> None:
    """Fill `out` (a slice of shape out.shape at `offset` of a parameter of `full_shape`) with exactly the
    values that the whole parameter holds there. kind: "normal" (mean 0, `std`), "kaiming_uniform" (uniform
    in +-1/sqrt(fan_in), nn.Linear's and PEFT's LoRA A), "ones" or "zeros"."""
    if kind == "ones":
        out.fill_(1.0)
        return
    if kind == "zeros":
        out.zero_()
        return
    if out.numel() == 0:
        return
    if len(full_shape) == 0:
        raise ValueError(f"{name}: a scalar parameter cannot be drawn by rows")
    rows = block_rows(full_shape)
    first, count = offset[0], out.shape[0]
    rest = tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:]))
    for b in range(first // rows, (first + count - 1) // rows + 1):
        lo, hi = b * rows, min((b + 1) * rows, full_shape[0])
        gen = torch.Generator().manual_seed(_block_seed(seed, name, b))
        block = torch.empty((hi - lo, *full_shape[1:]), dtype=torch.float32)
        if kind == "kaiming_uniform":
            bound = 1 / math.sqrt(full_shape[-1])
            block.uniform_(-bound, bound, generator=gen)
        else:
            block.normal_(0.0, std, generator=gen)
        a, z = max(lo, first), min(hi, first + count)
        out[a - first : z - first].copy_(block[(slice(a - lo, z - lo), *rest)])


def to_empty_keeping_ties(module: torch.nn.Module, device: torch.device | str) -> None:
    """`module.to_empty(device)`, keeping parameters that are shared (tied embeddings) shared: moving a
    meta tensor to a real device replaces each parameter with a new one, which would untie them."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for mod in module.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, attr))
    module.to_empty(device=device)
    for shared in owners.values():
        first_mod, first_attr = shared[0]
        for mod, attr in shared[1:]:
            if mod._parameters[attr] is not first_mod._parameters[first_attr]:
                mod._parameters[attr] = first_mod._parameters[first_attr]
