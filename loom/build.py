"""One way to build a model in a layout, used by training, RL's engine and reference models and `loom memory`.

`build_in_layout` is the only place a run's model is made: the structure on the meta device (no rank ever
allocates the whole model), a recipe's extra modules (a reward or value head), the layout applied by the
caller's `place` (a step runner, `parallelize`, tensor parallelism alone, or `loom memory`'s measuring
set-up), then each rank allocates and initialises only its shards with the values one process would hold
there (loom/models/init.py), and pretrained weights replace them slice by slice. `torch_dtype` is the one
mapping of `train.dtype` to a torch dtype.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol, TypeVar

import torch
from torch import nn

from loom.config import Config


def torch_dtype(cfg: Config) -> torch.dtype:
    """`train.dtype` as a torch dtype: bfloat16 or float32."""
    return torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32


def compute_dtype(cfg: Config) -> torch.dtype | None:
    """The dtype trained weights compute in (autocast, or FSDP's mixed precision), None in float32: the
    trained weights themselves stay float32 (the master copy)."""
    dtype = torch_dtype(cfg)
    return None if dtype == torch.float32 else dtype


class Placed(Protocol):
    """What `place` returns: the model as its user runs it (a pipeline rank's view under pp) and the
    modules that hold this rank's weights (a step runner is one)."""

    model: nn.Module
    parts: list[nn.Module]


class Whole(NamedTuple):
    """A model placed as one module."""

    model: nn.Module
    parts: list[nn.Module]


def whole(model: nn.Module) -> Whole:
    return Whole(model, [model])


def parallelized(cfg: Config, layout) -> Callable[[nn.Module], Whole]:
    """`place` for a whole model in the run's layout (TP, CP, EP, recompute, compile, FSDP), as training's
    SPMD runner places it."""
    from loom.parallel import parallelize

    return lambda model: whole(parallelize(model, layout, cfg, compute_dtype(cfg)))


def tensor_parallel(layout, sp: bool = False) -> Callable[[nn.Module], Whole]:
    """`place` for a model sharded over the run's tensor-parallel group only (an inference engine's copy)."""
    def place(model: nn.Module) -> Whole:
        if layout.tp > 1:
            from loom.parallel.tensor import apply_tensor_parallel

            apply_tensor_parallel(model, layout.submesh("tp"), sp)
        return whole(model)
    return place


P = TypeVar("P", bound=Placed)


def build_in_layout(cfg: Config, device: torch.device | str, place: Callable[[nn.Module], P], *,
                    dtype: torch.dtype = torch.float32, extend: Callable[[nn.Module], None] | None = None,
                    seed: int | None = None, init_from: str = "", mark: Callable[[str], None] | None = None,
                    adapters: bool = False, rows_later: bool = False) -> P:
    """Build `cfg.model` on meta, `extend` it (a recipe's modules, before the layout is applied), `place` it
    (apply the layout), allocate this rank's shards on `device` initialised from `seed` (train.seed by
    default; nothing is allocated when `device` is meta), then load `init_from`'s weights (a Hugging Face or
    loom model directory, or a loom checkpoint; every rank reads its slices). `mark(what)` names the load
    for hang reports. `adapters`: with `lora.rank > 0`, LoRA adapters on `lora.targets` (loom/models/lora.py),
    added after `extend` so that the recipe's heads stay trained and everything else is frozen in train.dtype;
    the base's names are unchanged, so `init_from` loads into it. `rows_later` (without `init_from`): the
    parameters are left without values or memory (loom/parallel/materialize.py's `released`), for an optimizer
    that draws its rows of each from the seed itself (loom/parallel/zero.py). Returns what `place` returned."""
    from loom.models.llama import build_model

    model = build_model(cfg.model, device="meta", dtype=dtype)
    if extend is not None:
        extend(model)
    if adapters and cfg.lora.enabled:
        from loom.models.lora import apply_lora

        apply_lora(model, cfg.lora, torch_dtype(cfg))
    placed = place(model)
    if str(device) != "meta":
        from loom.parallel.materialize import materialize

        if rows_later and init_from:
            raise ValueError("rows_later draws the weights from the seed; with init_from they are loaded whole")
        materialize(placed.parts, torch.device(device), cfg.train.seed if seed is None else seed, rows_later)
    if init_from:
        from loom.interop.pretrained import check_matches_source, load_pretrained

        if mark is not None:
            mark(f"train.init_from load ({init_from})")
        check_matches_source(cfg)
        load_pretrained(placed.model, init_from)
    return placed
