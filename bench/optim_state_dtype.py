"""Quality cost of bf16 AdamW moments: the demo run (configs/tiny.toml) with fp32 vs bf16 moments.

    .venv/bin/python bench/optim_state_dtype.py [--steps 450] [--out bench/results/optim_state_dtype.json]

Same seed, data and schedule; only `optim.state_dtype` differs. Records the final held-out loss and
bits per byte of each, and the bytes per parameter each setting holds (measured on the live tensors).
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
from loom.train.optim import state_bytes_per_param  # noqa: E402
from loom.train.trainer import Trainer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=450)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "optim_state_dtype.json"))
    args = ap.parse_args()
    runs = {}
    for dtype in ("float32", "bfloat16"):
        cfg = load_config("tiny", [f"optim.state_dtype={dtype}", f"train.steps={args.steps}", "log.progress=none",
                                   "log.tensorboard=false", "checkpoint.save_final=false"])
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, Path(tmp) / "run", quiet=True)
            result = trainer.fit()
            # one more backward (no step) so gradients exist for the byte count
            rows = trainer.val_data.batch(0, 2)
            x, y = rows["input_ids"], rows["labels"]
            trainer.runner.loss_sum({"input_ids": x, "labels": y}).backward()
            bytes_pp = state_bytes_per_param(trainer.model, trainer.optimizer)
            losses = [json.loads(x)["loss"] for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
                      if "loss" in json.loads(x)]
        runs[dtype] = {"val_loss": result["val_loss"], "val_bpb": result["val_bpb"], "final_train_loss": losses[-1],
                       "bytes_per_param": bytes_pp}
        print(dtype, json.dumps(runs[dtype]), flush=True)
    out = {"benchmark": "optim_state_dtype", "config": "tiny", "steps": args.steps, "runs": runs,
           "val_loss_delta_bf16_minus_fp32": runs["bfloat16"]["val_loss"] - runs["float32"]["val_loss"],
           **stamp("python bench/optim_state_dtype.py " + " ".join(sys.argv[1:]))}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
