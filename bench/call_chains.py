"""Where is a model built, and how deep is it? The call chains of `loom train`, `loom rl` and `loom plan`.

Runs each command in this process on a tiny config (one step) under `sys.setprofile` and prints, for the first
call of each watched function, the chain of loom frames that led to it and the total frame count (loom and
everything else: argparse, torch, the standard library). Used to show the paths before and after a refactor:

    .venv/bin/python bench/call_chains.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=160",
        "model.vocab_size=512", "model.max_seq_len=64", "train.seq_len=32", "train.micro_batch=2",
        "train.global_batch=2", "train.steps=1", "train.eval_interval=0", "data.corpus_max_bytes=100000",
        "log.progress=none", "log.tensorboard=false", "checkpoint.save_final=false"]
# Qualified names: the first call of each is recorded (every distinct chain for `__init__`).
WATCH = {
    "train": ["Transformer.__init__", "Transformer.forward"],
    "rl": ["Transformer.__init__", "Transformer.forward"],
    "plan": ["step_time", "memory"],
}


def trace(argv: list[str], watch: list[str]) -> dict:
    from loom.cli import main

    seen: dict[str, list] = {}
    pkg = str(ROOT / "loom")

    def prof(frame, event, arg):
        if event != "call":
            return
        name = frame.f_code.co_qualname
        key = next((w for w in watch if name == w and frame.f_code.co_filename.startswith(pkg)), None)
        if key is None or (key in seen and not key.endswith("__init__")):
            return
        chain, total, f = [], 0, frame
        while f is not None:
            total += 1
            if f.f_code.co_filename.startswith(pkg):
                rel = os.path.relpath(f.f_code.co_filename, ROOT)
                chain.append(f"{rel}:{f.f_code.co_qualname}")
            f = f.f_back
        entry = {"loom_frames": len(chain), "all_frames": total, "chain": chain[::-1]}
        if key not in seen:
            seen[key] = entry
        elif all(entry["chain"] != e["chain"] for e in [seen[key], *seen.get(key + " (also)", [])]):
            seen.setdefault(key + " (also)", []).append(entry)  # every distinct way a model gets built

    sys.setprofile(prof)
    try:
        rc = main(argv)
    finally:
        sys.setprofile(None)
    return {"argv": argv, "rc": rc, "first_calls": seen}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="also write the chains here")
    args = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        out["train"] = trace(["train", "--config", "tiny", "--run-dir", str(t / "train"),
                              *[f"--{o}" for o in TINY]], WATCH["train"])
        rl = [o for o in TINY if not o.startswith(("model.", "train.micro", "train.global", "train.seq"))]
        out["rl"] = trace(["rl", "--config", "tiny-grpo", "--run-dir", str(t / "rl"), *[f"--{o}" for o in rl],
                           "--model.layers=2", "--train.micro_batch=8", "--train.global_batch=8",
                           "--rl.group_size=4", "--rl.max_new_tokens=4"], WATCH["rl"])
        out["plan"] = trace(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--top", "1"],
                            WATCH["plan"])
    for cmd, r in out.items():
        print(f"\n## loom {cmd} (exit {r['rc']})")
        for key, cs in r["first_calls"].items():
            for c in cs if isinstance(cs, list) else [cs]:
                print(f"{key}: {c['loom_frames']} loom frames of {c['all_frames']}")
                print("   " + "\n → ".join(c["chain"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
