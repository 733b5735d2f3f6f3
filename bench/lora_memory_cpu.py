"""Peak memory of DPO and SFT with and without LoRA on CPU: what the frozen base saves, and that DPO keeps no
second model (its reference is the base with the adapters switched off).

    .venv/bin/python bench/lora_memory_cpu.py [--layers 8 --hidden 1024] [--out bench/results/lora_memory_cpu.json]

Runs `loom dpo --config tiny-dpo` and `loom sft --config tiny-sft` on a ~100M-parameter model (random weights,
fp32, 3 steps), once with full fine-tuning and once with `lora.rank=16` on all linear projections, each in its
own process, and records the run's `memory_gib` (peak resident memory of the process, metrics.jsonl) and the
banner's LoRA line. Expected from the model: full fine-tuning holds weights + gradients + two AdamW moments
(16 bytes per parameter in fp32), LoRA the frozen weights (4 bytes) plus the adapters' share; a second model
copy for DPO's reference would add another 4 bytes per parameter on top of the LoRA run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.provenance import stamp  # noqa: E402


def run(command: str, config: str, model: list[str], extra: list[str], tmp: Path) -> dict:
    run_dir = tmp / f"{command}-{len(extra)}"
    args = [command, "--config", config, "--run-dir", str(run_dir), *model, "--train.steps=3", "--log.progress=plain",
            "--log.tensorboard=false", "--checkpoint.save_final=false", "--train.eval_interval=0", *extra]
    proc = subprocess.run([sys.executable, "-m", "loom.cli", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    banner = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith(("lora", "model"))]
    return {"command": "loom " + " ".join(args[:3] + args[4:]), "memory_gib": max(r["memory_gib"] for r in steps),
            "loss": [round(r["loss"], 4) for r in steps], "banner": banner}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lora_memory_cpu.json"))
    args = ap.parse_args()
    h = args.hidden
    model = [f"--model.layers={args.layers}", f"--model.hidden={h}", "--model.heads=16", "--model.kv_heads=4",
             f"--model.ffn_hidden={h * 11 // 4 // 64 * 64}", "--model.vocab_size=4096", "--train.seq_len=128",
             "--model.max_seq_len=256", "--train.micro_batch=4", "--train.threads=2"]
    lora = ["--lora.rank=16", "--lora.alpha=32", "--lora.targets=all-linear"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for command, config, batch in (("dpo", "tiny-dpo", 8), ("sft", "tiny-sft", 4)):
            for name, extra in (("full", []), ("lora", lora)):
                row = run(command, config, model + [f"--train.global_batch={batch}"], extra, Path(tmp))
                results.append({"recipe": command, "mode": name, **row})
                print(f"{command} {name}: peak {row['memory_gib']:.3f} GiB", flush=True)
    from loom.config import load_config
    from loom.models import build_model

    cfg = load_config("tiny-dpo", [a.removeprefix("--") for a in model])
    params = sum(p.numel() for p in build_model(cfg.model).parameters())
    out = {"what": "peak resident memory (metrics.jsonl memory_gib, max over 3 steps) of loom dpo and loom sft, full "
                   "fine-tuning vs LoRA rank 16 on all linear projections, fp32, CPU, one process each",
           "params": params, "fp32_weight_gib": round(params * 4 / 2**30, 3), "runs": results,
           **stamp(" ".join(["bench/lora_memory_cpu.py", *sys.argv[1:]]))}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out} ({params / 1e6:.0f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
