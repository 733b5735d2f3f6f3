"""`loom plan --validate`: the planner's prediction for each published run (`published.py`) and for loom's own
measured GPU runs (`measured_runs.json`)."""

from __future__ import annotations

import json
from pathlib import Path

from loom.config import ModelConfig
from loom.planner.published import (  # noqa: F401 (re-exported: the tables' long-standing home)
    PUBLISHED_MOE_ROUTING, flops_seconds, llama, megatron_core_seconds, megatron_gpt, megatron_moe_seconds,
    megatron_recipe, moe, narayanan_seconds, nemo_gpt, published_moe_heldout_runs, published_moe_runs,
    published_runs, published_wide_runs, tokens_seconds)
from loom.planner.workload import Workload


def predict(workload: Workload, fixed: dict):
    """The planner's best estimate for a published layout, among the schedules of that time."""
    from loom.planner.search import search

    # context parallelism past the search's default bound only where a source fixes it (Llama 3 at 128k)
    found, _ = search(workload, fixed=fixed, top=1, schedules=("1f1b", "interleaved"),
                      cp_max=max(8, fixed.get("cp", 1)))
    return found[0] if found else None


def validate() -> list[dict]:
    """Every published run priced: `published_runs` (set "published"), `published_moe_runs` (set "moe"), then
    `published_wide_runs` (set "wide"), then `published_moe_heldout_runs` (set "moe-heldout"); MoE rows carry
    their routing."""
    runs = [(name, *run, PUBLISHED_MOE_ROUTING.get(name), "published") for name, run in published_runs().items()]
    runs += [(name, *run, "moe") for name, run in published_moe_runs().items()]
    runs += [(name, *run, None, "wide") for name, run in published_wide_runs().items()]
    runs += [(name, *run, "moe-heldout") for name, run in published_moe_heldout_runs().items()]
    rows = []
    for name, w, fixed, seconds, source, routing, group in runs:
        best = predict(w, fixed)
        rows.append({"run": name, "set": group, "routing": routing, "source": source, "published_s": round(seconds, 4),
                     "predicted_s": round(best.step_time_s, 4) if best else None,
                     "error": round(best.step_time_s / seconds - 1, 4) if best else None,
                     "fits": bool(best and best.fits),
                     "layout": best.to_json() if best else None})
    return rows


MEASURED = Path(__file__).with_name("measured_runs.json")


def measured_validation(compile: str = "auto") -> list[dict]:
    """loom's own runs measured on a GPU (`measured_runs.json`, numbers copied from the bench files it names),
    each predicted from the profile measured on that machine with its layout fixed as `loom plan --layout`
    fixes it; memory compared as the planner's total less its reserve (CUDA context, fragmentation) against
    torch.cuda.max_memory_allocated. Empty when the profile is not there (an installed package without
    the repository's bench/ folder)."""
    from loom.planner.hardware import load_gpu
    from loom.planner.steptime import evaluate
    from loom.planner.workload import Layout

    if not MEASURED.is_file():
        return []
    data = json.loads(MEASURED.read_text())
    root = Path(__file__).resolve().parents[2]
    gpus = {}  # a run's own "profile" (the machine it ran on), else the file's
    rows = []
    for run in data["runs"]:
        profile = root / run.get("profile", data["profile"])
        if not profile.is_file():
            continue
        if profile not in gpus:
            gpus[profile] = load_gpu(str(profile))
        gpu = gpus[profile]
        seq = run["seq"]
        shape = {"tie_embeddings": True, **data["shapes"][run["shape"]]}  # Llama-3.2's tied head unless unset
        cfg = ModelConfig(**shape, max_seq_len=seq, rope_theta=500000.0)
        w = Workload(cfg, seq, run["micro_batch"], 1, gpu, precision=run["precision"], loss_chunk=run["loss_chunk"],
                     compile=compile)
        # One process: loom's replicate style (fully_shard over one rank); recompute.mode=full recomputes
        # every layer (recompute_layers=0), as bench/gpu_train.py ran it.
        spec = f"tp=1,pp=1,dp=1,cp=1,mbs={run['micro_batch']},recompute={run['recompute']},style=replicate"
        best = evaluate(w, Layout(micro_batch=run["micro_batch"], recompute=run["recompute"], recompute_layers=0,
                                  dp_style="replicate"))
        memory = (best.memory["total"] - best.memory["reserve"]) / 2**30
        rows.append({"run": run["run"], "source": run["source"], "layout": spec,
                     "measured_s": round(run["step_s"], 4), "predicted_s": round(best.step_time_s, 4),
                     "error": round(best.step_time_s / run["step_s"] - 1, 4),
                     "measured_gib": round(run["peak_memory_gib"], 2), "predicted_gib": round(memory, 2),
                     "memory_error": round(memory / run["peak_memory_gib"] - 1, 4),
                     "time_s": {k: round(v, 4) for k, v in best.time_terms.items() if v}})
    return rows
