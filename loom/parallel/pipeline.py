"""Pipeline parallelism with `torch.distributed.pipelining`: stage splitting and schedules.

The model's layers are cut into `pp * vpp` chunks (stages). Every rank builds the full model from the
seed, then keeps deep copies holding only its own stages' layers — the embedding stays on stage 0,
the final norm and LM head (and the loss) on the last stage. Names are preserved (a stage keeps
`layers.7` as `layers.7`), so checkpoints are independent of the split.

Stage placement: looped (stage s on rank s mod pp) for `1f1b` and `interleaved`; a "V" (rank r holds
stages r and 2pp-1-r) for `zero_bubble` with two stages per rank, as ZB-V wants.
"""

from __future__ import annotations

import copy
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from loom.config import Config
from loom.rules import chunk_layer_counts, chunk_owner, rank_chunks


def stage_ids(cfg: Config, pp_rank: int) -> list[int]:
    p = cfg.parallel
    return rank_chunks(p.pp, p.vpp, p.schedule, pp_rank)


def stage_owner(cfg: Config, stage: int) -> int:
    """The pipeline rank holding `stage`."""
    p = cfg.parallel
    return chunk_owner(p.pp, p.vpp, p.schedule, stage)


@torch.no_grad()
def forward_through_stages(chunks, ids, cfg: Config, pp_group, x: torch.Tensor, **kwargs):
    """Forward only, stage after stage, with blocking point-to-point transfers (used for evaluation).

    Returns the last stage's output on the rank that holds it, else None. Every rank of the pipeline
    group must call it. Hidden states may be sequence shards (SP): each rank exchanges with the rank at
    the same tensor/data-parallel coordinate, which is what `pp_group` connects. `kwargs` (packed sequences'
    doc_ids and positions) go to every stage.
    """
    import torch.distributed as dist

    num_stages = cfg.parallel.pp * cfg.parallel.vpp
    mine = dict(zip(ids, chunks))
    peer = lambda stage: dist.get_global_rank(pp_group, stage_owner(cfg, stage))  # noqa: E731
    here = dist.get_rank()
    h = x
    for stage in range(num_stages):
        if stage not in mine:
            continue
        if stage > 0 and peer(stage - 1) != here:  # receive the previous stage's output
            meta = torch.empty(4, dtype=torch.int64, device=x.device)
            dist.recv(meta, src=peer(stage - 1))
            shape = [int(v) for v in meta if v > 0]
            h = torch.empty(shape, dtype=torch.float32, device=x.device)
            dist.recv(h, src=peer(stage - 1))
        h = mine[stage](h, **kwargs)
        if stage < num_stages - 1 and peer(stage + 1) != here:
            h = h.float().contiguous()
            meta = torch.tensor(list(h.shape) + [0] * (4 - h.dim()), dtype=torch.int64, device=h.device)
            dist.send(meta, dst=peer(stage + 1))
            dist.send(h, dst=peer(stage + 1))
    return h if (num_stages - 1) in mine else None


def split_stages(model: nn.Module, cfg: Config, pp_rank: int) -> tuple[list[nn.Module], list[int]]:
    """This rank's stage modules (deep copies of `model` keeping only their layers) and their ids."""
    counts = chunk_layer_counts(cfg)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    ids = stage_ids(cfg, pp_rank)
    chunks = []
    for sid in ids:
        keep = set(range(starts[sid], starts[sid] + counts[sid]))
        chunk = copy.deepcopy(model)
        for name in list(chunk.layers.keys()):
            if int(name) not in keep:
                del chunk.layers[name]
        if sid != 0:
            chunk.tok_embeddings = None
            chunk.pos_embeddings = None
            chunk.embed_dropout = nn.Identity()
        if sid != len(counts) - 1:
            chunk.norm = None
            chunk.output = None
        chunks.append(chunk)
    return chunks, ids


class RankView(nn.Module):
    """All of this rank's stage modules under the full model's names (for the optimizer and state dicts)."""

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.cfg, self.fresh_parameters = chunks[0].cfg, chunks[0].fresh_parameters
        self.layers = nn.ModuleDict()
        for chunk in chunks:
            for name, layer in chunk.layers.items():
                self.layers[name] = layer
            for name, module in chunk.named_children():  # a stage's embedding, norm and head (None: absent)
                if name in ("tok_embeddings", "pos_embeddings", "embed_dropout", "norm", "output"):
                    setattr(self, name, module)

    def forward(self, *args, **kwargs):  # pragma: no cover - the schedule runs the stages
        raise RuntimeError("a pipeline rank's view is not callable; the schedule runs its stages")


class WaitTimer:
    """Seconds this process spent blocked on pipeline point-to-point transfers.

    torch.distributed.pipelining waits for every batch of sends/receives through one module-level
    function; `install` wraps it with a clock. The bubble of a step is that waiting time over the
    time the rank computed: theory says (p - 1) / (v * m) for 1F1B (v = 1) and interleaved schedules.

    On CPU (gloo) the wait blocks the host, so a host clock measures it. On CUDA (NCCL) `work.wait()` only
    makes the compute stream wait and returns at once (a host clock reads ~0): the wait is bracketed by CUDA
    events on the current stream instead, whose elapsed time is how long the stream stood still; `take` hands
    them over after the step and `event_seconds` adds them up once they are complete (the runner reads them a
    step later, with no synchronisation of its own).
    """

    seconds = 0.0
    use_cuda_events = False
    pending: list = []  # (start, end) CUDA events of the current step
    installed = None  # the wrapper now in torch's schedules module

    @classmethod
    def install(cls, device: torch.device | None = None) -> None:
        from torch.distributed.pipelining import schedules

        cls.use_cuda_events = device is not None and device.type == "cuda"
        original = schedules._wait_batch_p2p
        if original is cls.installed:
            return

        def timed(work):
            if cls.use_cuda_events:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    return original(work)
                finally:
                    end.record()
                    cls.pending.append((start, end))
            t0 = time.perf_counter()
            try:
                return original(work)
            finally:
                cls.seconds += time.perf_counter() - t0

        schedules._wait_batch_p2p = cls.installed = timed

    @classmethod
    def reset(cls) -> None:
        cls.seconds, cls.pending = 0.0, []

    @classmethod
    def take(cls) -> tuple[float, list]:
        """This step's host-clock waiting seconds and its CUDA (start, end) events; starts the next step from zero."""
        out = cls.seconds, cls.pending
        cls.reset()
        return out

    @staticmethod
    def event_seconds(pending: list) -> float:
        """The seconds between each (start, end) pair of CUDA events, added up (the events must be complete)."""
        return sum(a.elapsed_time(b) for a, b in pending) / 1e3


def _without_moe_statistics(stage) -> None:
    """The stage's metadata inference (a forward the schedule runs once before the first step's real ones,
    on the first micro-batch or on uninitialised tensors) records no MoE routing statistics."""
    from loom.models.moe import statistics_off

    for name in ("_forward_metadata_inference", "_shape_inference"):  # torch 2.13, older
        infer = getattr(stage, name, None)
        if infer is not None:
            def quiet(*args, _infer=infer, **kwargs):
                with statistics_off():
                    return _infer(*args, **kwargs)

            setattr(stage, name, quiet)
            return


def build_schedule(chunks, ids, cfg: Config, pp_group, device: torch.device, n_micro: int, loss_fn):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import (
        Schedule1F1B,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    WaitTimer.install(device)
    num_stages = cfg.parallel.pp * cfg.parallel.vpp
    stages = [PipelineStage(chunk, sid, num_stages, device, group=pp_group) for chunk, sid in zip(chunks, ids)]
    for stage in stages:
        _without_moe_statistics(stage)
    kind = cfg.parallel.schedule
    if kind == "1f1b":
        return Schedule1F1B(stages[0], n_micro, loss_fn=loss_fn, scale_grads=False), stages
    if kind == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_micro, loss_fn=loss_fn, scale_grads=False), stages
    if cfg.parallel.vpp == 2:
        return ScheduleZBVZeroBubble(stages, n_micro, loss_fn=loss_fn, scale_grads=False), stages
    return ScheduleInterleavedZeroBubble(stages, n_micro, loss_fn=loss_fn, scale_grads=False), stages


class TiedEmbedding:
    """A tied embedding and LM head under pipeline parallelism (Megatron's approach): the first stage holds
    the embedding, the last stage its own copy as the head weight. Both start equal (the same init name),
    their gradients are summed over the two ranks after backward (the gradient one process computes for
    the shared weight), so identical optimizer updates keep them equal. The head copy is left out of the
    gradient norm, which counts the shared weight once.

    Under tensor parallelism both copies are vocabulary shards (the embedding split by rows, the head by
    output columns: `Shard(0)` of the same [vocab, hidden] weight), and the ranks exchanging them sit at the
    same tensor-parallel coordinate (`pp_group` connects them), so tensor-parallel rank r of the first stage
    adds the gradient of its rows to rank r of the last stage. The exchange is of each gradient in its
    parameter's own layout (see `_in_parameter_layout`)."""

    def __init__(self, chunks: list[nn.Module], cfg: Config, pp_group):
        p = cfg.parallel
        last = p.pp * p.vpp - 1
        self.chunks = chunks
        ranks = dist.get_process_group_ranks(pp_group)
        self.embedding_rank = ranks[chunk_owner(p.pp, p.vpp, p.schedule, 0)]
        self.head_rank = ranks[chunk_owner(p.pp, p.vpp, p.schedule, last)]

    # Looked up when used: materialising the stages (meta -> device) replaces the parameter objects.
    @property
    def embedding(self):
        return next((c.tok_embeddings.weight for c in self.chunks if c.tok_embeddings is not None), None)

    @property
    def head(self):
        return next((c.output.weight for c in self.chunks if c.output is not None), None)

    @staticmethod
    def _in_parameter_layout(param: torch.Tensor) -> torch.Tensor:
        """This rank's part of `param`'s gradient, laid out as `param` is, as a plain tensor.

        A DTensor parameter's gradient need not come back in the parameter's placements: DTensor's embedding
        backward gives the vocabulary-parallel embedding a full [vocab, hidden] gradient, replicated (or,
        under SP, a partial sum per rank), while the column-parallel head's gradient is its vocabulary shard.
        Exchanging those local tensors sent the whole table against a shard (gloo: "Received data size doesn't
        match expected size"). Redistributed to the parameter's placements (a slice of the replicated
        gradient, a reduce-scatter of the partial one over the tensor-parallel group, as FSDP does before its
        own reduction), both copies are the same rows on the same tensor-parallel rank. The gradient is
        replaced by its redistributed form, so the optimizer sees it too."""
        grad = param.grad
        if not isinstance(grad, DTensor):
            return grad
        if tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
            param.grad = grad
        return grad.to_local()

    @torch.no_grad()
    def sum_gradients(self) -> None:
        embedding, head = self.embedding, self.head
        if not any(w is not None and w.requires_grad for w in (embedding, head)):
            return  # a frozen base (LoRA): the tied copies start equal and nothing trains them
        if embedding is not None and head is not None:  # both stages on this rank (V schedules)
            mine, theirs = self._in_parameter_layout(embedding), self._in_parameter_layout(head)
            mine.add_(theirs)  # embedding + head, as the two-rank case below adds them
            theirs.copy_(mine)
            return
        mine = embedding if embedding is not None else head
        if mine is None:
            return
        peer = self.head_rank if embedding is not None else self.embedding_rank
        grad = self._in_parameter_layout(mine)
        theirs = torch.empty_like(grad)
        ops = [dist.P2POp(dist.isend, grad, peer), dist.P2POp(dist.irecv, theirs, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if embedding is not None:  # the same order of addition on both ranks: bit-identical sums
            grad.add_(theirs)
        else:
            grad.copy_(theirs + grad)

    def counted_once(self, params) -> tuple[list, list]:
        """(parameters whose gradients enter the norm, the head copy that is clipped but not counted)."""
        params, head = list(params), self.head
        if head is None:
            return params, []
        return [q for q in params if q is not head], [head]
