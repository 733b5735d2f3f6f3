"""Where a CPU training step's time goes: per-op self time and page faults, one framework per process.

Each op call's self time is the minimum over the profiled steps (a call that another process on the
machine interrupted in one step ran undisturbed in another), summed per op name; page faults are the
process's minor faults per step, and step times are taken from as many steps run without the
profiler. Run once per framework, each in a fresh process:

    .venv/bin/python bench/cpu_profile.py --framework loom --out /tmp/loom.json
    .venv/bin/python bench/cpu_profile.py --framework transformers --out /tmp/hf.json
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cpu_vs_hf import HFLoop, _make_runner  # noqa: E402

from loom.config import load_config  # noqa: E402
from loom.provenance import stamp  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=("loom", "transformers"), required=True)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=8, help="profiled steps")
    ap.add_argument("--no-host-memory", action="store_true", help="loom without keep_freed_memory")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.no_host_memory:
        import loom.train.trainer

        loom.train.trainer.keep_freed_memory = lambda: False
    cfg = load_config(args.config, [f"train.steps={2 * args.steps + 10}", "train.dtype=float32", "log.progress=none",
                                    "log.tensorboard=false", "train.device=cpu"])
    with tempfile.TemporaryDirectory() as tmp:
        runner = _make_runner(args.framework, cfg, tmp)
        assert args.framework == "loom" or isinstance(runner, HFLoop)
        for _ in range(6):  # loom's heap reaches its size within ~5 steps
            runner.train_step()
        walls, faults = [], []  # without the profiler, whose own allocations share the heap
        for _ in range(args.steps):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            runner.train_step()
            walls.append(time.perf_counter() - t)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        per_call = []
        for _ in range(args.steps):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                runner.train_step()
            seen, calls = collections.Counter(), {}
            for e in prof.events():
                calls[(e.name, seen[e.name])] = e.self_cpu_time_total / 1e3
                seen[e.name] += 1
            per_call.append(calls)
    ops = collections.defaultdict(lambda: [0.0, 0])
    for key in per_call[0]:
        ops[key[0]][0] += min(c.get(key, float("inf")) for c in per_call)
        ops[key[0]][1] += 1
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])
    result = {
        "framework": args.framework, "host_memory": not args.no_host_memory if args.framework == "loom" else None,
        "threads": torch.get_num_threads(), "steps": args.steps,
        "step_s_min": round(min(walls), 4), "step_s_median": round(sorted(walls)[len(walls) // 2], 4),
        "minor_faults_per_step": sorted(faults)[len(faults) // 2],
        "op_ms_sum_of_call_minima": round(sum(v[0] for v in ops.values()), 1),
        "top_ops": [{"op": k, "ms": round(v[0], 2), "calls": v[1]} for k, v in top[:25]],
        **stamp("python bench/cpu_profile.py " + " ".join(sys.argv[1:])),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "top_ops"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
