"""Loss functions of preference and RL post-training: pure functions on tensors, every setting named.

Shapes: `logits` [batch, seq, vocab]; `labels` [batch, seq] with IGNORE (-100) where a position is not
scored (prompt, padding); per-token tensors [batch, seq] with a 0/1 (or bool) `mask` of the response
tokens; per-sequence tensors [batch]; GRPO rewards [groups, group_size].

Aggregations return (sum, count) as loom's losses do (loom/models/losses.py): the trainer divides the sum
over the whole global batch by the count over the whole global batch, so accumulation and data
parallelism give the exact global mean. `mean(sum, count)` for a single batch.

Conventions, stated once:
- log-ratio `log r = logp_new - logp_old`; ratios are exp of it;
- KL estimators of KL(pi || ref) from tokens sampled by pi (Schulman, "Approximating KL divergence"), with
  `d = logp_ref - logp`: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - 1 - d (unbiased and >= 0);
- group standard deviation: the sample estimator (Bessel's n - 1, as torch.std and TRL) by default or the
  population one (n); eps added to the std, not under the square root. A group of one has no spread: its
  advantage is 0 whatever the estimator.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

IGNORE = -100


def mean(total: torch.Tensor, count) -> torch.Tensor:
    return total / count


# --- log-probabilities ----------------------------------------------------------------------------------------


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) at every position [batch, seq] in fp32; 0 where the label is IGNORE."""
    nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=IGNORE)
    return -nll.view(labels.shape)


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per sequence [batch]: the summed log-probability of its scored (response) tokens, or their mean."""
    total = token_logprobs(logits, labels).sum(-1)
    if not average:
        return total
    return total / (labels != IGNORE).sum(-1).clamp(min=1)


# --- preference losses ---------------------------------------------------------------------------------------


def dpo_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor, beta: float, kind: Literal["dpo", "ipo"] = "dpo"):
    """Per pair [batch]: (loss, chosen reward, rejected reward) from sequence log-probs.

    h = (pi_c - ref_c) - (pi_r - ref_r). DPO (Rafailov et al. 2023): -log sigmoid(beta h). IPO (Azar et al.
    2023): (h - 1 / (2 beta))^2 (with summed log-probs, as written in the paper; TRL averages them per token
    for IPO: pass mean log-probs for that). Implicit rewards beta (pi - ref), detached.
    """
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if kind == "dpo":
        loss = -F.logsigmoid(beta * h)
    elif kind == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}")
    return loss, beta * (policy_chosen - ref_chosen).detach(), beta * (policy_rejected - ref_rejected).detach()


def reward_model_losses(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per pair [batch]: -log sigmoid(r_chosen - r_rejected) (Bradley-Terry, Ouyang et al. 2022)."""
    return -F.logsigmoid(chosen - rejected)


def preference_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over pairs (divide by the pair count): chosen and rejected rewards, margin, and accuracy (the
    share of pairs whose chosen reward is strictly higher)."""
    chosen, rejected = chosen.detach().float(), rejected.detach().float()
    return {"chosen_reward": chosen.sum(), "rejected_reward": rejected.sum(), "margin": (chosen - rejected).sum(),
            "accuracy": (chosen > rejected).float().sum()}


# --- GRPO family ---------------------------------------------------------------------------------------------


def group_std(rewards: torch.Tensor, estimator: Literal["sample", "population"] = "sample") -> torch.Tensor:
    """Per group [groups]; 0 for a group of one (no spread to measure)."""
    n = rewards.shape[-1]
    if n == 1:
        return torch.zeros(rewards.shape[:-1], dtype=rewards.dtype, device=rewards.device)
    return rewards.std(-1, correction=1 if estimator == "sample" else 0)


def group_advantages(rewards: torch.Tensor, scale: Literal["std", "none"] = "std", eps: float = 1e-4,
                     estimator: Literal["sample", "population"] = "sample") -> torch.Tensor:
    """[groups, size] -> [groups, size]: reward minus its group's mean, divided by (group std + eps) when
    scale="std" (GRPO, Shao et al. 2024), not divided when scale="none" (Dr. GRPO, Liu et al. 2025)."""
    centred = rewards - rewards.mean(-1, keepdim=True)
    if scale == "none":
        return centred
    return centred / (group_std(rewards, estimator).unsqueeze(-1) + eps)


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """[groups, size]: reward minus the mean of the *other* samples of its group (Ahmadian et al. 2024),
    = size / (size - 1) x (reward - group mean); 0 for a group of one."""
    n = rewards.shape[-1]
    if n == 1:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean(-1, keepdim=True)) * (n / (n - 1))


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """[groups] bool: groups whose rewards are not all identical (DAPO's dynamic sampling drops the others:
    their advantages are all 0, so they only dilute the per-token mean). A group of one is never informative."""
    return (rewards != rewards[..., :1]).any(-1)


def clipped_policy_losses(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                          mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.2,
                          ratio_level: Literal["token", "sequence"] = "token"):
    """Per token [batch, seq]: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), and the clipped indicator.

    `advantages` [batch] (one per sequence) or [batch, seq]. ratio_level="token": r = exp(logp - old_logp)
    per token (PPO, GRPO, DAPO's clip-higher with eps_high > eps_low). "sequence": GSPO (Zheng et al. 2025):
    every token of a sequence gets r = exp(mean over its response tokens of (logp - old_logp)).
    Positions outside `mask` are 0.
    """
    mask = mask.to(logp.dtype)
    log_ratio = (logp - old_logp) * mask
    if ratio_level == "sequence":
        per_seq = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
        log_ratio = per_seq.unsqueeze(-1).expand_as(logp)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped) * mask
    return loss, (clipped < unclipped).to(logp.dtype) * mask


def aggregate(per_token: torch.Tensor, mask: torch.Tensor,
              mode: Literal["token", "sequence", "constant"], max_tokens: int | None = None):
    """(sum, count) of a per-token loss, the global mean being sum / count over the whole batch:

    - "token" (DAPO): every response token of the batch weighs the same; count = response tokens;
    - "sequence" (original GRPO): each sequence's mean over its tokens, then the mean over sequences;
      count = sequences;
    - "constant" (Dr. GRPO): each sequence's sum divided by the constant `max_tokens` (the generation
      budget), then the mean over sequences; count = sequences.
    """
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if mode == "token":
        return masked.sum(), mask.sum()
    if mode == "sequence":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum(), torch.tensor(float(per_token.shape[0]))
    if mode == "constant":
        if not max_tokens:
            raise ValueError("aggregation 'constant' needs max_tokens (the generation budget)")
        return masked.sum() / max_tokens, torch.tensor(float(per_token.shape[0]))
    raise ValueError(f"unknown aggregation {mode!r}")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: Literal["k1", "k2", "k3"]) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) at tokens sampled from pi; d = ref_logp - logp."""
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d ** 2
    if estimator == "k3":
        return torch.exp(d) - 1 - d
    raise ValueError(f"unknown KL estimator {estimator!r}")


def truncated_is_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Per token: min(p_trainer / p_rollout, cap), detached (Yao et al. 2025, truncated importance
    sampling): corrects for the rollout engine's probabilities differing from the trainer's."""
    return torch.exp(trainer_logp.detach() - rollout_logp).clamp(max=cap)


def mismatch_sums(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum |delta log p|, sum p_trainer / p_rollout, tokens, max ratio (0 without tokens)] over the response
    tokens `mask` (fp64; sums add over micro-batches, the max by max)."""
    mask = mask.to(rollout_logp.device)
    delta = (trainer_logp.detach().to(rollout_logp.device).double() - rollout_logp.double()) * mask
    ratio = torch.where(mask.bool(), torch.exp(delta), torch.zeros_like(delta))  # no host sync (a training step's)
    return torch.stack([delta.abs().sum(), ratio.sum(), mask.sum().double(), ratio.amax()])


def add_mismatch(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
    """Two `mismatch_sums` (or None and one) as one: the sums added, the max of the maxima."""
    return b if a is None else torch.cat([a[:3] + b[:3], torch.maximum(a[3:], b[3:])])


def reduce_mismatch(sums: torch.Tensor, mean=None, maximum=None) -> dict[str, float]:
    """`mismatch_sums` -> mean |delta log p|, mean and max token-probability ratio p_trainer / p_rollout.
    `mean([(sum, count), ...])` and `maximum(value)` reduce over processes (RL: over the data-parallel ranks); by
    default this process's tokens alone."""
    abs_sum, ratio_sum, tokens, top = sums.tolist()
    mean = mean or (lambda pairs: [float(s) / float(c) if float(c) > 0 else float("nan") for s, c in pairs])
    abs_diff, ratio_mean = mean([(abs_sum, tokens), (ratio_sum, tokens)])
    ratio_max = top if tokens else 1.0
    return {"logp_abs_diff": abs_diff, "prob_ratio_mean": ratio_mean,
            "prob_ratio_max": maximum(ratio_max) if maximum else ratio_max}


def mismatch_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, mean=None,
                     maximum=None) -> dict[str, float]:
    """Trainer/engine agreement over the response tokens: mean |delta log p|, mean and max token-probability
    ratio p_trainer / p_rollout. `mean([(sum, count), ...])` and `maximum(value)` reduce over processes (RL:
    over the data-parallel ranks); by default this process's tokens alone."""
    return reduce_mismatch(mismatch_sums(trainer_logp, rollout_logp, mask), mean, maximum)


# --- PPO -----------------------------------------------------------------------------------------------------


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2016) over response tokens [batch, seq].

    delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lam A_{t+1}; returns = A + V. The episode ends
    at each sequence's last response token (V after it is 0); positions outside `mask` get 0 and do not
    carry anything across (responses are contiguous, right-padded)."""
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m
        next_value = values[:, t] * m
        next_adv = adv * m
    return advantages, (advantages + values) * mask


def clipped_value_losses(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                         clip: float) -> torch.Tensor:
    """Per token: 0.5 max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2) (PPO2's value loss)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


def kl_penalised_rewards(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                         coef: float, estimator: Literal["k1", "k2", "k3"] = "k1") -> torch.Tensor:
    """Per-token rewards [batch, seq] (Ziegler et al. 2019): -coef x KL estimate at every response token, plus
    the sequence's score [batch] at its last response token."""
    mask = mask.to(logp.dtype)
    rewards = -coef * kl_estimate(logp.detach(), ref_logp, estimator) * mask
    last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(-1)
    rewards[torch.arange(len(scores)), last] += scores.to(rewards.dtype)
    return rewards


def grpo_token_losses(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                      eps_low: float, eps_high: float, ratio_level: Literal["token", "sequence"] = "token",
                      kl_coef: float = 0.0, ref_logp: torch.Tensor | None = None,
                      kl_estimator: Literal["k1", "k2", "k3"] = "k3", is_weights: torch.Tensor | None = None):
    """Per token: the clipped policy loss, times truncated importance weights when given, plus kl_coef x the
    KL estimate (coefficient 0: no reference needed). Aggregate with `aggregate`."""
    loss, _ = clipped_policy_losses(logp, old_logp, advantages, mask, eps_low, eps_high, ratio_level)
    if is_weights is not None:
        loss = loss * is_weights
    if kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs the reference policy's log-probs")
        loss = loss + kl_coef * kl_estimate(logp, ref_logp, kl_estimator) * mask.to(logp.dtype)
    return loss
