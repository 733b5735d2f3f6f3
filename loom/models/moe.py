"""Mixture-of-experts feed-forward in plain PyTorch: a router, stacked experts, shared experts.

One MoE layer replaces a block's MLP. Per token the router picks `top_k` of `experts` routed experts
(and gives each a gate weight); the token's output is the gate-weighted sum of those experts' outputs
plus the always-on shared experts' output (Qwen2-MoE, DeepSeek). The computation goes in stages, so that
expert parallelism can slot a token exchange between "permute" and "compute" without touching the rest:

    route     logits [T, E] -> chosen experts [T, k], gate weights [T, k], auxiliary losses
    dispatch  capacity (optional dropping), then the kept (token, expert) pairs sorted expert-major:
              `token[i]` is the token of row i, `counts[e]` the rows of expert e (contiguous)
    compute   `GroupedExperts(x[token], counts)`: one grouped matrix multiply per weight (CUDA, bf16) or a
              loop over the experts' contiguous row ranges (CPU, fp32, meta)
    combine   rows scaled by their gates and summed back into their tokens (index_add)

Routers (`model.moe.router`):
- `softmax`: softmax over all experts, top-k, optionally renormalised over the chosen k (Mixtral does).
- `sinkhorn` (S-BASE): in training, the experts are chosen from Sinkhorn-balanced scores (`sinkhorn`),
  the gate comes from the original logits (sigmoid for k = 1, softmax otherwise); in evaluation, plain
  top-k of the logits.
- `sigmoid_bias` (DeepSeek-V3, auxiliary-loss-free balancing): sigmoid scores; a per-expert bias, used
  only to choose experts, moves by `rate * sign(mean load - load)` after every optimizer step
  (`update_router_biases`, called by the trainer once per step with the data-parallel group). The bias is
  a persistent buffer, so checkpoints hold it.

Auxiliary losses, weighted by their coefficients, join the training loss through `AuxLoss` (their
gradient is injected in backward, scaled by `aux_grad_scale`, the runner's 1 / micro-batches), and
their unweighted values are recorded for metrics (`moe_metrics`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig


def sinkhorn(logits: torch.Tensor, tol: float = 1e-4, max_iters: int = 1000) -> torch.Tensor:
    """Sinkhorn balancing of router logits [T, E] in fp32, as Megatron-Core's S-BASE router does.

    Scales the rows and columns of exp(logits) alternately until the column scaling changes by less than
    `tol` (mean absolute change): the result's columns each sum to 1/E exactly (the last scaling) and its
    rows to 1/T up to the tolerance, i.e. every expert gets the same share of the tokens.
    """
    cost = torch.exp(logits.detach().float() - logits.detach().float().max())  # a constant factor cancels
    t, e = cost.shape
    eps = 1e-8
    d0 = torch.ones(t, dtype=cost.dtype, device=cost.device)
    d1 = torch.ones(e, dtype=cost.dtype, device=cost.device)
    if cost.device.type == "meta":  # shapes only (loom memory)
        return cost
    for _ in range(max_iters):
        d0 = (1.0 / t) / ((cost * d1).sum(1) + eps)
        d1_new = (1.0 / e) / ((cost * d0[:, None]).sum(0) + eps)
        err = (d1_new - d1).abs().mean()
        d1 = d1_new
        if err.item() <= tol:
            break
    return cost * d0[:, None] * d1


class AuxLoss(torch.autograd.Function):
    """Returns `out` unchanged; in backward, gives `aux` (a scalar, already weighted by its coefficient) the
    gradient `scale`, so the auxiliary loss is trained without passing through the model's loss function
    (Megatron-Core does the same). `scale` is 1 / micro-batches per step: each micro-batch's auxiliary loss
    counts once in the step's mean."""

    @staticmethod
    def forward(ctx, out, aux, scale: float):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        shape, dtype = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=grad.device), None


def _in_backward() -> bool:
    """True while autograd runs a backward pass (activation recomputation re-runs forward there)."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    """Chooses experts: returns (experts [T, k] int64, gates [T, k], scores for the balance loss [T, E],
    logits [T, E] fp32)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.moe_router
        self.top_k = cfg.moe_top_k
        self.renormalize = cfg.moe_renormalize
        self.experts = cfg.moe_experts
        self.weight = nn.Parameter(torch.empty(cfg.moe_experts, cfg.hidden))
        # DeepSeek-V3's selection bias (sigmoid_bias only): state, checkpointed, updated outside autograd.
        self.register_buffer("expert_bias", torch.zeros(cfg.moe_experts) if self.kind == "sigmoid_bias" else None,
                             persistent=True)

    def forward(self, x: torch.Tensor):
        off = torch.autocast(x.device.type, enabled=False) if x.device.type != "meta" else contextlib.nullcontext()
        with off:  # routing in fp32 whatever the activations
            logits = F.linear(x.float(), self.weight.float())
        k = self.top_k
        if self.kind == "softmax":
            probs = torch.softmax(logits, dim=-1)
            gates, chosen = probs.topk(k, dim=-1)
            if self.renormalize and k > 1:
                gates = gates / gates.sum(-1, keepdim=True)
            return chosen, gates, probs, logits
        if self.kind == "sinkhorn":
            probs = torch.softmax(logits, dim=-1)
            gate_scores = torch.sigmoid(logits) if k == 1 else probs
            if self.training:
                with torch.no_grad():
                    chosen = sinkhorn(logits).topk(k, dim=-1).indices
                gates = gate_scores.gather(-1, chosen)
            else:
                gates, chosen = gate_scores.topk(k, dim=-1)
            if self.renormalize and k > 1:
                gates = gates / gates.sum(-1, keepdim=True)
            return chosen, gates, probs, logits
        # sigmoid_bias
        scores = torch.sigmoid(logits)
        with torch.no_grad():
            chosen = (scores + self.expert_bias.float()).topk(k, dim=-1).indices
        gates = scores.gather(-1, chosen)
        if self.renormalize and k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        return chosen, gates, scores / scores.sum(-1, keepdim=True), logits

    def reset_buffers(self) -> None:
        if self.expert_bias is not None:
            self.expert_bias.zero_()


class GroupedExperts(nn.Module):
    """`experts` MLPs stored stacked: w1, w3 [E, hidden, ffn] and w2 [E, ffn, hidden] (SwiGLU; GELU has no w3).

    `forward(x, counts)` takes rows sorted expert-major (`counts[e]` rows for expert e, in order) and returns
    each row through its expert. Expert parallelism will hold a slice [E/ep, ...] of these and call it on the
    rows it received.
    """

    def __init__(self, experts: int, hidden: int, ffn: int, gated: bool):
        super().__init__()
        self.gated = gated
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, ffn)) if gated else None

    def _mlp(self, mm, x):
        h = F.silu(mm(x, self.w1)) * mm(x, self.w3) if self.gated else F.gelu(mm(x, self.w1))
        return mm(h, self.w2)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if use_grouped_mm(x):
            return self._grouped(x, counts)
        return self._looped(x, counts)

    def _looped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One matmul per expert on its contiguous rows. An expert with no rows is skipped; its weights get
        a zero gradient through the other experts' (they are one stacked tensor)."""
        e = self.w1.shape[0]
        if x.device.type == "meta":  # shapes only (loom memory): the rows spread evenly, as on average
            n = x.shape[0]
            sizes = [n // e + (1 if i < n % e else 0) for i in range(e)]
        else:
            sizes = counts.tolist()
        outs = []
        for i, part in enumerate(torch.split(x, sizes)):
            if sizes[i] == 0:
                continue
            outs.append(self._mlp(lambda a, w, i=i: a @ w[i], part))
        if not outs:
            return x.new_zeros(0, self.w2.shape[-1]) + 0 * self.w2.sum()  # still connected to the weights
        return torch.cat(outs)

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`torch._grouped_mm` over the experts' row groups. Every group is padded with zero rows to a
        multiple of 16 and at least 16 rows: an empty group hangs the kernel's backward (PyTorch 2.8-2.10,
        Hopper), and 16-row alignment is what it expects. Positions are computed on the device, no sync."""
        align = 16
        e, n = counts.shape[0], x.shape[0]
        padded = ((counts.clamp(min=1) + align - 1) // align) * align
        ends = torch.cumsum(padded, 0)
        starts = ends - padded
        row_expert = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=n)
        first_row = torch.cumsum(counts, 0) - counts
        dest = starts[row_expert] + torch.arange(n, device=x.device) - first_row[row_expert]
        capacity = n + e * align  # a static bound on the padded rows
        xp = x.new_zeros(capacity, x.shape[1]).index_copy(0, dest, x)
        offs = ends.to(torch.int32)

        def mm(a, w):
            return torch._grouped_mm(a, w, offs=offs)

        return self._mlp(mm, xp)[dest]


def use_grouped_mm(x: torch.Tensor) -> bool:
    """PyTorch's grouped GEMM where it has one: CUDA, compute capability 9.0+, bf16 activations."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


class MoE(nn.Module):
    """A mixture-of-experts MLP: router, routed experts (stacked), optional shared experts."""

    def __init__(self, cfg: ModelConfig):
        from loom.models.llama import FeedForward

        super().__init__()
        self.num_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.drop_policy = cfg.moe_drop_policy
        self.balance = cfg.moe_load_balance
        self.balance_coeff, self.z_coeff = cfg.moe_load_balance_coeff, cfg.moe_z_loss_coeff
        self.bias_rate = cfg.moe_bias_update_rate
        ffn = cfg.moe_ffn_hidden or cfg.ffn_hidden
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.moe_experts, cfg.hidden, ffn, cfg.mlp == "swiglu")
        self.shared = FeedForward(cfg, cfg.moe_shared_experts * ffn) if cfg.moe_shared_experts else None
        self.shared_gate = (nn.Linear(cfg.hidden, 1, bias=False)
                            if cfg.moe_shared_experts and cfg.moe_shared_gate else None)
        self.aux_grad_scale = 1.0  # the runner sets 1 / micro-batches per optimizer step
        self.tokens_per_expert: torch.Tensor | None = None  # training assignments since the last bias update
        self.recorded: dict[str, torch.Tensor] = {}  # summed unweighted aux losses since the last read
        self.forwards = 0
        self.dropped = 0

    # --- stages -------------------------------------------------------------------------------------

    def dispatch(self, chosen: torch.Tensor, gates: torch.Tensor, tokens: int):
        """Sort the (token, expert) pairs expert-major, dropping what exceeds the capacity.

        Returns (token [N], gate [N], counts [E]): row i of the permuted input is token `token[i]`, to be
        weighted by `gate[i]`; the rows of expert e are contiguous, `counts[e]` of them, in token order
        (dropping by position keeps the first tokens, by probability the highest gates)."""
        k, e = chosen.shape[1], self.num_experts
        flat_expert, flat_gate = chosen.reshape(-1), gates.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)  # expert-major, token order within an expert
        if self.capacity_factor > 0 and chosen.device.type != "meta":  # meta (loom memory): nothing dropped
            capacity = math.ceil(self.capacity_factor * tokens * k / e)
            if self.drop_policy == "probs":  # within an expert, highest gate first
                by_gate = torch.argsort(flat_gate.detach(), descending=True, stable=True)
                ranked = by_gate[torch.argsort(flat_expert[by_gate], stable=True)]
            else:
                ranked = order
            sorted_expert = flat_expert[ranked]
            counts_all = torch.bincount(flat_expert, minlength=e)
            group_start = torch.cumsum(counts_all, 0) - counts_all
            rank = torch.arange(ranked.numel(), device=ranked.device) - group_start[sorted_expert]
            kept = ranked[rank < capacity]
            self.dropped += flat_expert.numel() - kept.numel()
            order = kept[torch.argsort(flat_expert[kept] * flat_expert.numel() + kept)]  # expert, then token
        counts = torch.bincount(flat_expert[order], minlength=e) if order.device.type != "meta" else \
            torch.zeros(e, dtype=torch.long, device=order.device)
        return order // k, flat_gate[order], counts

    def combine(self, y: torch.Tensor, token: torch.Tensor, gate: torch.Tensor, tokens: int) -> torch.Tensor:
        out = y.new_zeros(tokens, y.shape[-1])
        return out.index_add(0, token, y * gate[:, None].to(y.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        chosen, gates, probs, logits = self.router(flat)
        token, gate, counts = self.dispatch(chosen, gates, flat.shape[0])
        # Expert parallelism goes here: exchange flat[token] by `counts` (all-to-all), compute, exchange back.
        y = self.experts(flat[token], counts)
        out = self.combine(y, token, gate, flat.shape[0])
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        out = out.view(shape)
        if self.training and torch.is_grad_enabled():
            out = self._aux(out, chosen, probs, logits, shape)
        return out

    def _aux(self, out, chosen, probs, logits, shape):
        counting = not _in_backward()  # a recomputed forward (activation checkpointing) is not counted twice
        e = self.num_experts
        if counting and self.router.expert_bias is not None and chosen.device.type != "meta":
            counts = torch.bincount(chosen.reshape(-1), minlength=e).detach()
            self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
        if self.balance == "sequence" and len(shape) == 3:
            balance = load_balance_loss(chosen.view(shape[0], shape[1], -1), probs.view(shape[0], shape[1], e), e)
        else:
            balance = load_balance_loss(chosen, probs, e)
        z = z_loss(logits)
        if counting:
            for name, value in (("moe_load_balance_loss", balance), ("moe_z_loss", z)):
                self.recorded[name] = self.recorded.get(name, 0) + value.detach()
            self.forwards += 1
        aux = self.balance_coeff * balance + self.z_coeff * z
        if self.balance_coeff == 0 and self.z_coeff == 0:
            return out
        return AuxLoss.apply(out, aux, self.aux_grad_scale)

    def reset_buffers(self) -> None:
        self.router.reset_buffers()


def load_balance_loss(chosen: torch.Tensor, probs: torch.Tensor, experts: int) -> torch.Tensor:
    """Switch Transformer's balance loss, unweighted: E * sum_i f_i * P_i, with f_i the share of the k * T
    assignments that went to expert i and P_i the mean router probability of expert i (1 when balanced).
    chosen [..., T, k], probs [..., T, E]: with a leading batch dimension, per sequence then averaged (the
    sequence-wise variant of DeepSeek-V3)."""
    t, k = chosen.shape[-2], chosen.shape[-1]
    one_hot = torch.zeros(*chosen.shape[:-1], experts, device=chosen.device, dtype=probs.dtype)
    one_hot.scatter_add_(-1, chosen, torch.ones_like(chosen, dtype=probs.dtype))
    f = one_hot.sum(-2) / (t * k)
    p = probs.mean(-2)
    return (experts * (f * p).sum(-1)).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss, unweighted: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


# --- what the trainer calls -------------------------------------------------------------------------


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    for m in moe_layers(model):
        m.aux_grad_scale = scale


@torch.no_grad()
def update_router_biases(model: nn.Module, group=None) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, once per optimizer step after backward: each sigmoid_bias
    router's bias moves by rate * sign(mean load - load), the loads counted over every micro-batch of the
    step and, with `group` (the data-parallel process group; None on one process), summed over its ranks.
    Evaluation forwards are not counted. Resets the counts."""
    for m in moe_layers(model):
        bias = m.router.expert_bias
        if bias is None:
            continue
        counts = m.tokens_per_expert
        m.tokens_per_expert = None
        if counts is None:
            counts = torch.zeros(m.num_experts, dtype=torch.long, device=bias.device)
        counts = counts.to(bias.device, torch.float32)
        if group is not None:
            import torch.distributed as dist

            dist.all_reduce(counts, group=group)
        bias.add_(m.bias_rate * torch.sign(counts.mean() - counts).to(bias.dtype))


def moe_metrics(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unweighted auxiliary losses of the training forwards since the last call, averaged over MoE
    layers and forwards (tensors: the trainer moves them to the host with the loss). Resets them."""
    sums: dict[str, torch.Tensor] = {}
    layers = moe_layers(model)
    for m in layers:
        for name, value in m.recorded.items():
            sums[name] = sums.get(name, 0) + value / max(m.forwards, 1)
        m.recorded, m.forwards = {}, 0
    return {name: value / len(layers) for name, value in sums.items()}


def dropped_assignments(model: nn.Module) -> int:
    return sum(m.dropped for m in moe_layers(model))
