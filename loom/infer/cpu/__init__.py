"""The engine's CPU decode path, all of it behind one entry point: `cpu_decode(model)`, which the engine calls
once; a GPU engine gets None and never runs anything here.

What a CPU engine does differently, and only on fp32 weights of one process:

- decode steps (and the prefill's head on the prompts' last positions) run on a twin of the model that shares
  its parameters but whose linear layers multiply through the packed small-batch kernel (`kernels.py`); the
  twin holds a packed copy of those weights (as much memory again as the linear layers), rewritten in place by
  `repack` after a refit. The model itself is untouched: a trainer's forward on it stays its own;
- decode attention runs through the kernel's `decode_attention` (`CpuDecode.attention`, which the engine hands
  to its `KVSlab`);
- the LM head, when it is not packed, multiplies as (W h^T)^T for the few rows of a decode step (MKL streams
  the tall weight faster as the left operand; equal to `F.linear` up to the order of fp32 additions).

Where the kernels cannot run (no AVX2, no C++ compiler, LOOM_CPU_KERNELS=0, bf16, a tensor-parallel shard) or
the engine is built with `cpu_kernel=False`, the twin is the model itself and SDPA attends.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from loom.infer.cpu import kernels
from loom.infer.cpu.kernels import PackedLinear
from loom.parallel.distributed import full_tensor


class CpuDecode:
    """One CPU engine's decode path. `decoder`: the module decode steps run (the model, or its packed twin);
    `packed`: the twin's packed layers; `attention`: the decode attention kernel, or None (SDPA);
    `head_in_step`: the head is packed, so a compiled step computes it (and its reductions) itself."""

    def __init__(self, model: nn.Module, use_kernels: bool):
        self.decoder, self.packed = packed_twin(model) if use_kernels else (model, [])
        self.attention = torch.ops.loom_cpu.decode_attention if self.packed else None
        self.paged_attention = torch.ops.loom_cpu.decode_attention_paged if self.packed else None
        self.head_in_step = isinstance(self.decoder.output, PackedLinear)

    def repack(self) -> None:
        """Rewrite the packed copies from the model's (new) weights, in place."""
        for layer in self.packed:
            layer.repack()

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the decoder's LM head: packed, or for the few rows of a decode step
        and a plain fp32 weight computed as (W h^T)^T, else the head as it is."""
        head = self.decoder.output
        if self.head_in_step:
            return head(hidden)
        w = head.weight
        if (type(head) is nn.Linear and type(w) is nn.Parameter and head.bias is None
                and w.dtype == hidden.dtype == torch.float32 and 1 < hidden.shape[0] <= 64):
            return torch.mm(w, hidden.t()).t().contiguous()
        return full_tensor(head(hidden)).float()


def cpu_decode(model: nn.Module, use_kernels: bool = True) -> CpuDecode | None:
    """The CPU decode path of an engine on `model`, or None where the model's weights are not on a CPU."""
    if next(model.parameters()).device.type != "cpu":
        return None
    return CpuDecode(model, use_kernels)


def packed_twin(model: nn.Module) -> tuple[nn.Module, list[PackedLinear]]:
    """(twin, its packed layers): a copy of `model` that shares every parameter and buffer with it but whose
    fp32 CPU linear layers (`kernels.packable`) are `PackedLinear`s over the model's own weights. (model, [])
    when nothing is packable or the kernel cannot run here."""
    if not any(kernels.packable(m) for m in model.modules()):
        return model, []
    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    twin = copy.deepcopy(model, memo)
    originals = dict(model.named_modules())
    packed = []
    for name, module in list(twin.named_modules()):
        if name and kernels.packable(module):
            parent, _, leaf = name.rpartition(".")
            packed.append(PackedLinear(originals[name]))
            setattr(twin.get_submodule(parent) if parent else twin, leaf, packed[-1])
    return twin, packed


def decode_attention_kernel(device: str | torch.device, dtype: torch.dtype):
    """The decode attention kernel an engine's slab uses for tensors of `dtype` on `device`, or None (SDPA)."""
    return torch.ops.loom_cpu.decode_attention if kernels.runs_on(device, dtype) else None


def decode_product(device: str | torch.device, dtype: torch.dtype):
    """weight -> the function that multiplies a decode step's rows by it, as the engine does here: the packed
    kernel (the weight packed once, here, not per call) where the CPU kernels run, else None (F.linear)."""
    if not kernels.runs_on(device, dtype):
        return None

    def make(weight: torch.Tensor):
        packed, n = kernels.pack(weight), weight.shape[0]
        return lambda x: torch.ops.loom_cpu.packed_linear(x, packed, n, None)

    return make
