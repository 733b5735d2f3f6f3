"""Padding with and without SFT packing, and training speed, on the locally generated chat set.

    .venv/bin/python bench/sft_packing.py [--examples 2000] [--steps 20] [--out bench/results/sft_packing.json]

Data: `synthetic:N` (loom/post/synthetic.py: arithmetic, word reversal/sorting, letter counts, upper-casing;
system prompts, one- and two-turn chats, prompt/completion records) in ChatML, tokenized with the config's
tokenizer (configs/tiny-sft.toml: a 4096-token BPE). For each sequence length, the fraction of row
positions that are padding over one epoch with packing (greedy, several examples per row) and without (one
example per row). Then `train.steps` steps of configs/tiny-sft.toml with and without packing: tokens/s
(all row positions) and useful tokens/s (positions holding an example), the median over the steps after
the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.config import load_config  # noqa: E402
from loom.data.tokenizer import load_tokenizer  # noqa: E402
from loom.post import sft  # noqa: E402
from loom.provenance import stamp  # noqa: E402
from loom.train.trainer import Trainer  # noqa: E402


def padding(cfg, tokenizer) -> dict:
    train, _ = sft.build_datasets(cfg, tokenizer)
    return {"rows_per_epoch": train.stats["rows_per_epoch"], "padding_fraction": round(train.stats["padding"], 4),
            "examples": train.stats["examples"], "overlong": train.stats["overlong"],
            "dropped": train.stats["dropped"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "sft_packing.json"))
    args = ap.parse_args()
    base = [f"sft.data=synthetic:{args.examples}", "log.progress=none", "log.tensorboard=false",
            "checkpoint.save_final=false", "train.eval_interval=0"]
    result = {"data": f"synthetic:{args.examples} (loom/post/synthetic.py), ChatML, configs/tiny-sft.toml tokenizer",
              "padding": {}, "training": {}}
    for seq_len in (256, 512, 1024):
        row = {}
        for packing in (False, True):
            cfg = load_config("tiny-sft", base + [f"train.seq_len={seq_len}", f"model.max_seq_len={seq_len}",
                                                  f"sft.packing={str(packing).lower()}"])
            row["packed" if packing else "padded"] = padding(cfg, load_tokenizer(cfg))
        result["padding"][str(seq_len)] = row
        print(seq_len, json.dumps(row), flush=True)
    for packing in (False, True):
        cfg = load_config("tiny-sft", base + [f"train.steps={args.steps}", f"sft.packing={str(packing).lower()}"])
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(cfg, Path(tmp) / "run", quiet=True, recipe=sft.SFT())
            trainer.fit()
            rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
            useful = 1 - trainer.train_data.stats["padding"]
        speed = statistics.median(r["tokens_per_s"] for r in rows if "loss" in r and r["step"] > 1)
        result["training"]["packed" if packing else "padded"] = {
            "seq_len": cfg.train.seq_len, "global_batch": cfg.train.global_batch, "steps": args.steps,
            "tokens_per_s": round(speed), "useful_tokens_per_s": round(speed * useful),
            "final_loss": [r for r in rows if "loss" in r][-1]["loss"]}
        print("packing" if packing else "padded", json.dumps(result["training"]["packed" if packing else "padded"]),
              flush=True)
    result.update(stamp("bench/sft_packing.py " + " ".join(sys.argv[1:])))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
