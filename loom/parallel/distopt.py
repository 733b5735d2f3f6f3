"""The distributed optimizer (`parallel.distributed_optimizer=true`): Megatron-Core's alternative to FSDP.

Weights are whole on every data-parallel rank, in the compute dtype (bf16 under `train.dtype=bfloat16`); the
fp32 master weights and AdamW's moments are split over the data-parallel x cp ranks (the group FSDP would
shard over). What FSDP2 does per micro-batch, this does once per step:

- forward and backward read the weights as they are: no all-gather before each block, and none of FSDP2's
  copies of the gathered flat buffer into the parameters (twice per micro-batch, `loom plan`'s "FSDP2 buffer
  copies");
- each parameter's gradient is added, as autograd produces it, into a contiguous fp32 gradient buffer (a
  post-accumulate hook; the bf16 `.grad` is dropped at once), so gradients accumulate over micro-batches in
  fp32 with no per-micro-batch collective; with `distopt_fused_wgrad` (the default) the blocks' linear layers
  write their weight gradients there from their backward's product (`LinearIntoBuffer`), and the chunked loss
  (`train.loss_chunk`) an untied LM head's from its forward's, on a step's first micro-batch (later ones add its
  fp32 copy in backward; loom/parallel/headgrad.py), with no 16-bit `.grad`;
- on the last micro-batch each bucket of the buffer is reduce-scattered as soon as its parameters' gradients
  are complete (overlapping the rest of backward), leaving each rank the fp32 sum of its rows;
- the optimizer updates the rank's rows of the fp32 master weights; the new weights are cast to the compute
  dtype and all-gathered once.

Which rows a rank owns: every parameter (its tensor-parallel shard under tp) is split by rows over the n ranks
of the group as `torch.chunk` splits it (ceil(rows / n) per rank, the last ones shorter or empty), exactly as
FSDP2 shards it. A bucket's buffers are laid out rank-major: `[n, S]`, rank r's rows of every parameter of the
bucket side by side in row r, so a reduce-scatter of the flat buffer gives each rank its rows contiguously and
adding a gradient into the buffer is one strided add (two where the rows do not divide). Because the split is
FSDP2's, the checkpoint holds the same tensors an FSDP run writes (fp32 weights and moments, DTensors sharded by
rows over the same mesh): a run resumes in either style, and in any other layout (`loom/train/checkpoint.py`).

Memory per parameter: compute-dtype weight (2 or 4 bytes) + fp32 gradient (4) + (master 4 + moments 8 or 4)
/ n, against FSDP's (4 + 4 + 8) / n plus one block gathered: more memory for fewer copies and collectives
(Megatron's trade). Under expert parallelism the routed experts' rows are split over their expert-data-parallel
ranks (`edp`) instead, their summed gradient divided by all dp x cp ranks, as FSDP does them. Not yet: LoRA,
dp_replicate > 1, the zero-bubble schedule, pipeline stages with a tied embedding (`loom.rules.distopt_problem`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from loom.config import Config
from loom.parallel.headgrad import attach_head
from loom.parallel.wgrad import LinearIntoBuffer, fused_out_dtype_works

BUCKET_ELEMENTS = 32 << 20  # parameters per gradient bucket (fp32: 128 MiB of buffer); one larger tensor alone


@dataclass
class _Slot:
    """One parameter in a bucket: its rows per rank (`per_rank`, the last ranks' fewer), row width and column
    offset in the bucket's rank-major buffers."""

    param: nn.Parameter
    name: str
    rows: int
    width: int
    per_rank: int
    offset: int
    replicas: int  # ranks holding the same values outside the group (tensor-parallel replicas): norm weight
    filled: bool = False  # this step's first gradient was copied in (later ones are added)
    arrivals: int = 0  # this step's gradients so far (a pipeline stage's count tells the last micro-batch's)
    row_dim: int = 0  # 1: a stack of one ([1, rows, ...], a rank's one expert), split along its second dimension

    def piece_shape(self, rows: int) -> tuple[int, ...]:
        """The shape of `rows` of this parameter's rows (along `row_dim`)."""
        shape = tuple(self.local().shape)
        if not shape:
            return (rows,)
        return shape[:self.row_dim] + (rows,) + shape[self.row_dim + 1:]

    def my_rows(self, rank: int) -> int:
        return max(0, min(self.per_rank, self.rows - rank * self.per_rank))

    @property
    def span(self) -> int:
        return self.per_rank * self.width

    def local(self) -> torch.Tensor:
        p = self.param
        return p._local_tensor if isinstance(p, DTensor) else p.data


@dataclass
class _Group:
    """The ranks a bucket's rows are split over: the dp_shard x cp ranks, or for routed experts under expert
    parallelism the expert-data-parallel ranks (`edp`), whose gradient sum is divided by all dp x cp ranks."""

    mesh: object
    divide: int
    experts: bool = False

    def __post_init__(self):
        self.group, self.n, self.rank = self.mesh.get_group(), self.mesh.size(), self.mesh.get_local_rank()


@dataclass
class _Bucket:
    slots: list[_Slot]
    size: int  # S: elements of one rank's row of the buffers
    where: _Group | None = None
    grad: torch.Tensor | None = None  # [n, S] fp32: gradients summed over micro-batches
    shard: torch.Tensor | None = None  # [S] fp32: this rank's reduced rows
    master: torch.Tensor | None = None  # [S] fp32: this rank's rows of the weights
    ready: int = 0
    work: object | None = None
    pieces: list = field(default_factory=list)  # per slot: (master view, grad view) shaped as the rows


def _layout_slots(params: list[tuple[str, nn.Parameter]], where: _Group, tp_size: int,
                  per_param: bool = False) -> list[_Bucket]:
    """`params` in buckets of at most BUCKET_ELEMENTS (`per_param`: one parameter per bucket), split over `where`'s
    ranks. A parameter is counted once by the gradient norm: `replicas` is the number of tensor-parallel ranks
    holding the same values."""
    buckets, current, used, n = [], [], 0, where.n
    for name, p in params:
        local = p._local_tensor if isinstance(p, DTensor) else p.data
        # A stack of one (a rank's single expert [1, hidden, ffn]) is split along its rows, not padded to n copies
        row_dim = 1 if local.dim() >= 3 and local.shape[0] == 1 and n > 1 else 0
        rows = local.shape[row_dim] if local.dim() else 1
        width = local.numel() // max(rows, 1)
        per_rank = max(1, math.ceil(rows / n))
        replicated = isinstance(p, DTensor) and all(isinstance(pl, Replicate) for pl in p.placements)
        replicas = tp_size if (replicated or not isinstance(p, DTensor)) else 1
        if where.experts:  # experts: whole on each tp rank unless they are spread over them (loom.rules)
            replicas = tp_size
        slot = _Slot(p, name, rows, width, per_rank, 0, replicas, row_dim=row_dim)
        if current and (per_param or used + slot.span > BUCKET_ELEMENTS):
            buckets.append(_Bucket(current, used, where))
            current, used = [], 0
        slot.offset = used
        current.append(slot)
        used += slot.span
    if current:
        buckets.append(_Bucket(current, used, where))
    return buckets


def _rank_major(buf: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """The slot's columns of a `[n, S]` buffer (every rank's rows, padded)."""
    return buf[:, slot.offset:slot.offset + slot.span]


def _matching(buf: torch.Tensor, flat: torch.Tensor, slot: _Slot) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(part of the `[n, S]` buffer, the same elements of the parameter flattened as `flat`): the ranks holding
    full rows in one strided view, and the rows left to the next rank (when the rows do not divide)."""
    cols, span = _rank_major(buf, slot), slot.span
    full = slot.rows // slot.per_rank
    rest = slot.rows - full * slot.per_rank
    out = [(cols[:full], flat[:full * span].view(full, span))] if full else []
    if rest:
        out.append((cols[full, :rest * slot.width], flat[full * span:]))
    return out


def _draw_rows(master: torch.Tensor, slot: _Slot, first: int, part: nn.Module, seed: int) -> None:
    """`master` (rows `first`.. of `slot`'s parameter) filled with the values the whole parameter starts with."""
    from loom.models.init import fill

    if slot.param.dim() == 0:
        raise ValueError(f"{slot.name}: rows are drawn only for tensors with rows")
    offset = [0] * slot.param.dim()
    if isinstance(slot.param, DTensor):  # the rank's slice (a routed expert's under ep) within the whole parameter
        from loom.parallel.materialize import local_slice

        offset = list(local_slice(slot.param)[1])
    offset[slot.row_dim] += first
    name = part.init_name(slot.name)
    fill(master, tuple(slot.param.shape), tuple(offset), seed, name, *part.init_spec(name))


class DistributedOptimizer:
    """AdamW over this rank's rows of every trained parameter (see the module docstring); the trainer's
    optimizer: `param_groups` (the learning rate is set there), `step`, `zero_grad`, and `reduce_and_clip`
    between backward and step."""

    PER_PARAM = False  # one parameter per bucket (loom/parallel/zero.py's sharded weights)

    def __init__(self, parts: list[nn.Module], cfg: Config, layout, compute_dtype: torch.dtype | None,
                 make_optimizer, seed: int | None = None):
        """`make_optimizer(param_groups)`: the optimizer over this rank's rows (the trainer's AdamW). `seed`: the
        parameters are `released` (loom/parallel/materialize.py: built with `rows_later`), and each rank draws
        its master rows from the seed, the values one process holds there (loom/models/init.py)."""
        p = cfg.parallel
        if seed is not None and not self.PER_PARAM:
            raise ValueError("drawn master rows (`seed`) are for sharded weights (loom/parallel/zero.py) only")
        self.dense = _Group(layout.submesh("dp_shard_cp" if p.cp > 1 else "dp_shard"), layout.grad_ranks)
        self.tp_size = layout.tp
        self.layout = layout
        self.dtype = compute_dtype or torch.float32
        self.last_micro_batch = False  # set by the SPMD runner per micro-batch; else reduced after backward
        # A pipeline stage runs each micro-batch's backward when its schedule says, with no runner call between
        # them: a parameter's gradient is complete when it has arrived once per micro-batch.
        self.arrivals_per_step = (cfg.train.global_batch // (layout.dp_size * cfg.train.micro_batch)
                                  if p.pp > 1 else 0)
        named, seen, owner = [], set(), {}
        for part in parts:
            for name, param in part.named_parameters():
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    named.append((name, param))
                    owner[id(param)] = part
        # Backward produces the last layers' gradients first: their buckets are reduced first.
        named.reverse()
        experts = [(n, q) for n, q in named if layout.ep > 1 and ".experts." in n]  # DTensors over ep
        dense = [(n, q) for n, q in named if not (layout.ep > 1 and ".experts." in n)]
        self.buckets = _layout_slots(dense, self.dense, self.tp_size, self.PER_PARAM)
        if experts:
            self.experts = _Group(layout.submesh("edp"), layout.grad_ranks, experts=True)
            self.buckets += _layout_slots(experts, self.experts, 1 if layout.experts_span_tp else self.tp_size,
                                          self.PER_PARAM)
        device = named[0][1].device
        self.device = device
        for bucket in self.buckets:
            n, rank = bucket.where.n, bucket.where.rank
            bucket.grad = None if self.PER_PARAM else torch.zeros(n, bucket.size, dtype=torch.float32, device=device)
            bucket.shard = torch.zeros(bucket.size, dtype=torch.float32, device=device)
            bucket.master = torch.zeros(bucket.size, dtype=torch.float32, device=device)
            for slot in bucket.slots:
                rows = slot.my_rows(rank)
                start = slot.offset
                shape = slot.piece_shape(rows)
                master = bucket.master[start:start + rows * slot.width].view(shape)
                grad = bucket.shard[start:start + rows * slot.width].view(shape)
                local = slot.local()
                if seed is not None:  # drawn: the parameter holds no values
                    _draw_rows(master, slot, rank * slot.per_rank, owner[id(slot.param)], seed)
                elif local.dim():
                    first = rank * slot.per_rank
                    master.copy_(local.narrow(slot.row_dim, min(first, slot.rows), rows))
                elif rows:
                    master.copy_(local.reshape(1))
                bucket.pieces.append((master, grad))
        # The weights in the compute dtype, every rank the same (each rank's rows from their owner).
        for _, param in named:
            if param.dtype != self.dtype and seed is None:  # (zero.py gives drawn ones their storage itself)
                if isinstance(param, DTensor):
                    param._local_tensor = param._local_tensor.to(self.dtype)
                else:
                    param.data = param.data.to(self.dtype)
        self._gather_weights()
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.param.register_post_accumulate_grad_hook(self._hook(bucket, slot))
        decay, no_decay = [], []
        self.piece_slot = {}
        o = cfg.optim
        for bucket in self.buckets:
            for slot, (master, grad) in zip(bucket.slots, bucket.pieces):
                master.grad = grad
                self.piece_slot[id(master)] = (slot, bucket.where)
                (no_decay if slot.param.dim() < 2 and not o.decay_norms_and_biases else decay).append(master)
        groups = [{"params": decay, "weight_decay": o.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        self.inner = make_optimizer(groups)  # AdamW over the rows (loom.train.optim.optimizer_for_groups)
        moment_dtype = torch.bfloat16 if o.state_dtype == "bfloat16" else torch.float32
        step_device = device if o.state_dtype != "bfloat16" and device.type in ("cpu", "cuda") else "cpu"
        for group in self.inner.param_groups:  # moments exist from the start: a checkpoint loads into them
            for piece in group["params"]:
                self.inner.state[piece] = {"step": torch.zeros((), dtype=torch.float32, device=step_device),
                                           "exp_avg": torch.zeros_like(piece, dtype=moment_dtype),
                                           "exp_avg_sq": torch.zeros_like(piece, dtype=moment_dtype)}
        for part in parts:
            part._loom_distopt = self
        self.fused_gemm = fused_out_dtype_works(device)
        self.fused_linears = self._fuse_linears(parts) if cfg.parallel.distopt_fused_wgrad else 0
        # The chunked loss's untied LM head: its weight gradient written into the buffer (loom/parallel/headgrad.py)
        self.head_grad = attach_head(self, parts) if cfg.parallel.distopt_fused_wgrad else None

    # -- backward ------------------------------------------------------------------------------------------

    def _hook(self, bucket: _Bucket, slot: _Slot):
        def accumulate(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:  # a fused linear's weight: `LinearIntoBuffer` put its gradient in the buffer
                return
            if isinstance(grad, DTensor):
                if grad.placements != param.placements:
                    grad = grad.redistribute(placements=param.placements)
                grad = grad._local_tensor
            # The step's first gradient is copied in (no zeroed buffer to read), later micro-batches' added.
            for dst, src in _matching(self._grad_buffer(bucket), grad.reshape(-1), slot):
                dst.add_(src) if slot.filled else dst.copy_(src)
            param.grad = None
            self._arrived(bucket, slot)
        return accumulate

    def _arrived(self, bucket: _Bucket, slot: _Slot) -> None:
        """`slot`'s gradient of this micro-batch is in the buffer: on the last micro-batch, a complete bucket is
        reduced at once (its reduce-scatter overlaps the rest of backward)."""
        slot.filled = True
        slot.arrivals += 1
        if self.last_micro_batch or slot.arrivals == self.arrivals_per_step:
            bucket.ready += 1
            if bucket.ready == len(bucket.slots):
                self._reduce(bucket)

    def _into_buffer(self, bucket: _Bucket, slot: _Slot):
        """For `LinearIntoBuffer`: the weight gradient dy^T x of one micro-batch, each rank's rows straight into
        their place in the fp32 buffer (one product per rank; on CUDA with 16-bit inputs inside the GEMM,
        `out_dtype`; elsewhere computed, then copied or added)."""
        def into(dy: torch.Tensor, x: torch.Tensor) -> None:
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
            for r in range(bucket.where.n):
                rows = slot.my_rows(r)
                if not rows:
                    break
                seg = self._grad_buffer(bucket)[r, slot.offset:slot.offset + rows * slot.width].view(rows, slot.width)
                a = dy2[:, r * slot.per_rank:r * slot.per_rank + rows].t()
                if self.fused_gemm:
                    torch.addmm(seg, a, x2, beta=1 if slot.filled else 0, out_dtype=torch.float32, out=seg)
                elif slot.filled:
                    seg.add_(a @ x2)
                else:
                    seg.copy_(a @ x2)
            self._arrived(bucket, slot)
        return into

    def _fuse_linears(self, parts: list[nn.Module]) -> int:
        """Route the weight gradients of the blocks' dense linear layers (attention, MLP; this optimizer's, not
        fp8; biased ones where the weight is a plain tensor, not a tensor-parallel shard) through
        `LinearIntoBuffer`. Returns how many."""
        from loom.models.llama import FeedForward

        where = {id(slot.param): (bucket, slot) for bucket in self.buckets for slot in bucket.slots
                 if not bucket.where.experts}
        count = 0
        for part in parts:
            for block in getattr(part, "layers", {}).values():
                linears = [block.attention.wq, block.attention.wk, block.attention.wv, block.attention.wo]
                if isinstance(block.feed_forward, FeedForward):
                    linears += [m for m in (block.feed_forward.w1, block.feed_forward.w2, block.feed_forward.w3) if m]
                for module in linears:
                    if type(module) is not nn.Linear or id(module.weight) not in where or (
                            module.bias is not None and isinstance(module.weight, DTensor)):
                        continue
                    into = self._into_buffer(*where[id(module.weight)])
                    with torch.enable_grad():
                        node = module.weight.view_as(module.weight).grad_fn.next_functions[0][0]
                    module.forward = (lambda m, f, a: lambda x: LinearIntoBuffer.apply(x, m.weight, m.bias, f, a))(
                        module, into, node)
                    count += 1
        return count

    def _grad_buffer(self, bucket: _Bucket) -> torch.Tensor:
        """The bucket's `[n, S]` fp32 gradient buffer."""
        return bucket.grad

    def _reduce(self, bucket: _Bucket) -> None:
        if bucket.work is None:
            for slot in bucket.slots:
                if not slot.filled:  # no gradient this step: zero, not the last step's
                    _rank_major(bucket.grad, slot).zero_()
            bucket.work = dist.reduce_scatter_tensor(bucket.shard, bucket.grad.view(-1), group=bucket.where.group,
                                                     async_op=True)

    def reduce_and_clip(self, max_norm: float) -> torch.Tensor:
        """Finish the reduce-scatters (a bucket whose parameters got no gradient this step is reduced now),
        average over the group, and clip this rank's rows to `max_norm` (0: no clipping) by the global norm:
        squares summed over every rank, a tensor-parallel replica's counted once. Returns the norm."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        self._finish_reduction()
        for bucket in self.buckets:
            bucket.shard.div_(bucket.where.divide)  # the mean over dp x cp (experts: summed over edp)
            for slot, (_, grad) in zip(bucket.slots, bucket.pieces):
                if grad.numel():
                    squares += grad.float().square().sum() / slot.replicas
        dist.all_reduce(squares)  # every rank: the group's rows, the tensor-parallel shards, pipeline stages
        norm = squares.sqrt()
        if max_norm > 0:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for bucket in self.buckets:
                bucket.shard.mul_(coef)
        return norm

    def micro_batch_starts(self) -> None:
        """Before each micro-batch (nothing here; sharded weights collect the last one's reductions)."""

    def _finish_reduction(self) -> None:
        """Every bucket's reduce-scatter done: each rank holds the sum of its rows in `shard`."""
        for bucket in self.buckets:
            self._reduce(bucket)
            bucket.work.wait()
            bucket.work, bucket.ready = None, 0

    # -- the optimizer's interface ----------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        self._gather_weights()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The next step's first gradients overwrite the buffer (nothing is zeroed)."""
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.filled, slot.arrivals = False, 0

    @torch.no_grad()
    def _gather_weights(self) -> None:
        """Every rank's rows of the master weights, in the compute dtype, into the parameters."""
        for bucket in self.buckets:
            n = bucket.where.n
            send = bucket.master.to(self.dtype)
            out = torch.empty(n * bucket.size, dtype=self.dtype, device=self.device)
            dist.all_gather_into_tensor(out, send, group=bucket.where.group)
            out = out.view(n, bucket.size)
            for slot in bucket.slots:
                for src, dst in _matching(out, slot.local().view(-1), slot):
                    dst.copy_(src)

    # -- checkpoints ---------------------------------------------------------------------------------------------

    def _dtensor(self, slot: _Slot, local: torch.Tensor, where: _Group) -> DTensor:
        """This rank's rows of `slot` (master or moment) as the DTensor an FSDP run saves for the parameter."""
        from torch.distributed.tensor.placement_types import _StridedShard

        p = slot.param
        if where.experts:  # FSDP2's 2-D (edp, ep) DTensor: ep's experts, then edp's rows of them (a rank's one
            mesh = self.layout.flattened["edp_ep"]  # expert: edp's rows of its second dimension, as FSDP splits it)
            rows = Shard(1) if slot.row_dim == 1 else _StridedShard(0, split_factor=self.layout.ep)
            placements = (rows, Shard(0))
            return DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape, stride=p.stride())
        if isinstance(p, DTensor) and self.tp_size > 1:
            mesh = self.layout.mesh[("dp_shard_cp" if self.layout.cp > 1 else "dp_shard", "tp")]
            tp_place = p.placements[0]
            if isinstance(tp_place, Shard) and tp_place.dim == 0:
                placements = (_StridedShard(0, split_factor=self.tp_size), tp_place)
            else:
                placements = (Shard(0), tp_place)
            shape, stride = p.shape, p.stride()
        else:
            mesh, placements = self.dense.mesh, (Shard(slot.row_dim),)
            shape = slot.local().shape
            stride = slot.local().stride()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    def state_dicts(self, model_state: dict, names: dict) -> tuple[dict, dict]:
        """The checkpoint's {"model": ..., "optim": ...} as FSDP's get_state_dict writes them (flattened
        optimizer state): `model_state` is the model's own state dict, whose entries for the trained
        parameters (`names`: parameter -> its state-dict key) are replaced by the fp32 master rows. The returned
        tensors are views: loading a checkpoint into them fills the master weights and moments in place."""
        model_out = dict(model_state)
        optim = {}
        for group in self.inner.param_groups:
            for piece in group["params"]:
                slot, where = self.piece_slot[id(piece)]
                key = names[id(slot.param)]
                model_out[key] = self._dtensor(slot, piece, where)
                state = self.inner.state[piece]
                optim[f"state.{key}.step"] = state["step"]
                optim[f"state.{key}.exp_avg"] = self._dtensor(slot, state["exp_avg"], where)
                optim[f"state.{key}.exp_avg_sq"] = self._dtensor(slot, state["exp_avg_sq"], where)
                for k, v in group.items():
                    if k != "params":
                        optim[f"param_groups.{key}.{k}"] = {"fused": None, "foreach": True}.get(k, v)
        return model_out, optim

    @torch.no_grad()
    def loaded(self) -> None:
        """After a checkpoint was loaded into `state_dicts`' views: the weights from the new master rows, and
        one step count for every piece."""
        steps = [s["step"] for s in self.inner.state.values()]
        top = max(float(s) for s in steps) if steps else 0.0
        for s in steps:
            s.fill_(top)
        self._gather_weights()

