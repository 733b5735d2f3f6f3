"""DPO on a locally made preference set: held-out preference accuracy per evaluation, from one command.

    .venv/bin/python bench/dpo_demo.py [--steps 150] [--out bench/results/dpo_demo.json]

Runs `loom dpo --config tiny-dpo` (random initialisation; pairs from loom/post/pref_data.py: a synthetic
task's correct answer chosen, a wrong one rejected; 10% held out) and records every evaluation's held-out
loss, margin and accuracy (the share of held-out pairs whose implicit reward beta (log pi - log pi_ref) is
higher for the chosen answer). At step 0 the policy is the reference: every margin is exactly 0, a tie, so
the starting accuracy is chance (0.5, ties counted as half). Writes the JSON (machine, commit, command) and
a PNG curve beside it when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.provenance import stamp  # noqa: E402
from plotting import finish, pyplot, running_mean  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-interval", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "dpo_demo.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = ["loom", "dpo", "--config", "tiny-dpo", "--run-dir", str(run_dir), f"--train.steps={args.steps}",
                   f"--train.eval_interval={args.eval_interval}", "--log.progress=none", "--log.tensorboard=false",
                   "--checkpoint.save_final=false"]
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "loom.cli", *command[1:]], cwd=ROOT, check=True)
        wall = time.perf_counter() - t0
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    evals = [{"step": 0, "val_accuracy": 0.5, "val_margin": 0.0, "note": "the reference itself: every margin 0 (a tie)"}]
    evals += [{k: r[k] for k in ("step", "val_loss", "val_accuracy", "val_margin", "val_chosen_reward",
                                 "val_rejected_reward")} for r in rows if "val_loss" in r]
    result = {
        "what": "DPO (beta 0.1) on synthetic preference pairs (chosen: correct answer, rejected: wrong), configs/"
                "tiny-dpo.toml from random initialisation; held-out pair accuracy of the implicit reward",
        "wall_s": round(wall, 1), "train_s": round(sum(r["step_time_s"] for r in steps), 1),
        "evaluations": evals,
        "train": [{k: r[k] for k in ("step", "loss", "accuracy", "margin")} for r in steps],
        **stamp(" ".join(["bench/dpo_demo.py", *sys.argv[1:]]) + "  (runs: " + " ".join(command) + ")"),
    }
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}: held-out accuracy " + ", ".join(f"{e['step']}: {e['val_accuracy']:.3f}" for e in evals))
    plt = pyplot()
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([e["step"] for e in evals], [e["val_accuracy"] for e in evals], "o-", label="held-out pair accuracy")
    ax.plot([r["step"] for r in steps], running_mean([r["accuracy"] for r in steps], 10), alpha=0.6,
            label="training batch accuracy (10-step mean)")
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    finish(fig, ax, out, "loom dpo --config tiny-dpo (CPU)", "step", "preference accuracy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
