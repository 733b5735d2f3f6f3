"""Host synchronisations per training step on a GPU, as CUDA itself reports them (issue 58).

    .venv/bin/python bench/host_syncs_gpu.py --out F.json [--steps 6] [--smoke]

Trains small runs in this process on `cuda` with `torch.cuda.set_sync_debug_mode("warn")`, which makes every
synchronising CUDA call (`.item()`, `.tolist()`, `cuda.synchronize()`, a blocking copy from pageable memory,
...) warn, and counts the warnings of each step (`Trainer.timed_step`; evaluation and checkpoints are outside
it) by the source line that made them. tests/test_host_syncs.py counts loom's calls on CPU; this is what only
a GPU shows: torch's own synchronisations and blocking copies. docs/training.md ("Host synchronisations per
step") says what a step should make: one transfer. Step 1 (lazy initialisation) is reported apart.

`--smoke` (CPU): the same runs without the debug mode (CPU has none), to check the script itself.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.provenance import stamp  # noqa: E402

SMALL = ["model.layers=2", "model.hidden=256", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=512",
         "model.vocab_size=512", "model.max_seq_len=128", "train.seq_len=64", "train.micro_batch=4",
         "train.global_batch=8", "data.corpus_max_bytes=300000", "log.progress=none", "log.tensorboard=false",
         "checkpoint.interval=0", "checkpoint.save_final=false", "train.eval_interval=0"]
CASES = {
    "train": ("tiny", []),
    "train-bf16": ("tiny", ["train.dtype=bfloat16"]),
    "sft": ("tiny-sft", ["sft.data=synthetic:200"]),
    "moe": ("tiny-moe", ["model.moe.router=sigmoid_bias"]),
}


def run(name: str, steps: int, device: str) -> dict:
    import torch

    from loom.config import load_config
    from loom.train.trainer import Trainer

    config, extra = CASES[name]
    cfg = load_config(config, SMALL + extra + [f"train.steps={steps}", f"train.device={device}"])
    recipe = None
    if config == "tiny-sft":
        from loom.post.sft import SFT

        recipe = SFT()
    trainer = Trainer(cfg, Path(tempfile.mkdtemp()) / "run", quiet=True, recipe=recipe)
    per_step: list[collections.Counter] = []
    timed = trainer.timed_step

    def counted_step():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            row = timed()
        per_step.append(collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                            if "synchroniz" in str(w.message)))
        return row

    trainer.timed_step = counted_step
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        trainer.fit()
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    later = per_step[1:]
    where = sum(later, collections.Counter())
    return {"case": name, "settings": SMALL + extra, "steps": steps,
            "first_step_syncs": sum(per_step[0].values()) if per_step and cuda else None,
            "syncs_per_step": [sum(c.values()) for c in later] if cuda else None,
            "where_after_step_1": dict(where.most_common()) if cuda else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--smoke", action="store_true", help="CPU, no sync debug mode: check the script runs")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    rows = []
    for name in args.cases:
        try:
            rows.append(run(name, args.steps, device))
        except Exception as exc:  # one case failing keeps the others
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"})
        Path(args.out).write_text(json.dumps({"benchmark": "host_syncs_gpu", "device": device, "rows": rows,
                                              **stamp("python bench/host_syncs_gpu.py " + " ".join(sys.argv[1:]))},
                                             indent=2) + "\n")
        print(json.dumps(rows[-1]), flush=True)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
