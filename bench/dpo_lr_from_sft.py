"""DPO from an SFT run at several learning rates: which rate makes the preference loss fall, which makes it rise.

    .venv/bin/python bench/dpo_lr_from_sft.py [--sft-steps 200] [--dpo-steps 60] [--lrs 1e-3,1e-4,2e-5,5e-6]

Trains `loom sft --config tiny-sft` (ChatML, synthetic arithmetic, random initialisation), then runs
`loom dpo --config tiny-dpo --train.init_from=THAT_RUN` once per learning rate (warmup 5 steps, cosine to a tenth)
and records the training loss (DPO's starts at log 2 = 0.693: the policy is its own reference) and the held-out
pair accuracy. Writes bench/results/dpo_lr_from_sft.json with machine, commit and command. The rate tiny-dpo.toml
ships (1e-3) is tuned for random initialisation; this is the measurement behind the advice `loom dpo` prints when
it starts from trained weights with a rate above 1e-4 (loom/config/advice.py).
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

QUIET = ["--log.progress=none", "--log.tensorboard=false", "--train.threads=1"]


def loom(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "loom.cli", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft-steps", type=int, default=200)
    ap.add_argument("--dpo-steps", type=int, default=60)
    ap.add_argument("--lrs", default="1e-3,1e-4,2e-5,5e-6")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "dpo_lr_from_sft.json"))
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        sft = Path(tmp) / "sft"
        sft_s = loom("sft", "--config", "tiny-sft", "--run-dir", str(sft), f"--train.steps={args.sft_steps}", *QUIET)
        for lr in args.lrs.split(","):
            run_dir = Path(tmp) / f"dpo-{lr}"
            command = ["dpo", "--config", "tiny-dpo", "--run-dir", str(run_dir), f"--train.init_from={sft}",
                       f"--train.steps={args.dpo_steps}", f"--optim.lr={lr}", f"--optim.min_lr={float(lr) / 10:g}",
                       "--optim.warmup_steps=5", f"--train.eval_interval={args.dpo_steps}",
                       "--checkpoint.save_final=false", *QUIET]
            wall = loom(*command)
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            train = [r for r in rows if "loss" in r]
            val = [r for r in rows if "val_accuracy" in r]
            first, last = train[:10], train[-10:]
            runs.append({"lr": float(lr), "wall_s": round(wall, 1),
                         "loss_first10": round(sum(r["loss"] for r in first) / len(first), 4),
                         "loss_last10": round(sum(r["loss"] for r in last) / len(last), 4),
                         "accuracy_last10": round(sum(r["accuracy"] for r in last) / len(last), 4),
                         "val_accuracy": val[-1]["val_accuracy"] if val else None,
                         "loss": [round(r["loss"], 4) for r in train]})
            print(f"lr {lr}: loss {runs[-1]['loss_first10']} -> {runs[-1]['loss_last10']}, "
                  f"held-out accuracy {runs[-1]['val_accuracy']}", flush=True)
    result = {"what": "loom dpo --config tiny-dpo from a tiny-sft run, one run per learning rate; DPO's loss starts "
                      "at log 2 = 0.693 (policy = reference); falling is learning",
              "sft_steps": args.sft_steps, "sft_s": round(sft_s, 1), "dpo_steps": args.dpo_steps, "runs": runs,
              **stamp(" ".join(["bench/dpo_lr_from_sft.py", *sys.argv[1:]]))}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
