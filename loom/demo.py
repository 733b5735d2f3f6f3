"""`make demo`: train the tiny model on the embedded corpus on CPU, evaluate, and show a sample.

The bar it must clear: bits per byte on held-out Python source below gzip -9 on the same bytes.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from loom.config import load_config
from loom.data.tokenizer import Tokenizer
from loom.infer.engine import Engine
from loom.infer.sampling import SamplingParams
from loom.models.io import load_model_dir
from loom.provenance import stamp
from loom.train.trainer import Trainer

PROMPT = "import os\n\n\ndef "
NEW_TOKENS = 120


def complete(model, tok: Tokenizer, prompt: str) -> str:
    """`prompt` and its continuation by the generation engine: temperature 0.7, top-k 40, seed 0, up to
    NEW_TOKENS tokens or the end of a document."""
    ids = tok.encode(prompt)
    engine = Engine(model, max_batch=1, max_len=min(model.cfg.max_seq_len, len(ids) + NEW_TOKENS))
    stop = () if tok.eod_id is None else (tok.eod_id,)
    done = engine.generate([ids], SamplingParams(temperature=0.7, top_k=40, max_new_tokens=NEW_TOKENS,
                                                 stop_token_ids=stop, seed=0))[0]
    return tok.decode([i for i in ids + done.tokens if i != tok.eod_id])


def main(argv: list[str] | None = None) -> int:
    overrides = list(argv if argv is not None else sys.argv[1:])
    run_dir = Path("runs/demo")
    if run_dir.exists():
        shutil.rmtree(run_dir)  # the demo's own directory: each demo starts fresh
    cfg = load_config("tiny", [o.removeprefix("--") for o in overrides])
    print(f"loom demo: training {cfg.name} ({cfg.model.layers} layers, hidden {cfg.model.hidden}, "
          f"{cfg.train.steps} steps of {cfg.train.global_batch}x{cfg.train.seq_len} tokens) on the Python "
          f"standard library, {torch.get_num_threads()} CPU threads", flush=True)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, run_dir)
    print(f"tokenizer and data ready in {time.perf_counter() - t0:.0f}s", flush=True)
    t1 = time.perf_counter()
    result = trainer.fit()
    train_s = time.perf_counter() - t1

    model, _, ckpt = load_model_dir(run_dir)
    tok = Tokenizer.from_file(ckpt / "tokenizer.json")
    sample = complete(model, tok, PROMPT)
    print("\n--- sample (temperature 0.7, top-k 40, seed 0) " + "-" * 23)
    print(sample)
    print("-" * 70)
    print(f"training took {train_s:.0f}s; run directory: {run_dir} (metrics.jsonl, checkpoints/, tokenizer.json)")
    print(f"held-out: val_loss {result['val_loss']:.3f} nats/token, val_bpb {result['val_bpb']:.3f} bits/byte; "
          f"gzip -9 {result['gzip_bpb']:.3f}, xz -9 {result['xz_bpb']:.3f} bits/byte on the same text")
    print(f"try: loom generate --checkpoint {run_dir} --prompt 'class ' --temperature 0.8 --top-k 40")
    summary = {**result, "train_seconds": round(train_s, 1), "steps": cfg.train.steps, "sample": sample,
               **stamp("make demo")}
    (run_dir / "demo.json").write_text(json.dumps(summary, indent=2) + "\n")
    if result["val_bpb"] >= result["gzip_bpb"]:
        print("FAILED: the model did not beat gzip on held-out text", file=sys.stderr)
        return 1
    print("the model beats gzip on held-out Python source")
    return 0


if __name__ == "__main__":
    sys.exit(main())
