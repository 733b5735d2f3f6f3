"""Bit-for-bit fingerprint of training in the reference layouts: per-step loss and grad norm, as hex floats.

A change that is not about computation (a refactor, a rename, a file split) must leave every number here
identical. Record once, change the code, then check:

    .venv/bin/python bench/layout_fingerprint.py --out bench/results/layout_fingerprint.json
    .venv/bin/python bench/layout_fingerprint.py --check bench/results/layout_fingerprint.json

Each layout is `loom train --config tiny --nproc N` on CPU (gloo) for 6 steps of test_parallel's model. The
check exits 1 naming each layout and step whose loss or grad norm differs in any bit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL = [
    "model.layers=4", "model.hidden=64", "model.heads=8", "model.kv_heads=4", "model.ffn_hidden=160",
    "model.vocab_size=512", "model.max_seq_len=64", "train.seq_len=32", "train.micro_batch=2",
    "train.global_batch=16", "train.steps=6", "train.eval_interval=0", "optim.warmup_steps=2", "optim.lr=3e-3",
    "data.corpus_max_bytes=300000", "log.progress=none", "log.tensorboard=false", "checkpoint.save_final=false",
]
UNTIED = ["model.tie_embeddings=false"]
MOE = ["model.moe.experts=8", "model.moe.ffn_hidden=32", "model.moe.top_k=2", "model.moe.z_loss_coeff=0.001",
       "train.seed=1"]

# name: (processes, overrides)
LAYOUTS = {
    "single": (1, []),
    "bf16": (1, ["train.dtype=bfloat16"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "fsdp2": (2, ["parallel.dp_shard=2"]),
    "pp2-1f1b": (2, UNTIED + ["parallel.pp=2"]),
    "pp2-vpp2-interleaved": (2, UNTIED + ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"]),
    "pp2-vpp2-zbv": (2, UNTIED + ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zero_bubble"]),
    "moe-ep2": (2, MOE + ["parallel.dp_shard=2", "parallel.ep=2"]),
}


def run(name: str, nproc: int, extra: list[str], work: Path) -> dict:
    run_dir = work / name
    cmd = [sys.executable, "-m", "loom.cli", "train", "--config", "tiny", "--run-dir", str(run_dir),
           "--nproc", str(nproc), *[f"--{o}" for o in MODEL + extra]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: loom train exited {proc.returncode}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    return {"nproc": nproc, "overrides": extra,
            "loss": [float(r["loss"]).hex() for r in rows], "grad_norm": [float(r["grad_norm"]).hex() for r in rows]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the fingerprint here")
    ap.add_argument("--check", type=Path, help="compare against this recorded fingerprint")
    ap.add_argument("--only", nargs="*", default=None, help=f"layouts to run (default all: {', '.join(LAYOUTS)})")
    args = ap.parse_args()
    if not args.out and not args.check:
        ap.error("give --out FILE (record) or --check FILE (compare)")
    names = args.only or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; valid: {', '.join(LAYOUTS)}")
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            t = time.perf_counter()
            got[name] = run(name, *LAYOUTS[name], Path(tmp))
            print(f"{name:22s} {time.perf_counter() - t:5.1f} s  loss[-1]={float.fromhex(got[name]['loss'][-1]):.6f}",
                  flush=True)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        import torch
        doc = {"commit": commit, "torch": torch.__version__, "command": " ".join(sys.argv), "layouts": got}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if args.check:
        ref = json.loads(args.check.read_text())["layouts"]
        bad = []
        for name in names:
            for key in ("loss", "grad_norm"):
                a, b = ref[name][key], got[name][key]
                for step, (x, y) in enumerate(zip(a, b), 1):
                    if x != y:
                        bad.append(f"{name} step {step} {key}: recorded {float.fromhex(x)!r}, now {float.fromhex(y)!r}")
                if len(a) != len(b):
                    bad.append(f"{name} {key}: recorded {len(a)} steps, now {len(b)}")
        if bad:
            print("DIFFERENT:\n  " + "\n  ".join(bad))
            return 1
        print(f"identical: {len(names)} layouts, every loss and grad norm bit for bit")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
