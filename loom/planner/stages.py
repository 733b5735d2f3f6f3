"""What one rank of a layout holds: the chunks of the pipeline it runs and the micro-batches of
activations it keeps at its peak, its parameters before data-parallel sharding, and the groups that
shard them (as loom's fully_shard does, or as Megatron-Core does)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from loom.config import ModelConfig
from loom.rules import experts_span_tp, rank_chunks, valid_split
from loom.planner.params import model_sizes
from loom.planner.workload import Layout, Workload


def stage_layers(cfg: ModelConfig, pp: int) -> int:
    """Layers on the fullest stage of an (even as possible) split; inference's pipeline uses it."""
    return math.ceil(cfg.layers / pp)


@dataclass(frozen=True)
class StageShape:
    """What one pipeline rank runs: the layer counts of its chunks, whether it holds the embedding and
    the LM head, and how many micro-batches of each chunk's activations it holds at its peak."""
    chunks: tuple[int, ...]
    embedding: bool
    head: bool
    held: tuple[float, ...]
    layers: int = 0  # sum(chunks)
    held_layers: float = 0.0  # sum(chunk x held): layer-micro-batches of activations at the peak


def _shape(chunks: tuple[int, ...], embedding: bool, head: bool, held: tuple[float, ...]) -> StageShape:
    return StageShape(chunks, embedding, head, held, sum(chunks), sum(c * h for c, h in zip(chunks, held)))


def _held(pp: int, vpp: int, schedule: str, rank: int, m: int) -> tuple[float, ...]:
    """Micro-batches of each local chunk whose activations rank `rank` holds at its peak, following the
    order in which torch.distributed.pipelining's schedules run forwards before the first backward."""
    if schedule == "interleaved" and vpp > 1:
        # Megatron's interleaved warm-up: 2(p-r-1) + (v-1)p forwards, then one more before the first
        # backward; the k-th runs local chunk (k // p) % v.
        held = [0] * vpp
        for k in range(min(m * vpp, 2 * (pp - rank - 1) + (vpp - 1) * pp + 1)):
            held[(k // pp) % vpp] += 1
        return tuple(float(x) for x in held)
    if schedule == "zero_bubble" and vpp == 2:
        # ZB-V: 2p-r-1 forwards of the first chunk and r+1 of the second (each backed out at once).
        return (float(min(m, 2 * pp - rank - 1)), float(min(m, rank + 1)))
    return tuple(float(min(m, pp - rank)) for _ in range(vpp))  # 1F1B: rank r has p - r in flight


@lru_cache(maxsize=65536)
def pipeline_ranks(layers: int, pp: int, vpp: int, schedule: str, first: int, last: int,
                   m: int, embedding: bool = False, loss: bool = False) -> tuple[StageShape, ...] | None:
    """The distinct rank shapes of a pipeline (None when the split is impossible). `embedding` / `loss`: the
    split counts the embedding / the head and loss as a layer (a chunk may then hold no transformer layer)."""
    if pp == 1:
        return None if embedding or loss else (_shape((layers,), True, True, (1.0,)),)
    counts = valid_split(layers, pp * vpp, first, last, embedding, loss)
    if counts is None:
        return None
    shapes = []
    for r in range(pp):
        ids = rank_chunks(pp, vpp, schedule, r)
        shapes.append(_shape(tuple(counts[i] for i in ids), 0 in ids, pp * vpp - 1 in ids,
                             _held(pp, vpp, schedule, r, m)))
    return tuple(dict.fromkeys(shapes))


def rank_shapes(w: Workload, lay: Layout) -> tuple[StageShape, ...]:
    """The distinct rank shapes of a layout's pipeline (ValueError when its layers cannot be split so)."""
    m = w.global_batch // (lay.dp * lay.micro_batch)
    shapes = pipeline_ranks(w.model.layers, lay.pp, lay.vpp, lay.schedule, lay.first_stage_layers,
                            lay.last_stage_layers, m, lay.embedding_in_split, lay.loss_in_split)
    if shapes is None:
        raise ValueError(f"{w.model.layers} layers cannot be split as {lay}")
    return shapes


def max_chunk_layers(w: Workload, lay: Layout) -> int:
    """The largest chunk: recompute.num_layers (block method) counts layers per chunk, as loom applies it
    to each chunk a rank runs."""
    return max(max(s.chunks) for s in rank_shapes(w, lay))


def recomputed_layers(lay: Layout, chunk: int) -> int:
    """Layers of a chunk recomputed fully (0 unless recompute=full)."""
    if lay.recompute != "full":
        return 0
    return min(lay.recompute_layers or chunk, chunk)


def _stage_params(w: Workload, lay: Layout, shape: StageShape) -> tuple[float, float]:
    """(parameters outside the routed experts, routed-expert parameters) of one pipeline rank, whole (before
    tensor or expert parallelism splits them)."""
    z = model_sizes(w)
    if lay.pp == 1:
        return z["total"] - z["experts"], z["experts"]
    # A tied head still needs its own copy on the last stage when pp > 1 (Megatron does the same).
    return (shape.layers * z["dense_layer"] + (z["embedding"] if shape.embedding else 0)
            + (z["head"] if shape.head else 0)), shape.layers * z["expert_layer"]


def local_params(w: Workload, lay: Layout, shape: StageShape) -> tuple[float, float]:
    """What one GPU of a pipeline rank holds before data-parallel sharding: the dense part split over tp, and
    its E/ep routed experts (never split over tp: with experts spread over tensor-parallel ranks
    (`Workload.experts_over_tp`) each tp rank holds its own E/ep of them, otherwise every tensor-parallel
    rank of an expert-parallel rank holds the same ones)."""
    dense, experts = _stage_params(w, lay, shape)
    return dense / lay.tp, experts / lay.ep


def priced_as_megatron(w: Workload, lay: Layout) -> bool:
    """Whether a layout's memory and gradient traffic follow Megatron-Core (--framework megatron, on any layout;
    a distopt layout under loom is loom's own distributed optimizer, loom/parallel/distopt.py)."""
    return w.framework == "megatron"


def expert_data_parallel(w: Workload, lay: Layout) -> int:
    """Ranks holding the same routed experts, over which their gradients are reduced (and sharded): tp x dp
    x cp / ep with experts spread over tensor-parallel ranks (`Workload.experts_over_tp`), else dp x cp / ep."""
    return (lay.tp if w.experts_over_tp(lay.tp, lay.sp, lay.ep) else 1) * lay.dp * lay.cp // lay.ep


def expert_rank_stride(w: Workload, lay: Layout) -> int:
    """Distance in the world between consecutive members of an expert-parallel group (tp innermost in the
    mesh): 1 with experts spread over tensor-parallel ranks (an EP group is whole tp groups side by side),
    else tp (one rank of each tp group, `loom/parallel/dims.py`)."""
    return 1 if w.experts_over_tp(lay.tp, lay.sp, lay.ep) else lay.tp


def expert_row_padding(w: Workload, lay: Layout) -> tuple[float, bool]:
    """(factor, off_rows) for a rank's routed experts, stacked [E/ep, hidden, ffn] tensors, when they are split
    over more data-parallel ranks than they have experts (Mixtral's one per rank under ep 8 over 8 edp ranks, or
    8 over 64 ranks without ep). loom's fully_shard splits them along a dimension the ranks divide
    (loom/parallel/data.py's `shard_dim`): no padding, but FSDP2 copies them once more per gather and reduction
    (`off_rows`). loom's distributed optimizer and sharded weights split every parameter by rows, as torch.chunk
    does (loom/parallel/distopt.py): a rank holds ceil(E/ep / n) experts' rows and the buffers are laid out for
    n ranks of those, so memory and traffic of the experts scale by `factor` = ceil(E/ep / n) * n / (E/ep); one
    expert per rank (E = ep) is split along its second dimension instead, unpadded.
    Megatron's flat buffers split by elements: (1, False)."""
    cfg = w.model
    if not cfg.moe_layers or priced_as_megatron(w, lay):
        return 1.0, False
    local = cfg.moe.experts // lay.ep
    if lay.dp_style in ("distopt", "zero3"):
        n = expert_data_parallel(w, lay) if lay.ep > 1 else lay.dp * lay.cp
    else:
        n = loom_shard_groups(lay)[1]
    if local >= n:
        return math.ceil(local / n) * n / local, False
    if local == 1 and lay.dp_style in ("distopt", "zero3"):  # a stack of one: split along its second dimension
        return 1.0, False  # (distopt.py's `row_dim`), rows of a [1, hidden, ffn] tensor, no padding
    ffn = cfg.moe.ffn_hidden or cfg.ffn_hidden
    if lay.dp_style not in ("distopt", "zero3") and (cfg.hidden % n == 0 or ffn % n == 0):
        return 1.0, True
    return n / local, False


def loom_shard_groups(lay: Layout) -> tuple[int, int]:
    """The ranks loom's fully_shard splits a rank's dense parameters and its routed experts over
    (loom/parallel): dp x cp for the fsdp style, the cp ranks for replicate (HSDP over dp_shard_cp); under
    expert parallelism the routed experts over the expert-data-parallel ranks whatever the style (dp x cp /
    ep, or tp x dp x cp / ep with experts spread over tensor-parallel ranks: `loom.rules.experts_span_tp`),
    else with the dense part. Gradients are reduced every micro-batch only when the dense group has more
    than one rank (loom/train/steps.py)."""
    dense = lay.cp if lay.dp_style == "replicate" else lay.dp * lay.cp
    if lay.ep == 1:
        return dense, dense
    return dense, (lay.tp if experts_span_tp(lay.tp, lay.sp, lay.ep) else 1) * lay.dp * lay.cp // lay.ep
