"""The rule book's facts about loom's distributed optimizer, without torch: which layouts it runs
(`parallel.distributed_optimizer`, and with `parallel.distopt_shard_weights` its sharded weights,
loom/parallel/distopt.py and zero.py), and when the sharded weights keep a compute-dtype copy of their rows.
`loom.rules` re-exports them; the runtime, the config checks, `loom memory` and the planner ask there.
"""

from __future__ import annotations


def zero3_keeps_compute_rows(micro_batches: int) -> bool:
    """Whether loom's sharded weights (loom/parallel/zero.py) keep a compute-dtype copy of each rank's rows between
    steps (cast once after the optimizer step) instead of casting the fp32 master rows at every gather. Casting per
    gather costs twice per micro-batch 6 bytes of traffic per row element, the copy 2 bytes of memory per row
    element: past 8 micro-batches per step the casts cost more than the copy (Llama-3 8B on 8 H100s, 16 of them:
    57 ms more per step, `loom plan`), below it the memory is worth more (70B on 64 at 8: less recomputation)."""
    return micro_batches > 8


def distopt_problem(cfg) -> str | None:
    """What `parallel.distributed_optimizer=true` does not run yet (None: this layout runs)."""
    p = cfg.parallel
    if not getattr(p, "distributed_optimizer", False):
        if getattr(p, "distopt_shard_weights", False):
            return ("parallel.distopt_shard_weights=true shards the distributed optimizer's weights; set "
                    "parallel.distributed_optimizer=true with it, or parallel.distopt_shard_weights=false")
        return None
    fix = "set parallel.distributed_optimizer=false (FSDP)"
    if p.dp_shard * p.cp == 1:
        return ("parallel.distributed_optimizer=true splits the optimizer over parallel.dp_shard x parallel.cp ranks, "
                f"and there is one (dp_shard={p.dp_shard}, cp={p.cp}); raise parallel.dp_shard or {fix}")
    if p.dp_replicate != 1:
        return (f"parallel.distributed_optimizer=true with parallel.dp_replicate={p.dp_replicate} is not supported "
                f"yet; use parallel.dp_shard for the data-parallel ranks, or {fix}")
    if getattr(getattr(cfg, "lora", None), "enabled", False):
        return f"parallel.distributed_optimizer=true with LoRA (lora.rank={cfg.lora.rank}) is not supported yet; {fix}"
    if p.schedule == "zero_bubble":
        return ("parallel.distributed_optimizer=true with parallel.schedule=zero_bubble is not supported yet (its "
                f"separate weight-gradient pass); use parallel.schedule=1f1b or interleaved, or {fix}")
    if p.pp > 1 and cfg.model.tie_embeddings:
        return ("parallel.distributed_optimizer=true with parallel.pp > 1 and model.tie_embeddings=true is not "
                f"supported yet (the tied head's copies); {fix}")
    if getattr(p, "distopt_shard_weights", False):
        fix = "set parallel.distopt_shard_weights=false (weights whole on every rank)"
        for name, size in (("tp", p.tp), ("pp", p.pp)):
            if size > 1:
                return (f"parallel.distopt_shard_weights=true with parallel.{name}={size} is not supported yet (it "
                        f"shards over parallel.dp_shard x parallel.cp, and routed experts over their expert-data-"
                        f"parallel ranks, only); set parallel.{name}=1 or {fix}")
    return None

