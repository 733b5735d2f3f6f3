"""Mixture-of-experts feed-forward in plain PyTorch: a router, stacked experts, shared experts.

One MoE layer replaces a block's MLP. Per token the router picks `top_k` of `experts` routed experts
(and gives each a gate weight); the token's output is the gate-weighted sum of those experts' outputs
plus the always-on shared experts' output (Qwen2-MoE, DeepSeek). The computation goes in stages, so that
expert parallelism can slot a token exchange between "dispatch" and "compute" without touching the rest:

    route     logits [T, E] -> chosen experts [T, k], gate weights [T, k]
    dispatch  capacity (optional dropping), then the kept (token, expert) pairs sorted expert-major:
              `token[i]` is the token of row i, `counts[e]` the rows of expert e (contiguous)
    compute   `GroupedExperts(x[token], counts)`: one grouped matrix multiply per weight (CUDA, Hopper,
              bf16) or one matmul per expert on its rows (CPU, fp32, meta)
    combine   rows scaled by their gates and summed back into their tokens (`index_put` accumulating)

SwiGLU experts take each row's gate into their activation (loom/models/swiglu.py's `weighted_swiglu`), with or
without expert parallelism (whose exchange carries the gates with the rows), so the combine only sums: nothing
keeps the experts' outputs for the gates' gradient. Rows are scattered with `index_put`, whose backward keeps
only the indices; `index_copy` and `index_add` keep their source as well (for its shape), one row of the hidden
width per routed row each, which eager experts (between expert parallelism's all-to-alls) would hold to backward.

Routers (`model.moe.router`):
- `softmax`: softmax over all experts, top-k, optionally renormalised over the chosen k (Mixtral does).
- `sinkhorn` (S-BASE): in training, the experts are chosen from Sinkhorn-balanced scores (`sinkhorn`),
  the gate comes from the original logits (sigmoid for k = 1, softmax otherwise); in evaluation, plain
  top-k of those gates.
- `sigmoid_bias` (DeepSeek-V3, auxiliary-loss-free balancing): sigmoid scores; a per-expert bias, used
  only to choose experts, moves by `rate * sign(mean load - load)` after every optimizer step
  (`update_router_biases`, with the loads of every micro-batch of the step summed over the data-parallel
  ranks by `step_stats`). The bias is a persistent fp32 buffer, so checkpoints hold it.

Auxiliary losses (Switch load balancing, router z-loss), weighted by their coefficients, join the training
loss through `AuxLoss`: their gradient is injected in backward, scaled by `aux_grad_scale` (the runner's
1 / micro-batches), so the step trains on their mean over micro-batches (and, through the data-parallel
gradient average, over ranks). Each training forward also records, outside autograd, the tokens routed to
each expert, the assignments dropped and the unweighted loss values; `step_stats` sums them over the step's
micro-batches and the data-parallel ranks (one all-reduce) for metrics.jsonl and the bias update. A forward
recomputed in backward (activation checkpointing) or run without gradients (evaluation) records nothing.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from loom.config import ModelConfig
from loom.models.routing import load_balance_loss, sinkhorn, z_loss
from loom.models.swiglu import swiglu, weighted_swiglu


class AuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; in backward, gives `aux` (a scalar, already weighted by its coefficient) the
    gradient `scale`, so the auxiliary loss is trained without passing through the model's loss function
    (Megatron-Core does the same)."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        shape, dtype = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=grad.device), None


_RECORDING = [True]  # False inside `statistics_off`


@contextlib.contextmanager
def statistics_off():
    """Training forwards inside this context record no routing statistics: a pipeline schedule's metadata
    inference runs each stage once (on its first micro-batch, or on uninitialised tensors of the right
    shape) before the step's real forwards."""
    _RECORDING[0] = False
    try:
        yield
    finally:
        _RECORDING[0] = True


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation recomputation re-runs forward there). Never in a
    compiled block: its recomputation is part of the compiled backward graph, which runs no Python."""
    return not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of `experts` (int64, any shape) name each expert: [num_experts] int64. `bincount` with a
    static output size (its own has a data-dependent one, which would cut a compiled block)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def _local(w):
    """A parameter as a plain tensor: a DTensor's local part (differentiable; under tensor parallelism the
    router and experts are replicated DTensors, under expert parallelism the experts are sharded ones)."""
    return w.to_local() if isinstance(w, DTensor) else w


class Router(nn.Module):
    """Chooses experts: returns (experts [T, k] int64, gates [T, k] fp32, probabilities for the balance
    loss [T, E], logits [T, E] fp32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.moe.router
        self.top_k = cfg.moe.top_k
        self.renormalize = cfg.moe.renormalize
        self.weight = nn.Parameter(torch.empty(cfg.moe.experts, cfg.hidden))
        # DeepSeek-V3's selection bias (sigmoid_bias only): state, checkpointed, updated outside autograd.
        self.register_buffer("expert_bias", torch.zeros(cfg.moe.experts) if self.kind == "sigmoid_bias" else None)

    def forward(self, x: torch.Tensor, shards=None, token_mesh=None):
        """`shards`: the MoE layer's `token_shards` (Sinkhorn balances over all of their tokens), or None.
        `token_mesh`: the MoE layer's `token_mesh` (this rank's tokens are one shard of its ranks' tokens, the
        weight replicated over it), or None."""
        off = torch.autocast(x.device.type, enabled=False) if x.device.type != "meta" else contextlib.nullcontext()
        with off:  # routing in fp32 whatever the activations
            if token_mesh is not None:  # as a DTensor, so that the weight's gradient sums over the token shards
                rows = DTensor.from_local(x.float(), token_mesh, [Shard(0)], run_check=False)
                logits = F.linear(rows, self.weight.float()).to_local()
            else:
                logits = F.linear(x.float(), _local(self.weight).float())
        k = self.top_k
        if self.kind == "sigmoid_bias":
            scores = torch.sigmoid(logits)
            with torch.no_grad():
                chosen = (scores + self.expert_bias).topk(k, dim=-1).indices
            gates = scores.gather(-1, chosen)
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            probs = torch.softmax(logits, dim=-1)
            # S-BASE gates a single expert with a sigmoid (a softmax over one choice would be 1).
            gate_scores = torch.sigmoid(logits) if self.kind == "sinkhorn" and k == 1 else probs
            if self.kind == "sinkhorn" and self.training:
                with torch.no_grad():
                    if shards is None:
                        chosen = sinkhorn(logits).topk(k, dim=-1).indices
                    else:  # balanced over the tokens of every shard; this rank's rows kept
                        t = logits.shape[0]
                        scores = sinkhorn(shards.gather(logits))[shards.rank * t:(shards.rank + 1) * t]
                        chosen = scores.topk(k, dim=-1).indices
                gates = gate_scores.gather(-1, chosen)
            else:
                gates, chosen = gate_scores.topk(k, dim=-1)
        if self.renormalize and k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        return chosen, gates, probs, logits

    def reset_buffers(self) -> None:
        if self.expert_bias is not None:  # fp32 whatever the model's dtype: steps of 1e-3 must not round away
            self.expert_bias = torch.zeros(self.expert_bias.shape, dtype=torch.float32, device=self.expert_bias.device)


class GroupedExperts(nn.Module):
    """`experts` MLPs stored stacked: w1, w3 [E, hidden, ffn] and w2 [E, ffn, hidden] (SwiGLU; GELU has no w3).

    `forward(x, counts)` takes rows sorted expert-major (`counts[e]` rows for expert e, in order) and returns
    each row through its expert. Under expert parallelism the weights are DTensors holding this rank's slice
    [E/ep, ...] (loom/parallel/expert.py), called on the rows the rank received: it computes with their
    local parts (`_weights`), with `counts` per local expert.
    """

    def __init__(self, experts: int, hidden: int, ffn: int, gated: bool):
        super().__init__()
        self.gated = gated
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, ffn)) if gated else None

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        """`grouped`: force (True) or forbid (False) `torch._grouped_mm`; None picks it where it is fast. In a
        compiled block the grouped path is traced whole (static shapes); the loop runs eagerly. `gate` (SwiGLU
        only): each row's fp32 gate weight, folded into the activation (loom/models/swiglu.py), so the output
        rows come weighted and nothing keeps them for the gate's gradient."""
        if grouped is None:
            grouped = use_grouped_mm(x)
        return self._grouped(x, counts, gate) if grouped else self._looped(x, counts, gate)

    def _weights(self) -> tuple:
        """(w1, w2, w3) as plain tensors: a DTensor's local part (differentiable), else the parameter."""
        return tuple(_local(w) for w in (self.w1, self.w2, self.w3))

    def _mlp(self, x, w1, w2, w3, mm, gate=None):
        if gate is not None:
            h = weighted_swiglu(mm(x, w1), mm(x, w3), gate)
        else:  # (swiglu keeps its two inputs, not silu's output too)
            h = swiglu(mm(x, w1), mm(x, w3)) if self.gated else F.gelu(mm(x, w1))
        return mm(h, w2)

    @torch.compiler.disable  # sizes read on the host: eager in a compiled block (one graph break, no recompiles)
    def _looped(self, x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """One matmul per expert on its contiguous rows. Every expert runs, an empty one on zero rows, so
        every weight gets a (zero) gradient; `unbind` makes backward stack the experts' gradients once."""
        w1, w2, w3 = self._weights()
        e = w1.shape[0]
        if x.device.type == "meta":  # shapes only (loom memory): the rows spread evenly, as on average
            n = x.shape[0]
            sizes = [n // e + (1 if i < n % e else 0) for i in range(e)]
        else:
            sizes = counts.tolist()
        w3 = w3.unbind(0) if self.gated else [None] * e
        gates = torch.split(gate, sizes) if gate is not None else [None] * e
        outs = [self._mlp(part, w1_, w2_, w3_, torch.matmul, g)
                for part, w1_, w2_, w3_, g in zip(torch.split(x, sizes), w1.unbind(0), w2.unbind(0), w3, gates)]
        return torch.cat(outs)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """`torch._grouped_mm` over the experts' row groups, with no host synchronisation. Every group is
        padded with zero rows to a multiple of 16, and an empty group to 16 rows: `_grouped_mm`'s backward
        hangs on an empty group (Hopper, PyTorch 2.8-2.10) and its kernels expect 16-row alignment. The
        buffer has a static size (rows + 16 x experts); the last group runs to its end, so no row is left
        outside a group (the kernel leaves such rows uninitialised)."""
        align = 16
        dtype = torch.get_autocast_dtype("cuda") if x.is_cuda and torch.is_autocast_enabled("cuda") else x.dtype
        e, n = counts.shape[0], x.shape[0]
        padded = (counts.clamp(min=1) + align - 1) // align * align
        starts = torch.cumsum(padded, 0) - padded
        row_expert = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=n)
        first_row = torch.cumsum(counts, 0) - counts
        dest = starts[row_expert] + torch.arange(n, device=x.device) - first_row[row_expert]
        capacity = n + e * align  # >= the padded rows
        # Allocated flat, then viewed: in a compiled block a [capacity, h] zero tensor is merged with the one the
        # backward of `y[dest]` below creates (same shape), and inductor then saves it for backward, e*h bytes a
        # padded row; a flat one is not merged and not saved (tests/test_plan_moe_memory.py). Same values.
        h = x.shape[1]
        # (`index_put`, not `index_copy`: its backward keeps the indices, not the rows as well)
        xp = x.new_zeros(capacity * h, dtype=dtype).view(capacity, h).index_put((dest,), x.to(dtype))
        offs = torch.cat([(starts + padded)[:-1], starts.new_full((1,), capacity)]).to(torch.int32)
        w1, w2, w3 = self._weights()
        w3 = w3.to(dtype) if self.gated else None
        gp = None if gate is None else gate.new_zeros(capacity).index_put((dest,), gate)  # padding rows: 0
        y = self._mlp(xp, w1.to(dtype), w2.to(dtype), w3,
                      lambda a, w: torch._grouped_mm(a, w, offs=offs), gp)
        return y[dest]


def use_grouped_mm(x: torch.Tensor) -> bool:
    """PyTorch's grouped GEMM where it is fast: CUDA, compute capability 9.0+, bf16 (or bf16 autocast)."""
    if not x.is_cuda:
        return False
    autocast_bf16 = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
    return grouped_mm_wanted(torch.cuda.get_device_capability(x.device), x.dtype, autocast_bf16)


def grouped_mm_wanted(capability: tuple[int, int], dtype: torch.dtype, autocast_bf16: bool) -> bool:
    """The decision of `use_grouped_mm` for a CUDA tensor, apart from the device (tested on CPU): Hopper or
    newer, and the experts' products run in bf16 (the tensor's dtype or CUDA autocast)."""
    return capability[0] >= 9 and (dtype == torch.bfloat16 or autocast_bf16)


class MoE(nn.Module):
    """A mixture-of-experts MLP: router, routed experts (stacked), optional shared experts."""

    def __init__(self, cfg: ModelConfig, shared: nn.Module | None = None):
        """`shared`: the always-on shared experts as one MLP (model.moe.shared_experts x moe.ffn_hidden wide),
        built by the caller (loom/models/llama.py's FeedForward), or None."""
        super().__init__()
        self.num_experts, self.top_k = cfg.moe.experts, cfg.moe.top_k
        self.capacity_factor = cfg.moe.capacity_factor
        self.drop_policy = cfg.moe.drop_policy
        self.balance = cfg.moe.load_balance
        self.balance_coeff, self.z_coeff = cfg.moe.load_balance_coeff, cfg.moe.z_loss_coeff
        self.bias_rate = cfg.moe.bias_update_rate
        ffn = cfg.moe.ffn_hidden or cfg.ffn_hidden
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.moe.experts, cfg.hidden, ffn, cfg.mlp == "swiglu")
        self.shared = shared
        self.shared_gate = nn.Linear(cfg.hidden, 1, bias=False) if shared is not None and cfg.moe.shared_gate else None
        self.aux_grad_scale = 1.0  # the runner sets 1 / micro-batches per optimizer step
        # Expert parallelism (loom/parallel/expert.py) installs its token exchange here: called as
        # `expert_parallel(experts, rows, counts, gate=...)` in place of `experts(rows, counts, gate=...)`.
        self.expert_parallel = None
        # Context parallelism (loom/parallel/context.py) installs the group holding the other tokens of the
        # same sequences: `sum(t)` (differentiable) and `gather(t)` over it, `size`, `rank`. The balance loss
        # and Sinkhorn then cover whole sequences.
        self.token_shards = None
        # Tensor parallelism with sequence parallelism and experts spread over the tp ranks
        # (loom/parallel/tensor.py, loom.rules.experts_span_tp) installs the tp mesh: each of its ranks routes
        # its own sequence shard (no rank computes another's tokens), the router's replicated weight computes
        # as a DTensor on it (its gradient sums over the ranks), and the auxiliary losses' gradient is divided
        # by its size: each rank's z-loss is a mean over its 1/tp of the tokens, and the balance loss, summed
        # over `token_shards`, sends every rank's gradient to every rank, so both weigh a token tp times.
        self.token_mesh = None
        # Since the last `step_stats`: [tokens routed to each expert (E), assignments dropped, assignments,
        # balance loss sum, z-loss sum, training forwards]; None before the first training forward.
        self.stats: torch.Tensor | None = None

    # --- stages -------------------------------------------------------------------------------------

    def dispatch(self, chosen: torch.Tensor, gates: torch.Tensor, seq_len: int | None = None):
        """Sort the (token, expert) pairs expert-major, dropping what exceeds the capacity.

        Returns (token [N], gate [N], counts [E]): row i of the permuted input is token `token[i]`, to be
        weighted by `gate[i]`; the rows of expert e are contiguous, `counts[e]` of them, in token order.
        With `model.moe.capacity_factor` c > 0 each expert keeps at most ceil(c * T * k / E) assignments:
        those with the highest gates (`drop_policy=probs`) or the earliest positions in their sequences
        (`position`: position 0 of every sequence first, as Megatron-Core's sequence-major order does;
        `seq_len` is the sequence length of the [batch * seq] tokens)."""
        tokens, k = chosen.shape
        e = self.num_experts
        flat_expert, flat_gate = chosen.reshape(-1), gates.reshape(-1)
        if chosen.device.type == "meta":  # shapes only (loom memory): nothing dropped
            return torch.arange(tokens * k, device="meta") // k, flat_gate, torch.zeros(e, dtype=torch.long,
                                                                                       device="meta")
        order = torch.argsort(flat_expert, stable=True)  # expert-major, token order within an expert
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * tokens * k / e)
            index = torch.arange(tokens * k, device=chosen.device)
            if self.drop_policy == "probs":
                priority = -flat_gate.detach()  # highest gate first; ties: earlier token
            else:
                position = index // k % (seq_len or tokens)
                priority = position * (tokens * k) + index  # earliest position first, then batch order
            by_priority = torch.argsort(priority, stable=True)
            ranked = by_priority[torch.argsort(flat_expert[by_priority], stable=True)]  # expert-major
            counts_all = expert_counts(flat_expert, e)
            group_start = torch.cumsum(counts_all, 0) - counts_all
            rank_in_expert = index - group_start[flat_expert[ranked]]
            kept = ranked[rank_in_expert < capacity]
            order = kept[torch.argsort(flat_expert[kept] * (tokens * k) + kept)]  # expert, then token
        counts = expert_counts(flat_expert[order], e)
        return order // k, flat_gate[order], counts

    def combine(self, y: torch.Tensor, token: torch.Tensor, gate: torch.Tensor, tokens: int) -> torch.Tensor:
        # Allocated flat, then viewed, as in `GroupedExperts._grouped`: a [tokens, h] zero tensor would be merged
        # with the one the backward of the dispatch's `flat[token]` creates, and saved, e*h bytes a token.
        # (`index_put` accumulating, not `index_add`: its backward keeps the indices, not the rows as well)
        h = y.shape[-1]
        out = y.new_zeros(tokens * h).view(tokens, h)
        return out.index_put((token,), y if gate is None else y * gate[:, None].to(y.dtype), accumulate=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        chosen, gates, probs, logits = self.router(flat, self.token_shards, self.token_mesh)
        token, gate, counts = self.dispatch(chosen, gates, shape[-2] if x.dim() == 3 else None)
        folded = self.experts.gated  # SwiGLU experts weigh their rows themselves (the gate in the activation)
        if self.expert_parallel is None:
            y = self.experts(flat[token], counts, gate=gate if folded else None)
        else:  # rows (and their gates) sent to the ranks holding their experts, computed there and returned
            y = self.expert_parallel(self.experts, flat[token], counts, gate=gate if folded else None)
        out = self.combine(y, token, None if folded else gate, flat.shape[0])
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        out = out.view(shape)
        if self.training and torch.is_grad_enabled():
            out = self._aux(out, chosen, probs, logits, shape, kept=token.shape[0])
        return out

    def _aux(self, out, chosen, probs, logits, shape, kept: int):
        e = self.num_experts
        if self.balance == "sequence" and len(shape) == 3:
            b, s = shape[0], shape[1]
            balance = load_balance_loss(chosen.view(b, s, -1), probs.view(b, s, e), e, self.token_shards)
        else:
            balance = load_balance_loss(chosen, probs, e, self.token_shards)
        z = z_loss(logits)
        # A recomputed forward is not counted twice; a pipeline's shape inference not at all.
        if _RECORDING[0] and not _in_backward() and chosen.device.type != "meta":
            load = expert_counts(chosen, e).float()
            n = chosen.numel()
            rest = torch.stack([torch.tensor(float(n - kept), device=load.device), torch.tensor(float(n),
                                device=load.device), balance.detach().float(), z.detach().float(),
                                torch.ones((), device=load.device)])
            stats = torch.cat([load, rest])
            self.stats = stats if self.stats is None else self.stats + stats
        if self.balance_coeff == 0 and self.z_coeff == 0:
            return out
        aux = self.balance_coeff * balance + self.z_coeff * z
        share = self.token_mesh.size() if self.token_mesh is not None else 1
        return AuxLoss.apply(out, aux, self.aux_grad_scale / share)

    def reset_buffers(self) -> None:
        self.router.reset_buffers()


# --- what the runner and the trainer call ------------------------------------------------------------


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    for m in moe_layers(model):
        m.aux_grad_scale = scale


def _slots(model: nn.Module) -> tuple[int, list[tuple[int, MoE]]]:
    """(rows, [(row, layer)]): one row per MoE layer of the whole model when `model` is a model or a pipeline
    stage (its `layers` named by their index in the whole model, `cfg` the whole model's), so that the rows of
    different stages line up in a sum over ranks (a stage leaves the other stages' rows at zero); else (a
    bare MoE module) one row per MoE layer it holds."""
    cfg, layers = getattr(model, "cfg", None), getattr(model, "layers", None)
    if cfg is None or not isinstance(layers, nn.ModuleDict):
        found = moe_layers(model)
        return len(found), list(enumerate(found))
    row = {i: j for j, i in enumerate(i for i in range(cfg.layers) if cfg.is_moe_layer(i))}
    return len(row), [(row[int(name)], m) for name, block in layers.items() for m in moe_layers(block)]


def step_stats(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """What the MoE layers recorded since the last call (every training micro-batch of the step) on this rank;
    resets it. The trainer sums `take_stats` over all ranks in the step's one all-reduce instead.

    That sum may span the whole world under any layout: pipeline stages fill disjoint rows (one per MoE layer
    of the whole model, `_slots`); data- and context-parallel ranks (and sequence shards, and tensor-parallel
    ranks routing their own tokens under `token_mesh`) add their tokens; ranks that compute the same tokens
    (tensor-parallel replicas) multiply every count and sum alike, which the metrics below and the bias
    update's sign rule do not see (all are ratios or signs).

    Returns (metrics, loads): metrics as device tensors (the trainer moves them to the host with the loss):
    `moe_load_balance_loss` and `moe_z_loss` (unweighted, mean over layers and micro-batches),
    `moe_imbalance` and `moe_imbalance_max` (tokens of the busiest expert over the mean, mean and worst
    over layers), `moe_dropped` (fraction of assignments dropped by the capacity); loads [E] per MoE layer
    of the whole model: the tokens routed to each expert. Nothing (and no collective) for a dense model.
    """
    stats = take_stats(model)
    return ({}, []) if stats is None else stats_metrics(stats)


def take_stats(model: nn.Module) -> torch.Tensor | None:
    """This rank's routing records since the last call, one row per MoE layer of the whole model ([layers,
    experts + 5], zero rows for layers on other pipeline stages); resets them. None for a dense model. The
    trainer sums them over the ranks in the step's one all-reduce, then reads them with `stats_metrics`."""
    n, slots = _slots(model)
    if not n:
        return None
    e = next(m for _, m in slots).num_experts if slots else model.cfg.moe.experts
    device = next(model.parameters()).device
    stats = torch.zeros(n, e + 5, device=device)
    for row, m in slots:
        if m.stats is not None:
            stats[row] = m.stats.to(device)
        m.stats = None
    return stats


def stats_metrics(stats: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """(metrics, loads) of routing records summed over the ranks (`step_stats`)."""
    e = stats.shape[1] - 5
    load = stats[:, :e]
    dropped, assigned, balance, z, forwards = stats[:, e:].unbind(1)
    forwards = forwards.clamp(min=1)
    imbalance = load.max(1).values / load.mean(1).clamp(min=1e-9)
    metrics = {
        "moe_load_balance_loss": (balance / forwards).mean(),
        "moe_z_loss": (z / forwards).mean(),
        "moe_imbalance": imbalance.mean(),
        "moe_imbalance_max": imbalance.max(),
        "moe_dropped": dropped.sum() / assigned.sum().clamp(min=1),
    }
    return metrics, list(load)


@torch.no_grad()
def update_router_biases(model: nn.Module, loads: list[torch.Tensor]) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, once per optimizer step: each sigmoid_bias router's bias
    moves by rate * sign(mean load - load) (an under-used expert becomes more likely to be chosen), with
    `loads` from `step_stats` (every micro-batch of the step, summed over the ranks; one per MoE layer of
    the whole model, of which a pipeline stage updates its own)."""
    for row, m in _slots(model)[1]:
        bias, load = m.router.expert_bias, loads[row]
        if bias is not None:
            bias.add_(m.bias_rate * torch.sign(load.mean() - load).to(bias.device, bias.dtype))
