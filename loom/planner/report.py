"""Planner output: the ranked table, the per-term breakdown, a plot, and a loom config for the winner."""

from __future__ import annotations

from pathlib import Path

from loom.errors import UserError
from loom.planner.workload import GIB, Estimate, Workload

TERM_LABELS = {
    "gemm": "linear-layer matmuls", "attention": "attention core", "elementwise": "elementwise ops",
    "tp_comm": "TP collectives", "cp_comm": "CP K/V gather", "overhead": "kernel gaps", "head": "LM head + loss", "pp_p2p": "PP send/recv",
    "pp_bubble": "pipeline bubble", "dp_comm": "DP comm (exposed)", "optimizer": "optimizer step",
    "ep_comm": "EP all-to-all", "fsdp_copy": "FSDP2 buffer copies",
    "distopt_copy": "distopt grad buffer adds", "clock": "sustained clock",
}


def days(estimate: Estimate, w: Workload, tokens: float | None) -> float | None:
    if not tokens:
        return None
    return tokens / (estimate.tokens_per_s_per_gpu * w.gpus) / 86400


def layout_name(e: Estimate) -> str:
    lay = e.layout
    rec = lay.recompute + (f"({lay.recompute_layers})" if lay.recompute == "full" and lay.recompute_layers else "")
    parts = [f"tp={lay.tp}", f"pp={lay.pp}"]
    if lay.vpp > 1:
        parts.append(f"vpp={lay.vpp}")
    parts += [f"dp={lay.dp}"] + ([f"cp={lay.cp}"] if lay.cp > 1 else []) + ([f"ep={lay.ep}"] if lay.ep > 1 else [])
    parts += [f"mbs={lay.micro_batch}", f"sp={'on' if lay.sp else 'off'}", rec, lay.dp_style]
    if lay.pp > 1:
        parts.append(lay.schedule)
    if lay.first_stage_layers or lay.last_stage_layers:
        parts.append(f"split={lay.first_stage_layers or '='}/{lay.last_stage_layers or '='}")
    if lay.embedding_in_split or lay.loss_in_split:  # Megatron's split: the embedding / the loss as a layer
        parts.append("split=" + "+".join(n for n, on in (("emb", lay.embedding_in_split), ("loss", lay.loss_in_split)) if on))
    return " ".join(parts)


def format_table(estimates: list[Estimate], w: Workload, tokens: float | None = None) -> str:
    width = max([62] + [len(layout_name(e)) for e in estimates])
    head = f"{'#':>2}  {'layout':<{width}} {'step s':>8} {'tok/s/gpu':>9} {'TFLOP/s':>7} {'MFU':>5}  " \
           f"{'mem GiB: par':>12} {'grad':>5} {'opt':>5} {'act':>5} {'total':>6}"
    if tokens:
        head += f" {'days':>6}"
    lines = [head, "-" * len(head)]
    for i, e in enumerate(estimates, 1):
        mem = {k: v / GIB for k, v in e.memory.items()}
        line = (f"{i:>2}  {layout_name(e):<{width}} {e.step_time_s:>8.3f} {e.tokens_per_s_per_gpu:>9.0f} "
                f"{e.tflops_per_gpu:>7.1f} {100 * e.mfu:>4.1f}%  {mem['params']:>12.1f} {mem['grads']:>5.1f} "
                f"{mem['optimizer']:>5.1f} {mem['activations']:>5.1f} {mem['total']:>6.1f}")
        if tokens:
            line += f" {days(e, w, tokens):>6.1f}"
        lines.append(line)
    return "\n".join(lines)


def format_terms(e: Estimate, capacity_gib: float, margin_gib: float = 0.0) -> str:
    """Why a layout costs what it costs: every step-time term and memory term."""
    total = e.step_time_s
    lines = [f"step time {total:.3f} s  ({layout_name(e)})"]
    for key, value in sorted(e.time_terms.items(), key=lambda kv: -kv[1]):
        if value > 0:
            lines.append(f"  {TERM_LABELS.get(key, key):<22} {value:9.3f} s  {100 * value / total:5.1f}%")
    lines.append(f"memory per GPU {e.memory['total'] / GIB:.1f} of {capacity_gib:.1f} GiB"
                 + (f" ({margin_gib:.1f} GiB kept free: fits below {capacity_gib - margin_gib:.1f})" if margin_gib else ""))
    for key, value in e.memory.items():
        if key != "total":
            lines.append(f"  {key:<22} {value / GIB:9.2f} GiB")
    return "\n".join(lines)


def eager_note(e: Estimate, w: Workload) -> str | None:
    """A line saying why a layout's elementwise ops cost what they do when loom runs its blocks eagerly on a
    GPU (--compile off, or the zero-bubble schedule, which loom does not compile: `loom.rules.compile_problem`)
    and they take a tenth of the step or more; None otherwise."""
    from loom.planner.steptime import kernels_workload

    if w.gpu.is_cpu or kernels_workload(w, e.layout).fused_elementwise():
        return None
    share = e.time_terms.get("elementwise", 0.0) / e.step_time_s
    if share < 0.10:
        return None
    why = "--compile off" if w.compile == "off" else "loom does not compile blocks under the zero-bubble schedule"
    return (f"note: loom runs this layout's blocks eagerly ({why}); eager elementwise ops are {100 * share:.0f}% of "
            "the step, priced at the rate loom's eager layer was measured to reach (12-21% of the memory bandwidth "
            "on an H200)")


def to_loom_config(e: Estimate, w: Workload, base_name: str | None = None):
    """The loom config that runs this layout: the one documented conversion from the planner's Layout
    (dp, dp_style) to loom's ParallelConfig (dp_replicate, dp_shard) and train/recompute settings.
    (dp_style distopt: parallel.distributed_optimizer=true, loom/parallel/distopt.py). fp8 precision becomes
    `train.fp8=tensorwise` (torchao's per-tensor-scaled fp8 linear layers, torchtitan's default recipe)."""
    from loom.config import Config, load_config

    lay = e.layout
    cfg = load_config(base_name) if base_name else Config()
    cfg.model = w.model
    p = cfg.parallel
    p.tp, p.sp, p.pp, p.vpp, p.cp, p.ep = lay.tp, lay.sp, lay.pp, lay.vpp, lay.cp, lay.ep
    p.schedule = lay.schedule
    p.first_stage_layers, p.last_stage_layers = lay.first_stage_layers, lay.last_stage_layers
    p.embedding_in_split, p.loss_in_split = lay.embedding_in_split, lay.loss_in_split
    p.dp_replicate, p.dp_shard = (lay.dp, 1) if lay.dp_style == "replicate" else (1, lay.dp)
    p.distributed_optimizer = lay.dp_style in ("distopt", "zero3") and lay.dp * lay.cp > 1  # loom/parallel/distopt.py
    p.distopt_shard_weights = lay.dp_style == "zero3" and p.distributed_optimizer  # loom/parallel/zero.py
    t = cfg.train
    t.micro_batch, t.global_batch, t.seq_len = lay.micro_batch, w.global_batch, w.seq_len
    t.dtype = "bfloat16"
    t.fp8 = "tensorwise" if w.precision == "fp8" else "off"
    t.loss_chunk = w.loss_chunk
    t.compile = w.runs_compiled(lay)  # the blocks run as they were priced (--compile; auto: loom's GPU path)
    cfg.optim.state_dtype = w.state_dtype
    cfg.lora.rank, cfg.lora.targets = w.lora_rank, list(w.lora_targets) or cfg.lora.targets
    cfg.parallel.grad_accum = w.grad_accum
    cfg.parallel.ep_overlap_chunks = w.ep_overlap_chunks
    r = cfg.recompute
    r.mode = lay.recompute
    if lay.recompute == "full" and lay.recompute_layers:
        r.method, r.num_layers = "block", lay.recompute_layers
    else:
        r.method, r.num_layers = "uniform", 0
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, w.seq_len)
    return cfg


def loom_runnable(e: Estimate, w: Workload) -> str | None:
    """Why loom cannot run this layout today, or None when it can: the rule book's verdict on the
    layout's loom config (loom.rules.check_layout, the check `loom train` runs)."""
    from loom.rules import layout_problem

    try:
        cfg = to_loom_config(e, w)
    except UserError as exc:
        return str(exc)
    return layout_problem(cfg, e.layout.world, w.recipe)


def refused_faster(verdicts: list, best: Estimate | None, margin: float = 0.10) -> list[dict]:
    """The layouts loom refuses that would run at least `margin` faster than `best`, the fastest loom runs
    (None: loom runs none, so every refused layout counts): for each reason loom gives (`loom_runnable`), its
    fastest layout that fits, fastest first. `verdicts` holds (estimate, reason or None) in the search's
    order. A user then sees what a setting costs (dropout with tensor parallelism, say) rather than a slow
    winner, or a refusal, with no explanation."""
    fastest: dict[str, Estimate] = {}
    for e, reason in verdicts:
        if reason and e.fits and (best is None or e.step_time_s < (1 - margin) * best.step_time_s):
            if reason not in fastest or e.step_time_s < fastest[reason].step_time_s:
                fastest[reason] = e
    rows = sorted(fastest.items(), key=lambda item: item[1].step_time_s)
    return [{"layout": layout_name(e), "step_time_s": round(e.step_time_s, 4), "reason": reason} for reason, e in rows]


def write_config(e: Estimate, w: Workload, base_name: str | None, path: Path) -> str:
    """Write the layout as a loom config (only one the rule book accepts); returns a note about what was mapped."""
    from loom.rules import layout_problem

    cfg = to_loom_config(e, w, base_name)
    problem = layout_problem(cfg, e.layout.world, w.recipe)
    if problem:
        raise UserError(f"--config: loom cannot run {layout_name(e)} ({problem}); nothing written")
    lay = e.layout
    note = ""
    header = (f"# Written by `loom plan`: predicted {e.step_time_s:.3f} s/step, {e.tokens_per_s_per_gpu:.0f} tokens/s/GPU, "
              f"{e.memory['total'] / GIB:.1f} GiB/GPU on {w.gpus} x {w.gpu.name}.\n"
              f"# Launch with {lay.world} processes, e.g. `loom {w.recipe} --config {path} --nproc 8 --nnodes {max(1, lay.world // 8)} ...`.\n")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(header + cfg.to_toml())
        tmp.replace(path)
    except OSError as exc:
        raise UserError(f"--config {path}: cannot write ({exc})") from None
    return note


def pyplot():
    """matplotlib's pyplot on the file-only backend, or a clear message when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'loom[plot]' (or pip install matplotlib)") from None
    return plt


def plot(estimates: list[Estimate], path: Path, capacity_gib: float) -> None:
    plt = pyplot()
    names = [f"#{i}" for i in range(1, len(estimates) + 1)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.45 * len(estimates) + 4.0))
    keys = [k for k in TERM_LABELS if any(e.time_terms.get(k, 0) > 0 for e in estimates)]
    left = [0.0] * len(estimates)
    for key in keys:
        values = [e.time_terms.get(key, 0.0) for e in estimates]
        ax1.barh(names, values, left=left, label=TERM_LABELS[key])
        left = [a + b for a, b in zip(left, values)]
    ax1.invert_yaxis()
    ax1.set_xlabel("seconds per step")
    ax1.set_title("step time by term")
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False)
    mem_keys = ["params", "grads", "optimizer", "activations", "logits", "buffers", "fp8_weights", "reserve"]
    left = [0.0] * len(estimates)
    for key in mem_keys:
        values = [e.memory[key] / GIB for e in estimates]
        ax2.barh(names, values, left=left, label=key)
        left = [a + b for a, b in zip(left, values)]
    ax2.axvline(capacity_gib, color="black", linestyle="--", linewidth=1, label="usable GPU memory")
    ax2.invert_yaxis()
    ax2.set_xlabel("GiB per GPU")
    ax2.set_title("memory by term")
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, frameon=False)
    labels = "\n".join(f"#{i}: {layout_name(e)}" for i, e in enumerate(estimates, 1))
    fig.text(0.01, 0.01, labels, fontsize=6, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.02 + 0.016 * len(estimates), 1, 1))
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    """Write a --plot figure and close it; an unwritable path is the user's error (exit 2)."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=120)
    except OSError as exc:
        raise UserError(f"--plot {path}: cannot write ({exc})") from None
    finally:
        plt.close(fig)
