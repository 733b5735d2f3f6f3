"""The eager engine's host work per decode step: ATen calls, host-device synchronisations, step time (CPU).

On a GPU an eager decode step (no compile: what `loom generate` and `loom rl` ran by default) is bound by the
host, which dispatches every op one by one: on an H200, Llama-3.2-1B shape, 40-49 ms per step against 1.6 ms
replaying a CUDA graph (../shared/measured/h200-2026-11-26/generate_gpu.json). The op stream is the same on
the CPU, so this counts it here, on the path a GPU takes: `Engine(compile=False, cpu_kernel=False)` (no
packed CPU kernels, SDPA attention), in fp32 and in bf16 (a GPU engine's dtype, whose casts are ops of their
own).

The models are small Llamas with grouped-query attention (hidden 64, 4 heads, 2 key/value heads, MLP 128,
vocabulary 512) with 2 and 16 layers (16: Llama-3.2-1B's layer count), so that compute is negligible and the
step time is the host's. One decode step is (a generation of 1 + S new tokens - one of 1 new token) / S for
`--batch` prompts of 8 tokens, greedy, the engine's default window (`sync_every=8`): the prefill and first
token taken out, each window's setup and read-back spread over its steps, as a generation pays them.

Per decode step it reports, from torch's profiler (CPU activities):

- `aten_calls`: ATen ops called from Python (profiler events with no ATen op above them);
- `aten_events`: every ATen op the profiler records, nested ones included (`linear` -> `t`, `matmul` -> `mm`,
  ...): each a trip through the dispatcher, which on a GPU is host time per op;
- `syncs`: what would stop the host for the device on a GPU: device-to-host reads (`aten::_local_scalar_dense`
  from `.item()`/`int(t)`/`bool(t)`, `aten::nonzero` from boolean indexing, `Tensor.tolist()` counted by a
  torch function mode) and host data made into tensors (`aten::lift_fresh`: `torch.tensor(list)`, which the
  engine uploads); `reads` and `uploads` give the two parts;
- the same per layer: (16-layer count - 2-layer count) / 14; and the fixed part of a step (2-layer count
  less twice the per-layer part);
- `step_ms`: the decode step's wall time here without the profiler, from the fastest of `--repeats` runs of
  each generation (on a shared machine other processes only add time; the load averages before and after are
  kept in `load_avg`), and `step_cpu_ms` the process's CPU time for it the same way (`time.process_time`);
  with one torch thread (`--threads`): the host's dispatch work is one thread's.

    .venv/bin/python bench/engine_ops.py --label before   # writes bench/results/engine_ops_cpu.json["before"]
    .venv/bin/python bench/engine_ops.py --label after    # keeps "before", writes "after"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.config import ModelConfig  # noqa: E402
from loom.infer.engine import Engine  # noqa: E402
from loom.infer.sampling import SamplingParams  # noqa: E402
from loom.models.llama import build_model  # noqa: E402
from loom.provenance import stamp  # noqa: E402

READS = ("aten::_local_scalar_dense", "aten::nonzero")
UPLOADS = ("aten::lift_fresh",)


class _Tolist(TorchFunctionMode):
    """Counts `Tensor.tolist()` (a device-to-host copy on a GPU; on the CPU the profiler records no op for it)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def model(layers: int, dtype: torch.dtype = torch.float32):
    cfg = ModelConfig(layers=layers, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512, max_seq_len=256)
    return build_model(cfg, seed=0, dtype=dtype).eval()


def engine(layers: int, batch: int, dtype=torch.float32) -> Engine:
    return Engine(model(layers, dtype), max_batch=batch, max_len=256, compile=False, cpu_kernel=False)


def prompts(batch: int) -> list[list[int]]:
    return [[1 + (7 * b + i) % 500 for i in range(8)] for b in range(batch)]


def counts(eng: Engine, batch: int, new: int) -> collections.Counter:
    """Profiler counts of one generation of `new` tokens for `batch` prompts (after one unprofiled)."""
    params = SamplingParams(max_new_tokens=new)
    eng.generate(prompts(batch), params)
    tolist = _Tolist()
    with profile(activities=[ProfilerActivity.CPU]) as prof, tolist:
        eng.generate(prompts(batch), params)
    out = collections.Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        out["aten_events"] += 1
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            out["aten_calls"] += 1
        if e.name in READS:
            out["reads"] += 1
        if e.name in UPLOADS:
            out["uploads"] += 1
    out["reads"] += tolist.calls
    out["syncs"] = out["reads"] + out["uploads"]
    return out


def per_step(eng: Engine, batch: int, steps: int) -> dict[str, float]:
    """Counts of one decode step: (a generation of 1 + steps tokens - one of 1 token) / steps."""
    one, more = counts(eng, batch, 1), counts(eng, batch, 1 + steps)
    return {k: (more[k] - one[k]) / steps for k in ("aten_calls", "aten_events", "syncs", "reads", "uploads")}


def step_ms(eng: Engine, batch: int, steps: int, repeats: int) -> tuple[float, float]:
    """Wall and process CPU milliseconds of a decode step (no profiler): (time(1 + steps tokens) - time(1 token))
    / steps, each time the fastest of `repeats` (another process on the machine only ever adds time)."""
    def timed(new):
        wall, cpu = time.perf_counter(), time.process_time()
        eng.generate(prompts(batch), SamplingParams(max_new_tokens=new))
        return time.perf_counter() - wall, time.process_time() - cpu

    timed(1 + steps)
    long, short = zip(*[(timed(1 + steps), timed(1)) for _ in range(repeats)])
    return tuple(1e3 * (min(t[i] for t in long) - min(t[i] for t in short)) / steps for i in (0, 1))


def measure(batch: int, steps: int, repeats: int, dtype: torch.dtype, layers=(2, 16)) -> dict:
    small, large = layers
    rows = {}
    for n in layers:
        eng = engine(n, batch, dtype)
        rows[n] = per_step(eng, batch, steps)
        wall, cpu = step_ms(eng, batch, steps, repeats)
        rows[n]["step_ms"], rows[n]["step_cpu_ms"] = round(wall, 3), round(cpu, 3)
    per_layer = {k: round((rows[large][k] - rows[small][k]) / (large - small), 4) for k in rows[small]}
    fixed = {k: round(rows[small][k] - small * per_layer[k], 3) for k in per_layer}
    return {"per_step": {f"{n}_layers": {k: round(v, 3) for k, v in rows[n].items()} for n in layers},
            "per_layer": per_layer, "fixed_per_step": fixed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after", help='key of the output JSON to write ("before", "after")')
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32, help="decode steps measured (S)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtypes", default="float32,bfloat16", help="float32: the dtype of the tests' equality "
                    "checks; bfloat16: a GPU engine's (its casts are ops of their own)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the host's dispatch work, which is "
                    "one thread's, without a second thread spinning on a shared machine)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/engine_ops_cpu.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    load = [round(x, 2) for x in os.getloadavg()]
    result = {}
    with torch.no_grad():
        for name in args.dtypes.split(","):
            result[name] = measure(args.batch, args.steps, args.repeats, getattr(torch, name))
    result["load_avg"] = {"before": load, "after": [round(x, 2) for x in os.getloadavg()]}
    result.update(stamp("python bench/engine_ops.py " + " ".join(sys.argv[1:])))
    result["settings"] = {"batch": args.batch, "torch_threads": args.threads, "decode_steps": args.steps,
                          "repeats": args.repeats,
                          "prompt_tokens": 8, "engine": "Engine(compile=False, cpu_kernel=False)",
                          "model": "hidden 64, heads 4, kv_heads 2, ffn 128, vocab 512; 2 and 16 layers"}
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    data.setdefault("benchmark", "engine_ops_cpu")
    data["doc"] = ("Per decode step of the eager engine on the path a GPU takes (compile=False, cpu_kernel=False), "
                   "counted with torch's profiler on the CPU: see bench/engine_ops.py")
    data[args.label] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({name: result[name] for name in args.dtypes.split(",")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
