"""The cost of expert-parallel dispatch on CPU: configs/tiny-moe.toml trained on 4 gloo processes, everything
else equal, in these layouts:

- dp4-ep1, dp4-ep2, dp4-ep4: dp_shard=4 with parallel.ep = 1, 2 and 4. ep=1 keeps all 8 experts on every rank
  (FSDP shards them like any weight); ep=2 and ep=4 hold 4 and 2 of them per rank and exchange the routed rows
  all-to-all (counts, rows forward, rows back; the same three in backward).
- tp2-dp2-ep2 (tp=2 without sp, ep=2 carved from dp_shard=2) and tp2-sp-dp2-ep1 (tp=2 with sp, experts
  replicated): the layouts of before experts spread over tensor-parallel ranks; both tp ranks compute the
  whole MoE layer on the whole sequence.
- tp2-sp-dp2-ep4 (tp=2 with sp, ep=4 over tp x dp_shard=2): each rank routes its own sequence shard to 2 of
  the 8 experts (loom.rules.experts_span_tp).

    .venv/bin/python bench/moe_ep_cpu.py [--steps 8] [--nproc 4] [--layouts dp4-ep1,...] [--out ...]

Records the median tokens/s over the steps after the first (the whole job, all ranks), the final loss (the
same for every layout up to rounding: they compute the same thing) and the load average, since the
processes share the machine's cores with anything else running.
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


def layouts(nproc: int) -> dict[str, dict]:
    """name -> parallel sizes, for `nproc` processes."""
    out = {f"dp{nproc}-ep{ep}": {"dp_shard": nproc, "ep": ep} for ep in (1, 2, 4) if nproc % ep == 0}
    if nproc % 2 == 0 and nproc >= 4:
        dp = nproc // 2
        out[f"tp2-dp{dp}-ep{dp}"] = {"tp": 2, "dp_shard": dp, "ep": dp}
        out[f"tp2-sp-dp{dp}-ep1"] = {"tp": 2, "sp": "true", "dp_shard": dp, "ep": 1}
        out[f"tp2-sp-dp{dp}-ep{nproc}"] = {"tp": 2, "sp": "true", "dp_shard": dp, "ep": nproc}
    return out


def run(name: str, sizes: dict, nproc: int, steps: int, micro_batch: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "loom.cli", "train", "--config", "tiny-moe", "--run-dir", str(run_dir),
               "--nproc", str(nproc), *[f"--parallel.{k}={v}" for k, v in sizes.items()],
               f"--train.steps={steps}", f"--train.micro_batch={micro_batch}", "--train.eval_interval=0",
               "--checkpoint.save_final=false", "--log.progress=none", "--log.tensorboard=false"]
        load_before = os.getloadavg()[0]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "loss" in r]
    return {"layout": name, **sizes,
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in steps_rows[1:]),
            "step_time_s": [round(r["step_time_s"], 3) for r in steps_rows],
            "final_loss": steps_rows[-1]["loss"], "load_average_before": load_before}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--layouts", default="", help="comma-separated names (default: all, see the docstring)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe_ep_cpu.json"))
    args = ap.parse_args()
    table = layouts(args.nproc)
    chosen = args.layouts.split(",") if args.layouts else list(table)
    unknown = [n for n in chosen if n not in table]
    if unknown:
        ap.error(f"unknown layouts {unknown}; valid for --nproc {args.nproc}: {', '.join(table)}")
    runs = []
    for name in chosen:
        runs.append(run(name, table[name], args.nproc, args.steps, args.micro_batch))
        print(json.dumps(runs[-1]), flush=True)
    out = {"benchmark": "moe_ep_cpu", "config": "tiny-moe", "nproc": args.nproc,
           "steps": args.steps, "micro_batch": args.micro_batch, "runs": runs,
           **stamp("python bench/moe_ep_cpu.py " + " ".join(sys.argv[1:]))}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
