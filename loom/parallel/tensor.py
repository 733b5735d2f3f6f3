"""Tensor and sequence parallelism applied to the plain model with DTensor `parallelize_module` plans.

Why DTensor plans rather than hand-written collectives: the plan is data (which module is split how),
the model keeps no parallel code, PyTorch's sharding propagation handles the norm-weight and bias
gradients (partial sums reduced across the group) and composes with FSDP2 into 2-D DTensors, and
the equivalence tests prove the result. The cost is some Python dispatch per op; on one process with
tp=1 nothing is wrapped at all.

Layout (Megatron's, after Shoeybi et al. 2019 and Korthikanti et al. 2022):

- token embedding split by vocabulary rows; its output is reduced (all-reduce, or reduce-scatter along
  the sequence under SP);
- attention: wq, wk, wv split by output columns (whole heads per rank), wo by input rows;
- MLP: w1, w3 split by columns, w2 by rows;
- LM head split by vocabulary columns; the loss is computed on the vocabulary shards
  (`loss_parallel`), so the full logits never exist on one rank;
- with SP, the residual stream, norms and dropout live sharded along the sequence: the input of
  attention and MLP is all-gathered on entry and their output reduce-scattered on exit. The gathered
  input is what the column-parallel matmuls save for backward; `recompute.mode=selective` (a later
  release) will drop it and re-gather in backward, as Korthikanti et al. do.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)


class Replicated(ParallelStyle):
    """A module whose parameters are replicated over the group (norms without SP, position table).

    Parameters become replicated DTensors so that every parameter of the model is a DTensor (the
    optimizer and gradient clipping then see one kind of tensor). Inputs are taken as replicated; the
    output is redistributed to `output_layout` (e.g. this rank's sequence chunk) and returned as a
    DTensor or, with `use_local_output`, as this rank's local tensor.
    """

    def __init__(self, output_layout=Replicate(), use_local_output: bool = False):
        super().__init__()
        self.output_layout, self.use_local_output = output_layout, use_local_output

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()])))

        def prepare_input(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False) if isinstance(x, torch.Tensor)
                and not isinstance(x, DTensor) else x for x in inputs
            )

        def prepare_output(mod, output, mesh):
            output = output.redistribute(placements=[self.output_layout])
            return output.to_local() if self.use_local_output else output

        return distribute_module(module, mesh, partition, prepare_input, prepare_output)


def apply_tensor_parallel(model: nn.Module, tp_mesh, sp: bool) -> None:
    """Shard `model` in place over the 1-D mesh `tp_mesh`."""
    seq = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    tied = model.cfg.tie_embeddings
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    top["norm"] = SequenceParallel() if sp else Replicated()
    if model.pos_embeddings is not None:
        # Learned positions: the [seq, hidden] rows, cut to this rank's sequence chunk under SP.
        top["pos_embeddings"] = Replicated(Shard(0) if sp else Replicate(), use_local_output=True)
    parallelize_module(model, tp_mesh, top)
    if tied:  # both modules now hold their own DTensor; share the embedding's again
        model.output.weight = model.tok_embeddings.weight

    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(
                input_layouts=(seq, None, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        plan["attention_norm"] = SequenceParallel() if sp else Replicated()
        plan["ffn_norm"] = SequenceParallel() if sp else Replicated()
        parallelize_module(block, tp_mesh, plan)


def loss_context(tp: int):
    """Context for the loss and its backward: vocabulary-parallel cross-entropy when tp > 1."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()
