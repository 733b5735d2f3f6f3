"""Data parallelism with FSDP2 (`fully_shard`) over the `(dp_replicate, dp_shard)` mesh.

One mechanism covers the three styles:

- fully sharded (`dp_shard > 1`): parameters, gradients and optimizer state are split across the shard
  group; each block's parameters are all-gathered just before use and freed after, gradients are
  reduce-scattered block by block during backward (overlapping it);
- replicated (`dp_replicate > 1`, `dp_shard = 1`): the shard group has size 1, so every rank holds
  everything and gradients are all-reduced across replicas, again block by block during backward —
  DDP's communication pattern;
- hybrid (both > 1): sharded within a group, replicated across groups (HSDP).

Gradients over a step's micro-batches (`parallel.grad_accum`): "sharded" (default) reduce-scatters
every micro-batch's gradients into the rank's shard, so no rank ever holds the whole model's
gradients; under HSDP the all-reduce across replicas still runs once, after the last micro-batch.
"unsharded" keeps full gradients until the last micro-batch and reduces once. Replicated data
parallelism always reduces once (its gradients are whole anyway).

Parameters: each block is resharded after its forward (gathered again for backward), except under
pipeline parallelism, where a stage's blocks keep their gathered parameters from the first forward to
the end of the step (torchtitan's policy: the schedule interleaves many micro-batches' forwards and
backwards, and re-gathering for each would multiply the all-gathers).

Expert parallelism (`loom/parallel/expert.py`): each MoE layer's experts, already a DTensor sharded over
`ep`, are sharded again over the expert-data-parallel group `edp` by a `fully_shard` of their own, inside
their block's; their gradients are summed over `edp` and divided by all dp x cp ranks (not FSDP's default,
the edp size), because each already holds the tokens of its whole EP group. With experts spread over tp
ranks (sequence parallelism, `loom.rules.experts_span_tp`) `edp` is the ranks with the same tp rank holding
the same experts: the tp group is never in it, so no expert gradient is summed over tensor-parallel ranks.

Mixed precision: with `train.dtype=bfloat16` blocks compute in bf16 from bf16 copies of fp32 master
weights, and gradients are reduced in fp32. The optimizer always updates fp32 parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def shard_dim(shape: tuple[int, ...], ranks: int) -> int:
    """The dimension FSDP splits a parameter of `shape` along over `ranks`: its rows (dim 0, FSDP2's default) unless
    it has fewer rows than ranks, as a rank's stacked experts [E, hidden, ffn] can have (Mixtral's one expert per
    ep rank over 8 edp ranks). FSDP2 pads dim 0 to a multiple of the ranks, so there every rank would store,
    gather and reduce a whole expert, 8 x the bytes; split instead along the first dimension that the ranks
    divide (FSDP2 requires even splits off dim 0), at the price of one more copy per gather and reduction
    (FSDP2's chunk-cat), which `loom plan` counts (planner/steptime.py, `fsdp_copy_bytes`)."""
    if len(shape) < 2 or shape[0] >= ranks:
        return 0
    return next((d for d in range(1, len(shape)) if shape[d] % ranks == 0), 0)


def _placement(mesh):
    from torch.distributed.tensor import Shard

    ranks = mesh.size(mesh.ndim - 1)  # HSDP: the shard dimension of (replicate, shard)

    def place(param: nn.Parameter):
        local = param._local_tensor if hasattr(param, "_local_tensor") else param
        return Shard(shard_dim(tuple(local.shape), ranks))
    return place


def apply_data_parallel(model: nn.Module, dp_mesh, compute_dtype: torch.dtype | None,
                        reshard_after_forward: bool = True, experts: tuple | None = None) -> None:
    """`experts`: (edp mesh, gradient divide factor) under expert parallelism, else None."""
    from loom.models.moe import moe_layers

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(blocks) - 1
        if experts is not None:
            edp_mesh, divide = experts
            for moe in moe_layers(block):
                fully_shard(moe.experts, mesh=edp_mesh, mp_policy=policy, reshard_after_forward=reshard,
                            shard_placement_fn=_placement(edp_mesh))
                moe.experts.set_gradient_divide_factor(divide)
                # gloo has no pre-scaled sum: sum, then divide. (Not on one rank, where FSDP 2.13 would
                # divide twice: once copying the gradient instead of reducing it, once after.)
                if edp_mesh.device_type == "cpu" and edp_mesh.size() > 1:
                    moe.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard,
                    shard_placement_fn=_placement(dp_mesh))
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)  # the root keeps its weights from forward to backward


def set_gradient_sync(model: nn.Module, last_micro_batch: bool, sharded: bool) -> None:
    """Before a micro-batch's backward: reduce its gradients now (`sharded` accumulation under FSDP, or the
    last micro-batch), or keep them whole until the last one. The replica all-reduce of HSDP and of
    replicated data parallelism runs on the last micro-batch only."""
    distopt = getattr(model, "_loom_distopt", None)
    if distopt is not None:  # the distributed optimizer reduces each bucket once the last micro-batch fills it
        distopt.last_micro_batch = last_micro_batch
        distopt.micro_batch_starts()
        return
    if not isinstance(model, FSDPModule):
        return
    model.set_requires_gradient_sync(last_micro_batch or sharded)
    if sharded:
        model.set_requires_all_reduce(last_micro_batch)
