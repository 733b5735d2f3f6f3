import collections
import contextlib
import json
import math
import shutil
import time

import numpy as np
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


def measured_train_flops_per_token(*overrides) -> float:
    """FLOPs of one forward + backward per token, counted by torch's FlopCounterMode on a fresh model.

    The model is built with explicit-softmax attention, whose score and value matmuls the counter sees
    (it does not count CPU SDPA); loom counts both kinds as the same full s x s matmuls."""
    from torch.utils.flop_counter import FlopCounterMode

    from loom.models import build_model

    cfg = small_config(*overrides, "model.attention=math")
    model = build_model(cfg.model, seed=0)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    return counter.get_total_flops() / x.numel()


def test_metrics_rows_follow_the_contract(tmp_path):
    t0 = time.perf_counter()
    trainer = train(tmp_path / "run")
    wall = time.perf_counter() - t0
    steps, evals = rows(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    flops_per_token = measured_train_flops_per_token()
    # by hand: 3 x (2 layers x (16384 qkv with GQA + 8192 scores and values + 8192 out + 61440 SwiGLU)
    # + 65536 head)
    assert flops_per_token == 3 * (2 * (16384 + 8192 + 8192 + 61440) + 65536)
    for r in steps:
        assert CONTRACT_KEYS <= set(r)
        assert r["mfu"] is None  # no known peak on a CPU
        assert r["tokens"] == r["step"] * 8 * 32
        assert r["memory_gib"] > 0
        # Throughput is the step's tokens (global batch 8 x 32) over the step's own time...
        assert math.isclose(r["tokens_per_s"] * r["step_time_s"], 8 * 32, rel_tol=1e-9)
        # ...and TFLOP/s is that times the FLOPs torch counts for a training step, per token.
        assert math.isclose(r["tflops_per_device"], r["tokens_per_s"] * flops_per_token / 1e12, rel_tol=1e-9)
    assert 0 < sum(r["step_time_s"] for r in steps) < wall  # each step timed inside the run, not around it
    assert len(evals) == 1 and evals[0]["step"] == 6
    ev = evals[0]
    # bits per byte is the mean token loss rescaled by tokens / bytes of the same held-out text
    scored = trainer.val_data.scored_bytes(trainer.tokenizer)  # the held-out text the loss scores
    n_tokens = len(trainer.val_data) * trainer.cfg.train.seq_len
    assert math.isclose(ev["val_bpb"], ev["val_loss"] * n_tokens / math.log(2) / len(scored), rel_tol=1e-9)
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
    """Step 1's reported loss is the plain cross-entropy of the initial model on the first global batch,
    computed here apart from the trainer: a fresh model from the same seed, in float64."""
    from loom.data.token_datasets import build_datasets
    from loom.data.tokenizer import load_tokenizer
    from loom.models import build_model

    cfg = small_config("train.steps=1")
    train(tmp_path / "r", "train.steps=1")
    got = rows(tmp_path / "r")[0][0]["loss"]

    train_data, _ = build_datasets(cfg, load_tokenizer(cfg))
    first = train_data.batch(0, cfg.train.global_batch)
    x, y = first["input_ids"], first["labels"]
    model = build_model(cfg.model, dtype=torch.float64, seed=cfg.train.seed)
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert math.isclose(got, want, rel_tol=1e-6), (got, want)


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
    trainer = train(tmp_path / "r", "train.steps=100", "optim.warmup_steps=5")
    steps, _ = rows(tmp_path / "r")
    first = sum(r["loss"] for r in steps[:3]) / 3
    last = sum(r["loss"] for r in steps[-3:]) / 3
    assert last < first - 1.0, (first, last)
    # Below the best loss without context: the entropy of the token frequencies of the run's own targets.
    targets = trainer.train_data.rows(np.arange(len(trainer.train_data)))[:, 1:]
    p = np.bincount(targets.ravel()) / targets.size
    assert last < -(p[p > 0] * np.log(p[p > 0])).sum(), last


@contextlib.contextmanager
def linear_output_dtypes():
    """Count the dtypes of every nn.Linear output computed inside the block (all modules, any owner)."""
    seen = collections.Counter()

    def hook(module, args, output):
        if isinstance(module, torch.nn.Linear):
            seen[output.dtype] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def test_bf16_autocast_tracks_fp32(tmp_path):
    with linear_output_dtypes() as fp32_dtypes:
        train(tmp_path / "a")
    with linear_output_dtypes() as bf16_dtypes:
        train(tmp_path / "b", "train.dtype=bfloat16")
    # The matmuls really ran in bf16, and not in the fp32 run: 6 steps x 2 micro-batches x 15 Linear
    # layers (2 layers x 7, and the head), plus evaluation.
    assert set(fp32_dtypes) == {torch.float32} and set(bf16_dtypes) == {torch.bfloat16}
    assert bf16_dtypes.total() == fp32_dtypes.total() >= 6 * 2 * 15
    a, _ = rows(tmp_path / "a")
    b, _ = rows(tmp_path / "b")
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) / ra["loss"] < 0.02
    # ...and it shows: gradient norms move by more than the 1e-4 that reordered fp32 sums give (the
    # micro-batch test above); bf16 measured 3e-3 here.
    worst = max(abs(ra["grad_norm"] - rb["grad_norm"]) / ra["grad_norm"] for ra, rb in zip(a, b))
    assert 3e-4 < worst < 0.05, worst


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
