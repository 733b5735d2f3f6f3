"""What a run says before its first step, and the data facts it announces while it trains."""

from __future__ import annotations

import numpy as np


def _parts(dataset) -> list:
    """The sample datasets behind `dataset` (one, or the parts of a blend)."""
    return list(getattr(dataset, "datasets", [dataset]))


def data_summary(dataset) -> tuple[int, int]:
    """(tokens in the training datasets, samples in one pass over them at the run's sequence length)."""
    tokens = samples = 0
    for part in _parts(dataset):
        n = int(part.dataset.num_tokens)
        tokens += n
        samples += max(1, (n - 1) // part.seq_len)
    return tokens, samples


def epoch_steps(dataset, global_batch: int) -> dict[int, str]:
    """{step: message} for each step after which the run has read one more full pass over a training dataset.

    Samples are shuffled across the whole run, so an "epoch" here is a count: after it, documents repeat.
    """
    if hasattr(dataset, "epoch_steps"):  # a dataset that makes its own rows (SFT) knows its passes
        return dataset.epoch_steps(global_batch)
    parts = _parts(dataset)
    out: dict[int, str] = {}
    for d, part in enumerate(parts):
        per_epoch = max(1, (int(part.dataset.num_tokens) - 1) // part.seq_len)
        if len(parts) == 1:
            drawn = np.arange(1, len(dataset) + 1)
        else:  # samples drawn from part d after each global sample of the blend
            drawn = np.cumsum(np.asarray(dataset.dataset_index) == d)
        for k in range(1, int(drawn[-1]) // per_epoch + 1 if len(drawn) else 1):
            i = int(np.searchsorted(drawn, k * per_epoch))  # the sample that completes pass k
            step = i // global_batch + 1
            name = part.dataset.prefix if len(parts) > 1 else "the training data"
            out[step] = (out.get(step, "") + "; " if step in out else "") + \
                f"{name}: pass {k} complete, documents repeat from here"
    return out


def command(cfg) -> str:
    """The recipe a config runs, as its subcommand's name."""
    if cfg.rl.prompts:
        return "rl"
    if cfg.pref.data:
        return cfg.pref.recipe if cfg.pref.recipe != "auto" else "dpo"
    return "sft" if cfg.sft.data else "train"


def banner(cfg, layout, params: int, train_data, run_dir, resumed_from, valid_source: str) -> str:
    p, t = cfg.parallel, cfg.train
    tokens_per_step = t.global_batch * t.seq_len
    run_tokens = t.steps * tokens_per_step
    if hasattr(train_data, "summary"):  # SFT: examples, over-long ones, packing and padding
        data_line = f"  data         {train_data.summary()}"
    else:
        data_tokens, samples_per_pass = data_summary(train_data)
        epochs = t.steps * t.global_batch / samples_per_pass
        data_line = (f"  data         {data_tokens:,} tokens; {t.steps} steps read {run_tokens:,} tokens = {epochs:.2f} "
                     "epochs" + (", attention within documents" if cfg.data.document_mask else ""))
    sizes = [f"{k}={getattr(p, k)}" for k in ("tp", "pp", "vpp", "dp_replicate", "dp_shard", "cp", "ep")
             if getattr(p, k) != 1]
    if p.sp:
        sizes.append("sp")
    if p.pp > 1:
        sizes.append(f"schedule={p.schedule}")
    layout_text = ", ".join(sizes) or "one process"
    micro = t.global_batch // (p.dp * t.micro_batch)
    lines = [
        f"loom {command(cfg)}: {cfg.name}, {params / 1e6:,.1f}M parameters ({cfg.model.layers} layers, hidden "
        f"{cfg.model.hidden}), {t.dtype}, recompute={cfg.recompute.mode}",
        f"  layout       {layout_text} ({layout.world_size} process{'es' if layout.world_size > 1 else ''} on "
        f"{cfg.train.device if cfg.train.device != 'auto' else 'the default device'})",
        f"  batch        {t.global_batch} x {t.seq_len} = {tokens_per_step:,} tokens per step "
        f"({micro} micro-batch{'es' if micro > 1 else ''} of {t.micro_batch} per data-parallel rank)",
        data_line,
        f"  validation   {valid_source}",
        f"  run dir      {run_dir}" + (f" (resuming from {resumed_from.name})" if resumed_from else ""),
    ]
    return "\n".join(lines)
