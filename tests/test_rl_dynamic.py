"""rl.dynamic_sampling (DAPO): groups whose rewards are all equal are replaced by informative groups of more
prompts, up to rl.dynamic_sampling_max_rounds rounds, and the number refilled is logged."""

import json

import numpy as np
import torch

from loom.cli import main
from loom.post import tasks
from loom.post.rl.dynamic import Groups, refill

RL = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=160",
      "model.vocab_size=320", "model.max_seq_len=32", "train.seq_len=16", "train.global_batch=32",
      "train.micro_batch=32", "train.steps=1", "train.eval_interval=0", "log.progress=none",
      "log.tensorboard=false", "rl.prompts=addition:200", "rl.valid_prompts=addition:8",
      "rl.reward=rl_env_rewards:mostly_constant", "rl.group_size=4", "rl.max_new_tokens=4", "rl.engine_batch=32",
      "checkpoint.save_final=false"]


def groups_of(tag: int, rewards: list[list[float]]) -> Groups:
    n = sum(map(len, rewards))
    return Groups([tag * 10 + g for g in range(len(rewards))], [[tag]] * n, [f"c{tag}"] * n, [f"t{tag}"] * n,
                  {"reward": torch.tensor([r for g in rewards for r in g], dtype=torch.float64)})


def test_refill_replaces_uniform_groups_in_order_within_the_round_bound():
    first = groups_of(0, [[1, 1], [0, 1], [0, 0], [2, 2]])  # groups 0, 2 and 3 are uniform
    draws = {1: groups_of(1, [[3, 3], [0, 5]]), 2: groups_of(2, [[1, 2], [4, 4]])}
    got, refilled, rounds = refill(first, draws.__getitem__, max_rounds=2)
    assert (refilled, rounds) == (2, 2)
    assert got.indices == [11, 1, 20, 3]  # round 1's informative group, then round 2's; group 3 stays
    assert got.rewards["reward"].tolist() == [0, 5, 0, 1, 1, 2, 2, 2]
    assert got.prompts == [[1], [1], [0], [0], [2], [2], [0], [0]] and got.texts[0] == "t1"
    again, refilled, rounds = refill(groups_of(0, [[0, 1]]), draws.__getitem__, max_rounds=2)
    assert (refilled, rounds) == (0, 0)  # nothing uniform: nothing drawn


def step_row(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][0]


def test_constant_groups_are_replaced_and_counted(tmp_path):
    """Step 1's prompts are the first 8 of the run's shuffled stream (recomputed here from the task and the
    seed): those whose first operand is not a multiple of 4 score 0 whatever the completion, so their groups
    are uniform; each is either refilled or still uniform in the batch trained on, and at least one is
    refilled. Without dynamic sampling nothing is refilled and all of them stay."""
    assert main(["rl", "--config", "tiny-grpo", *[f"--{o}" for o in RL], "--run-dir", str(tmp_path / "on"),
                 "--rl.dynamic_sampling=true"]) == 0
    problems = tasks.addition(200, tasks.SEEDS["rl"], False)
    first = np.random.default_rng([1234, 0]).permutation(len(problems))[:8]  # train.seed, first pass
    constant = sum(int(problems[i][0].split("+")[0]) % 4 != 0 for i in first)
    on = step_row(tmp_path / "on")
    assert constant >= 2
    assert on["refilled_groups"] >= 1 and on["refilled_groups"] + round(on["uniform_groups"] * 8) == constant
    assert 1 <= on["dynamic_sampling_rounds"] <= 4 and on["dynamic_sampling_s"] > 0


def test_dynamic_sampling_needs_grpo_groups_and_runs_in_either_mode():
    import pytest

    from loom.config import load_config
    from loom.errors import UserError

    # rl.mode=async refills on the generation ranks (tests/test_rl_async_features.py)
    assert load_config("tiny-grpo", ["rl.mode=async", "rl.dynamic_sampling=true"]).rl.dynamic_sampling
    assert load_config("tiny-grpo", ["rl.mode=async", "rl.environment=loom.post.rl.tools:Calculator"]).rl.environment
    assert load_config("tiny-grpo", ["rl.dynamic_sampling=true"]).rl.dynamic_sampling
    for extra in (["rl.algorithm=ppo"], ["rl.group_size=1"]):
        with pytest.raises(UserError, match="needs groups to compare"):
            load_config("tiny-grpo", ["rl.dynamic_sampling=true", *extra])
