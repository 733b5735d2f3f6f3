"""`loom memory`: measure what one training step keeps for backward and how many FLOPs it does.

Activation bytes are counted, not estimated: a `saved_tensors_hooks` ledger sees every tensor autograd
saves during the forward pass, attributes it to the module running, and counts each storage once
(views and tensors saved twice share a storage), leaving parameters out. Code that keeps tensors
outside autograd's saved tensors — a recomputation checkpoint keeps its inputs, sequence parallelism
keeps a shard in place of a gathered input — reports them to the ledger itself.

FLOPs are counted with `torch.utils.flop_counter.FlopCounterMode` over forward and backward of the
unsharded model (tensor, data and pipeline parallelism split matmuls without repeating them, so this
equals the sum over ranks); recomputation in backward shows up as hardware FLOPs.

On one process the model lives on the meta device: shapes, storages and FLOPs are exact with no
memory and no arithmetic, so a 405B configuration is measured in seconds.
"""

from __future__ import annotations

import torch

from loom.build import build_in_layout, tensor_parallel, torch_dtype, whole
from loom.config import Config
from loom.ledger import SavedTensorLedger
from loom.models.losses import token_loss_sum
from loom.rules import adam_moment_bytes, experts_span_tp, grads_stay_sharded, zero3_keeps_compute_rows


class _FusedAttention(torch.autograd.Function):
    """Stands in for SDPA on the meta device, where PyTorch would pick its math fallback (which keeps the
    s x s probabilities): a fused kernel (FlashAttention, or SDPA's flash path on CPU) keeps q, k, v, its
    output and the fp32 row log-sum-exp, and that is what this saves. Shapes only; never differentiated."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:3], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - measurement runs forward only
        raise RuntimeError("the fused-attention stand-in only measures memory")


def _fused_core(q, k, v, kind, dropout, doc_ids=None):
    return _FusedAttention.apply(q, k, v)


class _ContextParallelStandIn:
    """A context-parallel rank's attention without the exchange (measurement only): the rank's keys and
    values padded to the whole sequence, as the all-gather leaves them, then the two causal calls on key
    prefixes that `loom.parallel.context.ContextParallelCore` makes. What autograd keeps matches the real
    core's (the gathered keys/values, the rank's queries and outputs)."""

    def __init__(self, cp: int, inner):
        self.cp, self.inner = cp, inner

    def __call__(self, q, k, v, kind, dropout, doc_ids=None):
        c, cp = q.shape[2] // 2, self.cp

        def gathered(x):
            return torch.cat([x, x.new_zeros((*x.shape[:2], 2 * c * (cp - 1), x.shape[3]))], dim=2)

        k, v = gathered(k), gathered(v)
        # Rank 0 holds chunks 0 and 2cp-1 (every rank keeps the same bytes): the last chunk sees every key.
        out_a = self.inner(q[:, :, :c], k[:, :, :c], v[:, :, :c], kind, dropout)
        out_b = self.inner(q[:, :, c:], k, v, kind, dropout)
        return torch.cat([out_a, out_b], dim=2)


ATTENTION_COUNTED = {
    "sdpa": "fused kernel (FlashAttention / SDPA flash): keeps q, k, v, output and log-sum-exp, no s x s term",
    "math": "materialised softmax (model.attention=math): keeps the s x s scores and probabilities",
}


def attention_counted(model) -> str:
    if model.attention == "sdpa" and model.attn_dropout:
        return "SDPA with attention dropout: PyTorch's math path, which keeps the s x s probabilities and mask"
    return ATTENTION_COUNTED[model.attention]


def _build(cfg: Config, device, layout=None, layer_plan: dict[str, str] | None = None, fused_standin: bool = False):
    """The model one rank trains, built as training builds it (`loom.build.build_in_layout`), in `train.dtype`,
    placed for measurement: this rank's attention (a fused kernel's stand-in on meta, context parallelism's
    stand-in), tensor parallelism and recomputation; nothing allocated on meta."""
    from loom.parallel.recompute import apply_recompute

    if layer_plan is None and (plan := recompute_plan(cfg, layout, device, auto_memory_bytes(cfg))):
        layer_plan = plan["plan"]

    def place(model):
        model.train()
        if fused_standin and str(device) == "meta" and cfg.model.attention == "sdpa" and not cfg.model.attn_dropout:
            for block in model.layers.values():  # count what a fused kernel keeps, not the math fallback's
                block.attention.core = _fused_core
        if cfg.parallel.cp > 1:  # one cp rank: its seq_len / cp tokens (`_positions`), keys/values gathered
            for block in model.layers.values():
                block.attention.core = _ContextParallelStandIn(cfg.parallel.cp, block.attention.core)
        if layout is not None and layout.tp > 1:
            tensor_parallel(layout, cfg.parallel.sp)(model)
        apply_recompute(model, cfg, layer_plan)
        return whole(model)

    return build_in_layout(cfg, device, place, dtype=torch_dtype(cfg), seed=0).model


def _batch(cfg: Config, device):
    t = cfg.train
    x = torch.randint(0, cfg.model.vocab_size, (t.micro_batch, t.seq_len // cfg.parallel.cp), device=device)
    return x, torch.roll(x, -1, dims=1)


def _positions(cfg: Config, x: torch.Tensor) -> dict:
    """A cp rank's `positions` entry (rank 0's tokens, as `loom.parallel.context.shard_batch` gives them)."""
    if cfg.parallel.cp == 1:
        return {}
    from loom.parallel.context import shard_batch

    return {"positions": shard_batch({"input_ids": x.new_zeros(x.shape[0], cfg.train.seq_len)}, cfg.train.seq_len,
                                     cfg.parallel.cp, 0)["positions"]}


def measure_activations(cfg: Config, layout=None, device="meta", layer_plan=None) -> dict:
    """Saved bytes of one micro-batch's forward on this rank, per layer and per component."""
    from loom.parallel.tensor import loss_context
    model = _build(cfg, device, layout, layer_plan, fused_standin=True)
    x, y = _batch(cfg, device)
    with loss_context(layout.tp if layout else 1):
        with SavedTensorLedger(model) as ledger:
            loss = token_loss_sum(model(x, **_positions(cfg, x)), y)
    per_layer = ledger.per_layer()
    layers = {k: v for k, v in per_layer.items() if k.startswith("layers.")}
    worst = max(layers, key=layers.get)
    del loss
    return {
        "layer_activation_bytes": layers[worst],
        "layers": layers,
        "outside_layers_bytes": per_layer.get("outside layers", 0),
        "breakdown": ledger.breakdown(worst),
        "total_activation_bytes": sum(per_layer.values()),
    }


def count_flops(cfg: Config, layer_plan=None) -> int:
    """Matmul FLOPs of forward + backward (incl. recomputation) of one micro-batch, unsharded model."""
    from torch.utils.flop_counter import FlopCounterMode

    from dataclasses import replace

    cfg = replace(cfg, parallel=replace(cfg.parallel, cp=1))  # whole sequences: the sum over cp ranks
    model = _build(cfg, "meta", None, layer_plan)
    x, y = _batch(cfg, "meta")
    with FlopCounterMode(display=False) as counter:
        token_loss_sum(model(x), y).backward()
    return counter.get_total_flops()


def _with_mode(cfg: Config, mode: str) -> Config:
    from dataclasses import replace

    return replace(cfg, recompute=replace(cfg.recompute, mode=mode, method="uniform", num_layers=0))


def step_flops(cfg: Config, layer_plan=None) -> dict:
    """Model and hardware FLOPs of one optimizer step, summed over all ranks."""
    micro_batches = cfg.train.global_batch // cfg.train.micro_batch
    return {
        "model_flops_per_step": count_flops(_with_mode(cfg, "none")) * micro_batches,
        "hardware_flops_per_step": count_flops(cfg, layer_plan) * micro_batches,
    }


def state_bytes(cfg: Config, layout=None) -> dict:
    """Parameters, gradients and optimizer state per rank (fp32 master weights and gradients)."""
    model = _build(_with_mode(cfg, "none"), "meta", None)  # recomputation changes no state
    total = trained = model.num_params()
    frozen_bytes = 0.0
    if cfg.lora.enabled:  # LoRA: the base frozen in train.dtype (no gradient, no optimizer state), adapters trained
        from loom.models.lora import apply_lora, trainable_count

        apply_lora(model, cfg.lora, torch_dtype(cfg))
        trained, total = trainable_count(model)
        frozen_bytes = (total - trained) * torch_dtype(cfg).itemsize
    p = cfg.parallel
    shard = p.dp_shard * p.cp  # FSDP shards over the data-parallel shards and their cp ranks
    ranks = p.tp * p.pp * shard
    # Routed experts are not split by tensor parallelism: each tp rank holds them whole (experts carved from
    # dp x cp), unless they are spread over tp ranks too (rules.experts_span_tp); ep ranks hold experts / ep and
    # FSDP shards those over the rest of the shard group, so a rank holds 1 / max(ep, shard group) of them.
    experts = 0 if cfg.lora.enabled else sum(t.numel() for n, t in model.named_parameters() if ".experts." in n)
    expert_group = shard * (p.tp if experts_span_tp(p.tp, p.sp, p.ep) else 1)
    per_rank = (trained - experts) / ranks + experts / (p.pp * max(p.ep, expert_group))
    moment_bytes = adam_moment_bytes(cfg.optim.state_dtype)
    # Gradients between a step's micro-batches: this rank's shard, or the whole stage's (rules.py).
    micro_batches = cfg.train.global_batch // (p.dp * cfg.train.micro_batch)
    sharded = grads_stay_sharded(p.grad_accum, p.pp, micro_batches)
    weight_bytes = 4 if torch_dtype(cfg) == torch.float32 else torch_dtype(cfg).itemsize
    if p.distributed_optimizer and p.distopt_shard_weights:  # loom/parallel/zero.py: every state split by rows
        # the fp32 master rows are the weights' only copy (each gather casts them afresh), as FSDP's, unless a
        # compute-dtype copy is kept (past 8 micro-batches a step: loom.rules.zero3_keeps_compute_rows)
        kept = weight_bytes if weight_bytes < 4 and zero3_keeps_compute_rows(micro_batches) else 0
        return {"params_total": total, "params_trained": trained, "params_bytes": per_rank * (4 + kept),
                "trained_params_per_rank": per_rank, "grads_bytes": per_rank * 4,
                "grad_accum": "sharded every micro-batch (sharded weights)",
                "optimizer_bytes": per_rank * moment_bytes}  # moments
    if p.distributed_optimizer:  # loom/parallel/distopt.py: weights and fp32 gradients whole on every dp rank
        whole = per_rank * shard
        return {"params_total": total, "params_trained": trained, "params_bytes": whole * weight_bytes,
                "trained_params_per_rank": per_rank, "grads_bytes": whole * 4,
                "grad_accum": "whole fp32 buffer, reduce-scattered once per step (distributed optimizer)",
                "optimizer_bytes": per_rank * (4 + moment_bytes)}  # fp32 master rows + moments
    return {"params_total": total, "params_trained": trained, "params_bytes": per_rank * 4 + frozen_bytes / ranks,
            "trained_params_per_rank": per_rank,
            "grads_bytes": per_rank * 4 * (1 if sharded else shard),
            "grad_accum": ("whole: dp_shard=1" if shard == 1 else
                           "sharded every micro-batch" if sharded else "whole until the last micro-batch"),
            "optimizer_bytes": per_rank * moment_bytes}


def plan_budget(cfg: Config, layout=None, device="meta", budget_bytes: float | None = None) -> dict:
    """The recomputation plan that fits `recompute.budget_gib` (or `budget_bytes`) with the fewest
    recomputed FLOPs.

    Each layer can keep everything (`none`), recompute its attention core (`selective`) or recompute
    everything but its input (`full`). The bytes each choice keeps are measured on this rank's layout
    (the ledger above) and the FLOPs it adds are counted; as the layers are alike, the best plan is
    found exactly by trying every count of selective and full layers (O(L^2)) — the cheapest in FLOPs
    among those whose activations fit, ties broken by memory. The budget covers one micro-batch's
    activations on this rank, everything outside the layers included.
    """
    budget = cfg.recompute.budget_gib * 2**30 if budget_bytes is None else budget_bytes
    return _cheapest_plan(cfg, _per_mode(cfg, layout, device), budget, budget_bytes is None)


def _per_mode(cfg: Config, layout, device) -> tuple[dict, float, dict]:
    """Bytes one layer keeps under each mode, bytes outside the layers, FLOPs one layer adds under each mode."""
    keep, extra = {}, {}
    base_flops = count_flops(_with_mode(cfg, "none"))
    for mode in ("none", "selective", "full"):
        m = measure_activations(_with_mode(cfg, mode), layout, device)
        keep[mode] = m["layer_activation_bytes"]
        outside = m["outside_layers_bytes"]
        extra[mode] = (count_flops(_with_mode(cfg, mode)) - base_flops) / cfg.model.layers
    return keep, outside, extra


def _cheapest_plan(cfg: Config, measured: tuple[dict, float, dict], budget: float, from_config: bool) -> dict:
    keep, outside, extra = measured
    names = [str(i) for i in range(cfg.model.layers)]
    best = None
    for n_full in range(len(names) + 1):
        for n_sel in range(len(names) - n_full + 1):
            n_none = len(names) - n_full - n_sel
            total = outside + n_none * keep["none"] + n_sel * keep["selective"] + n_full * keep["full"]
            cost = n_sel * extra["selective"] + n_full * extra["full"]
            if total <= budget and (best is None or (cost, total) < best[:2]):
                best = (cost, total, n_full, n_sel)
    if best is None:
        from loom.errors import UserError

        need = outside + len(names) * keep["full"]
        what = (f"recompute.budget_gib={cfg.recompute.budget_gib}" if from_config
                else f"the activation budget of {budget / 2**30:.4f} GiB")
        raise UserError(
            f"{what} is below the smallest footprint, full "
            f"recomputation of every layer: {need / 2**30:.4f} GiB per micro-batch on this rank; raise the "
            "budget, lower train.micro_batch, or add tensor/sequence parallelism"
        )
    cost, total, n_full, n_sel = best
    plan = {n: ("full" if i < n_full else "selective" if i < n_full + n_sel else "none") for i, n in enumerate(names)}
    return {"plan": plan, "activation_bytes": total, "extra_flops_per_micro_batch": cost,
            "per_layer_bytes": keep, "per_layer_extra_flops": extra}


def recompute_plan(cfg: Config, layout=None, device="meta", memory_bytes: float | None = None) -> dict | None:
    """The per-layer plan of `recompute.mode=budget` (`plan_budget`) or `auto` (`plan_auto` for `memory_bytes`);
    None for the modes that need none."""
    if cfg.recompute.mode == "budget":
        return plan_budget(cfg, layout, device)
    if cfg.recompute.mode == "auto":
        return plan_auto(cfg, layout, device, memory_bytes)
    return None


AUTO_RESERVE = 0.05  # of the memory, kept free by recompute.mode=auto: allocator blocks, workspaces, buffers


def plan_auto(cfg: Config, layout=None, device="meta", memory_bytes: float | None = None) -> dict:
    """`recompute.mode=auto`: the cheapest recomputation (in FLOPs) whose training step fits `memory_bytes`
    on this rank (None: no limit, nothing recomputed).

    The activation budget is the memory less what a step holds outside the activations and less a reserve:
    the parameters, gradients and optimizer state (`state_bytes`, this rank's share); 5% of the memory
    (`AUTO_RESERVE`: the caching allocator's partly used blocks, the GEMM and compile workspaces, the
    collectives' buffers: the margin `loom plan` keeps free by default); and one layer's activations kept
    whole, the working set of backward, which holds a layer's input gradients while that layer's saved
    tensors are still alive. What is left is searched as `plan_budget` searches its budget. The bytes are measured as `loom memory`
    measures them (eager autograd's saved tensors), so a compiled step, which saves less, fits with room.
    """
    names = [str(i) for i in range(cfg.model.layers)]
    if memory_bytes is None:
        return {"plan": {n: "none" for n in names}, "memory_bytes": None}
    states = state_bytes(cfg, layout)
    held = states["params_bytes"] + states["grads_bytes"] + states["optimizer_bytes"]
    copies = autocast_copy_bytes(cfg, states)
    measured = _per_mode(cfg, layout, device)
    reserve = AUTO_RESERVE * memory_bytes + measured[0]["none"]
    budget = memory_bytes - held - copies - reserve
    if budget <= 0:
        from loom.errors import UserError

        raise UserError(
            f"recompute.mode=auto: the parameters, gradients and optimizer state take {_size(held)} per rank"
            + (f", autocast's 16-bit weight copies {_size(copies)}" if copies else "")
            + f" and the reserve {_size(reserve)}, more than the {_size(memory_bytes)} of memory; "
            "shard them (parallel.dp_shard, parallel.tp), keep optimizer moments in bf16 "
            "(optim.state_dtype=bfloat16), or set recompute.memory_gib to the memory you have")
    plan = _cheapest_plan(cfg, measured, budget, from_config=False)
    return {**plan, "memory_bytes": memory_bytes, "state_bytes": held, "copy_bytes": copies,
            "reserve_bytes": reserve, "budget_bytes": budget}


def autocast_copy_bytes(cfg: Config, states: dict) -> float:
    """The 16-bit copies of a rank's trained weights that autocast makes in forward and autograd keeps for
    backward: where the trainer trains fp32 master weights in a 16-bit dtype without data parallelism or
    context parallelism (`SPMDRunner`: with them FSDP2 casts each block's weights as it gathers them and frees
    them after). 2 bytes a trained weight, counted whole: embeddings and norms, which are not cast, and the layers
    recomputed in full, whose copies live only while their backward runs, are counted too, so the plan errs on
    the side of fitting; a compiled block may recompute the casts instead of keeping them."""
    p = cfg.parallel
    if cfg.train.dtype == "float32" or p.dp_replicate * p.dp_shard * p.cp > 1:
        return 0.0
    return 2.0 * states["trained_params_per_rank"]


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def auto_memory_bytes(cfg: Config, device=None) -> float | None:
    """The memory `recompute.mode=auto` fits a rank's step in: `recompute.memory_gib`, else a CUDA device's
    free memory now, else None (a CPU: no limit)."""
    if cfg.recompute.memory_gib > 0:
        return cfg.recompute.memory_gib * 2**30
    if device is not None and torch.device(device).type == "cuda":
        return float(torch.cuda.mem_get_info(torch.device(device))[0])
    return None


def describe_plan(plan: dict) -> str:
    """One line for the log: how many layers recompute what, and the budget it fit."""
    counts = {m: sum(v == m for v in plan["plan"].values()) for m in ("none", "selective", "full")}
    layers = ", ".join(f"{n} {m}" for m, n in counts.items() if n)
    if plan.get("memory_bytes") is None:
        return (f"recompute.mode=auto: {layers} (no memory limit: a CPU, or `loom memory`, which does not know the "
                "device; recompute.memory_gib sets one)")
    copies = f" - {_size(plan['copy_bytes'])} autocast weight copies" if plan["copy_bytes"] else ""
    return (f"recompute.mode=auto: {layers}; activations {_size(plan['activation_bytes'])} of a "
            f"{_size(plan['budget_bytes'])} budget ({_size(plan['memory_bytes'])} memory - "
            f"{_size(plan['state_bytes'])} parameters, gradients and optimizer state{copies} - "
            f"{_size(plan['reserve_bytes'])} reserve)")


def report(cfg: Config) -> dict | None:
    """Everything `loom memory` prints, measured on this process's layout (None off rank 0)."""
    import torch.distributed as dist

    from loom.parallel.dims import place_in_mesh
    from loom.parallel.distributed import init_distributed

    distributed = not dist.is_initialized()
    init_distributed(torch.device("cpu"))  # measurement runs on CPU ranks (gloo)
    distributed = distributed and dist.is_initialized()
    layout = place_in_mesh(cfg, "cpu")
    if layout.tp > 1 and not layout.distributed:
        from loom.errors import UserError

        raise UserError(f"parallel.tp={layout.tp} is measured on {layout.tp} processes: add --nproc {cfg.parallel.world_size}")
    if cfg.parallel.pp > 1:
        from loom.errors import UserError

        raise UserError("loom memory measures one rank of a layout without pipeline stages; set parallel.pp=1 "
                        "(a stage holds layers/pp of the layers, each as measured here)")
    device = "cpu" if layout.tp > 1 else "meta"
    plan = recompute_plan(cfg, layout, device, auto_memory_bytes(cfg))
    acts = measure_activations(cfg, layout if layout.tp > 1 else None, device, plan and plan["plan"])
    result = None
    if layout.is_main:
        p, t = cfg.parallel, cfg.train
        result = {
            "config": cfg.name,
            "layout": {"tp": p.tp, "sp": p.sp, "pp": p.pp, "vpp": p.vpp, "dp_replicate": p.dp_replicate,
                       "dp_shard": p.dp_shard, "cp": p.cp},
            "recompute": cfg.recompute.mode,
            "attention_counted": attention_counted(cfg.model),
            "micro_batch": t.micro_batch, "seq_len": t.seq_len, "dtype": t.dtype,
            **acts,
            **step_flops(cfg, plan and plan["plan"]),
            **state_bytes(cfg),
        }
        if plan:
            result["budget_plan"] = plan["plan"]
            if cfg.recompute.mode == "auto":
                result["auto_plan"] = describe_plan(plan)
    if distributed:
        dist.destroy_process_group()
    return result


def format_table(r: dict) -> str:
    gib = lambda n: f"{n / 2**30:10.4f} GiB"  # noqa: E731
    lay = ", ".join(f"{k}={v}" for k, v in r["layout"].items())
    lines = [
        f"loom memory: {r['config']} ({lay}; recompute={r['recompute']}; micro_batch {r['micro_batch']} x "
        f"seq {r['seq_len']}, {r['dtype']})",
        "",
        f"attention counted as: {r['attention_counted']}",
        "",
        "activations saved for backward, per rank, one micro-batch:",
        f"  one transformer layer        {gib(r['layer_activation_bytes'])}  ({r['layer_activation_bytes']:,} bytes)",
    ]
    lines += [f"    {name:<26} {gib(n)}" for name, n in sorted(r["breakdown"].items(), key=lambda kv: -kv[1])]
    lines += [
        f"  outside the layers           {gib(r['outside_layers_bytes'])}  (embedding, head, loss)",
        f"  all layers + outside         {gib(r['total_activation_bytes'])}",
        "",
        "state per rank (fp32 master weights and gradients):" if r.get("params_trained", r["params_total"])
        == r["params_total"] else "state per rank (LoRA: the frozen base in train.dtype, no gradients or optimizer "
        "state for it; fp32 adapters, gradients, moments):",
        f"  parameters                   {gib(r['params_bytes'])}  ({r['params_total']:,} parameters in the model"
        + (f", {r['params_trained']:,} trained: LoRA)"
           if r.get("params_trained", r["params_total"]) != r["params_total"] else ")"),
        f"  gradients                    {gib(r['grads_bytes'])}  ({r['grad_accum']})",
        f"  optimizer                    {gib(r['optimizer_bytes'])}",
        "",
        "matmul FLOPs per optimizer step, all ranks:",
        f"  model (MFU)                  {r['model_flops_per_step']:.4e}",
        f"  hardware (HFU, recompute)    {r['hardware_flops_per_step']:.4e}",
    ]
    if "auto_plan" in r:
        lines += ["", r["auto_plan"]]
    return "\n".join(lines)
