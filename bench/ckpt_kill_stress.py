"""SIGKILL a whole training job at random moments while it checkpoints every step; check what is left.

Each trial starts `loom train --nproc 2 --parallel.dp_shard=2 --checkpoint.interval=1` (or one
process with `--nproc 1`), alternating synchronous and `checkpoint.async=true` saves), waits a random time within the run, and kills the
launcher and its workers at once (SIGKILL to every process of the job; torchrun starts each worker in
a session of its own, so a process-group kill would miss them). Nothing gets to clean up. Then:

- `checkpoints/latest`, if present, must name a complete checkpoint: every file matches the manifest
  (`loom.train.checkpoint.verify`) and the weights load in one process (`loom.models.io`);
- `--checkpoint.resume=true` must finish the run, and its losses must equal an undisturbed run's
  exactly (same layout, fp32).

    python bench/ckpt_kill_stress.py --trials 20        # writes bench/results/ckpt_kill_stress.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMALL = [
    "model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=160",
    "model.vocab_size=512", "model.max_seq_len=64", "train.seq_len=32", "train.micro_batch=4",
    "train.global_batch=8", "train.eval_samples=8", "optim.warmup_steps=2", "optim.lr=3e-3",
    "data.corpus_max_bytes=300000", "log.progress=none", "log.tensorboard=false", "checkpoint.interval=1",
]
NPROC = 2


def command(run_dir: Path, steps: int, mode: str, *extra: str) -> list[str]:
    layout = ["--nproc", str(NPROC), f"--parallel.dp_shard={NPROC}"] if NPROC > 1 else []
    return [sys.executable, "-m", "loom.cli", "train", "--config", "tiny", "--run-dir", str(run_dir), *layout,
            *[f"--{o}" for o in SMALL], f"--train.steps={steps}", f"--checkpoint.async={str(mode == 'async').lower()}",
            *extra]


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def steps_done(run_dir: Path) -> int:
    try:
        return sum('"loss"' in x for x in (run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_job(pid: int) -> int:
    """SIGKILL `pid` and all its descendants (Linux /proc); wait until none runs. Returns how many."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    job, todo = [], [pid]
    while todo:
        p = todo.pop()
        job.append(p)
        todo += children.get(p, [])
    for p in job:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 30
    while any(_alive(p) for p in job[1:]) and time.time() < deadline:
        time.sleep(0.01)
    assert not any(_alive(p) for p in job[1:]), "job processes survived SIGKILL"
    return len(job)


def check_latest(run_dir: Path) -> dict:
    """What `latest` names, and whether it is complete (manifest checksums, weights load)."""
    from loom.errors import UserError
    from loom.models.io import load_model_dir
    from loom.train.checkpoint import latest_checkpoint, verify

    root = run_dir / "checkpoints"
    out = {"leftover_tmp_dirs": sorted(p.name for p in root.glob(".tmp-*")) if root.is_dir() else []}
    try:
        latest = latest_checkpoint(root)
        out["latest"] = latest.name if latest else None
        if latest is not None:
            verify(latest)
            load_model_dir(latest)
        out["latest_complete"] = True
    except UserError as exc:
        out["latest_complete"] = False
        out["error"] = str(exc)
    return out


def trial(i: int, steps: int, reference: list[float], work: Path, rng: random.Random, env: dict) -> dict:
    mode = "sync" if i % 2 == 0 else "async"
    run_dir = work / f"trial-{i}"
    # Kill once the run has made `after` steps, plus a random fraction of a step.
    after = rng.randint(1, steps - 2)
    proc = subprocess.Popen(command(run_dir, steps, mode), cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while steps_done(run_dir) < after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.4))
    killed = kill_job(proc.pid)
    proc.wait()
    result = {"trial": i, "mode": mode, "processes_killed": killed, "killed_after_steps": steps_done(run_dir),
              **check_latest(run_dir)}
    t0 = time.time()
    # Killed before its first checkpoint committed: nothing to resume, so the same command starts again (partial
    # .tmp-* directories do not count as checkpoints) and must still reproduce the reference.
    again = ("--checkpoint.resume=true",) if result.get("latest") is not None else ()
    resumed = subprocess.run(command(run_dir, steps, mode, *again), cwd=ROOT, env=env, capture_output=True, text=True)
    result["resume_exit_code"] = resumed.returncode
    result["resume_s"] = round(time.time() - t0, 1)
    if resumed.returncode != 0:
        result["resume_stderr"] = resumed.stderr[-2000:]
    result["losses_equal_reference"] = resumed.returncode == 0 and losses(run_dir) == reference
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nproc", type=int, default=2, choices=[1, 2])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "ckpt_kill_stress.json"))
    args = parser.parse_args()
    from loom.provenance import stamp

    global NPROC
    NPROC = args.nproc
    provenance = stamp("python bench/ckpt_kill_stress.py " + " ".join(sys.argv[1:]))  # the commit that runs
    rng = random.Random(args.seed)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # the caller's loom cache when LOOM_CACHE is set (a test session's: the tokenizer and token files are
        # built already), else a private one: the runs share it either way, built by the reference run
        env["LOOM_CACHE"] = os.environ.get("LOOM_CACHE") or str(work / "cache")
        t0 = time.time()
        ref = subprocess.run(command(work / "reference", args.steps, "sync"), cwd=ROOT, env=env,
                             capture_output=True, text=True)
        if ref.returncode != 0:
            print(ref.stderr[-3000:], file=sys.stderr)
            return 1
        reference = losses(work / "reference")
        trials = []
        for i in range(args.trials):
            trials.append(trial(i, args.steps, reference, work, rng, env))
            print(json.dumps({k: v for k, v in trials[-1].items() if k != "resume_stderr"}), flush=True)
    summary = {
        "trials": len(trials),
        "latest_complete": sum(t["latest_complete"] for t in trials),
        "no_checkpoint_yet": sum(t.get("latest") is None for t in trials),
        "resumed_ok": sum(t["resume_exit_code"] == 0 for t in trials),
        "losses_equal_reference": sum(t["losses_equal_reference"] for t in trials),
        "killed_with_a_partial_tmp_dir": sum(bool(t["leftover_tmp_dirs"]) for t in trials),
        "wall_s": round(time.time() - t0, 1),
    }
    print(json.dumps(summary))
    out = {"summary": summary, "trials": trials, "steps": args.steps, "seed": args.seed, "nproc": NPROC, **provenance}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    ok = summary["latest_complete"] == summary["resumed_ok"] == summary["losses_equal_reference"] == len(trials)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
