"""Asynchronous against synchronous RL on CPU (issue 56): the same GRPO run, `--nproc 3` both ways:
synchronous (three data-parallel ranks, the engine in each) and `rl.mode=async` (one generation rank, two
training ranks, `rl.max_staleness=1`, truncated importance weights), same steps; held-out reward and wall time.

    .venv/bin/python bench/rl_async.py [--steps 40] [--out bench/results/rl_async_cpu.json]

The task: tests/rl_rewards.py's `ones` (the share of 1s in a completion, a reward a random policy climbs) on
loom's addition prompts; the held-out reward is the run's last `val_reward_sampled` (sampled as in
training, one fixed seed per prompt) and `val_reward` (greedy). Wall time: the whole `loom rl` command,
start-up included, and the sum of its step times.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.provenance import stamp  # noqa: E402

MODEL = ["model.max_seq_len=32", "train.seq_len=24", "train.global_batch=96", "train.micro_batch=16",
         "train.eval_interval=0", "log.progress=none", "log.tensorboard=false", "rl.prompts=addition:2000",
         "rl.valid_prompts=addition:48", "rl.reward=rl_rewards:ones", "rl.group_size=8", "rl.max_new_tokens=16",
         "rl.engine_batch=96", "rl.tis_cap=2", "optim.lr=1e-3", "optim.min_lr=1e-3", "optim.warmup_steps=0",
         "checkpoint.save_final=false"]  # tiny-grpo's model (4 layers, hidden 128), random initialisation


def run(run_dir: Path, steps: int, extra: list[str]) -> dict:
    command = ["rl", "--config", "tiny-grpo", "--run-dir", str(run_dir), "--nproc", "3",
               *[f"--{o}" for o in MODEL], f"--train.steps={steps}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "loom.cli", *command], cwd=ROOT, check=True, env=env)
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_reward" in r]
    out = {"command": "loom " + " ".join(command), "wall_s": round(wall, 2),
           "step_time_s": round(sum(r["step_time_s"] for r in steps_), 2),
           "val_reward": evals[-1]["val_reward"], "val_reward_sampled": evals[-1]["val_reward_sampled"],
           "val_reward_sampled_start": evals[0]["val_reward_sampled"],
           "train_reward_last5": sum(r["reward"] for r in steps_[-5:]) / 5,
           "generation_s_mean": sum(r["generation_s"] for r in steps_) / len(steps_)}
    if "staleness_mean" in steps_[-1]:
        out.update(staleness_max=max(r["staleness_max"] for r in steps_),
                   stale_dropped=sum(r["stale_dropped"] for r in steps_),
                   is_weight_max=max(r.get("is_weight_max", 0) for r in steps_))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default=str(ROOT / "bench/results/rl_async_cpu.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(Path(tmp) / "sync", args.steps, [])
        asyn = run(Path(tmp) / "async", args.steps, ["--rl.mode=async", "--rl.generation_ranks=1",
                                                     "--rl.max_staleness=1"])
    result = {**stamp(" ".join(["bench/rl_async.py", *sys.argv[1:]])), "sync": sync, "async": asyn,
              "wall_ratio": round(asyn["wall_s"] / sync["wall_s"], 3),
              "step_time_ratio": round(asyn["step_time_s"] / sync["step_time_s"], 3),
              "val_reward_sampled_gap_points": round(100 * (sync["val_reward_sampled"]
                                                           - asyn["val_reward_sampled"]), 2)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
