"""Parallelism applied to a plain model: `parallelize` runs fp8 conversion, tensor/sequence parallel,
context parallel, expert parallel, recomputation, per-block compilation, then FSDP2."""

from __future__ import annotations

import os

import torch
from torch import nn

from loom.config import Config
from loom.parallel.dims import MeshPlace, place_in_mesh


def parallelize(model: nn.Module, layout: MeshPlace, cfg: Config, compute_dtype: torch.dtype | None,
                layer_plan: dict[str, str] | None = None) -> nn.Module:
    """fp8 linear layers (`train.fp8`), TP(+SP) over the `tp` mesh dimension, context parallelism over
    `cp`, expert parallelism over `ep` (MoE experts sharded, tokens exchanged all-to-all), activation
    recomputation, `torch.compile` of each transformer block (`train.compile`), then data
    parallelism over `(dp_replicate, dp_shard)` (with cp > 1 `(dp_replicate, dp_shard_cp)`) — torchtitan's
    order. `model` is the whole model or one pipeline stage.
    `layer_plan` ({layer: none|selective|full}) overrides `cfg.recompute` (the budget planner's output).
    """
    from loom.parallel.recompute import apply_recompute

    if cfg.train.fp8 != "off":
        from loom.parallel.float8 import apply_float8

        apply_float8(model, cfg.train.fp8)
    if layout.tp > 1:
        from loom.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, layout.submesh("tp"), cfg.parallel.sp, layout.experts_span_tp)
    if layout.cp > 1:
        from loom.parallel.context import apply_context_parallel

        apply_context_parallel(model, layout.submesh("cp"))
    if layout.ep > 1:
        from loom.parallel.expert import apply_expert_parallel

        # Experts over tp ranks too: the balance loss and Sinkhorn then cover the cp x tp ranks' tokens.
        shards = (layout.submesh("cp_tp" if layout.cp > 1 else "tp") if layout.experts_span_tp else None)
        apply_expert_parallel(model, layout.submesh("ep"), shards, cfg.parallel.ep_overlap_chunks)
    if layout.tp * layout.cp > 1:  # dropout on shards draws from this rank's stream
        from loom.parallel.rng import install

        tp_rank = layout.submesh("tp").get_local_rank() if layout.tp > 1 else 0
        install(model, cfg.train.seed, layout.tp, tp_rank, cfg.parallel.sp, layout.cp, layout.cp_rank)
    apply_recompute(model, cfg, layer_plan, eager_core=cfg.train.compile and layout.tp > 1)
    if cfg.train.compile:
        compile_blocks(model)
    if layout.grad_ranks > 1 and not cfg.parallel.distributed_optimizer:  # distopt: the optimizer reduces
        from loom.parallel.data import apply_data_parallel

        p = cfg.parallel
        shard = ("dp_shard_cp", p.dp_shard * p.cp) if p.cp > 1 else ("dp_shard", p.dp_shard)
        names = [n for n, size in (("dp_replicate", p.dp_replicate), shard) if size > 1]
        if names == ["dp_replicate"]:
            names = ["dp_replicate", "dp_shard"]  # FSDP2 replicates over a 2-D mesh with a shard group of 1
        # Pipeline stages keep their gathered parameters through the step (see loom/parallel/data.py).
        # Expert parallelism: the experts are sharded by FSDP over the expert-data-parallel ranks instead, and
        # their gradients (which hold every EP rank's tokens) divided by all dp x cp ranks.
        experts = (layout.submesh("edp"), layout.grad_ranks) if layout.ep > 1 else None
        apply_data_parallel(model, layout.submesh(*names), compute_dtype, reshard_after_forward=layout.pp == 1,
                            experts=experts)
    return model


def compile_blocks(model: nn.Module) -> None:
    """Compile every transformer block in place (`nn.Module.compile`: names, state dicts and the hooks
    FSDP registers later are unchanged). After TP and recomputation, so the compiled graph contains the
    DTensor ops and the selective checkpoint regions; before FSDP, whose all-gathers stay outside the graphs.
    A fully recomputed block is compiled inside its checkpoint (`recompute.compile_inside`).
    What cannot be traced runs eagerly between a block's graphs, each a counted graph break
    (tests/test_compile_layouts.py): sequence parallelism's gather hooks, the context-parallel key/value
    exchange and the MoE layers' cp-group sums, the expert-parallel all-to-all, Sinkhorn's iterations and the
    experts' per-expert loop where `torch._grouped_mm` does not run (the grouped path traces whole).
    `LOOM_COMPILE_BACKEND` picks another torch.compile backend (tests use `aot_eager`: the same graph
    capture and autograd tracing, without code generation)."""
    from loom.parallel.recompute import compile_inside

    backend = os.environ.get("LOOM_COMPILE_BACKEND", "inductor")
    for block in model.layers.values():
        if not compile_inside(block, lambda fn: torch.compile(fn, backend=backend)):
            block.compile(backend=backend)


def is_compiled(block: nn.Module) -> bool:
    """Whether `compile_blocks` compiled this transformer block (in place, or inside its checkpoint)."""
    inner = getattr(block.forward, "inner", None)
    return (getattr(block, "_compiled_call_impl", None) is not None
            or getattr(inner, "_torchdynamo_orig_callable", None) is not None)


__all__ = ["MeshPlace", "place_in_mesh", "parallelize"]
