"""Weights from the training ranks to the generation ranks of `rl.mode=async` (loom/post/rl/async_loop.py): each
training rank broadcasts, in its own gloo group with the generation ranks, the chunks it is the first holder of,
in buckets; a generation rank (`WeightReceiver`) keeps of each chunk what its engine holds and refits it."""

from __future__ import annotations

import pickle
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.models.init import canonical_name

BUCKET_BYTES = 256 << 20  # weights broadcast in buckets of at most this many bytes (one tensor may exceed it)


def _pair_group(store, trainer: int, member: int, generation_ranks: int, timeout_s: float):
    """The gloo group {training rank `trainer`, generation ranks 0..G-1}: the trainer is member 0."""
    prefixed = dist.PrefixStore(f"pair{trainer}/", store)
    return dist.ProcessGroupGloo(prefixed, member, 1 + generation_ranks, timedelta(seconds=timeout_s))


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def _buckets(sizes: list[int], itemsize: int) -> list[list[int]]:
    """Chunk indices packed in order into buckets of at most BUCKET_BYTES (a larger chunk alone)."""
    out, current, used = [], [], 0
    for i, n in enumerate(sizes):
        if current and used + n * itemsize > BUCKET_BYTES:
            out.append(current)
            current, used = [], 0
        current.append(i)
        used += n * itemsize
    return out + ([current] if current else [])


def _weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) of what the engine takes: the policy's parameters, or with LoRA the merged weights
    W + (alpha / rank) B A in place of the adapted ones (`merged_state_dict`: shard by shard where FSDP shards
    them by rows, else whole on every rank), as the synchronous loop refits its engine (`policy_weights`)."""
    from loom.models.lora import lora_layers, merged_state_dict

    if not lora_layers(model):
        return [(canonical_name(n), p) for n, p in model.named_parameters()]
    names = {canonical_name(n) for n, _ in model.named_parameters()}
    return [(n, t) for n, t in merged_state_dict(model).items() if n in names]


def _chunks(model: nn.Module, trainer_rank: int) -> list[tuple[str, torch.Tensor, tuple, tuple, tuple]]:
    """(name, local tensor, global offset, local shape, global shape) of the weights (`_weights`) this training
    rank sends: a DTensor's local shard if it is its first holder, a plain tensor from training rank 0."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for name, p in _weights(model):
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            coord = p.device_mesh.get_coordinate()
            first = all(coord[i] == 0 for i, pl in enumerate(p.placements) if not pl.is_shard())
            local = p.to_local()
        else:
            shape, offset, first, local = tuple(p.shape), (0,) * p.dim(), trainer_rank == 0, p
        if first and local.numel():
            assert tuple(local.shape) == tuple(shape), (name, tuple(local.shape), shape)
            out.append((name, local, tuple(offset), tuple(shape), tuple(p.shape)))
    return out


def _box(p: torch.Tensor) -> tuple[tuple, tuple]:
    """(global offset, local shape) of this rank's part of an engine parameter: its tensor-parallel shard, or all
    of it."""
    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        return tuple(offset), tuple(shape)
    return (0,) * p.dim(), tuple(p.shape)


def _overlap(chunk_offset, chunk_shape, box_offset, box_shape):
    """Where a received chunk meets a rank's box, both given by global offset and shape: (the chunk's spans, the
    box's spans), each a list of (dim, start, length) to narrow by; None when they do not meet."""
    src, dst = [], []
    for dim, (co, cn, bo, bn) in enumerate(zip(chunk_offset, chunk_shape, box_offset, box_shape)):
        lo, hi = max(co, bo), min(co + cn, bo + bn)
        if hi <= lo:
            return None
        src.append((dim, lo - co, hi - lo))
        dst.append((dim, lo - bo, hi - lo))
    return src, dst


def _narrow(t: torch.Tensor, spans) -> torch.Tensor:
    for dim, start, length in spans:
        t = t.narrow(dim, start, length)
    return t


class WeightReceiver:
    """A generation rank's side of the weight broadcast: takes every training rank's chunks, keeps of each the part
    its engine holds (the whole tensor, or under rl.generation_tp its tensor-parallel shard: `_box`) and refits the
    engine from them."""

    def __init__(self, store, index: int, trainers: int, generation_ranks: int, engine, timeout_s: float):
        self.engine = engine
        self.groups, self.plans = [], []
        params = dict(engine.model.named_parameters())
        self.sharded = any(isinstance(p, DTensor) for p in params.values())
        boxes = {name: _box(p) for name, p in params.items()}
        # what this rank keeps: CPU tensors of its parts' shapes (the broadcast arrives on the CPU)
        self.staged = {name: torch.empty(boxes[name][1], dtype=p.dtype, device="cpu") for name, p in params.items()}
        self.dtype = next(iter(params.values())).dtype
        itemsize = next(iter(params.values())).element_size()
        covered = dict.fromkeys(params, 0)
        kept = dict.fromkeys(params, 0)
        self.dp_ranks = []
        for r in range(trainers):
            dp_rank, chunks = pickle.loads(store.get(f"trainer/{r}"))
            self.dp_ranks.append(dp_rank)
            where = []
            for name, offset, shape, full in chunks:
                if name not in params or tuple(params[name].shape) != tuple(full):
                    raise RuntimeError(f"weight broadcast: training rank {r} sends {name} {tuple(full)}, which the "
                                       "engine's model does not have")
                covered[name] += torch.Size(shape).numel()
                where.append(_overlap(offset, shape, *boxes[name]))
                if where[-1] is not None:
                    kept[name] += torch.Size([n for _, _, n in where[-1][1]]).numel()
            self.plans.append((chunks, _buckets([torch.Size(c[2]).numel() for c in chunks], itemsize), where))
        missing = [n for n, p in params.items() if covered[n] != p.numel() or kept[n] != self.staged[n].numel()]
        if missing:
            raise RuntimeError(f"weight broadcast: the training ranks' chunks do not cover {missing[:3]}")
        for r in range(trainers):
            self.groups.append(_pair_group(store, r, 1 + index, generation_ranks, timeout_s))

    def receive(self) -> float:
        """One version of the weights from every training rank, into the engine; the seconds."""
        t0 = time.perf_counter()
        for group, (chunks, buckets, where) in zip(self.groups, self.plans):
            for bucket in buckets:
                sizes = [torch.Size(chunks[i][2]).numel() for i in bucket]
                flat = torch.empty(sum(sizes), dtype=self.dtype)
                _broadcast(group, flat)
                for i, part in zip(bucket, flat.split(sizes)):
                    if where[i] is not None:  # the part of the chunk this rank's shard holds
                        name, _, shape, _ = chunks[i]
                        _narrow(self.staged[name], where[i][1]).copy_(_narrow(part.view(shape), where[i][0]))
        if self.sharded:
            self.engine.refit(self.staged, local=True)  # this rank's shards, as the engine holds them
        else:
            self.engine.refit(self.staged)
        return time.perf_counter() - t0
