"""What the parallel layouts cost on one CPU machine: tokens/s of the tiny model per layout.

    .venv/bin/python bench/parallel_cpu.py [--steps 12] [--out bench/results/parallel_cpu.json]

Every layout trains the same global batch (16 x 256 tokens, micro-batches of 8) on the same 2 cores: one process with 2
threads, or 2 processes with 1 thread each. On a CPU the processes compete for the same cores and
gloo moves tensors through memory, so this measures the overhead of the DTensor / FSDP2 machinery
and of the collectives, not a speed-up. Throughput is the median over steps after the first 3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.provenance import stamp  # noqa: E402

LAYOUTS = {
    "single (2 threads)": (1, []),
    "tp=2": (2, ["--parallel.tp=2"]),
    "tp=2 sp": (2, ["--parallel.tp=2", "--parallel.sp=true"]),
    "dp_replicate=2": (2, ["--parallel.dp_replicate=2"]),
    "dp_shard=2": (2, ["--parallel.dp_shard=2"]),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "parallel_cpu.json"))
    args = ap.parse_args()
    results = {}
    for name, (nproc, extra) in LAYOUTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "loom.cli", "train", "--config", "tiny", "--run-dir", f"{tmp}/run",
                   "--nproc", str(nproc), f"--train.steps={args.steps}", "--train.eval_samples=16",
                   "--train.micro_batch=8", "--log.progress=none", "--log.tensorboard=false", "--checkpoint.save_final=false",
                   *extra]
            env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
            subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True)
            rows = [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
            tps = [r["tokens_per_s"] for r in rows if "loss" in r][3:]
            results[name] = {"nproc": nproc, "tokens_per_s": round(statistics.median(tps), 1),
                             "final_loss": [r["loss"] for r in rows if "loss" in r][-1]}
            print(name, results[name], flush=True)
    base = results["single (2 threads)"]["tokens_per_s"]
    for r in results.values():
        r["relative_to_single"] = round(r["tokens_per_s"] / base, 3)
    out = {"benchmark": "parallel_cpu", "config": "tiny", "steps": args.steps, "layouts": results,
           **stamp("python bench/parallel_cpu.py " + " ".join(sys.argv[1:]))}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
