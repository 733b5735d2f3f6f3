"""RL's objective: the clipped policy loss (GRPO family, PPO) with PPO's value head and value loss."""

from __future__ import annotations

import torch
from torch import nn

from loom.config import Config
from loom.models.losses import HeadInput, Loss
from loom.parallel.distributed import full_tensor
from loom.post import losses as L


class PolicyLoss(Loss):
    """The clipped policy loss (and PPO's value loss) of one micro-batch, summed as `rl.aggregation` counts:
    response tokens ("token") or sequences. Rows left out (dropped uniform groups) have an all-zero mask.
    Statistics (`take_sums`) are aggregated the same way."""

    count_varies = True

    def __init__(self, cfg: Config):
        self.rl = cfg.rl
        self.ppo = cfg.rl.algorithm == "ppo"
        self.wants_hidden = self.ppo  # PPO reads the hidden states for its value head
        self.value_head = None
        self.sums: dict[str, torch.Tensor] = {}
        self.mismatch: torch.Tensor | None = None  # on-policy steps: `mismatch_sums` of the training forwards

    def count(self, batch) -> torch.Tensor:
        mask = batch["mask"]
        if self.rl.aggregation == "token":
            return mask.sum()
        return (mask.sum(-1) > 0).sum()

    def _agg(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return L.aggregate(per_token, mask, self.rl.aggregation, self.rl.max_new_tokens)[0]

    def __call__(self, output, batch) -> torch.Tensor:
        rl = self.rl
        values = None
        if isinstance(output, HeadInput):
            logits = output.head(output.hidden)
            values = value_of(output.hidden, self.value_head)
        else:
            logits = output
        logp = full_tensor(L.token_logprobs(logits, batch["labels"]))
        mask = batch["mask"].to(logp.dtype)
        old = batch.get("old_logp")
        if old is None:  # on-policy (RL.reuses_policy_logp): the old policy is this forward's, detached
            old = logp.detach()
            self.mismatch = L.add_mismatch(self.mismatch, L.mismatch_sums(old, batch["rollout_logp"],
                                                                           batch["rollout_mask"]))
        is_weights = L.truncated_is_weights(old, batch["rollout_logp"], rl.tis_cap) if rl.tis_cap else None
        kl_coef = 0.0 if self.ppo else rl.kl_coef  # PPO folds the KL into the reward
        per_token = L.grpo_token_losses(logp, old, batch["advantages"], mask, rl.clip_low, rl.clip_high, rl.ratio,
                                        kl_coef, batch.get("ref_logp"), rl.kl_estimator, is_weights)
        total = self._agg(per_token, mask)
        _, clipped = L.clipped_policy_losses(logp.detach(), old, batch["advantages"], mask, rl.clip_low,
                                             rl.clip_high, rl.ratio)
        stats = {"policy_loss": total.detach(), "clip_fraction": self._agg(clipped, mask),
                 "ratio": self._agg(torch.exp(logp.detach() - old), mask)}
        if is_weights is not None:  # the truncated importance weights' mean, as the loss aggregates
            stats["is_weight_mean"] = self._agg(is_weights, mask)
        if "ref_logp" in batch:
            stats["kl"] = self._agg(L.kl_estimate(logp.detach(), batch["ref_logp"], rl.kl_estimator), mask)
        if values is not None:
            value_loss = L.clipped_value_losses(values, batch["old_values"], batch["returns"], rl.value_clip) * mask
            value_sum = self._agg(value_loss, mask)
            stats["value_loss"] = value_sum.detach()
            total = total + rl.value_coef * value_sum
        for k, v in stats.items():
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        return total

    def take_mismatch(self) -> torch.Tensor | None:
        """The `mismatch_sums` of the on-policy forwards since the last call (None: none ran), and start again."""
        out, self.mismatch = self.mismatch, None
        return out

    def take_sums(self) -> dict[str, torch.Tensor]:
        out, self.sums = self.sums, {}
        return out


def add_value_head(model: nn.Module) -> None:
    model.value = nn.Linear(model.cfg.hidden, 1, bias=True, device=model.output.weight.device)
    model.fresh_parameters = ("value.weight", "value.bias")  # not in pretrained weights: keeps its initialisation


def value_of(hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """[batch, seq] value estimates in fp32 from the final hidden states."""
    return full_tensor(head(hidden)).squeeze(-1).float()
