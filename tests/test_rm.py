"""Reward model (loom/post/pref.py): a scalar head on a pretrained body, its loss, metrics and saved head."""

import math

import pytest
import torch

from loom.cli import main
from loom.config import load_config
from loom.data.tokenizer import load_tokenizer
from loom.data.tokenizer import Tokenizer
from loom.models.io import load_model_dir, save_model_dir
from loom.models.llama import build_model
from loom.post import pref
from loom.post.pref_data import records
from pref_reference import encode_side, last_hidden
from test_parallel import metrics

ARCH = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=160",
        "model.vocab_size=512", "model.max_seq_len=128"]
RUN = ["train.seq_len=128", "train.steps=3", "train.global_batch=8", "log.progress=none", "log.tensorboard=false",
       "pref.data=synthetic:120", "optim.warmup_steps=1", "optim.lr=2e-3", "data.split=90,10"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A 'pretrained' loom model directory: random weights from another seed, the run's tokenizer."""
    cfg = load_config("tiny-rm", ARCH)
    model = build_model(cfg.model)
    model.init_weights(seed=7)
    directory = tmp_path_factory.mktemp("pretrained")
    save_model_dir(model, cfg, directory, load_tokenizer(cfg).path)
    return directory


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory, pretrained):
    run_dir = tmp_path_factory.mktemp("rm") / "run"
    assert main(["rm", "--config", "tiny-rm", "--run-dir", str(run_dir), *[f"--{o}" for o in RUN],
                 f"--train.init_from={pretrained}", "--train.micro_batch=8"]) == 0
    return run_dir


def test_first_step_uses_the_pretrained_body_and_a_seeded_head(rm_run, pretrained):
    """Step 1's loss recomputed: the body read from train.init_from, the head `score` drawn from train.seed by
    name (as the trainer initialises every parameter), the first 4 pairs of the run's data order."""
    cfg = load_config(str(rm_run / "config.toml"))
    body, _, _ = load_model_dir(pretrained)
    model = build_model(cfg.model)
    pref.add_score_head(model)
    model.init_weights(cfg.train.seed)
    model.load_state_dict(body.state_dict(), strict=False)  # everything but score.weight
    train, _ = pref.build_datasets(cfg, Tokenizer.from_file(rm_run / "tokenizer.json"))
    batch = train.batch(0, cfg.train.global_batch)
    with torch.no_grad():
        r = pref.rewards_at(model(batch["input_ids"], return_hidden=True), batch["last"], model.score)
    want = torch.nn.functional.softplus(-(r[0::2] - r[1::2])).mean().item()  # -log sigmoid(r_c - r_r)
    steps, _ = metrics(rm_run)
    assert steps[0]["loss"] == pytest.approx(want, rel=1e-5)
    assert steps[0]["margin"] == pytest.approx((r[0::2] - r[1::2]).mean().item(), rel=1e-4, abs=1e-6)


def test_saved_head_gives_the_reported_held_out_accuracy(rm_run):
    """The head saved with the checkpoint, read back by load_reward_model, scores the held-out pairs (encoded
    independently, one unpadded sequence at a time) to the run's val_loss and val_accuracy."""
    model, cfg = pref.load_reward_model(rm_run)
    tok = Tokenizer.from_file(rm_run / "tokenizer.json")
    pairs = list(records(120))
    _, (lo, hi), _ = cfg.data.split_ranges(len(pairs))
    losses, wins = [], []
    for record in pairs[lo:hi]:
        sides = [encode_side(tok, record, side)[0] for side in ("chosen", "rejected")]
        if max(map(len, sides)) > cfg.train.seq_len + 1:
            continue
        rc, rr = (model.score(last_hidden(model, ids)).item() for ids in sides)
        losses.append(math.log1p(math.exp(-(rc - rr))))
        wins.append(rc > rr)
    _, evals = metrics(rm_run)
    assert len(losses) >= 8
    assert evals[-1]["val_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert evals[-1]["val_accuracy"] == pytest.approx(sum(wins) / len(wins))


@pytest.mark.slow  # DPO's dp_shard=2 test covers the recipe hooks under FSDP
def test_rm_dp_shard2_matches_single_process(rm_run, pretrained, tmp_path):
    from pool_launch import launch_in_pool

    # `loom rm --nproc 2`, in the session's kept rank processes
    launch_in_pool("rm", "tiny-rm", tmp_path / "run", 2,
                   RUN + ["train.micro_batch=2", "parallel.dp_shard=2", f"train.init_from={pretrained}"])
    (steps, evals), (ref_steps, ref_evals) = metrics(tmp_path / "run"), metrics(rm_run)
    for got, want in zip(steps, ref_steps):
        for key in ("loss", "grad_norm", "margin", "accuracy"):
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-6), (got["step"], key)
    for key in ("val_loss", "val_accuracy"):
        assert math.isclose(evals[-1][key], ref_evals[-1][key], rel_tol=1e-5), key
