"""`parallel.layout=auto`: the planner chooses the layout at launch, and the run checks the prediction.

`loom train|sft|dpo|rm|rl --parallel.layout=auto [--nproc N]` asks the planner (the cost model behind `loom plan`)
for the fastest layout of this model, batch and world size that fits the accelerator with the configured margin
and that the rule book accepts for the recipe (`loom.rules.layout_problem` on the run's own config, so dropout,
packing, LoRA and the recipe's limits count), then runs it. What it chooses: `parallel.{tp, sp, pp, vpp,
schedule, first_stage_layers, last_stage_layers, dp_replicate, dp_shard, cp, ep}`, `train.micro_batch` and
`recompute.{mode, method, num_layers}` (unless recompute.mode is auto or budget, which stay). Everything else
(dtype, fp8, compile, the loss chunk, LoRA, the optimizer state's dtype) is the config's and is priced as set.
`parallel.auto_fix` fixes knobs in `loom plan --layout`'s syntax (`tp=2,recompute=none`); the rest is searched.

The accelerator priced: `parallel.auto_hardware` (a preset name or a profile JSON) when given; else a profile of
this device in loom's cache (`$LOOM_CACHE/hardware/`, written by `loom plan --profile-hardware` or, on a CPU, by
the first auto launch, which measures the CPU once with `--quick`); else on a GPU the preset its name matches.
A CPU's memory is shared by the processes of one machine: each is given its share.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from loom.errors import UserError

# The knobs `parallel.layout=auto` sets, as `section.key`.
PARALLEL_KNOBS = ("tp", "sp", "pp", "vpp", "schedule", "first_stage_layers", "last_stage_layers", "embedding_in_split",
                  "loss_in_split", "dp_replicate", "dp_shard", "cp", "ep", "distributed_optimizer")


@dataclass
class Choice:
    """The layout the planner chose: the config values it sets, and what it predicts for them."""

    values: dict  # "section.key" -> value
    layout: str  # loom plan's name for it
    predicted_step_s: float
    predicted_memory_gib: float
    considered: int
    fit: int
    hardware: str

    def overrides(self) -> list[str]:
        """As `--section.key=value` overrides (for the launcher's workers)."""
        return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.values.items()]

    def prediction(self) -> dict:
        return {"predicted_step_s": round(self.predicted_step_s, 6),
                "predicted_memory_gib": round(self.predicted_memory_gib, 4)}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Choice":
        return cls(**json.loads(text))

    def describe(self) -> str:
        return (f"parallel.layout=auto chose {self.layout} on {self.hardware} ({self.fit} of {self.considered} layouts "
                f"fit): predicted {self.predicted_step_s:.4g} s/step, {self.predicted_memory_gib:.2f} GiB per process")


# --- the accelerator --------------------------------------------------------------------------------------

def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "device"


def cpu_name() -> str:
    """The name `loom plan --profile-hardware` gives this CPU's profile."""
    return f"cpu: {platform.processor() or platform.machine()} x{os.cpu_count()}"


def cached_profile_path(name: str) -> Path:
    from loom.files import cache_dir

    return cache_dir() / "hardware" / f"{_slug(name)}.json"


def _preset_for(name: str, memory_gib: float):
    from loom.planner.hardware import PRESETS

    low = name.lower()
    if "h200" in low:
        return PRESETS["h200"]
    if "h100" in low:
        return PRESETS["h100"]
    if "a100" in low:
        return PRESETS["a100-80gb" if memory_gib > 50 else "a100-40gb"]
    return None


def launch_hardware(spec: str, local_procs: int, measure=None):
    """The accelerator to price (module docstring). `measure(path)`: writes a profile of this CPU to `path`
    (default `loom.planner.profile.profile_hardware(path, quick=True)`)."""
    from loom.planner.hardware import load_gpu

    if spec:
        gpu = load_gpu(spec)
    else:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            memory = torch.cuda.get_device_properties(0).total_memory / 2**30
            path = cached_profile_path(name)
            gpu = load_gpu(str(path)) if path.is_file() else _preset_for(name, memory)
            if gpu is None:
                raise UserError(f"parallel.layout=auto: no planner preset for {name!r} and no profile of it in {path.parent}; "
                                f"measure one with `loom plan --profile-hardware {path}` (or give "
                                "parallel.auto_hardware=PRESET_OR_JSON; presets: a100-40gb, a100-80gb, h100, h200)")
        else:
            path = cached_profile_path(cpu_name())
            if not path.is_file():
                print(f"parallel.layout=auto: measuring this CPU once for the planner (cached at {path})",
                      file=sys.stderr, flush=True)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.stem}.{os.getpid()}.json")
                if measure is None:
                    from loom.planner.profile import profile_hardware

                    profile_hardware(tmp, quick=True)
                else:
                    measure(tmp)
                tmp.replace(path)
            gpu = load_gpu(str(path))
    if gpu.is_cpu and local_procs > 1:  # the processes of one machine share its memory
        gpu = dataclasses.replace(gpu, memory_gib=gpu.memory_gib / local_procs)
    return gpu


# --- the choice -------------------------------------------------------------------------------------------

def workload_for(cfg, world: int, gpu, recipe: str):
    """The planner's workload for this config: its model, batch and precision on `world` of `gpu`."""
    from loom.config.lora import loom_targets
    from loom.planner.workload import Workload

    if cfg.train.fp8 != "off":
        precision = "fp8"
    elif cfg.train.dtype == "bfloat16":
        precision = "bf16"
    else:
        precision = "fp32" if "fp32" in gpu.peak_tflops else "bf16"  # a GPU preset has no fp32 rate: tf32-class
    margin = cfg.parallel.auto_memory_margin_gib
    margin = round(0.05 * gpu.memory_gib, 3) if margin == "auto" else float(margin)
    if not 0 <= margin < gpu.memory_gib:
        raise UserError(f"parallel.auto_memory_margin_gib={margin} must be >= 0 and below the accelerator's "
                        f"{gpu.memory_gib:.1f} GiB per process (auto: 5% of it)")
    model = copy.deepcopy(cfg.model)
    model.max_seq_len = max(model.max_seq_len, cfg.train.seq_len)
    lora = cfg.lora
    return Workload(model=model, seq_len=cfg.train.seq_len, global_batch=cfg.train.global_batch, gpus=world, gpu=gpu,
                    precision=precision, state_dtype=cfg.optim.state_dtype, grad_accum=cfg.parallel.grad_accum,
                    memory_margin_gib=margin, framework="loom", loss_chunk=cfg.train.loss_chunk, recipe=recipe,
                    lora_rank=lora.rank, compile="on" if cfg.train.compile else "off",
                    ep_overlap_chunks=cfg.parallel.ep_overlap_chunks,
                    lora_targets=tuple(loom_targets(lora.targets)) if lora.enabled else ())


def _fixed(cfg, world: int) -> dict:
    from loom.planner.search import parse_layout

    text = cfg.parallel.auto_fix.strip()
    if not text:
        return {}
    try:
        fields = parse_layout(text, world)
    except UserError as exc:
        raise UserError(f"parallel.auto_fix={text!r}: {str(exc).replace('--layout', 'auto_fix').replace('--gpus', 'the world size')}") from None
    named = {p.split("=", 1)[0].strip() for p in text.split(",") if "=" in p}
    if "dp" not in named:  # the data-parallel size follows the searched mesh sizes
        fields.pop("dp")
        if fields.get("dp_style") == "replicate" and not ({"dp_style", "style"} & named):
            fields.pop("dp_style")
    return fields


def apply(cfg, values: dict):
    """A copy of `cfg` with `values` ("section.key" -> value) set."""
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        section, name = key.split(".", 1)
        setattr(getattr(out, section), name, value)
    return out


def _values(e, w, cfg) -> dict:
    from loom.planner.report import to_loom_config

    ref = to_loom_config(e, w)
    values = {f"parallel.{k}": getattr(ref.parallel, k) for k in PARALLEL_KNOBS}
    values["train.micro_batch"] = ref.train.micro_batch
    if cfg.recompute.mode not in ("auto", "budget"):
        values.update({f"recompute.{k}": getattr(ref.recompute, k) for k in ("mode", "method", "num_layers")})
    return values


def choose(cfg, world: int, recipe: str = "train", gpu=None, local_procs: int | None = None, measure=None) -> Choice:
    """The fastest layout that fits and that loom runs for this config on `world` processes (module docstring)."""
    from loom.planner.report import layout_name
    from loom.planner.search import search
    from loom.rules import layout_problem

    if gpu is None:
        gpu = launch_hardware(cfg.parallel.auto_hardware, local_procs or world, measure)
    w = workload_for(cfg, world, gpu, recipe)
    fixed = _fixed(cfg, world)
    estimates, info = search(w, fixed=fixed, top=0, max_micro_batch=max(16, cfg.train.micro_batch),
                             cross_node_tp="tp" in fixed)
    refused = None
    for e in estimates:  # fastest first
        values = _values(e, w, cfg)
        problem = layout_problem(apply(cfg, values), world, recipe)
        if problem is None:
            return Choice(values=values, layout=layout_name(e), predicted_step_s=e.step_time_s,
                          predicted_memory_gib=e.memory["total"] / 2**30, considered=info["considered"],
                          fit=info["fit"], hardware=gpu.name)
        refused = refused or problem
    fix = f" with parallel.auto_fix={cfg.parallel.auto_fix!r}" if cfg.parallel.auto_fix else ""
    if not estimates:
        need = f" (the smallest needs {info['smallest_gib']:.2f} GiB)" if info.get("smallest_gib") else ""
        raise UserError(f"parallel.layout=auto: no layout of this model fits {world} x {gpu.name} "
                        f"({w.usable_bytes / 2**30:.2f} GiB usable each){fix}{need}; use more processes, a smaller "
                        "train.global_batch or train.seq_len, optim.state_dtype=bfloat16, or set the layout by hand")
    raise UserError(f"parallel.layout=auto: {info['fit']} layouts fit {world} x {gpu.name}{fix}, but loom runs none of "
                    f"them for `loom {recipe}` with this config (the fastest: {refused}); set the layout by hand")


def summary(prediction: dict, step_times: list[float], peak_gib: float, tolerance: float = 0.25) -> str:
    """Measured against predicted, for the end of a run: the median step after the first (compilation, warm-up)
    and the peak memory; a miss over `tolerance` is said."""
    times = sorted(step_times[1:] or step_times)
    if not times:
        return ""
    n = len(times)
    median = times[n // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])
    pred_s, pred_m = prediction["predicted_step_s"], prediction["predicted_memory_gib"]
    err_s = median / pred_s - 1 if pred_s > 0 else float("inf")
    err_m = peak_gib / pred_m - 1 if pred_m > 0 else float("inf")
    text = (f"layout=auto: step {median:.4g} s measured (median of {n}) vs {pred_s:.4g} s predicted ({100 * err_s:+.0f}%); "
            f"memory {peak_gib:.2f} GiB vs {pred_m:.2f} GiB predicted ({100 * err_m:+.0f}%)")
    misses = [what for what, err in (("step time", err_s), ("memory", err_m)) if abs(err) > tolerance]
    if misses:
        text += (f"; the prediction MISSED by more than {100 * tolerance:.0f}% on {' and '.join(misses)} "
                 "(a profile of this machine, `loom plan --profile-hardware`, prices it better)")
    return text
