"""Run control and first contact: hang classification, resuming, the stop of a multi-process run, the
start-up banner and progress lines, and the pluggable loss of the step runners."""

import json
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, SMALL, small_config
from loom.errors import CollectiveTimeout, UserError
from loom.train.hang import Beacon, is_collective_failure
from loom.train.trainer import Trainer


class FakeStore:
    def __init__(self, posts):
        self.posts = posts

    def check(self, keys):
        return all(k in self.posts for k in keys)

    def get(self, key):
        return self.posts[key].encode()


def beacon_of_rank_0_with_rank_1_behind():
    beacon = Beacon(5.0)
    beacon.store, beacon.rank, beacon.world = FakeStore({"loom/beacon/1": "1|start-up"}), 0, 2
    beacon.seq, beacon.what = 3, "step 2: train"
    return beacon


def test_hangs_are_classified_by_exception_type_not_message():
    beacon = beacon_of_rank_0_with_rank_1_behind()
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms "
                        "for recv operation to complete")
    explained = beacon.explain(gloo)
    assert isinstance(explained, CollectiveTimeout) and "rank 1 did not get there" in str(explained)
    assert isinstance(beacon.explain(torch.distributed.DistBackendError("NCCL watchdog: timed out")), CollectiveTimeout)
    # A file system's timeout, or any other error whose text says "timed out", keeps its traceback.
    for other in (OSError(110, "Connection timed out"), TimeoutError("timed out"), ValueError("timeout")):
        assert not is_collective_failure(other)
        assert beacon.explain(other) is None


def test_resume_on_a_run_dir_without_checkpoints_is_refused(tmp_path):
    with pytest.raises(UserError, match="holds no checkpoint"):
        Trainer(small_config("checkpoint.resume=true"), tmp_path / "typo", quiet=True)
    assert not (tmp_path / "typo").exists()  # nothing written


def test_banner_first_progress_line_eta_and_announcements(tmp_path, capsys):
    from loom.models import build_model

    cfg = small_config("log.progress=plain", "train.steps=12", "train.log_interval=5", "checkpoint.interval=6",
                       "data.corpus_max_bytes=10000", "train.global_batch=32")
    Trainer(cfg, tmp_path / "r").fit()
    out = capsys.readouterr().out
    params = sum(p.numel() for p in build_model(cfg.model).parameters())
    assert f"{params / 1e6:,.1f}M parameters" in out
    assert f"32 x 32 = {32 * 32:,} tokens per step" in out
    assert "validation   the embedded corpus's held-out files" in out
    assert f"run dir      {tmp_path / 'r'}" in out
    steps = [int(m) for m in re.findall(r"^step +(\d+)/12 ", out, re.M)]
    assert steps == [1, 5, 10, 12]  # the first step at once, then every log_interval, and the last
    assert re.search(r"eta \d+:\d\d:\d\d", out)
    assert f"step 6: checkpoint {tmp_path / 'r' / 'checkpoints' / 'step-6'}" in out
    # 10 kB of corpus is a few hundred samples of 33 tokens: 12 steps x 32 samples pass over it at least once.
    tokens = int(re.search(r"data +([\d,]+) tokens", out).group(1).replace(",", ""))
    passes = 12 * 32 // ((tokens - 1) // 32)
    assert passes >= 1
    announced = re.findall(r"pass (\d+) complete, documents repeat", out)
    assert announced == [str(k) for k in range(1, min(passes, 2) + 1)]  # the first two, then a count of the rest
    if passes > 2:
        assert f"({passes - 2} more passes follow" in out
    # Advice under the banner: warmup longer than the run (the default 10 > 6 steps here).
    cfg = small_config("log.progress=plain", "train.steps=2", "optim.warmup_steps=4", "data.corpus_max_bytes=10000")
    Trainer(cfg, tmp_path / "r2").fit()
    assert "note: optim.warmup_steps=4 > train.steps=2" in capsys.readouterr().out


def test_ctrl_c_under_nproc_exits_0_and_the_printed_resume_command_works(tmp_path):
    """Ctrl-C reaches the launcher only (torchrun's workers run in their own sessions); the launcher passes
    SIGTERM on, the workers checkpoint, and the launcher exits 0 — not 1 with a SignalException traceback.
    The printed command resumes as printed although the run was started with many overrides."""
    run_dir = tmp_path / "r"
    args = ["train", "--config", "tiny", *[f"--{o}" for o in SMALL], "--train.steps=30", "--train.global_batch=16",
            "--parallel.dp_shard=2", "--nproc", "2", "--run-dir", str(run_dir)]
    proc = subprocess.Popen([sys.executable, "-m", "loom.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "SignalException" not in err and "Traceback" not in err
    printed = re.findall(r"Resume with: (.+)$", err, re.M)
    assert printed, err[-2000:]
    stopped_at = json.loads((run_dir / "stopped.json").read_text())["step"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stopped_at}"

    assert stopped_at < 30
    command = shlex.split(printed[-1])
    assert command[0] == "loom"
    resumed = subprocess.run([sys.executable, "-m", "loom.cli", *command[1:]], cwd=ROOT, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if '"loss"' in x]
    assert [r["step"] for r in rows] == list(range(1, 31))


def test_a_custom_loss_plugs_into_the_step_runner(tmp_path):
    """A loss that counts only some tokens (as a masked SFT loss will) gets the mean over exactly those,
    through the same runner: here the loss over the second half of every sequence."""
    from loom.models import build_model
    from loom.models.losses import Loss, token_loss_sum
    from loom.train.recipe import Recipe

    class SecondHalf(Loss):
        count_varies = True

        def __call__(self, output, batch):
            half = batch["labels"].shape[1] // 2
            return token_loss_sum(output[:, half:], batch["labels"][:, half:])

        def count(self, batch):
            return batch["labels"][:, batch["labels"].shape[1] // 2:].numel()

    cfg = small_config("train.steps=1")
    class SecondHalfRecipe(Recipe):
        def loss(self, cfg):
            return SecondHalf()

    trainer = Trainer(cfg, tmp_path / "r", quiet=True, recipe=SecondHalfRecipe())
    first = trainer.train_data.batch(0, cfg.train.global_batch)
    x, y = first["input_ids"], first["labels"]
    reference = build_model(cfg.model, seed=cfg.train.seed)  # the same initial weights, built independently
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(reference(x)[:, 16:].flatten(0, 1), y[:, 16:].flatten()).item()
    trainer.fit()
    got = [json.loads(r) for r in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()][0]["loss"]
    assert got == pytest.approx(want, rel=1e-5)
    full = torch.nn.functional.cross_entropy(reference(x).flatten(0, 1), y.flatten()).item()
    assert abs(got - full) > 1e-3  # the loss really is the custom one


def test_loom_memory_counts_sdpa_as_a_fused_kernel_on_meta_and_says_so():
    from loom.memory import format_table, measure_activations, report

    cfg = small_config("train.seq_len=64", "model.max_seq_len=64")
    meta = measure_activations(cfg, device="meta")["layer_activation_bytes"]
    real = measure_activations(cfg, device="cpu")["layer_activation_bytes"]  # SDPA's flash path on CPU
    assert meta == real
    math_cfg = small_config("train.seq_len=64", "model.max_seq_len=64", "model.attention=math")
    s, b, a = 64, cfg.train.micro_batch, cfg.model.heads
    assert measure_activations(math_cfg, device="meta")["layer_activation_bytes"] >= meta + 4 * b * a * s * s  # the fp32 probabilities
    assert "attention counted as: fused kernel" in format_table(report(cfg))


def _trained(tmp_path, *extra):
    run = tmp_path / "r"
    Trainer(small_config("checkpoint.interval=3", *extra), run, quiet=True).fit()
    return run


def test_a_failure_while_loading_keeps_its_traceback_and_never_falls_back(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    run = _trained(tmp_path)

    def broken_disk(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(dcp, "load", broken_disk)
    for fallback in ("false", "true"):  # not bad input (exit 2), and not a reason to roll back to step-3
        with pytest.raises(OSError, match="Input/output error"):
            Trainer(small_config("checkpoint.resume=true", f"checkpoint.fallback={fallback}"), run, quiet=True)


def test_a_key_or_shape_mismatch_is_bad_input_naming_the_tensor(tmp_path, monkeypatch):
    from loom.train.checkpoint import Checkpointer

    run = _trained(tmp_path)
    original = Checkpointer._state

    def with_extra_tensor(self):
        state = original(self)
        state["model"]["extra.weight"] = torch.zeros(3)
        return state

    monkeypatch.setattr(Checkpointer, "_state", with_extra_tensor)
    with pytest.raises(UserError, match="model.extra.weight is missing"):
        Trainer(small_config("checkpoint.resume=true"), run, quiet=True)


def test_changed_settings_on_resume_name_old_and_new_values(tmp_path):
    run = _trained(tmp_path)
    with pytest.raises(UserError, match="train.global_batch: 8 in the checkpoint, 16 now"):
        Trainer(small_config("checkpoint.resume=true", "train.global_batch=16"), run, quiet=True)
    with pytest.raises(UserError, match="model.ffn_hidden: 160 in the checkpoint, 192 now"):
        Trainer(small_config("checkpoint.resume=true", "model.ffn_hidden=192"), run, quiet=True)


def test_loom_memory_accepts_loom_plans_attention_names(capsys):
    from loom.cli import main

    args = ["memory", "--config", "korthikanti", "--json"]
    assert main([*args, "--attention", "flash", "--model.attn_dropout=0"]) == 0
    flash = json.loads(capsys.readouterr().out)
    assert main([*args, "--attention", "math"]) == 0
    math_ = json.loads(capsys.readouterr().out)
    assert flash["attention_counted"].startswith("fused kernel") and math_["attention_counted"].startswith("materialised")
    assert math_["layer_activation_bytes"] > flash["layer_activation_bytes"]


def test_only_the_first_passes_over_the_data_are_announced():
    from loom.data.dataset import first_passes

    notes = {3 * k: f"pass {k} complete" for k in range(1, 101)}  # 100 passes over a small set
    shown = first_passes(notes)
    assert list(shown) == [3, 6] and shown[3] == "pass 1 complete"
    assert shown[6] == "pass 2 complete (98 more passes follow, by step 300; not announced)"
    assert first_passes({5: "pass 1 complete"}) == {5: "pass 1 complete"}
