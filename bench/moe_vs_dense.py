"""configs/tiny-moe.toml against a dense tiny model with the same active parameters, same steps and data.

    .venv/bin/python bench/moe_vs_dense.py [--steps 200] [--out bench/results/moe_vs_dense.json]

The MoE model replaces every MLP of configs/tiny.toml with 8 experts of ffn 256, top-2; a token passes
through 2 experts (2 x 3 x 256 x 256 weights) and the router (8 x 256). The dense model is configs/tiny.toml
with model.ffn_hidden chosen so its MLP has the same weights as that active part (515: 3 x 256 x 515 =
395,520 vs 395,264). Same seed, data order and schedule (`train.steps` overridden in both). Records the
held-out loss and bits per byte at the last step, the total and active parameter counts (counted on the
built model: the routed experts' weights count k / E), the time and the model FLOPs per token (loom/flops.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.config import load_config  # noqa: E402
from loom.flops import train_flops_per_token  # noqa: E402
from loom.models.llama import build_model  # noqa: E402
from loom.provenance import stamp  # noqa: E402
from loom.train.trainer import Trainer  # noqa: E402


def parameter_counts(model_cfg) -> tuple[int, int]:
    """(total, active) parameters: a routed expert's weights count top_k / experts of their size."""
    model = build_model(model_cfg, device="meta")
    total = model.num_params()
    inactive = 0
    if model_cfg.moe.experts:
        share = 1 - model_cfg.moe.top_k / model_cfg.moe.experts
        inactive = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * share
    return total, int(total - inactive)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--dense-ffn", type=int, default=515)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe_vs_dense.json"))
    args = ap.parse_args()
    common = [f"train.steps={args.steps}", f"train.eval_interval={args.steps}", "log.progress=none",
              "log.tensorboard=false", "checkpoint.save_final=false"]
    configs = {"moe": ("tiny-moe", common), "dense": ("tiny", common + [f"model.ffn_hidden={args.dense_ffn}"])}
    runs = {}
    for name, (config, overrides) in configs.items():
        cfg = load_config(config, overrides)
        total, active = parameter_counts(cfg.model)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            result = Trainer(cfg, Path(tmp) / "run", quiet=True).fit()
            seconds = time.perf_counter() - t0
            rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "loss" in r]
        runs[name] = {"config": config, "overrides": overrides, "params_total": total, "params_active": active,
                      "train_flops_per_token": train_flops_per_token(cfg.model, cfg.train.seq_len),
                      "val_loss": result["val_loss"], "val_bpb": result["val_bpb"],
                      "final_train_loss": steps[-1]["loss"], "train_seconds": round(seconds, 1)}
        if name == "moe":
            runs[name]["final_moe"] = {k: v for k, v in steps[-1].items() if k.startswith("moe_")}
        print(name, json.dumps(runs[name]), flush=True)
    out = {"benchmark": "moe_vs_dense", "steps": args.steps, "runs": runs,
           "val_bpb_moe_minus_dense": runs["moe"]["val_bpb"] - runs["dense"]["val_bpb"],
           **stamp("python bench/moe_vs_dense.py " + " ".join(sys.argv[1:]))}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
