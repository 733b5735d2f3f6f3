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
- mixture-of-experts layers (loom/models/moe.py) are not split: every rank of the group computes the whole
  layer (router, experts, shared experts) on the whole sequence, with replicated parameters (replicated
  DTensors the layer computes with as local tensors; under `parallel.ep` the experts are expert-parallel
  DTensors instead). Under SP the input is all-gathered on entry and the rank keeps its sequence shard of
  the output; backward all-gathers the output's gradient, so every rank gets the whole layer's gradient
  (the same on every rank: nothing to reduce over the group) and keeps its shard of the input's. Routing,
  its statistics and the auxiliary losses then cover the whole sequence as on one process. Under SP with
  `parallel.ep` a multiple of tp the experts are spread over the tensor-parallel ranks instead (`_moe_plan_own_tokens`):
  each rank routes its own sequence shard, nothing is gathered;
- LM head split by vocabulary columns; the loss is computed on the vocabulary shards
  (`loss_parallel`), so the full logits never exist on one rank;
- with SP, the residual stream, norms and dropout live sharded along the sequence: the input of
  attention and MLP is all-gathered on entry and their output reduce-scattered on exit. Only the
  sequence shard of the gathered input is kept for backward, which gathers it again
  (`GatherSequence`), as Korthikanti et al. do.
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
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from loom.ledger import SavedTensorLedger
from loom.models.moe import MoE


class Replicated(ParallelStyle):
    """A module whose parameters are replicated over the group (norms without SP, position table).

    Parameters become replicated DTensors so that every parameter of the model is a DTensor (the
    optimizer and gradient clipping then see one kind of tensor). Inputs are taken as replicated; the
    output is redistributed to `output_layout` (e.g. this rank's sequence chunk) and returned as a
    DTensor or, with `use_local_output`, as this rank's local tensor.
    """

    def __init__(self, output_layout=Replicate(), use_local_output: bool = False, input_layout=Replicate()):
        super().__init__()
        self.output_layout, self.use_local_output = output_layout, use_local_output
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()])))

        def prepare_input(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(x, mesh, [self.input_layout], run_check=False) if isinstance(x, torch.Tensor)
                and not isinstance(x, DTensor) else x for x in inputs
            )

        def prepare_output(mod, output, mesh):
            output = output.redistribute(placements=[self.output_layout])
            return output.to_local() if self.use_local_output else output

        return distribute_module(module, mesh, partition, prepare_input, prepare_output)


class _Regather:
    """What is kept for backward instead of a view of the all-gathered input: the local shard."""

    __slots__ = ("source", "shape", "stride", "offset", "spec")

    def __init__(self, source, shape, stride, offset, spec):
        self.source, self.shape, self.stride, self.offset, self.spec = source, shape, stride, offset, spec


class _GatheredInput:
    """One all-gathered input: its local shard, and the regathered tensor while backward needs it."""

    def __init__(self, shard: torch.Tensor, mesh, full_local: torch.Tensor):
        self.shard, self.mesh = shard, mesh
        self.ptr = full_local.untyped_storage().data_ptr()
        self.pending = 0  # saved views not yet unpacked by backward
        self.full = None

    def regather(self) -> torch.Tensor:
        if self.full is None:
            dt = DTensor.from_local(self.shard, self.mesh, [Shard(1)], run_check=False)
            self.full = dt.redistribute(placements=[Replicate()]).to_local().contiguous()
        return self.full


class GatherSequence(ParallelStyle):
    """SP entry into a tensor-parallel region, keeping only the sequence shard for backward.

    The module's first input arrives sharded along the sequence and is all-gathered for the
    column-parallel matmuls. Autograd would save that gathered `[b, s, h]` tensor (each matmul keeps its
    input for the weight gradient). Instead, while the module runs, a `saved_tensors_hooks` pair swaps
    every saved view of it for the local `[b, s/t, h]` shard and all-gathers again in backward — the
    memory layout of Korthikanti et al. (2022), at the price of one extra all-gather per region.
    """

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        state: dict = {}

        def pack(t):
            # this hook hides the ledger's: report to it
            ledger = SavedTensorLedger.active
            gathered = state.get("current")
            local = t._local_tensor if isinstance(t, DTensor) else t
            if gathered is None or local.untyped_storage().data_ptr() != gathered.ptr:
                if ledger is not None:
                    ledger.record(t)
                return t
            if ledger is not None:
                ledger.record(gathered.shard)
            gathered.pending += 1
            spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
            return _Regather(gathered, local.shape, local.stride(), local.storage_offset(), spec)

        def unpack(packed):
            if not isinstance(packed, _Regather):
                return packed
            gathered = packed.source
            view = gathered.regather().as_strided(packed.shape, packed.stride, packed.offset)
            gathered.pending -= 1
            if gathered.pending == 0:
                gathered.full = None  # the last user has it; let it go after this op
            if packed.spec is None:
                return view
            mesh_, placements, shape, stride = packed.spec
            return DTensor.from_local(view, mesh_, placements, run_check=False, shape=shape, stride=stride)

        @torch.compiler.disable  # eager in a compiled block: one graph break on entry (see `compile_blocks`)
        def pre_hook(mod, inputs):
            x, *rest = inputs
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
            full = x.redistribute(placements=[Replicate()])
            if torch.is_grad_enabled():
                gathered = _GatheredInput(x.to_local(), mesh, full.to_local())
                state["current"] = gathered
                state["hooks"] = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
                state["hooks"].__enter__()
            return (full, *rest)

        @torch.compiler.disable
        def post_hook(mod, inputs, output):
            hooks = state.pop("hooks", None)
            if hooks is not None:
                hooks.__exit__(None, None, None)
            state.pop("current", None)
            return output

        module.register_forward_pre_hook(pre_hook)
        module.register_forward_hook(post_hook)
        return module


class RowwiseEmbedding(RowwiseParallel):
    """The vocabulary-split token embedding, whose output is reduced synchronously: `RowwiseParallel` returns
    an `AsyncCollectiveTensor`, which torch.compile (2.11-2.13) unwraps at a compiled block's entry without
    its autograd edge, so the embedding's gradient arrives as a plain tensor (a compiled first block fails in
    backward). The next op waits for the reduction at once in either case."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs


def apply_tensor_parallel(model: nn.Module, tp_mesh, sp: bool, experts_span_tp: bool = False) -> None:
    """Shard `model` in place over the 1-D mesh `tp_mesh`. `experts_span_tp` (with `sp`): the MoE layers route
    each rank's own sequence shard (`_moe_plan_own_tokens`); expert parallelism then spreads their experts."""
    seq = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    tied = model.cfg.tie_embeddings
    top = {
        "tok_embeddings": RowwiseEmbedding(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    top["norm"] = SequenceParallel() if sp else Replicated()
    # Heads a recipe added on top of the trunk (the reward model's `score`, PPO's `value`: the modules of
    # `model.fresh_parameters`) read the final hidden state, replicated here: every rank holds the whole head.
    for name in dict.fromkeys(p.split(".")[0] for p in model.fresh_parameters):
        top[name] = Replicated(use_local_output=True)
    if model.pos_embeddings is not None:
        # Learned positions: the [seq, hidden] rows, cut to this rank's sequence chunk under SP.
        top["pos_embeddings"] = Replicated(Shard(-2) if sp else Replicate(), use_local_output=True)
    # A pipeline stage holds only some of these modules.
    present = dict(model.named_children())
    top = {name: style for name, style in top.items() if name in present}
    parallelize_module(model, tp_mesh, top)
    if tied and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight  # both got their own DTensor; share again

    for block in model.layers.values():
        plan = {
            "attention": GatherSequence() if sp else PrepareModuleInput(
                input_layouts=(seq, None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        moe = block.feed_forward if isinstance(block.feed_forward, MoE) else None
        if moe is not None and sp and experts_span_tp:
            plan.update(_moe_plan_own_tokens(moe, tp_mesh))
        elif moe is not None:  # the whole sequence on every rank, local tensors inside
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
            for name, _ in moe.named_children():
                if name in ("shared", "shared_gate"):
                    plan[f"feed_forward.{name}"] = Replicated(use_local_output=True)
            for module in (moe.router, moe.experts):
                for pname, param in list(module.named_parameters(recurse=False)):
                    replicated = distribute_tensor(param.data, tp_mesh, [Replicate()])
                    module.register_parameter(pname, nn.Parameter(replicated))
        else:
            plan["feed_forward"] = GatherSequence() if sp else PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(Replicate(),))
            plan["feed_forward.w1"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
            if block.feed_forward.w3 is not None:
                plan["feed_forward.w3"] = ColwiseParallel()
        if block.attention.q_norm is not None:
            # Per-head norms on this rank's heads ([b, s, heads, d] sharded by heads): a replicated weight
            # whose gradient, partial per rank, is summed over the group.
            for name in ("attention.q_norm", "attention.k_norm"):
                plan[name] = Replicated(Shard(2), use_local_output=True, input_layout=Shard(2))
        plan["attention_norm"] = SequenceParallel() if sp else Replicated()
        plan["ffn_norm"] = SequenceParallel() if sp else Replicated()
        parallelize_module(block, tp_mesh, plan)


def _moe_plan_own_tokens(moe: MoE, tp_mesh) -> dict:
    """The plan of an MoE layer under SP whose experts are spread over the tp ranks (expert tensor parallelism
    1, `loom.rules.experts_span_tp`): the layer runs on the rank's own sequence shard, as a local tensor, and
    nothing is gathered. The router, shared experts and shared gate are replicated DTensors computed on the
    rank's rows as a `Shard(0)` DTensor, so their weight gradients (partial per rank) sum over the group, as
    the sequence-parallel norms' do; the routed experts stay plain here, for `apply_expert_parallel` to shard
    over an EP group made of whole tp groups (no two ranks of a tp group hold the same experts)."""
    plan = {"feed_forward": PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=True)}
    for name, _ in moe.named_children():
        if name in ("shared", "shared_gate"):
            plan[f"feed_forward.{name}"] = Replicated(Shard(0), use_local_output=True, input_layout=Shard(0))
    for pname, param in list(moe.router.named_parameters(recurse=False)):
        moe.router.register_parameter(pname, nn.Parameter(distribute_tensor(param.data, tp_mesh, [Replicate()])))
    moe.token_mesh = tp_mesh
    return plan


def loss_context(tp: int):
    """Context for the loss and its backward: vocabulary-parallel cross-entropy when tp > 1."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()
