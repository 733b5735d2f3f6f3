"""The rule book's pipeline facts, without torch: how pp x vpp chunks split a model's layers, which rank runs
which chunk under each schedule, and the micro-batch counts each schedule needs. `loom.rules` re-exports them;
the pipeline runtime, the config checks and the planner ask there.
"""

from __future__ import annotations

from loom.errors import UserError


# A model of L layers runs as pp x vpp chunks. An even split gives every chunk L / (pp*vpp) layers. An
# uneven split names the first and/or last chunk's layer count (`parallel.first_stage_layers`,
# `parallel.last_stage_layers`, as Megatron-Core's decoder_first/last_pipeline_num_layers); the other
# chunks split the rest evenly. The usual reason: the last chunk also runs the LM head and loss, and the
# first holds the most activations in flight, so giving them fewer layers balances the pipeline.
#
# Megatron-Core's other way (--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split;
# loom's `parallel.embedding_in_split`, `parallel.loss_in_split`): the embedding and/or the final norm + LM
# head + loss count as one layer each, the L + 1 or L + 2 units split evenly, and the first chunk holds one
# transformer layer fewer (the embedding takes its place), the last one fewer (the loss). pp x vpp may then
# reach L + 2, a chunk holding only the embedding or only the head and loss (e.g. 94 layers in 96 chunks).

SCHEDULES = ("1f1b", "interleaved", "zero_bubble")


def split_layers(layers: int, chunks: int, first: int = 0, last: int = 0, what: str | None = None,
                 embedding: bool = False, loss: bool = False) -> list[int]:
    """Transformer layers in each chunk, first to last; UserError naming what is wrong for an impossible split.
    `embedding` / `loss`: the embedding / the head and loss count as a layer each (Megatron-Core's
    account_for_embedding/loss_in_pipeline_split), so the first / last chunk holds one layer fewer."""
    what = what or f"{chunks} pipeline chunks"
    if embedding or loss:
        return _split_counting_ends(layers, chunks, first, last, what, embedding, loss)
    if chunks > layers:
        raise UserError(f"{what} = {chunks} pipeline stages but model.layers={layers}; every stage needs at least "
                        f"one layer: valid pp x vpp <= {layers}, or up to {layers + 2} with "
                        "parallel.embedding_in_split=true and parallel.loss_in_split=true")
    if chunks == 1:
        return [layers]
    rest = layers - first - last
    middle = chunks - (first > 0) - (last > 0)
    if first < 0 or last < 0 or rest < 0 or (middle == 0 and rest) or (middle and rest % middle) or (middle and rest < middle):
        if not first and not last:
            raise UserError(
                f"model.layers={layers} does not split evenly into pp x vpp = {chunks} stages; valid stage "
                f"counts: {', '.join(str(d) for d in range(1, layers + 1) if layers % d == 0)}, or set parallel.first_stage_layers / "
                "parallel.last_stage_layers for an uneven split (or parallel.embedding_in_split / "
                "parallel.loss_in_split to count the embedding / the loss as a layer)"
            )
        raise UserError(
            f"parallel.first_stage_layers={first} and parallel.last_stage_layers={last} leave {rest} of "
            f"model.layers={layers} for {middle} middle stages, which must split evenly with at least one each"
        )
    counts = [rest // middle if middle else 0] * chunks
    if first:
        counts[0] = first
    if last:
        counts[-1] = last
    return counts


def _split_counting_ends(layers: int, chunks: int, first: int, last: int, what: str, embedding: bool,
                         loss: bool) -> list[int]:
    """split_layers with the embedding and/or the loss counted as a layer each (an even split of the units)."""
    names = " and ".join(f"{n}=true" for n, on in (("parallel.embedding_in_split", embedding),
                                                    ("parallel.loss_in_split", loss)) if on)
    if first or last:
        raise UserError(f"{names} counts the ends of the model in an even split, so parallel.first_stage_layers="
                        f"{first} / parallel.last_stage_layers={last} cannot be set with it (as Megatron-Core's "
                        "account_for_*_in_pipeline_split); valid: 0, or set the flags to false")
    if chunks == 1:
        raise UserError(f"{names} splits pipeline stages, so it needs parallel.pp > 1; valid: false")
    units = layers + embedding + loss
    counted = "model.layers=" + str(layers) + "".join(f" + the {n}" for n, on in (("embedding", embedding),
                                                                                  ("loss", loss)) if on)
    if chunks > units or units % chunks:
        valid = [str(d) for d in range(2, units + 1) if units % d == 0]
        raise UserError(f"{counted} = {units} units do not split evenly into {what} = {chunks} stages (with {names}); "
                        f"valid pp x vpp: {', '.join(valid)}")
    counts = [units // chunks] * chunks
    counts[0] -= embedding
    counts[-1] -= loss
    return counts


def valid_split(layers: int, chunks: int, first: int = 0, last: int = 0, embedding: bool = False,
                loss: bool = False) -> list[int] | None:
    """split_layers, or None when the split is impossible (for searches)."""
    try:
        return split_layers(layers, chunks, first, last, embedding=embedding, loss=loss)
    except UserError:
        return None


def split_problem(layers: int, pp: int, vpp: int, first: int = 0, last: int = 0, embedding: bool = False,
                  loss: bool = False) -> str | None:
    """Why these pipeline sizes cannot split the model's layers, or None."""
    if pp == 1:
        if first or last:
            return (f"parallel.first_stage_layers={first} / parallel.last_stage_layers={last} split pipeline "
                    "stages, so they need parallel.pp > 1; valid: 0")
        if embedding or loss:
            return ("parallel.embedding_in_split / parallel.loss_in_split count the embedding / the loss in the "
                    "split of pipeline stages, so they need parallel.pp > 1; valid: false")
        return None
    try:
        split_layers(layers, pp * vpp, first, last, what=f"parallel.pp={pp} x parallel.vpp={vpp}", embedding=embedding,
                     loss=loss)
    except UserError as exc:
        return str(exc)
    return None


def rank_chunks(pp: int, vpp: int, schedule: str, rank: int) -> list[int]:
    """The chunk ids pipeline rank `rank` runs: round-robin, or the V shape of ZB-V (schedule
    zero_bubble with vpp=2: rank r holds chunks r and 2pp-1-r, so rank 0 has the first and the last)."""
    if schedule == "zero_bubble" and vpp == 2:
        return [rank, 2 * pp - 1 - rank]
    return [rank + v * pp for v in range(vpp)]


def chunk_owner(pp: int, vpp: int, schedule: str, chunk: int) -> int:
    """The pipeline rank holding `chunk`."""
    if schedule == "zero_bubble" and vpp == 2:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def schedule_problem(pp: int, vpp: int, schedule: str) -> str | None:
    """Why loom's pipeline cannot run `schedule` with this vpp, or None."""
    if pp == 1:
        return None if vpp == 1 else f"parallel.vpp={vpp} needs pipeline parallelism (parallel.pp > 1); valid: 1"
    if schedule == "1f1b" and vpp != 1:
        return (f"parallel.schedule=1f1b runs one stage per rank; with parallel.vpp={vpp} use "
                "parallel.schedule=interleaved (or zero_bubble)")
    if schedule == "zero_bubble" and vpp > 2:
        return f"parallel.schedule=zero_bubble supports parallel.vpp 1 or 2 (ZB-V), not {vpp}"
    return None


def micro_batches_needed(pp: int, vpp: int, schedule: str, micro_batches: int) -> str | None:
    """What micro-batch count the schedule needs, when `micro_batches` does not satisfy it; else None."""
    if pp == 1:
        return None
    if schedule == "zero_bubble" and vpp == 2:
        ok, need = micro_batches >= pp * vpp, f"at least pp x vpp = {pp * vpp}"
    elif schedule == "1f1b":
        ok, need = micro_batches >= pp, f"at least pp={pp}"
    else:
        ok, need = micro_batches >= pp and micro_batches % pp == 0, f"a multiple of pp={pp}"
    return None if ok else need


def micro_batch_count_problem(pp: int, vpp: int, schedule: str, global_batch: int, dp: int,
                              micro_batch: int) -> str | None:
    """The schedule's need on the micro-batch count global_batch / (dp x micro_batch), as a refusal."""
    micro = global_batch // (dp * micro_batch)
    need = micro_batches_needed(pp, vpp, schedule, micro)
    if not need:
        return None
    return (f"parallel.schedule={schedule} needs the micro-batch count to be {need}, but train.global_batch="
            f"{global_batch} / (data parallel {dp} x train.micro_batch={micro_batch}) = {micro}; "
            f"raise train.global_batch (e.g. {dp * micro_batch * pp * vpp}) or lower train.micro_batch")


def chunk_layer_counts(cfg) -> list[int]:
    """Transformer layers in each of the pp*vpp chunks of `cfg`, first to last (a chunk may hold none when the
    embedding or the loss counts as a layer); UserError for impossible splits."""
    p = cfg.parallel
    if p.pp == 1:
        return [cfg.model.layers]
    return split_layers(cfg.model.layers, p.pp * p.vpp, p.first_stage_layers, p.last_stage_layers,
                        what=f"parallel.pp={p.pp} x parallel.vpp={p.vpp}", embedding=p.embedding_in_split,
                        loss=p.loss_in_split)
