"""A run's length changed on resume (issue 53): the steps not yet taken read what a run planned for the new
length reads, and a changed length is said; and the early exits `train.exit_after_steps` /
`train.exit_after_minutes`: checkpoint, print the resume command, exit 0, every rank at the same step."""

import json
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, SMALL, run_main, small_config
from loom.train.trainer import Trainer

# fp32 (the default); the learning rate decays over a fixed count, so it does not depend on train.steps either.
FIXED_LR = "optim.decay_steps=6"


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def fit(run_dir, *overrides):
    trainer = Trainer(small_config(FIXED_LR, *overrides), run_dir, quiet=True)
    trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def planned_for_8(tmp_path_factory):
    """The reference: a run planned for 8 steps from the start, checkpointed at step 4."""
    run_dir = tmp_path_factory.mktemp("planned") / "r"
    fit(run_dir, "train.steps=8", "checkpoint.interval=4")
    return run_dir


def test_a_run_extended_on_resume_reads_what_the_longer_run_reads(tmp_path, planned_for_8, capsys):
    run_dir = tmp_path / "r"
    fit(run_dir, "train.steps=4")
    short = losses(run_dir)
    fit(run_dir, "train.steps=8", "checkpoint.resume=true")
    err = capsys.readouterr().err
    assert "note: train.steps=8 extends the checkpoint's run of 4 steps: steps 5..8 read what a run planned for " \
           "8 steps reads" in err
    assert "learning rate" not in err  # optim.decay_steps fixes the schedule: nothing to say about it
    want = losses(planned_for_8)
    assert sorted(want) == list(range(1, 9))
    assert losses(run_dir) == want  # bit for bit, steps 1-4 from the first launch and 5-8 from the resume
    assert {s: want[s] for s in short} == short


def test_a_shrunken_run_says_so_and_reads_the_same_steps(tmp_path, planned_for_8, capsys):
    """Resumed from the 8-step run's step-4 checkpoint with train.steps=6: steps 5 and 6 as planned, then the end;
    resumed at its step 8 with train.steps=6: nothing left, and said."""
    run_dir = tmp_path / "r"
    shutil.copytree(planned_for_8, run_dir)
    (run_dir / "checkpoints" / "latest").write_text("step-4\n")
    capsys.readouterr()
    fit(run_dir, "train.steps=6", "checkpoint.resume=true", "optim.decay_steps=0")
    err = capsys.readouterr().err
    assert "note: train.steps=6 shrinks the checkpoint's run of 8 steps: it now stops after step 6; steps 5..6 " \
           "read what they would have read; the learning rate now decays over 4 steps, not 6 (set " \
           "optim.decay_steps=6 to keep the checkpoint's schedule)" in err
    got, want = losses(run_dir), losses(planned_for_8)
    assert sorted(got) == list(range(1, 7)) and all(got[s] == want[s] for s in range(1, 5))
    assert got[5] == want[5]  # a step's loss is taken before its update: step 5's learning rate shows at step 6
    assert got[6] != want[6]  # the shorter decay: another learning rate at step 6
    shutil.rmtree(run_dir / "checkpoints" / "step-4")  # latest is step-6
    (run_dir / "checkpoints" / "latest").write_text("step-6\n")
    fit(run_dir, "train.steps=5", "checkpoint.resume=true")
    assert "note: train.steps=5 shrinks the checkpoint's run of 6 steps, and the checkpoint is at step 6: nothing " \
           "is left to train" in capsys.readouterr().err


def test_bad_exit_after_values_are_refused_before_launch(tmp_path):
    for value, says in (("train.exit_after_steps=-1", "train.exit_after_steps=-1 must be >= 0"),
                        ("train.exit_after_minutes=-0.5", "train.exit_after_minutes=-0.5 must be a finite number >= 0"),
                        ("train.exit_after_minutes=inf", "must be a finite number >= 0"),
                        ("train.exit_after_steps=2.5", "train.exit_after_steps='2.5' must be an integer"),
                        ("train.exit_after_minutes=soon", "train.exit_after_minutes='soon' must be a number")):
        proc = run_main("train", "--config", "tiny", "--run-dir", str(tmp_path / "r"), f"--{value}")
        assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr, (value, proc.stderr)
    assert not (tmp_path / "r").exists()


def _stop_checks(cases):
    """One step's stop check per case on this rank of a gloo group: train.exit_after_minutes=1, this rank's launch
    `minutes_ago[rank]` minutes ago, and a signal on rank `signal_rank`."""
    import torch
    import torch.distributed as dist

    from loom.train.control import RunControl

    rank, out = dist.get_rank(), []
    layout = type("Layout", (), {"distributed": True})()
    beacon = type("Beacon", (), {"mark": lambda self, what: None})()
    for minutes_ago, signal_rank in cases:
        control = RunControl(small_config("train.exit_after_minutes=1"), layout, torch.device("cpu"),
                             started=time.time() - 60 * minutes_ago[rank])
        control.stop_signal = 15 if rank == signal_rank else None
        out.append((control.stop_requested(beacon, 3), control.stop_reason))
    return out


def test_every_rank_stops_at_the_step_one_rank_passed_the_time_limit():
    """The ranks' clocks differ (nodes start apart): the step's stop check takes the latest, so every rank stops
    after the same step; a signal on one rank wins over the limit everywhere."""
    from distributed import shared_pool

    rank0, rank1 = shared_pool(2).run(_stop_checks, [([0.0, 2.0], None), ([0.0, 0.5], None), ([0.0, 2.0], 0)])
    late_on_1, in_time, signal_on_0 = zip(rank0, rank1)
    assert [stop for stop, _ in late_on_1] == [True, True]
    assert "on this rank; reached on another" in late_on_1[0][1] and "train.exit_after_minutes=1" in late_on_1[1][1]
    assert in_time == ((False, ""), (False, ""))
    assert signal_on_0 == ((True, "signal 15"), (True, "signal on another rank"))


def test_exit_after_steps_then_minutes_under_nproc_2(tmp_path):
    """`--nproc 2`: train.exit_after_steps=2 stops after step 2 (checkpoint, the resume command, exit 0, no HF export
    of an unfinished run); the printed command, with train.exit_after_minutes set so small that the first step of
    the launch passes it, continues at step 3 and stops there (the step count starts again with each launch)."""
    run_dir = tmp_path / "r"
    args = ["train", "--config", "tiny", *[f"--{o}" for o in SMALL], "--train.steps=5", "--parallel.dp_shard=2",
            "--train.exit_after_steps=2", "--nproc", "2", "--run-dir", str(run_dir),
            "--export-hf", str(tmp_path / "hf")]
    first = subprocess.run([sys.executable, "-m", "loom.cli", *args], cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stopped at train.exit_after_steps=2 (2 steps in this launch) after step 2; checkpoint saved" in first.stderr
    assert "not exported to" in first.stderr and not (tmp_path / "hf").exists()
    record = json.loads((run_dir / "stopped.json").read_text())
    assert record["step"] == 2 and record["reason"].startswith("train.exit_after_steps=2")
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-2"
    assert sorted(losses(run_dir)) == [1, 2]

    printed = re.findall(r"Resume with: (.+)$", first.stderr, re.M)
    command = shlex.split(printed[-1])
    assert command[0] == "loom" and "--nproc" in command
    second = subprocess.run([sys.executable, "-m", "loom.cli", *command[1:], "--train.exit_after_minutes=0.0001"],
                            cwd=ROOT, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    assert re.search(r"stopped at train\.exit_after_minutes=0\.0001 \([\d.]+ minutes since the launch\) after step 3; "
                     r"checkpoint saved\. Resume with: loom train", second.stderr), second.stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-3"
    assert sorted(losses(run_dir)) == [1, 2, 3]
