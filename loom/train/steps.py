"""Step runners: how one rank runs forward and backward over its share of a global batch.

One runner per execution style, both with the same small surface, so the trainer (and later the SFT,
DPO and RL recipes) never asks which style it runs:

- `model`: the module the optimizer and checkpoints see (a pipeline rank's view of its stages);
- `forward_backward(batch, scale)`: run this rank's micro-batches, accumulating `scale` x the summed loss's
  gradients; returns the summed loss this rank observed (0 off the last pipeline stage);
- `eval_loss_sum(batch)`: the summed loss of a held-out batch, without gradients (every rank gets it);
- `grad_norm_group`: the group over which squared gradient norms add up (pipeline stages), or None;
- `local_metrics()`: this rank's extra per-step numbers, averaged over ranks in the step's one all-reduce
  (the pipeline bubble);
- `norm_parameters()`: the parameters that make up the gradient norm, and shared copies clipped with them;
- `first_non_finite(batch)`: the first module whose output is non-finite, for divergence reports.

The loss is a `loom.models.losses.Loss`: a function of the model's output and the batch, so a new loss
(masked SFT, DPO, policy gradient) plugs in here without touching parallel code or the pipeline runner.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from loom.config import Config
from loom.models.losses import Batch, HeadInput, Loss
from loom.models.moe import set_aux_grad_scale
from loom.parallel import MeshPlace, parallelize
from loom.parallel.context import shard_batch
from loom.parallel.data import set_gradient_sync
from loom.parallel.distributed import all_reduce_sum, full_tensor
from loom.parallel.tensor import loss_context
from loom.rules import grads_stay_sharded


PACKING = ("doc_ids", "positions")  # batch entries the model takes beside the tokens (packed sequences)


def model_kwargs(batch: Batch) -> dict:
    return {k: batch[k] for k in PACKING if k in batch}


class BatchPrefetcher:
    """Reads the next step's batch in a background thread while the current step computes (pinned on
    CUDA, for asynchronous copies), so a step waits for its data only when reading is slower than
    computing. The batch a step gets is exactly `read(start)`, prefetched or not: the data position is
    the step's `consumed_samples` alone."""

    def __init__(self, read, pin: bool, background: bool):
        from concurrent.futures import ThreadPoolExecutor

        self.read, self.pin = read, pin
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="loom-data") if background else None
        self.pending = None  # (start, future)

    def _load(self, start: int) -> Batch:
        batch = self.read(start)
        return {k: v.pin_memory() for k, v in batch.items()} if self.pin else batch

    def get(self, start: int, next_start: int | None) -> tuple[Batch, float]:
        """The batch at `start` and the seconds this call waited for it; starts reading `next_start`."""
        t0 = time.perf_counter()
        if self.pending is not None and self.pending[0] == start:
            batch = self.pending[1].result()
        else:
            batch = self._load(start)
        waited = time.perf_counter() - t0
        self.pending = None
        if self.pool is not None and next_start is not None:
            self.pending = (next_start, self.pool.submit(self._load, next_start))
        return batch, waited

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pending = None


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """`batch` cut along the sample dimension into micro-batches of `size` samples."""
    n = next(iter(batch.values())).shape[0]
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, n, size)]


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without a host synchronisation: on CUDA through pinned memory (a copy from
    pageable memory waits for the stream), elsewhere as is."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def attention_kernels(device: torch.device):
    """On CUDA, SDPA restricted to fused kernels in a fixed order of preference — cuDNN first on Hopper
    and newer (the fastest there), flash first before — with memory-efficient attention as the fallback
    and never the math path that materialises the scores. Nothing changes on CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    if torch.cuda.get_device_capability(device)[0] >= 9:
        fused.reverse()
    return sdpa_kernel([*fused, SDPBackend.EFFICIENT_ATTENTION], set_priority=True)


class _Runner:
    grad_norm_group = None

    def __init__(self, cfg: Config, layout: MeshPlace, loss: Loss, device: torch.device,
                 autocast_dtype: torch.dtype | None):
        self.cfg, self.layout, self.loss, self.device = cfg, layout, loss, device
        self.autocast_dtype = autocast_dtype

    def cp_shard(self, batch: Batch) -> Batch:
        """This context-parallel rank's chunks of every sequence (the whole batch when cp = 1)."""
        return shard_batch(batch, self.cfg.train.seq_len, self.layout.cp, self.layout.cp_rank)

    def cp_sum(self, loss: torch.Tensor) -> torch.Tensor:
        """A loss summed over this rank's tokens -> over whole sequences (summed over the cp group)."""
        return all_reduce_sum(loss, self.layout.submesh("cp").get_group()) if self.layout.cp > 1 else loss

    def autocast(self):
        """Autocast (bf16 without FSDP) and, on CUDA, the fused attention kernels chosen explicitly."""
        stack = contextlib.ExitStack()
        if self.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast_dtype))
        stack.enter_context(attention_kernels(self.device))
        return stack

    def local_metrics(self) -> dict[str, float]:
        """This rank's per-step numbers whose mean over all ranks goes with the step's row (the trainer sums them in
        the step's one all-reduce): host floats, known without a synchronisation."""
        return {}

    def norm_parameters(self) -> tuple[list, list]:
        """(parameters whose gradients make up the norm, copies of shared weights clipped but not counted)."""
        return list(self.model.parameters()), []

    def first_non_finite(self, batch: Batch) -> str | None:
        return None


class SPMDRunner(_Runner):
    """Every rank runs the whole (tensor/data-parallel) model: micro-batches one after another, with the
    data-parallel gradient reduction only after the last."""

    def __init__(self, model: nn.Module, cfg: Config, layout: MeshPlace, loss: Loss, device: torch.device,
                 compute_dtype: torch.dtype | None, layer_plan: dict | None = None):
        # bf16 compute: FSDP2 casts parameters per block when data-parallel, else autocast does it.
        super().__init__(cfg, layout, loss, device, compute_dtype if layout.grad_ranks == 1 else None)
        # train.compile compiles each transformer block inside parallelize (TP, recompute, compile, FSDP).
        self.model = parallelize(model, layout, cfg, compute_dtype, layer_plan)
        self.parts = [self.model]  # the modules that hold this rank's weights (materialised by the trainer)

    def loss_sum(self, batch: Batch) -> torch.Tensor:
        with self.autocast():
            if self.loss.wants_hidden:  # the loss applies the head itself (chunked)
                hidden = self.model(batch["input_ids"], return_hidden=True, **model_kwargs(batch))
                return self.loss(HeadInput(hidden, self.model.output), batch)
            output = self.model(batch["input_ids"], **model_kwargs(batch))
        return self.loss(output, batch)

    def forward_backward(self, batch: Batch, scale: float | torch.Tensor) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.device)
        micro = micro_batches(self.cp_shard(batch), self.cfg.train.micro_batch)
        # Sharded accumulation: every micro-batch's gradients are reduce-scattered into this rank's shard.
        p = self.cfg.parallel
        sharded = p.dp_shard * p.cp > 1 and grads_stay_sharded(p.grad_accum, 1, len(micro))
        set_aux_grad_scale(self.model, 1.0 / len(micro))  # MoE auxiliary losses: the mean over micro-batches
        for m, mb in enumerate(micro):
            mb = to_device(mb, self.device)
            set_gradient_sync(self.model, m == len(micro) - 1, sharded)
            with loss_context(self.layout.tp):
                micro_loss = self.loss_sum(mb)
                (micro_loss * scale).backward()
            loss_sum += full_tensor(micro_loss).detach()
        return loss_sum

    def eval_loss_sum(self, batch: Batch) -> torch.Tensor:
        with loss_context(self.layout.tp):
            loss = full_tensor(self.loss_sum(to_device(self.cp_shard(batch), self.device))).detach()
        return self.cp_sum(loss)

    def first_non_finite(self, batch: Batch) -> str | None:
        first = None

        def check(name):
            def hook(module, inputs, output):
                nonlocal first
                out = output[0] if isinstance(output, tuple) else output
                if first is None and torch.is_tensor(out) and not torch.isfinite(full_tensor(out.detach())).all():
                    first = name
            return hook

        hooks = [m.register_forward_hook(check(n)) for n, m in self.model.named_modules() if n]
        try:
            with torch.no_grad(), self.autocast():
                batch = to_device(self.cp_shard(batch), self.device)
                self.model(batch["input_ids"], **model_kwargs(batch))
        finally:
            for h in hooks:
                h.remove()
        return first


class PipelineRunner(_Runner):
    """This rank's pipeline stages, run by a torch.distributed.pipelining schedule (1F1B, interleaved,
    zero-bubble), which cuts the rank's batch into micro-batches itself."""

    def __init__(self, model: nn.Module, cfg: Config, layout: MeshPlace, loss: Loss, device: torch.device,
                 compute_dtype: torch.dtype | None, layer_plan: dict | None = None):
        from loom.parallel.pipeline import RankView, TiedEmbedding, build_schedule, split_stages

        super().__init__(cfg, layout, loss, device, compute_dtype if layout.grad_ranks == 1 else None)
        self.chunks, self.stage_ids = split_stages(model, cfg, layout.pp_rank)
        for chunk in self.chunks:
            parallelize(chunk, layout, cfg, compute_dtype, layer_plan)
        self.model = RankView(self.chunks)
        self.parts = self.chunks
        self.model.pp_size = layout.pp
        num_stages = cfg.parallel.pp * cfg.parallel.vpp
        self.has_first, self.has_last = 0 in self.stage_ids, num_stages - 1 in self.stage_ids
        n_micro = cfg.train.global_batch // (layout.dp_size * cfg.train.micro_batch)
        # MoE auxiliary losses: every stage trains on their mean over the rank's micro-batches.
        for chunk in self.chunks:
            set_aux_grad_scale(chunk, 1.0 / n_micro)
        self.grad_norm_group = layout.submesh("pp").get_group()
        self.scale = 1.0
        self.bubble = 0.0
        self.timing = None  # CUDA: the last step's (start, end, waits) events, read at the next step
        self.schedule, self.stages = build_schedule(self.chunks, self.stage_ids, cfg, self.grad_norm_group, device,
                                                    n_micro, self._stage_loss)
        self.tied = TiedEmbedding(self.chunks, cfg, self.grad_norm_group) if cfg.model.tie_embeddings else None

    def norm_parameters(self) -> tuple[list, list]:
        if self.tied is None:
            return super().norm_parameters()
        return self.tied.counted_once(self.model.parameters())

    def _stage_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(output, {"labels": labels}) * self.scale

    def forward_backward(self, batch: Batch, scale: float | torch.Tensor) -> torch.Tensor:
        from loom.parallel.pipeline import WaitTimer

        self.scale = scale
        batch = to_device(self.cp_shard(batch), self.device)
        losses: list = []
        # Contiguous: torch 2.11's pipelining checks input strides against the stage's (a [b, s] slice of the
        # [b, s+1] sample rows has stride s+1).
        args = (batch["input_ids"].contiguous(),) if self.has_first else ()
        kwargs = {"target": batch["labels"].contiguous(), "losses": losses} if self.has_last else {}
        kwargs.update({k: v.contiguous() for k, v in model_kwargs(batch).items()})  # every stage gets them
        WaitTimer.reset()
        cuda = self.device.type == "cuda"  # time on the device's stream: NCCL waits do not block the host
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        with loss_context(self.layout.tp), self.autocast():
            self.schedule.step(*args, **kwargs)
        seconds, waits = WaitTimer.take()
        if cuda:  # read at the next step, when the events are complete (its transfer waited for them): no sync
            end.record()
            previous, self.timing = self.timing, (start, end, waits)
            self.bubble = float("nan") if previous is None else self._bubble(
                previous[0].elapsed_time(previous[1]) / 1e3, WaitTimer.event_seconds(previous[2]))
        else:  # gloo blocks the host: host clocks, this step's
            self.bubble = self._bubble(time.perf_counter() - t0, seconds)
        if self.tied is not None:
            self.tied.sum_gradients()
        if not losses:
            return torch.zeros((), device=self.device)
        return sum(full_tensor(loss).detach() for loss in losses) / self.scale

    def eval_loss_sum(self, batch: Batch) -> torch.Tensor:
        from loom.parallel.pipeline import forward_through_stages

        batch = to_device(self.cp_shard(batch), self.device)
        with loss_context(self.layout.tp):
            with self.autocast():
                output = forward_through_stages(self.chunks, self.stage_ids, self.cfg, self.grad_norm_group,
                                                batch["input_ids"], **model_kwargs(batch))
            loss = (full_tensor(self.loss(output, batch)).detach() if output is not None
                    else torch.zeros((), device=self.device))
        return self.cp_sum(all_reduce_sum(loss, self.grad_norm_group))  # only the last stage has it

    @staticmethod
    def _bubble(elapsed: float, waited: float) -> float:
        """Time blocked on pipeline transfers over time computing (the trainer averages it over ranks)."""
        return waited / max(elapsed - waited, 1e-9)

    def local_metrics(self) -> dict[str, float]:
        """The pipeline bubble of this rank: this step's on CPU; on CUDA the step before's (the first step's NaN),
        whose CUDA events are complete without a synchronisation."""
        return {"pipeline_bubble": self.bubble}


def build_runner(model: nn.Module, cfg: Config, layout: MeshPlace, loss: Loss, device: torch.device,
                 compute_dtype: torch.dtype | None, layer_plan: dict | None = None) -> _Runner:
    kind = PipelineRunner if layout.pp > 1 else SPMDRunner
    return kind(model, cfg, layout, loss, device, compute_dtype, layer_plan)
