"""Pipeline bubble: measured waiting time vs the theory (p - 1) / (v * m), per schedule and micro-batch count.

    .venv/bin/python bench/pipeline_bubble.py [--pp 2 4] [--steps 6] [--out bench/results/pipeline_bubble.json]

For each pipeline size p, schedule and micro-batch count m, trains a small Llama-style model for a
few steps with `loom train --nproc p` on CPU (gloo) and reads `pipeline_bubble` from metrics.jsonl:
the time each rank spent blocked on pipeline transfers over the time it computed, averaged over
ranks, median over the steps after the first two. Theory (Narayanan et al. 2021): (p - 1) / m for
1F1B, (p - 1) / (v * m) for the interleaved schedule with v stages per rank; ZB-V (Qi et al. 2023)
aims at zero when forward, input-backward and weight-backward take equal time. On a 2-core machine
p = 4 puts 4 processes on 2 cores, so waiting there also includes time a rank is descheduled: read
p = 4 rows as an upper bound.
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

SCHEDULES = {"1f1b": 1, "interleaved": 2, "zero_bubble": 2}  # schedule -> stages per rank (v)


def run(pp: int, schedule: str, v: int, m: int, steps: int) -> float:
    model = [
        f"--model.layers={2 * pp}", "--model.hidden=128", "--model.heads=4", "--model.kv_heads=4",
        "--model.ffn_hidden=352", "--model.vocab_size=512", "--model.max_seq_len=128", "--model.tie_embeddings=false",
        "--train.seq_len=128", "--train.micro_batch=1", f"--train.global_batch={m}", f"--train.steps={steps}",
        "--train.eval_samples=2", "--data.corpus_max_bytes=300000", "--log.progress=none",
        "--log.tensorboard=false", "--checkpoint.save_final=false",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "loom.cli", "train", "--config", "tiny", "--run-dir", f"{tmp}/run",
               "--nproc", str(pp), f"--parallel.pp={pp}", f"--parallel.vpp={v}", f"--parallel.schedule={schedule}",
               *model]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True)
        rows = [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["pipeline_bubble"] for r in rows if "loss" in r and r["step"] > 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8], help="m = multiple x pp")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline_bubble.json"))
    args = ap.parse_args()
    rows = []
    for pp in args.pp:
        for schedule, v in SCHEDULES.items():
            for k in args.multiples:
                m = k * pp
                if schedule == "zero_bubble" and m < pp * v:
                    continue  # ZB-V needs at least 2p micro-batches
                measured = run(pp, schedule, v, m, args.steps)
                theory = 0.0 if schedule == "zero_bubble" else (pp - 1) / (v * m)
                row = {"pp": pp, "schedule": schedule, "vpp": v, "microbatches": m, "measured": round(measured, 4),
                       "theory": round(theory, 4)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    out = {"benchmark": "pipeline_bubble", "definition": "time blocked on pipeline P2P / time computing, mean over "
           "ranks, median over steps 3..N", "rows": rows, **stamp("python bench/pipeline_bubble.py " + " ".join(sys.argv[1:]))}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    md = ["| pp | schedule | v | m | measured | theory (p-1)/(v m) |", "|---|---|---|---|---|---|"]
    md += [f"| {r['pp']} | {r['schedule']} | {r['vpp']} | {r['microbatches']} | {r['measured']:.3f} | "
           f"{r['theory']:.3f} |" for r in rows]
    Path(args.out).with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
