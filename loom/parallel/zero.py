"""Sharded weights for the distributed optimizer (`parallel.distopt_shard_weights=true`): ZeRO-3 without copies.

The distributed optimizer (distopt.py) keeps every weight whole on every data-parallel rank. This keeps only
the rank's fp32 master rows of each weight, and gathers a unit's weights just before the unit runs
(the embedding, each transformer block, the final norm with the head), as FSDP does, but without FSDP2's copies:

- every parameter is its own bucket, so the rank-major all-gather output of its rows IS the parameter: the
  weight's storage is that output buffer (`torch.chunk`'s row split padded to equal parts at the end), gathered
  straight into it and released (`untyped_storage().resize_(0)`) when the unit is done; FSDP2 gathers into a
  flat buffer of all the unit's parameters and copies each one out (`split_with_sizes_copy`), twice per
  micro-batch;
- a weight's gradient lands in an fp32 buffer laid out the same way (on CUDA written by the backward's GEMM
  itself, `out_dtype`; the linear layers' gradient-accumulation fusion of distopt.py in one product; the chunked
  loss's untied LM head straight from its forward's chunk products, every micro-batch, as its buffer is fresh:
  loom/parallel/headgrad.py), which is reduce-scattered as is, with no `chunk_cat` into a flat reduce buffer and
  no cast; each rank adds its summed rows into its fp32 gradient shard (1/n of the elements) and the buffer is
  freed when the next weight's gradient buffer is made: at most two weights' fp32 gradients at a time (the one
  being computed, the one before it being reduced), not a whole unit's;
- the optimizer updates the fp32 master rows (distopt.py); each gather casts them to the compute dtype into a
  temporary that lives until the gather completes (one cast of 1/n of the unit per gather), so no rank keeps a
  compute-dtype copy of its rows: per parameter (4 + 4 + moments) / n bytes, FSDP's. With more than 8
  micro-batches per step the rows are cast once after the step and kept instead (2 bytes / n more, fewer casts:
  `loom.rules.zero3_keeps_compute_rows`); checkpoints are distopt's (FSDP's DTensors), so runs resume in any
  layout.

Prefetch: a unit's forward starts the next unit's all-gather, a block's first weight gradient in backward the
previous block's (after the reductions of the unit above are added in: the head's is the largest), so on a GPU the
collectives run beside the compute (NCCL's stream); a CPU's gloo runs them as they come. At most two units are
gathered at once (the one running and the next), as FSDP2's default.

Start-up: no rank holds the whole model. Training builds it with its parameters `released` (loom/build.py's
`rows_later`: shapes, no memory) and each rank draws its fp32 master rows of every weight from the seed, the values
one process starts with there (loom/models/init.py); a checkpoint resumed loads into those rows. Only
`train.init_from` materialises the model whole (in fp32, on every rank) to load it, before keeping the rows.

Layouts: dp_shard x cp (the ranks distopt splits over), compiled or eager blocks, any recomputation, tied or untied
embeddings (a tied one belongs to the head unit, gathered from the model's start until its gradient, which sums
both uses, is reduced), expert parallelism (a routed expert's DTensor keeps its local part as a view of its gather
buffer, over the expert-data-parallel ranks). Not yet: tp, pp (their DTensors and stages), and recipes that run the model more than
once per backward (dpo, rm, rl: a weight is released once its gradient is reduced) — `loom.rules.distopt_problem`.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.parallel.context import _ALL_GATHER, _REDUCE_SCATTER
from loom.parallel.distopt import DistributedOptimizer, _Bucket, _Slot

_FREE, _GATHERING, _READY = 0, 1, 2


class _Unit:
    """Parameters gathered and released together, and the module whose forward uses them."""

    def __init__(self, name: str, buckets: list[_Bucket]):
        self.name, self.buckets = name, buckets


class ShardedDistributedOptimizer(DistributedOptimizer):
    PER_PARAM = True

    def __init__(self, parts: list[nn.Module], cfg, layout, compute_dtype, make_optimizer, seed: int | None = None):
        from loom.rules import zero3_keeps_compute_rows

        self._set_up = False
        self._pending: deque[_Bucket] = deque()  # reductions in flight, in the order they started
        micro_batches = cfg.train.global_batch // (layout.dp_size * cfg.train.micro_batch)
        self.keep_rows = zero3_keeps_compute_rows(micro_batches) and compute_dtype not in (None, torch.float32)
        super().__init__(parts, cfg, layout, compute_dtype, make_optimizer, seed)
        model = parts[0]
        by_param = {id(b.slots[0].param): b for b in self.buckets}
        owner = {}
        for name, param in model.named_parameters():
            if id(param) in by_param:
                owner.setdefault(id(param), name)
        embed, blocks, head = [], {k: [] for k in model.layers}, []
        output = getattr(model, "output", None)
        tied = output is not None and getattr(model, "tok_embeddings", None) is not None and (
            output.weight is model.tok_embeddings.weight)
        for pid, name in owner.items():
            parts_ = name.split(".")
            if parts_[0] == "layers":
                blocks[parts_[1]].append(by_param[pid])
            elif parts_[0] in ("tok_embeddings", "pos_embeddings") and not (tied and pid == id(output.weight)):
                embed.append(by_param[pid])
            else:  # the head unit; a tied embedding too, gathered from the model's start to its backward
                head.append(by_param[pid])
        self._tied = tied
        self._tied_weight = output.weight if tied else None
        self.units = ([_Unit("embed", embed)] + [_Unit(f"layers.{k}", blocks[k]) for k in model.layers]
                      + [_Unit("head", head)])
        for i, unit in enumerate(self.units):
            for bucket in unit.buckets:
                bucket.unit = i
        self._hooks(model)
        self._set_up = True
        self._release_all()

    # -- the rows and the gathered weights ----------------------------------------------------------------------

    @torch.no_grad()
    def _gather_weights(self) -> None:
        """After the optimizer's update (and once at set-up): gathered weights are stale, so every unit is released
        and gathers again, from the updated master rows, when it next runs."""
        for bucket in self.buckets:
            if not hasattr(bucket, "full"):
                self._set_up_bucket(bucket)
            if self.keep_rows:
                bucket.rows.copy_(bucket.master)
        if self._set_up:
            self._release_all()
        # At set-up the parameters now view their (released) gather buffers: what distopt's __init__ reads after
        # this are their shapes and autograd nodes, not values.

    def _set_up_bucket(self, bucket: _Bucket) -> None:
        slot = bucket.slots[0]
        n = bucket.where.n
        bucket.full = torch.empty(n * bucket.size, dtype=self.dtype, device=self.device)
        bucket.nbytes = bucket.full.untyped_storage().nbytes()
        shape = slot.local().shape
        view = bucket.full[:slot.rows * slot.width].view(shape)  # the parameter IS the gather output
        if isinstance(slot.param, DTensor):  # a routed expert under ep: its local part (this ep rank's experts)
            slot.param._local_tensor = view.data  # (its own version counter: the gathers write the buffer)
        else:
            slot.param.data = view
        # Released at once, until its unit first runs: the buffers are set up one at a time, so no rank ever holds
        # every weight's gather output (the whole model in the compute dtype) at start-up.
        bucket.full.untyped_storage().resize_(0)
        bucket.state, bucket.work, bucket.pending, bucket.accumulated = _FREE, None, None, False
        bucket.source = None
        if self.keep_rows:  # (loom.rules.zero3_keeps_compute_rows)
            bucket.rows = torch.empty(bucket.size, dtype=self.dtype, device=self.device)

    def _gather_bucket(self, bucket: _Bucket) -> None:
        if bucket.state != _FREE:
            return
        bucket.full.untyped_storage().resize_(bucket.nbytes)
        # The master rows cast to the compute dtype for this gather only (kept until it completes): no rank keeps
        # a compute-dtype copy of its rows between gathers, so a weight costs FSDP's 4 + 4 + moments bytes / n.
        if self.keep_rows:
            bucket.source = bucket.rows
        else:
            bucket.source = bucket.master if bucket.master.dtype == self.dtype else bucket.master.to(self.dtype)
        bucket.work = _ALL_GATHER(bucket.full, bucket.source, group=bucket.where.group, async_op=True)
        bucket.state = _GATHERING

    def _wait_bucket(self, bucket: _Bucket) -> None:
        if bucket.state == _GATHERING:
            bucket.work.wait()
            bucket.work, bucket.source, bucket.state = None, None, _READY

    def _release_bucket(self, bucket: _Bucket) -> None:
        self._wait_bucket(bucket)
        if bucket.state == _READY:
            bucket.full.untyped_storage().resize_(0)
            bucket.state = _FREE

    def _gather(self, i: int, wait: bool = True) -> None:
        if 0 <= i < len(self.units):
            for bucket in self.units[i].buckets:
                self._gather_bucket(bucket)
            if wait:
                for bucket in self.units[i].buckets:
                    self._wait_bucket(bucket)

    def _release(self, i: int) -> None:
        for bucket in self.units[i].buckets:
            self._release_bucket(bucket)

    def _release_all(self) -> None:
        for i in range(len(self.units)):
            self._release(i)

    def gather_all(self) -> None:
        """Every unit gathered (the weights whole until the next micro-batch or step releases them): for code that
        reads the parameters outside forward, as tests and exports do."""
        for i in range(len(self.units)):
            self._gather(i)

    def gathered_units(self) -> list[str]:
        """The units whose weights are gathered now (tests)."""
        return [u.name for u in self.units if any(b.state != _FREE for b in u.buckets)]

    # -- hooks: gather before a unit runs, release after ---------------------------------------------------------

    def _hooks(self, model: nn.Module) -> None:
        blocks = list(model.layers.values())
        first_block, last = 1, len(self.units) - 1

        @torch.compiler.disable
        def model_starts(module, args, kwargs=None):
            self._gather(0)  # the embedding
            if self._tied:  # the tied embedding lives in the head unit
                self._gather(last)
            self._gather(first_block, wait=False)

        def block_hooks(i: int):
            @torch.compiler.disable
            def before(module, args):
                if i == first_block:
                    self._release(0)  # the embedding's backward needs no weight
                self._gather(i)
                self._gather(i + 1, wait=False)

            @torch.compiler.disable
            def after(module, args, output):
                self._release(i)
                out = output[0] if isinstance(output, tuple) else output
                if torch.is_tensor(out) and out.requires_grad:
                    out.register_hook(lambda grad: self._before_backward(i))

            return before, after

        model.register_forward_pre_hook(model_starts)
        for k, block in enumerate(blocks):
            before, after = block_hooks(first_block + k)
            block.register_forward_pre_hook(before)
            block.register_forward_hook(after)
        norm = getattr(model, "norm", None)
        if norm is not None:  # the head unit: the final norm and the head, kept from forward to their backward
            norm.register_forward_pre_hook(torch.compiler.disable(lambda module, args: self._gather(last)))
        self._first_block, self._last = first_block, last

    def _before_backward(self, i: int) -> None:
        self._gather(i)  # (the block before it is fetched at this block's first gradient buffer: `_grad_buffer`)

    # -- gradients: each parameter's reduced as soon as it is complete ------------------------------------------

    def _grad_buffer(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.grad is None:
            # The reductions started before the last one are added in (their buffers freed) before this buffer is
            # made: the previous weight's stays in flight while this one's gradient is computed, so at most two
            # weights' fp32 gradients are alive at once (`loom.planner.memory.zero3_buffer_bytes`).
            while len(self._pending) > 1:
                self._collect(self._pending.popleft())
            # A block's first gradient: fetch the block before it now, once the unit above's reductions are in (the
            # head's, on the last block, is the largest), not as the block's backward starts.
            if self._first_block < bucket.unit < self._last:
                self._gather(bucket.unit - 1, wait=False)
            slot = bucket.slots[0]
            bucket.grad = torch.empty(bucket.where.n, bucket.size, dtype=torch.float32, device=self.device)
            bucket.grad.view(-1)[slot.rows * slot.width:].zero_()  # the padding rows at the end
        return bucket.grad

    def _into_buffer(self, bucket: _Bucket, slot: _Slot):
        """The weight gradient dy^T x in one product: with one parameter per bucket the rank-major buffer is the
        weight's rows in order."""
        def into(dy: torch.Tensor, x: torch.Tensor) -> None:
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
            out = self._grad_buffer(bucket).view(-1)[:slot.rows * slot.width].view(slot.rows, slot.width)
            if self.fused_gemm:
                torch.addmm(out, dy2.t(), x2, beta=0, out_dtype=torch.float32, out=out)
            elif dy2.dtype == torch.float32:
                torch.mm(dy2.t(), x2, out=out)
            else:  # 16-bit without out_dtype (a CPU): the product, then its fp32 copy
                out.copy_(dy2.t() @ x2)
            self._arrived(bucket, slot)
        return into

    def _arrived(self, bucket: _Bucket, slot: _Slot) -> None:
        """This micro-batch's gradient of the bucket's parameter is complete: reduce-scatter it (asynchronously)
        and release the weight, which backward no longer needs."""
        self._collect(bucket)  # a second use in the same backward (not a layout this runs; kept correct)
        tmp = torch.empty(bucket.size, dtype=torch.float32, device=self.device)
        work = _REDUCE_SCATTER(tmp, bucket.grad.view(-1), group=bucket.where.group, async_op=True)
        bucket.pending, bucket.grad = (work, tmp, bucket.grad), None
        self._pending.append(bucket)
        slot.filled = False  # the next gradient goes into a fresh buffer
        self._release_bucket(bucket)
        if bucket.unit == self._last and slot.param is not self._tied_weight:  # the head unit's gradients (the
            # head's, the final norm's) come first in backward: fetch the last block. (A tied weight's, summed over
            # both uses, comes last: nothing to fetch.)
            self._gather(self._last - 1, wait=False)

    def _collect(self, bucket: _Bucket) -> None:
        if bucket.pending is not None:
            work, tmp, _ = bucket.pending
            work.wait()
            bucket.shard.add_(tmp) if bucket.accumulated else bucket.shard.copy_(tmp)
            bucket.accumulated, bucket.pending = True, None

    def micro_batch_starts(self) -> None:
        """Before a micro-batch: the previous one's reductions added in, and every weight released."""
        for bucket in self.buckets:
            self._collect(bucket)
        self._pending.clear()
        self._release_all()

    def _finish_reduction(self) -> None:
        for bucket in self.buckets:
            self._collect(bucket)
            if not bucket.accumulated:  # no gradient this step
                bucket.shard.zero_()
        self._pending.clear()
        self._release_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for bucket in self.buckets:
            bucket.accumulated = False
