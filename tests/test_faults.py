"""Preemption (SIGTERM), non-finite steps, and the diagnosis when a run diverges."""

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, SMALL, small_config
from loom.cli import main
from loom.errors import TrainingDiverged
from loom.train.trainer import Trainer


def losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_sigterm_saves_and_resume_matches_uninterrupted_run(tmp_path):
    steps = ["--train.steps=120", "--train.eval_samples=4"]
    args = ["train", "--config", "tiny", *[f"--{o}" for o in SMALL], *steps]
    full = tmp_path / "full"
    assert main([*args, "--run-dir", str(full)]) == 0

    run_dir = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "loom.cli", *args, "--run-dir", str(run_dir)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "--checkpoint.resume=true" in out + err
    stopped_at = len(losses(run_dir))
    assert 5 <= stopped_at < 120
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stopped_at}"

    assert main([*args, "--run-dir", str(run_dir), "--checkpoint.resume=true"]) == 0
    assert losses(run_dir) == losses(full)  # bit-exact: same losses, in fp32, as the uninterrupted run


def test_one_non_finite_step_is_skipped(tmp_path):
    trainer = Trainer(small_config("train.steps=5"), tmp_path / "r", quiet=True)
    weight = trainer.model.layers["1"].feed_forward.w2.weight
    calls = {"n": 0}

    def poison_once(grad):
        calls["n"] += 1
        # 2 micro-batches per step: call 5 is the first micro-batch of step 3
        return torch.full_like(grad, float("nan")) if calls["n"] == 5 else grad

    weight.register_hook(poison_once)
    before = {}
    original_step = trainer.train_step

    def step_and_record():
        before[trainer.state.step + 1] = weight.detach().clone()
        return original_step()

    trainer.train_step = step_and_record
    trainer.fit()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert torch.equal(before[3], before[4])  # the skipped step 3 left the weights as they were
    assert not torch.equal(before[2], before[3]) and not torch.equal(before[4], weight.detach())


def test_divergence_stops_with_exit_3_and_names_the_tensor(tmp_path, capsys):
    trainer = Trainer(small_config("train.steps=20", "train.max_skipped_consecutive=3"), tmp_path / "r", quiet=True)
    with torch.no_grad():
        trainer.model.layers["1"].feed_forward.w3.weight[0, 0] = float("inf")
    with pytest.raises(TrainingDiverged) as err:
        trainer.fit()
    message = str(err.value)
    assert "3 consecutive steps" in message and "step 3" in message
    assert "layers.1.feed_forward.w3" in message  # the first module whose output is non-finite
    assert "non-finite parameters: layers.1.feed_forward.w3.weight" in message


def test_divergence_exit_code_through_cli(tmp_path, capsys):
    code = main(["train", "--config", "tiny", "--run-dir", str(tmp_path / "r"), *[f"--{o}" for o in SMALL],
                 "--optim.lr=1e30", "--optim.warmup_steps=0", "--train.grad_clip=0", "--train.steps=30",
                 "--train.max_skipped_consecutive=2"])
    assert code == 3
    assert "training diverged" in capsys.readouterr().err


def _children(pid):
    """Worker PIDs (loom.cli processes) whose parent is `pid` (Linux /proc)."""
    import os

    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read() if os.path.exists(f"/proc/{entry}/cmdline") else b""
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"loom.cli" in cmdline:
                out.append(int(entry))
    return out


def test_killed_worker_is_restarted_and_run_completes_like_undisturbed(tmp_path):
    import os

    from pool_launch import launch_in_pool

    overrides = [*SMALL, "train.steps=24", "checkpoint.interval=2", "parallel.dp_shard=2"]
    args = ["train", "--config", "tiny", *[f"--{o}" for o in overrides], "--nproc", "2"]
    full = tmp_path / "full"  # the undisturbed run: the same workers' run, in the session's kept rank processes
    launch_in_pool("train", "tiny", full, 2, overrides)
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "loom.cli", *args, "--run-dir", str(run_dir), "--max-restarts", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and not (run_dir / "checkpoints" / "latest").exists():
        time.sleep(0.05)
    time.sleep(0.5)
    workers = _children(proc.pid)
    assert workers, "no worker processes found"
    os.kill(workers[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert losses(run_dir)[-1] == pytest.approx(losses(full)[-1], rel=1e-6)
    assert len(losses(run_dir)) == 24


def test_killed_worker_without_restarts_stops_promptly(tmp_path):
    import os

    args = ["train", "--config", "tiny", *[f"--{o}" for o in SMALL], "--train.steps=400", "--parallel.dp_shard=2",
            "--nproc", "2", "--run-dir", str(tmp_path / "r")]
    proc = subprocess.Popen([sys.executable, "-m", "loom.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and not ((tmp_path / "r" / "metrics.jsonl").exists()
                                          and (tmp_path / "r" / "metrics.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.05)
    os.kill(_children(proc.pid)[-1], signal.SIGKILL)
    t0 = time.time()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.time() - t0 < 60
    assert "worker(s) failed" in err


def _kill_stress(tmp_path, nproc, trials, steps):
    """bench/ckpt_kill_stress.py: SIGKILL the whole job at random moments while it checkpoints every step
    (sync and async alternately); `latest` must name a complete checkpoint and resuming must reproduce
    the undisturbed run's losses exactly."""
    out = tmp_path / "kill.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ckpt_kill_stress.py"), "--trials", str(trials),
                           "--steps", str(steps), "--nproc", str(nproc), "--seed", str(time.time_ns() % 1000),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["latest_complete"] == summary["resumed_ok"] == summary["losses_equal_reference"] == trials


def test_sigkill_while_checkpointing_every_step_one_process(tmp_path):
    _kill_stress(tmp_path, nproc=1, trials=2, steps=6)  # killed after 1-4 steps, + a random part of one


@pytest.mark.slow  # ~90 s: three 2-process runs killed and resumed
def test_sigkill_while_checkpointing_every_step_two_processes(tmp_path):
    _kill_stress(tmp_path, nproc=2, trials=3, steps=12)


def test_a_save_killed_before_it_committed_does_not_block_starting_again(tmp_path, capsys):
    """A run killed during its first save leaves only `.tmp-step-N/`: the same command starts again (and its
    first save removes the partial directory); a committed checkpoint still makes it refuse (exit 2)."""
    ckpt = tmp_path / "r" / "checkpoints"
    (ckpt / ".tmp-step-1").mkdir(parents=True)
    args = ["train", "--config", "tiny", *[f"--{o}" for o in SMALL], "--train.steps=1", "--run-dir", str(tmp_path / "r")]
    assert main(args) == 0
    assert not (ckpt / ".tmp-step-1").exists() and (ckpt / "step-1").is_dir()
    assert main(args) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
