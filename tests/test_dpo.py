"""DPO / IPO (loom/post/pref.py): layouts against one process, the loss against plain torch, bad input."""

import json
import math
import shutil

import pytest
import torch

from loom.cli import main
from loom.config import load_config
from loom.data.tokenizer import Tokenizer
from loom.models.io import load_model_dir
from loom.models.llama import build_model
from loom.post.pref import DPOLoss
from loom.post.pref_data import records
from pref_reference import encode_side, reply_logprob
from test_parallel import metrics

PREF = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=160",
        "model.vocab_size=512", "model.max_seq_len=128", "train.seq_len=128", "train.steps=3", "train.global_batch=8",
        "log.progress=none", "log.tensorboard=false", "pref.data=synthetic:120", "optim.warmup_steps=1",
        "optim.lr=2e-3", "data.split=90,10", "pref.beta=0.5"]
STATS = ("loss", "grad_norm", "chosen_reward", "rejected_reward", "margin", "accuracy")


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """One process, the whole global batch in one micro-batch, from random initialisation."""
    run_dir = tmp_path_factory.mktemp("dpo") / "run"
    assert main(["dpo", "--config", "tiny-dpo", "--run-dir", str(run_dir), *[f"--{o}" for o in PREF],
                 "--train.micro_batch=8"]) == 0
    return run_dir


def test_first_step_is_at_the_reference_and_stats_are_logged(dpo_run):
    steps, evals = metrics(dpo_run)
    assert [r["step"] for r in steps] == [1, 2, 3]
    # The reference pass computed the initial policy's log-probs: at step 1 every h is 0, the loss log 2.
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[0]["chosen_reward"] == steps[0]["rejected_reward"] == steps[0]["margin"] == 0.0
    assert steps[-1]["margin"] != 0.0 and steps[-1]["loss"] < math.log(2)
    assert {"val_loss", "val_accuracy", "val_margin", "val_chosen_reward", "val_rejected_reward"} <= set(evals[-1])
    assert (dpo_run / "dpo_reference.pt").is_file()
    from loom.train.metrics import recipe_summary  # the progress line shows accuracy and margin

    assert recipe_summary(steps[-1]) == f"  accuracy {steps[-1]['accuracy']:.3f}  margin {steps[-1]['margin']:.3f}"


def test_dpo_dp_shard2_matches_single_process(dpo_run, tmp_path):
    from pool_launch import launch_in_pool

    # `loom dpo --nproc 2`, in the session's kept rank processes
    launch_in_pool("dpo", "tiny-dpo", tmp_path / "run", 2, PREF + ["train.micro_batch=2", "parallel.dp_shard=2"])
    (steps, evals), (ref_steps, ref_evals) = metrics(tmp_path / "run"), metrics(dpo_run)
    assert len(steps) == len(ref_steps) == 3
    for got, want in zip(steps, ref_steps):
        for key in STATS:
            # A reward beta (pi - ref) is the difference of two summed log-probs of ~-50: fp32 rounding of
            # those (~1e-7 relative, summed in another order) is ~1e-5 of a reward of 0.1.
            tol = 2e-5 if key in ("chosen_reward", "rejected_reward", "margin") else 1e-7
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=tol), (got["step"], key, got[key], want[key])
    for key in ("val_loss", "val_margin", "val_accuracy"):
        assert math.isclose(evals[-1][key], ref_evals[-1][key], rel_tol=1e-5, abs_tol=2e-5), key


def test_held_out_dpo_loss_equals_plain_torch(dpo_run):
    """The held-out DPO loss and accuracy after 3 steps, recomputed pair by pair: the policy from the step-3
    checkpoint, the reference from the seed (random initialisation), texts encoded independently."""
    cfg = load_config(str(dpo_run / "config.toml"))
    policy, _, _ = load_model_dir(dpo_run / "checkpoints" / "step-3")
    reference = build_model(cfg.model)
    reference.init_weights(cfg.train.seed)
    reference.eval()
    tok = Tokenizer.from_file(dpo_run / "tokenizer.json")
    pairs = list(records(120))
    _, (lo, hi), _ = cfg.data.split_ranges(len(pairs))
    beta, losses, wins = cfg.pref.beta, [], []
    for record in pairs[lo:hi]:
        sides = [encode_side(tok, record, side) for side in ("chosen", "rejected")]
        if max(len(ids) for ids, _ in sides) > cfg.train.seq_len + 1:
            continue  # dropped by the run too
        (pc, pr), (rc, rr) = ([reply_logprob(m, *s) for s in sides] for m in (policy, reference))
        h = (pc - rc) - (pr - rr)
        losses.append(math.log1p(math.exp(-beta * h)))  # -log sigmoid(beta h)
        wins.append(h > 0)
    assert len(losses) >= 8
    _, evals = metrics(dpo_run)
    assert evals[-1]["val_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-4)
    assert evals[-1]["val_accuracy"] == pytest.approx(sum(wins) / len(wins))
    assert abs(evals[-1]["val_loss"] - math.log(2)) > 1e-3  # the policy moved: not the trivial value at the reference


def test_dpo_and_ipo_loss_objects_count_pairs_and_report_sums():
    # Two pairs at the reference (policy log-probs = reference): h = 0 for both.
    logits = torch.randn(4, 5, 7, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[-100, 1, 2, 3, -100]] * 4)
    logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)[:, 1:4].sum(-1)
    batch = {"input_ids": torch.zeros(4, 5, dtype=torch.long), "labels": labels, "ref_logps": logp + 0}
    dpo, ipo = DPOLoss("dpo", 0.1), DPOLoss("ipo", 0.1)
    assert dpo.count(batch) == 2
    assert dpo(logits, batch).item() == pytest.approx(2 * math.log(2), abs=1e-5)
    assert ipo(logits, batch).item() == pytest.approx(2 * (0 - 1 / (2 * 0.1)) ** 2, abs=1e-3)  # (h - 1/(2 beta))^2
    batch["ref_logps"] = logp - torch.tensor([1.0, 0.0, 0.0, 1.0])  # pair 0: h = 1, pair 1: h = -1
    loss = dpo(logits, batch).item()
    assert loss == pytest.approx(math.log1p(math.exp(-0.1)) + math.log1p(math.exp(0.1)), abs=1e-5)
    sums = dpo.take_sums()
    assert sums["accuracy"].item() == 1 and sums["margin"].item() == pytest.approx(0.0, abs=1e-6)
    assert sums["chosen_reward"].item() == pytest.approx(0.1, abs=1e-6)
    assert dpo.take_sums() == {}


@pytest.mark.parametrize("command,extra,fragment", [
    ("dpo", ["--pref.data="], "loom dpo needs pref.data"),
    ("dpo", ["--parallel.tp=2"], "parallel.tp=2"),
    ("dpo", ["--train.micro_batch=3", "--train.global_batch=6"], "must be even"),
    ("rm", ["--pref.recipe=dpo"], "pref.recipe=dpo"),
    ("train", ["--pref.recipe=auto"], "`loom train` runs pre-training"),
    ("dpo", ["--pref.beta=0"], "pref.beta=0"),
    ("dpo", ["--sft.data=synthetic:10"], "pref.data is set together with sft.data"),
])
def test_bad_preference_settings_exit_2(command, extra, fragment, capsys):
    assert main([command, "--config", "tiny-dpo", "--print-config", *extra]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize("line,fragment", [
    ('{"prompt": "a", "chosen": "b"}', "needs \"prompt\", \"chosen\" and \"rejected\""),
    ('{"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "x"}], '
     '"rejected": [{"role": "user", "content": "y"}]}', "\"rejected\" must end with an assistant message"),
    ('not json', "not valid JSON"),
])
def test_malformed_pair_names_file_and_line(line, fragment, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n' + line + "\n")
    code = main(["dpo", "--config", "tiny-dpo", "--run-dir", str(tmp_path / "run"), *[f"--{o}" for o in PREF],
                 "--train.micro_batch=8", f"--pref.data={data}"])
    err = capsys.readouterr().err
    assert code == 2 and f"{data}, line 2" in err and fragment in err, err


def test_resumed_dpo_needs_its_reference_log_probs(dpo_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(dpo_run, run)
    (run / "dpo_reference.pt").unlink()
    code = main(["dpo", "--config", str(run / "config.toml"), "--run-dir", str(run), "--checkpoint.resume=true",
                 "--train.steps=4"])
    assert code == 2 and "dpo_reference.pt is missing" in capsys.readouterr().err


def test_only_the_last_reply_is_scored(tmp_path):
    """A conversation with an earlier assistant turn: that turn is shared context, only the compared reply
    (with its end-of-turn marker) is scored, on both sides."""
    from loom.data.tokenizer import load_tokenizer
    from loom.post.chat import load_template
    from loom.post.pref_data import Pairs, prepare_pairs

    turns = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"},
             {"role": "user", "content": "What is 2 + 2?"}]
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": turns, "chosen": [{"role": "assistant", "content": "2 + 2 = 4."}],
                                "rejected": [{"role": "assistant", "content": "2 + 2 = 5."}]}) + "\n")
    tok = load_tokenizer(load_config("tiny-dpo", PREF + ["train.micro_batch=8"]))
    pairs = Pairs(*prepare_pairs([str(data)], tok, load_template("chatml")))
    for side, reply in ((0, "2 + 2 = 4."), (1, "2 + 2 = 5.")):
        ids, mask = pairs.get(0, side)
        assert tok.decode(ids[mask > 0].tolist()) == reply + "<|im_end|>"  # not the newline after it
        assert "hi<|im_end|>" in tok.decode(ids[mask == 0].tolist())
