import json
import math
import shutil

import pytest
import torch

from conftest import small_config
from loom.config import OptimConfig
from loom.errors import UserError
from loom.train.schedule import lr_at
from loom.train.trainer import Trainer

CONTRACT_KEYS = {"step", "loss", "grad_norm", "lr", "tokens", "tokens_per_s", "tflops_per_device", "mfu", "memory_gib"}


def rows(run_dir):
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r], [r for r in lines if "val_loss" in r]


def train(run_dir, *overrides, quiet=True):
    trainer = Trainer(small_config(*overrides), run_dir, quiet=quiet)
    trainer.fit()
    return trainer


def test_metrics_rows_follow_the_contract(tmp_path):
    trainer = train(tmp_path / "run")
    steps, evals = rows(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert CONTRACT_KEYS <= set(r)
        assert r["mfu"] is None  # no known peak on a CPU
        assert r["tokens"] == r["step"] * 8 * 32
        assert r["tokens_per_s"] > 0 and r["memory_gib"] > 0
        expected = r["tokens_per_s"] * trainer.flops_per_token / 1e12
        assert math.isclose(r["tflops_per_device"], expected, rel_tol=1e-9)
    assert len(evals) == 1 and evals[0]["step"] == 6
    ev = evals[0]
    # bits per byte is the mean token loss rescaled by tokens / bytes of the same held-out text
    ref = trainer.val_reference()
    n_tokens = len(trainer.val_data) * trainer.cfg.train.seq_len
    assert math.isclose(ev["val_bpb"], ev["val_loss"] * n_tokens / math.log(2) / ref["bytes"], rel_tol=1e-9)
    assert 0.5 < ev["gzip_bpb"] < 8 and 0.5 < ev["xz_bpb"] < 8
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step-6"


def test_loss_is_mean_over_global_batch_independent_of_micro_batch(tmp_path):
    train(tmp_path / "a", "train.micro_batch=8")
    train(tmp_path / "b", "train.micro_batch=2")
    a, _ = rows(tmp_path / "a")
    b, _ = rows(tmp_path / "b")
    for ra, rb in zip(a, b):
        assert math.isclose(ra["loss"], rb["loss"], rel_tol=1e-5)
        assert math.isclose(ra["grad_norm"], rb["grad_norm"], rel_tol=1e-4)


def test_first_loss_equals_manual_cross_entropy(tmp_path):
    """Step 1's reported loss is the plain cross-entropy of the initial model on the first batch."""
    cfg = small_config("train.steps=1")
    trainer = Trainer(cfg, tmp_path / "r", quiet=True)
    from loom.data.loader import batch

    x, y = batch(trainer.train_data, 0, cfg.train.global_batch)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(trainer.model(x).flatten(0, 1), y.flatten()).item()
    trainer.fit()
    got = rows(tmp_path / "r")[0][0]["loss"]
    assert math.isclose(got, want, rel_tol=1e-5)


def test_resume_reproduces_uninterrupted_run_exactly(tmp_path):
    full = tmp_path / "full"
    train(full, "checkpoint.interval=3", "model.dropout=0.1")
    # Simulate a run stopped right after its step-3 checkpoint.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-6")
    (cut / "checkpoints" / "latest").write_text("step-3\n")
    train(cut, "checkpoint.interval=3", "model.dropout=0.1", "checkpoint.resume=true")
    a, ea = rows(full)
    b, eb = rows(cut)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]
    assert ea[-1]["val_loss"] == eb[-1]["val_loss"]


def test_model_learns(tmp_path):
    train(tmp_path / "r", "train.steps=40", "optim.warmup_steps=5")
    steps, _ = rows(tmp_path / "r")
    first = sum(r["loss"] for r in steps[:3]) / 3
    last = sum(r["loss"] for r in steps[-3:]) / 3
    assert last < first - 1.0, (first, last)


def test_bf16_autocast_tracks_fp32(tmp_path):
    train(tmp_path / "a")
    train(tmp_path / "b", "train.dtype=bfloat16")
    a, _ = rows(tmp_path / "a")
    b, _ = rows(tmp_path / "b")
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) / ra["loss"] < 0.02


def test_lr_schedule():
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay="cosine")
    assert lr_at(0, o, 110) == pytest.approx(0.1)
    assert lr_at(9, o, 110) == pytest.approx(1.0)
    assert lr_at(60, o, 110) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(110, o, 110) == pytest.approx(0.1)
    o.decay = "linear"
    assert lr_at(35, o, 110) == pytest.approx(0.1 + 0.9 * 0.75)


def test_weight_decay_skips_norms_and_biases():
    from loom.models.llama import build_model
    from loom.train.optim import build_optimizer

    cfg = small_config("model.bias=true", "model.norm=layernorm")
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg.optim)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.dim() >= 2), name


def test_refuses_to_overwrite_checkpoints_without_resume(tmp_path):
    train(tmp_path / "r")
    before = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    with pytest.raises(UserError, match="checkpoint.resume=true"):
        Trainer(small_config(), tmp_path / "r", quiet=True)
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == before


def test_corrupt_checkpoint_is_named_on_resume(tmp_path):
    train(tmp_path / "r", "checkpoint.interval=3")
    shard = tmp_path / "r" / "checkpoints" / "step-6" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # same size, one flipped byte: only the checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(UserError, match="__0_0.distcp does not match its manifest checksum"):
        Trainer(small_config("checkpoint.resume=true", "train.steps=8"), tmp_path / "r", quiet=True)


def test_keep_last_prunes(tmp_path):
    train(tmp_path / "r", "checkpoint.interval=1", "checkpoint.keep_last=2")
    names = sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir())
    assert names == ["latest", "step-5", "step-6"]


def test_resume_refuses_changed_data_settings_and_keeps_run_dir(tmp_path):
    train(tmp_path / "r")
    before = (tmp_path / "r" / "config.toml").read_text()
    with pytest.raises(UserError, match="train.seq_len"):
        Trainer(small_config("checkpoint.resume=true", "train.seq_len=16"), tmp_path / "r", quiet=True)
    assert (tmp_path / "r" / "config.toml").read_text() == before


def test_fallback_to_previous_complete_checkpoint(tmp_path):
    full = tmp_path / "full"
    train(full)
    run = tmp_path / "r"
    train(run, "checkpoint.interval=3")
    shard = run / "checkpoints" / "step-6" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-64])  # damage the latest
    with pytest.raises(UserError, match="__0_0.distcp"):
        Trainer(small_config("checkpoint.resume=true", "checkpoint.interval=3"), run, quiet=True)
    trainer = Trainer(small_config("checkpoint.resume=true", "checkpoint.fallback=true", "checkpoint.interval=3"),
                      run, quiet=True)
    assert trainer.resumed_from.name == "step-3" and trainer.state.step == 3
    trainer.fit()
    assert [r["loss"] for r in rows(run)[0]] == [r["loss"] for r in rows(full)[0]]
