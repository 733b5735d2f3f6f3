"""Post-training recipes on the one training loop: supervised fine-tuning (sft.py: chat templates, masked
loss, packing), reward models and DPO / IPO (pref.py), online RL (rl/), and the loss library of preference
and RL training (losses.py). `recipe_for` is the one place a subcommand becomes its recipe."""

from __future__ import annotations

from loom.train.recipe import Recipe

COMMANDS = ("train", "sft", "rm", "dpo", "rl")


def recipe_for(command: str) -> Recipe:
    """The recipe the subcommand `command` runs (train, sft, rm, dpo, rl)."""
    if command == "sft":
        from loom.post.sft import SFT

        return SFT()
    if command == "rm":
        from loom.post.pref import RewardModel

        return RewardModel()
    if command == "dpo":
        from loom.post.pref import DPO

        return DPO()
    if command == "rl":
        from loom.post.rl.recipe import RL

        return RL()
    if command != "train":
        raise ValueError(f"no recipe for {command!r}; the recipes: {', '.join(COMMANDS)}")
    return Recipe()
