"""Activation recomputation, applied to a built model from outside (the model has no checkpoint code).

- `selective`: recompute the attention core (scores, softmax, dropout, weighted values) in backward —
  what Korthikanti et al. (2022) found large in memory (5·a·s²·b bytes per layer) and cheap to compute
  (4·b·s²·h FLOPs). Under SP the gathered inputs of the tensor-parallel regions are never stored
  either (`loom.parallel.tensor.GatherSequence`), so TP+SP+selective holds 34·s·b·h/t bytes per layer.
- `full`: recompute whole transformer layers, keeping only each layer's input. `method=uniform`
  recomputes every layer; `method=block` the first `num_layers` layers of each pipeline stage (the
  rest keep their activations), as in Megatron.
- `budget`: per layer, the cheapest set of recomputations that fits `budget_gib` (see `plan_budget`).

Checkpoints are non-reentrant `torch.utils.checkpoint` regions; RNG state is replayed (the default
generators' by torch, tensor and context parallelism's dropout streams by `rng.replay_context`), so dropout
masks in a recomputed region are the ones of the original forward.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from loom.ledger import SavedTensorLedger
from loom.parallel import rng
from loom.parallel.context import local_core_slot


def _record_inputs(*tensors) -> None:
    """A checkpoint keeps its inputs alive outside autograd's saved tensors: tell the ledger."""
    ledger = SavedTensorLedger.active
    if ledger is not None:
        for t in tensors:
            if torch.is_tensor(t):
                ledger.record(t)


_CHECKPOINTED: weakref.WeakSet = weakref.WeakSet()  # the wrappers made here: a region is wrapped once


def _checkpointed(fn, streams=None, eager: bool = False):
    """`fn` as a checkpointed region; `streams`: the model's dropout streams under tp or cp
    (loom/parallel/rng.py), whose draws the recomputation replays as torch replays the default generators'.
    `eager`: the region runs eagerly inside a compiled block (one graph break) instead of being traced."""
    extra = {"context_fn": functools.partial(rng.replay_context, streams)} if streams is not None else {}

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        _record_inputs(*args)
        return checkpoint(fn, *args, use_reentrant=False, **extra, **kwargs)

    if eager:
        run = torch.compiler.disable(run)
    run.inner, run.streams = fn, streams
    _CHECKPOINTED.add(run)
    return run


def compile_inside(block, compile_fn) -> bool:
    """A fully recomputed block (`recompute_layer`) compiled inside its checkpoint: `block.forward` becomes the
    checkpoint of `compile_fn(original forward)`, so backward recomputes through the compiled graphs. (Traced
    from outside, the checkpoint is one higher-order op that a graph break anywhere in the block, at a
    collective or a data-dependent step, would make dynamo run eagerly, block and all.) False: the block is
    not fully recomputed."""
    run = block.forward
    if run not in _CHECKPOINTED:
        return False
    block.forward = _checkpointed(compile_fn(run.inner), run.streams)
    return True


def recompute_attention_core(block, streams=None, eager: bool = False) -> None:
    # Under context parallelism only the local attention is recomputed, the exchange is not repeated.
    owner, name = local_core_slot(block.attention)
    core = getattr(owner, name)
    if core not in _CHECKPOINTED:
        setattr(owner, name, _checkpointed(core, streams, eager))


def recompute_layer(block, streams=None) -> None:
    # Replace the instance's forward (module hooks such as FSDP's still run around it, and names
    # are unchanged, so checkpoints and parallel plans see the same module).
    if block.forward not in _CHECKPOINTED:
        block.forward = _checkpointed(block.forward, streams)


def apply_recompute(model, cfg, layer_plan: dict[str, str] | None = None, eager_core: bool = False) -> dict[str, str]:
    """Wrap `model`'s layers per `cfg.recompute`; returns {layer name: none|selective|full}. `eager_core`: a
    selectively recomputed attention core runs eagerly inside a compiled block (tensor parallelism: AOTAutograd
    in torch 2.13 saves a device mesh for backward when it traces that checkpoint among DTensor ops, and
    fails)."""
    rc = cfg.recompute
    names = list(model.layers.keys())
    if layer_plan is not None:
        layer_plan = {n: layer_plan.get(n, "none") for n in names}
    else:
        if rc.mode == "none":
            layer_plan = {n: "none" for n in names}
        elif rc.mode == "selective":
            layer_plan = {n: "selective" for n in names}
        elif rc.mode == "full":
            count = len(names) if rc.method == "uniform" or rc.num_layers == 0 else rc.num_layers
            layer_plan = {n: ("full" if i < count else "none") for i, n in enumerate(names)}
        else:
            raise ValueError("recompute.mode=budget needs a layer plan from loom.memory.plan_budget")
    streams = getattr(model, "dropout_streams", None)  # dropout under tp or cp (loom/parallel/rng.py `install`)
    for name, how in layer_plan.items():
        block = model.layers[name]
        if how == "selective":
            recompute_attention_core(block, streams, eager_core)
        elif how == "full":
            recompute_layer(block, streams)
    return layer_plan
