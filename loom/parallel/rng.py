"""Dropout's random streams under tensor and context parallelism.

A rank of a tensor-parallel group holds some attention heads (and, under SP, a slice of the sequence); a rank
of a context-parallel group holds some chunks of every sequence. Dropout on such a shard must draw its own
mask: with the same random stream on every rank, two ranks' shards would get the same pattern. Dropout on a
tensor every rank of the group holds whole (the residual stream under TP without SP) must draw the same mask
on each, or the copies drift apart. Megatron-LM keeps a second CUDA generator for the model-parallel regions;
loom derives each dropout call's seed instead:

- one CPU generator per process (`DropoutStreams`), reseeded from `train.seed` and the step number at every
  step (`begin_step`), so every rank of a group draws the same sequence of numbers, and a resumed run the
  same as an uninterrupted one, with nothing to checkpoint;
- each dropout call draws one number from it and seeds the device generator of its tensor with that number
  mixed with the rank's offset in the group (`stream`): the tp rank for attention (and for the residual
  stream under SP), the cp rank for both; the device generator's own state is put back afterwards;
- recomputation replays the draws: `loom.parallel.recompute` sets the generator of the model's
  `dropout_streams` back to where it stood when the checkpointed region first ran (`replay_context`), so a
  recomputed mask is the original one.

Nothing here runs on one process or without dropout: the model's dropout then uses the default generator, as
it always has. Data-parallel ranks share the streams (they see other data), as in Megatron-LM.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

_MASK = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd; spreads consecutive offsets over the seed space


def _mix(a: int, b: int) -> int:
    """A 63-bit seed from two integers (splitmix64's finaliser over their combination)."""
    z = (a * _GOLDEN + b + 1) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


class DropoutStreams:
    """The process's source of dropout seeds under tp or cp (module docstring)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.generator = torch.Generator().manual_seed(_mix(seed, 0))

    def begin_step(self, step: int) -> None:
        self.generator.manual_seed(_mix(self.seed, step + 1))

    def draw(self) -> int:
        return int(torch.randint(0, 1 << 62, (1,), generator=self.generator))


# The process's streams by seed, made by `install` and kept for the process's life: every pipeline stage of
# a run shares one; `begin_step` reseeds all of them.
_STREAMS: dict[int, DropoutStreams] = {}


class StreamedCore:
    """An attention core (`loom.models.llama.attention_core`'s signature) whose dropout draws from a rank's
    stream; without dropout (evaluation) it is the core itself."""

    def __init__(self, core, stream: Stream):
        self.core, self.stream = core, stream

    def __call__(self, q, k, v, kind: str, dropout: float, *rest):
        if dropout == 0:
            return self.core(q, k, v, kind, dropout, *rest)
        return self._streamed(q, k, v, kind, dropout, *rest)

    @torch.compiler.disable  # seeds a generator from the rank's stream: eager inside a compiled block
    def _streamed(self, q, k, v, kind: str, dropout: float, *rest):
        with self.stream(q):
            return self.core(q, k, v, kind, dropout, *rest)


class Stream:
    """One rank's offset in the group that shares a kind of dropout (`install`): a context that runs a dropout
    call on a device generator seeded from the next draw and the offset."""

    def __init__(self, streams: DropoutStreams, offset: int):
        self.streams, self.offset = streams, offset

    @contextlib.contextmanager
    def __call__(self, x: torch.Tensor):
        seed = _mix(self.streams.draw(), self.offset)
        cuda = x.device.type == "cuda"  # a CUDA tensor's device always has its index
        generator = torch.cuda.default_generators[x.device.index] if cuda else torch.random.default_generator
        state = generator.get_state()
        generator.manual_seed(seed)
        try:
            yield
        finally:
            generator.set_state(state)


def install(model: nn.Module, seed: int, tp: int, tp_rank: int, sp: bool, cp: int, cp_rank: int) -> None:
    """Give `model`'s dropout its rank's streams when it runs sharded over tp or cp ranks (module docstring):
    the residual stream's dropout (`Dropout`, the embedding's and LoRA adapters' included: their inputs are
    this rank's tokens) an offset of the ranks that hold other parts of it (cp, and tp under SP), the
    attention core's an offset of the ranks holding other heads or query chunks (tp and cp). Call after tensor
    and context parallelism are applied, before recomputation wraps the cores (so recomputation replays the
    streamed core)."""
    from loom.models.llama import Dropout
    from loom.parallel.context import local_core_slot

    drops = [m for m in model.modules() if isinstance(m, Dropout)]  # the model's, and LoRA's on its inputs
    if tp * cp == 1 or not (drops or model.cfg.attn_dropout > 0):
        return
    streams = _STREAMS.setdefault(seed, DropoutStreams(seed))
    model.dropout_streams = streams  # what recomputation replays (`replay_context`)
    hidden = Stream(streams, (tp_rank if sp else 0) + tp * cp_rank)
    attention = Stream(streams, tp_rank + tp * cp_rank)
    for module in drops:
        module.stream = hidden
    if model.cfg.attn_dropout > 0:
        for block in model.layers.values():
            owner, name = local_core_slot(block.attention)
            core = getattr(owner, name)
            if not isinstance(core, StreamedCore):
                setattr(owner, name, StreamedCore(core, attention))


def begin_step(step: int) -> None:
    """Reseed the process's dropout streams for training step `step` (0-based); nothing when it has none."""
    for streams in _STREAMS.values():
        streams.begin_step(step)


def replay_context(streams: DropoutStreams):
    """(forward, recompute) contexts for a checkpointed region (torch.utils.checkpoint's `context_fn`, with
    the model's `dropout_streams` bound): the recompute one sets the streams back to where they stood when the
    region first ran, and after it to where they were, so a recomputed mask is the original one."""
    first = streams.generator.get_state()

    @contextlib.contextmanager
    def recompute():
        now = streams.generator.get_state()
        streams.generator.set_state(first)
        try:
            yield
        finally:
            streams.generator.set_state(now)

    return contextlib.nullcontext(), recompute()
