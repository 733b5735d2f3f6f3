"""DAPO's dynamic sampling (`rl.dynamic_sampling=true`, Yu et al. 2025, section 3.2): a group whose completions
all score the same has advantages of 0 everywhere, so it carries no gradient and only dilutes the token mean.
Such groups are replaced by informative groups of freshly drawn prompts, round after round (each round draws
as many prompts as the rank's share of the step), until none is left or `rl.dynamic_sampling_max_rounds`
rounds ran; groups still uniform then stay (and `rl.drop_uniform_groups` may leave them out of the loss).

Each rank refills its own groups (groups never straddle data-parallel ranks); what a round draws is a function
of (train.seed, step, round, the rank's first prompt), so a resumed run draws what the uninterrupted one did."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from loom.post import losses as L


@dataclass
class Groups:
    """A rank's rollouts of one step, `group_size` consecutive rows per prompt: the prompt index of each group,
    and per row the prompt's ids, the completion, its text and its rewards (`Rewards`' dict of [rows] tensors)."""

    indices: list[int]
    prompts: list
    done: list
    texts: list[str]
    rewards: dict[str, torch.Tensor]

    def informative(self) -> torch.Tensor:
        """[groups] bool, as the advantages see the rewards (float32)."""
        return L.informative_groups(self.rewards["reward"].float().view(len(self.indices), -1))

    def put(self, slot: int, other: "Groups", group: int) -> None:
        """Group `group` of `other` in place of this one's group `slot`."""
        size = len(self.prompts) // len(self.indices)
        mine, theirs = slice(slot * size, (slot + 1) * size), slice(group * size, (group + 1) * size)
        self.indices[slot] = other.indices[group]
        for name in ("prompts", "done", "texts"):
            getattr(self, name)[mine] = getattr(other, name)[theirs]
        for key, values in self.rewards.items():
            values[mine] = other.rewards[key][theirs]


def refill(groups: Groups, draw: Callable[[int], Groups], max_rounds: int) -> tuple[Groups, int, int]:
    """Replace `groups`' uniform groups by informative ones of `draw(round)` (round = 1, 2, ...), in order, for at
    most `max_rounds` rounds. Returns (groups, how many were replaced, rounds drawn)."""
    slots = [g for g, keep in enumerate(groups.informative().tolist()) if not keep]
    refilled = rounds = 0
    while slots and rounds < max_rounds:
        rounds += 1
        extra = draw(rounds)
        for g, keep in enumerate(extra.informative().tolist()):
            if keep and slots:
                groups.put(slots.pop(0), extra, g)
                refilled += 1
    return groups, refilled, rounds
