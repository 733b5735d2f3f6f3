"""What a run says before its first step."""

from __future__ import annotations

from loom.data.dataset import Dataset


def lora_line(cfg, params: int, trained: int) -> str:
    """LoRA's trained share and the weight-state memory it saves per rank against full fine-tuning (frozen
    weights in train.dtype with no gradient or optimizer state; loom.rules.lora_bytes_per_param)."""
    from loom.rules import lora_bytes_per_param

    lo = cfg.lora
    frozen_b, trained_b, full_b = lora_bytes_per_param(cfg.train.dtype, cfg.optim.state_dtype)
    frozen = params - trained
    saved = frozen * (full_b - frozen_b) / cfg.parallel.dp_shard
    return (f"  lora         rank {lo.rank}, alpha {lo.alpha:g} on {','.join(lo.targets)}: {trained:,} trainable "
            f"of {params:,} parameters ({100 * trained / params:.2f}%); weight memory saved "
            + (f"{saved / 2**30:,.2f} GiB" if saved >= 2**30 else f"{saved / 2**20:,.1f} MiB")
            + f" per rank ({full_b} -> {frozen_b} bytes per frozen parameter)")


def banner(cfg, command: str, layout, params: int, train_data: Dataset, run_dir, resumed_from,
           valid_source: str, trained: int | None = None) -> str:
    p, t = cfg.parallel, cfg.train
    tokens_per_step = t.global_batch * t.seq_len
    sizes = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard,
             "cp": p.cp, "ep": p.ep}
    layout_parts = [f"{k}={v}" for k, v in sizes.items() if v != 1]
    if p.sp:
        layout_parts.append("sp")
    if p.pp > 1:
        layout_parts.append(f"schedule={p.schedule}")
    layout_text = ", ".join(layout_parts) or "one process"
    micro = t.global_batch // (p.dp * t.micro_batch)
    lines = [
        f"loom {command}: {cfg.name}, {params / 1e6:,.1f}M parameters ({cfg.model.layers} layers, hidden "
        f"{cfg.model.hidden}), {t.dtype}, recompute={cfg.recompute.mode}",
        f"  layout       {layout_text} ({layout.world_size} process{'es' if layout.world_size > 1 else ''} on "
        f"{cfg.train.device if cfg.train.device != 'auto' else 'the default device'})",
        f"  batch        {t.global_batch} x {t.seq_len} = {tokens_per_step:,} tokens per step "
        f"({micro} micro-batch{'es' if micro > 1 else ''} of {t.micro_batch} per data-parallel rank)",
        f"  data         {train_data.summary(t.steps, t.global_batch)}",
        f"  validation   {valid_source}",
        f"  run dir      {run_dir}" + (f" (resuming from {resumed_from.name})" if resumed_from else ""),
    ]
    if cfg.lora.enabled and trained is not None:
        lines.insert(1, lora_line(cfg, params, trained))
    return "\n".join(lines)
