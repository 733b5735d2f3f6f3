"""Online RL (loom/post/rl/): the engine in the loop learns a reward, refits leave no stale weights, the
trainer/engine mismatch is measured, layouts compute what one process computes, bad input exits 2."""

import json
import math

import pytest
import torch

from loom.cli import main
from loom.config import load_config
from loom.post import tasks
from loom.post.rl.recipe import RL as RLRecipe
from loom.post.rl.rollouts import rows_of
from loom.train.trainer import Trainer
from loom.infer.engine import Completion

RL = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=160",
      "model.vocab_size=320", "model.max_seq_len=32", "train.seq_len=16", "train.global_batch=32",
      "train.micro_batch=16", "train.steps=3", "train.eval_interval=0", "log.progress=none",
      "log.tensorboard=false", "rl.prompts=addition:200", "rl.valid_prompts=addition:16",
      "rl.reward=rl_rewards:ones", "rl.minibatches=1", "rl.group_size=4", "rl.max_new_tokens=4", "rl.engine_batch=32",
      "optim.lr=3e-3", "optim.min_lr=3e-3", "optim.warmup_steps=0", "checkpoint.save_final=false"]
PHASES = ("generation_s", "reward_s", "logprobs_s", "training_s", "refit_s")


def rows(run_dir):
    out = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in out if "loss" in r], [r for r in out if "val_reward" in r]


def rl_main(run_dir, *extra):
    return main(["rl", "--config", "tiny-grpo", "--run-dir", str(run_dir), *[f"--{o}" for o in RL], *extra])


def rl_in_pool(run_dir, *extra):
    """`loom rl --nproc 2` with RL and `extra` (--key=value), in the session's kept rank processes."""
    from pool_launch import launch_in_pool

    launch_in_pool("rl", "tiny-grpo", run_dir, 2, RL + [o[2:] for o in extra])


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("grpo") / "run"
    assert rl_main(run_dir, "--train.steps=25") == 0
    return run_dir


def test_grpo_learns_its_reward_and_logs_every_phase(grpo_run):
    steps, evals = rows(grpo_run)
    assert [r["step"] for r in steps] == list(range(1, 26))
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 25  # the starting point, and the end
    first = sum(r["reward"] for r in steps[:5]) / 5
    last = sum(r["reward"] for r in steps[-5:]) / 5
    assert last > first + 0.15, (first, last)  # a random policy climbs the "share of 1s" reward
    assert evals[-1]["val_reward_sampled"] > evals[0]["val_reward_sampled"]
    for r in steps:
        assert all(r[k] >= 0 for k in PHASES) and r["step_time_s"] >= sum(r[k] for k in PHASES)
        # The engine is refitted after every update: its log-probs are the trainer's (same fp32 weights).
        assert r["logp_abs_diff"] < 1e-4 and abs(r["prob_ratio_mean"] - 1) < 1e-4
        assert r["generated_tokens"] == round(r["response_length"] * 32)
        assert 0 <= r["reward"] <= 1 and r["optimizer_steps"] == 1
    assert any(r["grad_norm"] > 0 for r in steps)
    from loom.train.metrics import recipe_summary  # the progress line shows the reward, not only the loss

    r = steps[-1]
    assert recipe_summary(r).startswith(f"  reward {r['reward']:.3f} (std {r['reward_std']:.3f})  response "
                                        f"{r['response_length']:.1f} tokens")


def test_paged_engine_rollouts_equal_the_slab_engines(grpo_run, tmp_path, monkeypatch):
    """rl.engine_paged=true: each group's prompt prefilled once and its blocks shared; the same rollouts and
    updates as the slab engine (the first 3 steps of the module's run)."""
    from loom.infer.paged import PagedKV

    engines = []
    original = RLRecipe.set_up
    monkeypatch.setattr(RLRecipe, "set_up", lambda self, trainer: (original(self, trainer), engines.append(self.engine)))
    assert rl_main(tmp_path / "run", "--rl.engine_paged=true") == 0
    assert isinstance(engines[0].slab, PagedKV)
    paged, _ = rows(tmp_path / "run")
    slab, _ = rows(grpo_run)
    assert len(paged) == 3
    for got, want in zip(paged, slab[:3]):
        assert got["reward"] == want["reward"] and got["response_length"] == want["response_length"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
        assert got["logp_abs_diff"] < 1e-4


def test_stale_engine_weights_show_in_the_mismatch(tmp_path, monkeypatch):
    """Without the refit after each update the engine samples from the initial weights: the logged
    mismatch catches it from step 2 on (and the refit test above would fail)."""
    calls = []
    original = RLRecipe.set_up

    def setup_then_freeze(self, trainer):
        original(self, trainer)
        self.engine.refit = lambda model: calls.append(1) or 0.0

    monkeypatch.setattr(RLRecipe, "set_up", setup_then_freeze)
    assert rl_main(tmp_path / "run") == 0
    steps, _ = rows(tmp_path / "run")
    assert calls and steps[0]["logp_abs_diff"] < 1e-4
    assert steps[1]["logp_abs_diff"] > 1e-3 and steps[2]["prob_ratio_max"] > 1.001


def test_on_policy_grpo_reuses_the_training_forward_as_its_old_log_probs(tmp_path, monkeypatch):
    """rl.epochs = rl.minibatches = 1 (GRPO, no dropout): no separate forward for the old log-probs; the training
    forward's own, detached, give the same losses, gradient norms, trainer/engine mismatch and final weights as
    the separate pass (fp32, to rounding), with KL to a reference and uniform groups left out."""
    calls = []
    real = RLRecipe._forward_logp
    monkeypatch.setattr(RLRecipe, "_forward_logp", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    cfg = load_config("tiny-grpo", [*RL, "rl.kl_coef=0.05", "rl.drop_uniform_groups=true",
                                    "rl.reward=rl_rewards:digit_share"])
    cfg.validate()
    runs = {}
    for reuse in (True, False):
        monkeypatch.setattr(RLRecipe, "reuses_policy_logp", lambda self, r=reuse: r)
        calls.clear()
        trainer = Trainer(cfg, tmp_path / f"reuse{reuse}", quiet=True, recipe=RLRecipe())
        trainer.fit()
        runs[reuse] = (rows(tmp_path / f"reuse{reuse}")[0], trainer.model.state_dict(), len(calls))
    (steps_reuse, w_reuse, n_reuse), (steps_sep, w_sep, n_sep) = runs[True], runs[False]
    assert all(r["optimizer_steps"] == 1 for r in steps_reuse)  # every step trained (no fallback pass)
    assert n_sep == n_reuse + len(steps_sep) == 2 * len(steps_sep)  # one policy pass a step saved; the reference's stays
    for a, b in zip(steps_reuse, steps_sep):
        for key in ("loss", "grad_norm", "logp_abs_diff", "prob_ratio_mean", "prob_ratio_max", "kl", "reward"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        assert a["ratio"] == 1.0 and b["ratio"] == pytest.approx(1.0, abs=1e-5)
    for name, w in w_reuse.items():
        assert torch.allclose(w, w_sep[name], rtol=1e-4, atol=1e-6), name


def test_engine_equals_policy_after_training(tmp_path):
    cfg = load_config("tiny-grpo", [*RL, "train.steps=2"])
    cfg.validate()
    recipe = RLRecipe()
    trainer = Trainer(cfg, tmp_path / "run", quiet=True, recipe=recipe)
    before = {k: v.clone() for k, v in recipe.engine.model.state_dict().items()}
    trainer.fit()
    policy = trainer.model.state_dict()
    changed = 0
    for name, p in recipe.engine.model.named_parameters():
        assert torch.equal(p, policy[name]), name
        changed += not torch.equal(p, before[name])
    assert changed == len(list(recipe.engine.model.parameters()))


@pytest.mark.slow
def test_compiled_engine_in_the_loop_matches_the_trainer(tmp_path):
    """rl.engine_compile: every rollout decode step runs through the compiled graphs, refitted after each
    update, and its log-probs stay the trainer's."""
    cfg = load_config("tiny-grpo", [*RL, "train.steps=3", "rl.engine_compile=true"])
    cfg.validate()
    recipe = RLRecipe()
    Trainer(cfg, tmp_path / "run", quiet=True, recipe=recipe).fit()
    stats = recipe.engine.stats
    assert stats["compiled_steps"] == stats["decode_steps"] > 0 and stats["warmup_s"] > 0
    steps, _ = rows(tmp_path / "run")
    assert len(steps) == 3 and all(r["logp_abs_diff"] < 1e-4 for r in steps)


def test_resumed_run_continues_as_the_uninterrupted_one(grpo_run, tmp_path):
    """Rollout seeds follow the step, prompts the run's stream, weights and optimizer the checkpoint: a run
    stopped after step 2 and resumed computes step 3 as a run that never stopped."""
    run = tmp_path / "run"
    assert rl_main(run, "--train.steps=2", "--checkpoint.save_final=true") == 0
    assert rl_main(run, "--train.steps=3", "--checkpoint.resume=true") == 0
    steps, evals = rows(run)
    whole, _ = rows(grpo_run)  # the same settings for 25 steps (a constant learning rate)
    assert [r["step"] for r in steps] == [1, 2, 3] and [e["step"] for e in evals] == [0, 2, 3]
    assert steps[2]["reward"] == whole[2]["reward"]
    assert math.isclose(steps[2]["loss"], whole[2]["loss"], rel_tol=1e-5, abs_tol=1e-7)


def test_rows_align_labels_mask_and_rollout_logprobs():
    done = [Completion(prompt=[5, 6, 7], tokens=[8, 0], logprobs=[-0.5, -0.25]),
            Completion(prompt=[9], tokens=[4, 3, 0], logprobs=[-1.0, -2.0, -3.0])]
    batch = rows_of([[5, 6, 7], [9]], done, seq_len=6, pad=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 0, 0], [9, 4, 3, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 8, 0, -100, -100], [4, 3, 0, -100, -100, -100]]
    assert batch["mask"].tolist() == [[0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert batch["rollout_logp"].tolist() == [[0, 0, -0.5, -0.25, 0, 0], [-1, -2, -3, 0, 0, 0]]


def test_task_held_out_problems_are_never_trained_on():
    valid = {p for p, _ in tasks.addition(300, tasks.SEEDS["valid"], True)}
    train = {p for p, _ in tasks.addition(3000, tasks.SEEDS["rl"], False)}
    sft = {p for p, _ in tasks.addition(3000, tasks.SEEDS["sft"], False)}
    assert valid and not valid & train and not valid & sft
    for prompt, answer in tasks.addition(50, 7, False):
        a, b = prompt[:-1].split("+")
        assert int(answer) == int(a) + int(b) and max(len(a), len(b)) <= tasks.DIGITS
    assert tasks.exact_match("1+2=", " 3\n", "3") == 1.0 and tasks.exact_match("1+2=", "33", "3") == 0.0


def test_noisy_labeller_corrupts_sft_answers_only(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path))

    def load(role):
        path = tasks.materialise("addition_noisy:2000", role, "test")
        return [json.loads(x) for x in open(path)]
    for role, key, wrong_share in (("sft", "completion", (0.35, 0.45)), ("rl", "answer", (0, 0)),
                                   ("valid", "answer", (0, 0))):
        records = load(role)
        wrong = sum(int(r[key]) != eval(r["prompt"][:-1]) for r in records) / len(records)
        assert wrong_share[0] <= wrong <= wrong_share[1], (role, wrong)


def test_carryless_labeller_drops_carries_in_sft_answers_only(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path))
    assert [tasks.carryless(p) for p in ("38+45=", "7+5=", "99+99=", "12+3=", "5+95=")] == ["73", "2", "88", "15", "90"]
    for role, key in (("sft", "completion"), ("rl", "answer"), ("valid", "answer")):
        records = [json.loads(x) for x in open(tasks.materialise("addition_carryless:2000", role, "test"))]
        carry = [r for r in records if tasks.carryless(r["prompt"]) != str(eval(r["prompt"][:-1]))]
        assert 0.35 < len(carry) / len(records) < 0.65
        # Problems without a carry keep their true sum; with one, the SFT labeller drops it 60% of the time.
        assert all(int(r[key]) == eval(r["prompt"][:-1]) for r in records if r not in carry)
        dropped = sum(r[key] == tasks.carryless(r["prompt"]) for r in carry) / len(carry)
        assert (0.54 < dropped < 0.66) if role == "sft" else dropped == 0, (role, dropped)


def test_kl_reference_starts_at_zero_and_grows(tmp_path):
    assert rl_main(tmp_path / "run", "--rl.kl_coef=0.1", "--rl.kl_estimator=k3") == 0
    steps, _ = rows(tmp_path / "run")
    assert abs(steps[0]["kl"]) < 1e-6  # step 1: the policy is the reference
    assert steps[-1]["kl"] > 1e-5


def test_uniform_groups_dropped_and_a_step_without_any_makes_no_update(tmp_path):
    """rl.drop_uniform_groups: groups whose rewards are all equal leave the loss; a step where every group is
    uniform (here: exact match of the sum, which a random policy never produces) updates nothing."""
    assert rl_main(tmp_path / "run", "--rl.drop_uniform_groups=true", "--rl.reward=loom.post.tasks:exact_match",
                   "--train.steps=2") == 0
    steps, _ = rows(tmp_path / "run")
    for r in steps:
        assert r["uniform_groups"] == 1.0 and r["reward"] == 0.0
        assert r["optimizer_steps"] == 0 and r["grad_norm"] == 0.0 and r["loss"] == 0.0
    assert rl_main(tmp_path / "kept", "--rl.reward=loom.post.tasks:exact_match", "--train.steps=2") == 0
    assert all(r["optimizer_steps"] == 1 for r in rows(tmp_path / "kept")[0])


def test_ppo_value_head_epochs_minibatches_and_truncated_is(tmp_path):
    assert rl_main(tmp_path / "run", "--rl.algorithm=ppo", "--rl.group_size=1", "--rl.kl_coef=0.05",
                   "--rl.epochs=2", "--rl.minibatches=2", "--rl.tis_cap=2", "--rl.lam=0.9") == 0
    steps, evals = rows(tmp_path / "run")
    for r in steps:
        assert r["optimizer_steps"] == 4 and math.isfinite(r["value_loss"]) and r["value_loss"] > 0
        assert math.isfinite(r["loss"]) and "kl" in r
    # Later minibatches run on weights already updated by earlier ones: the ratio leaves 1.
    assert any(abs(r["ratio"] - 1) > 1e-5 for r in steps)
    assert math.isfinite(evals[-1]["val_reward"])


PPO = ["--rl.algorithm=ppo", "--rl.group_size=1", "--rl.kl_coef=0.05", "--rl.epochs=2", "--rl.minibatches=2"]


@pytest.fixture(scope="module")
def rl_single(tmp_path_factory):
    """`get(*extra)`: the one-process run of RL with `extra`, made on first use (the layouts share it)."""
    runs = {}

    def get(*extra):
        if extra not in runs:
            runs[extra] = tmp_path_factory.mktemp("rl-one") / "run"
            assert rl_main(runs[extra], *extra) == 0
        return runs[extra]

    return get


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_reward_function_gets_the_record_fields_and_dp_shard2_matches(tmp_path, rl_single, algorithm):
    """rl.reward receives the prompt record's other fields ("answer"); two FSDP ranks draw the same
    rollouts as one process (seeds follow the sample, not the rank) and compute the same losses. PPO with
    two minibatches: a minibatch is the same groups in every layout."""
    common = ["--rl.reward=rl_rewards:needs_answer" if algorithm == "grpo" else "--rl.reward=rl_rewards:ones",
              "--train.steps=2", *(PPO if algorithm == "ppo" else [])]
    rl_in_pool(tmp_path / "two", *common, "--parallel.dp_shard=2", "--train.micro_batch=8")
    (one, one_evals), (two, two_evals) = rows(rl_single(*common)), rows(tmp_path / "two")
    for a, b in zip(one, two):
        for key in ("reward", "response_length"):
            assert a[key] == b[key], (a["step"], key)
        for key in ("loss", "grad_norm", "clip_fraction", *(["value_loss"] if algorithm == "ppo" else [])):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (a["step"], key, a[key], b[key])
    assert one_evals[-1]["val_reward"] == two_evals[-1]["val_reward"]


def test_ppo_under_the_distributed_optimizer_matches_single_process(tmp_path, rl_single):
    """parallel.distributed_optimizer=true (loom/parallel/distopt.py) under PPO's minibatches, value head
    included: one process's rollouts and losses."""
    common = ["--rl.reward=rl_rewards:ones", "--train.steps=2", *PPO]
    rl_in_pool(tmp_path / "two", *common, "--parallel.dp_shard=2", "--train.micro_batch=8",
               "--parallel.distributed_optimizer=true")
    (one, _), (two, _) = rows(rl_single(*common)), rows(tmp_path / "two")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"]
        for key in ("loss", "grad_norm", "value_loss"):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (a["step"], key, a[key], b[key])


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_tp2_matches_single_process(tmp_path, rl_single, algorithm):
    """Two tensor-parallel ranks (the engine sharded the same way) compute one process's losses; PPO's value
    head is replicated over the group and its value loss matches too."""
    common = ["--rl.reward=rl_rewards:ones", "--train.steps=2", *(PPO if algorithm == "ppo" else [])]
    rl_in_pool(tmp_path / "two", *common, "--parallel.tp=2")
    (one, _), (two, _) = rows(rl_single(*common)), rows(tmp_path / "two")
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["reward"] == b["reward"]
        for key in ("loss", "grad_norm", *(["value_loss"] if algorithm == "ppo" else [])):
            assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-6), (a["step"], key, a[key], b[key])


@pytest.mark.parametrize("extra, message", [
    (["--rl.reward=no_such_module:f"], "cannot import 'no_such_module'"),
    (["--rl.reward=rl_rewards:missing"], "has no function 'missing'"),
    (["--rl.reward=justaname"], "must be package.module:function"),
    (["--parallel.pp=2"], "parallel.pp=2"),
    (["--rl.group_size=5"], "multiple of rl.group_size=5"),
    (["--rl.clip_low=1.5"], "rl.clip_low=1.5"),
    (["--train.seq_len=3"], "leaves no room for a prompt"),
])
def test_bad_rl_settings_exit_2(tmp_path, capsys, extra, message):
    assert rl_main(tmp_path / "run", *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_rl_without_prompts_exits_2(tmp_path, capsys):
    assert main(["rl", "--config", "tiny", "--run-dir", str(tmp_path / "run")]) == 2
    assert "loom rl needs rl.prompts" in capsys.readouterr().err


def test_bad_prompt_record_names_the_line(tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "x"}\n')
    assert rl_main(tmp_path / "run", f"--rl.prompts={bad}") == 2
    err = capsys.readouterr().err
    assert f"{bad}, line 2" in err and "\"prompt\"" in err


def test_reward_model_rewards_add_to_the_callable_and_ignore_padding(tmp_path):
    """rl.reward_model: a `loom rm` run's scores, times rl.reward_model_coef, are added to rl.reward's; a
    batch of ragged sequences is scored as each sequence alone."""
    from loom.post.rl.rewards import Rewards

    rm_dir = tmp_path / "rm"
    model = [o for o in RL if o.startswith("model.")] + ["model.max_seq_len=256"]
    assert main(["rm", "--config", "tiny-rm", "--run-dir", str(rm_dir), *[f"--{o}" for o in model],
                 "--train.steps=1", "--train.seq_len=256", "--pref.data=synthetic:40", "--log.progress=none",
                 "--log.tensorboard=false"]) == 0
    assert rl_main(tmp_path / "run", f"--rl.reward_model={rm_dir}", "--rl.reward_model_coef=0.5",
                   "--train.steps=1") == 0
    (row,), _ = rows(tmp_path / "run")
    assert row["reward_model"] != 0
    assert row["reward"] == pytest.approx(row["reward_fn"] + 0.5 * row["reward_model"], abs=1e-6)
    cfg = load_config("tiny-grpo", [*RL, f"rl.reward_model={rm_dir}"])
    rewards = Rewards(cfg, None, torch.device("cpu"))
    sequences = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
    together = rewards.score(sequences)
    alone = torch.cat([rewards.score([s]) for s in sequences])
    assert torch.allclose(together, alone, atol=1e-5) and together.std() > 0


def test_loom_train_with_rl_prompts_is_refused_naming_loom_rl(tmp_path, capsys):
    """The recipe is the subcommand's, never inferred from which data is set: `loom train` on an RL config
    exits 2 and names the command that trains on rl.prompts."""
    assert main(["train", "--config", "tiny-grpo", "--run-dir", str(tmp_path / "run"), "--rl.prompts=addition:8"]) == 2
    err = capsys.readouterr().err
    assert "rl.prompts is set, but `loom train` runs pre-training" in err and "run loom rl" in err
    assert not (tmp_path / "run").exists()
