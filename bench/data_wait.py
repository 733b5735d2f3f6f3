"""How long the demo's steps wait for data: `data_wait_s` against `step_time_s` from metrics.jsonl.

    .venv/bin/python bench/data_wait.py [--steps 40] [--out bench/results/data_wait.json]

Trains the demo's configuration (configs/tiny.toml, what `make demo` runs) for `--steps` steps, once with
the background reader (`data.prefetch=true`, the default) and once without, and reports the mean
`data_wait_s`, the mean `step_time_s` and their ratio. Step 1 is reported apart: no step before it read
its batch in the background. The bar (issue: web-scale data path) is a ratio of at most 1% with prefetch.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.config import load_config  # noqa: E402
from loom.provenance import stamp  # noqa: E402
from loom.train.trainer import Trainer  # noqa: E402


def measure(steps: int, prefetch: bool) -> dict:
    cfg = load_config("tiny", [f"train.steps={steps}", f"data.prefetch={str(prefetch).lower()}", "train.eval_interval=0",
                               "log.progress=none", "log.tensorboard=false", "checkpoint.save_final=false",
                               "train.log_interval=1"])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, Path(tmp) / "run", quiet=True)
        trainer.fit()
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "data_wait_s" in r]
    assert len(rows) == steps, (len(rows), steps)
    later = rows[1:]
    wait = sum(r["data_wait_s"] for r in later) / len(later)
    step = sum(r["step_time_s"] for r in later) / len(later)
    return {"prefetch": prefetch, "steps": steps, "first_step": {"data_wait_s": rows[0]["data_wait_s"],
                                                                   "step_time_s": rows[0]["step_time_s"]},
            "steps_2_on": {"mean_data_wait_s": wait, "mean_step_time_s": step, "wait_share": wait / step,
                           "max_data_wait_s": max(r["data_wait_s"] for r in later)},
            "all_steps_wait_share": sum(r["data_wait_s"] for r in rows) / sum(r["step_time_s"] for r in rows)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "data_wait.json"))
    args = ap.parse_args()
    runs = []
    for prefetch in (True, False):
        runs.append(measure(args.steps, prefetch))
        r = runs[-1]
        print(f"prefetch={prefetch}: steps 2..{args.steps}: mean data_wait_s {r['steps_2_on']['mean_data_wait_s'] * 1e3:.3f} ms, "
              f"mean step_time_s {r['steps_2_on']['mean_step_time_s']:.3f} s, share {r['steps_2_on']['wait_share']:.3%}; "
              f"all steps {r['all_steps_wait_share']:.3%}", flush=True)
    result = {"config": "tiny (make demo)", "runs": runs,
              "meets_1_percent": runs[0]["all_steps_wait_share"] <= 0.01,
              **stamp(f".venv/bin/python bench/data_wait.py --steps {args.steps}")}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
