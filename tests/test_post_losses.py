"""Post-training losses (loom/post/losses.py) against values computed by hand on fixed tensors."""

import math

import pytest
import torch

from loom.post import losses as L

LN = math.log


def close(got, want, tol=1e-6):
    got = torch.as_tensor(got, dtype=torch.float64)
    assert torch.allclose(got, torch.as_tensor(want, dtype=torch.float64), atol=tol, rtol=0), (got, want)


def test_sequence_logprobs_sum_and_mean_over_response_tokens():
    # position 0: uniform over 3 -> log 1/3; position 1: probabilities 1/4, 1/2, 1/4 -> log 1/2 for token 1
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, LN(2), 0.0]]]).repeat(2, 1, 1)
    labels = torch.tensor([[2, 1], [L.IGNORE, 1]])
    close(L.token_logprobs(logits, labels), [[LN(1 / 3), LN(1 / 2)], [0.0, LN(1 / 2)]])
    close(L.sequence_logprobs(logits, labels), [LN(1 / 3) + LN(1 / 2), LN(1 / 2)])
    close(L.sequence_logprobs(logits, labels, average=True), [(LN(1 / 3) + LN(1 / 2)) / 2, LN(1 / 2)])


def test_dpo_ipo_rewards_margins_accuracy():
    # pair 0: h = (-1 + 2) - (-3 + 2) = 2; pair 1: h = -2; beta 0.5
    pc, pr = torch.tensor([-1.0, -3.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-2.0, -2.0]), torch.tensor([-2.0, -2.0])
    loss, chosen, rejected = L.dpo_losses(pc, pr, rc, rr, beta=0.5)
    close(loss, [LN(1 + math.exp(-1)), LN(1 + math.exp(1))])  # -log sigmoid(0.5 h)
    close(chosen, [0.5, -0.5])
    close(rejected, [-0.5, 0.5])
    loss, _, _ = L.dpo_losses(pc, pr, rc, rr, beta=0.5, kind="ipo")
    close(loss, [(2 - 1) ** 2, (-2 - 1) ** 2])  # (h - 1 / (2 beta))^2
    sums = L.preference_sums(chosen, rejected)
    close(sums["margin"], 0.0)
    close(sums["accuracy"], 1.0)  # one of the two pairs
    close(sums["chosen_reward"], 0.0)
    # the gradient of DPO wrt the chosen log-prob: -beta sigmoid(-beta h)
    pc = pc.clone().requires_grad_()
    L.dpo_losses(pc, pr, rc, rr, beta=0.5)[0].sum().backward()
    close(pc.grad, [-0.5 / (1 + math.exp(1)), -0.5 / (1 + math.exp(-1))])


def test_reward_model_loss_and_strict_accuracy():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    close(L.reward_model_losses(chosen, rejected), [LN(1 + math.exp(-1)), LN(2)])
    close(L.preference_sums(chosen, rejected)["accuracy"], 1.0)  # a tie is not a win


def test_group_advantages_estimators_dr_grpo_rloo_and_groups_of_one():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    sample_std = math.sqrt(4 * 0.25 / 3)
    a = 0.5 / (sample_std + 1e-4)
    close(L.group_advantages(r, eps=1e-4), [[a, -a, -a, a]])
    a = 0.5 / (0.5 + 1e-4)
    close(L.group_advantages(r, eps=1e-4, estimator="population"), [[a, -a, -a, a]])
    close(L.group_advantages(r, scale="none"), [[0.5, -0.5, -0.5, 0.5]])  # Dr. GRPO
    close(L.rloo_advantages(r), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])  # 1 - mean(0, 0, 1), 0 - mean(0, 1, 1)
    one = torch.tensor([[3.0], [5.0]])
    for estimator in ("sample", "population"):
        close(L.group_advantages(one, estimator=estimator), [[0.0], [0.0]])
    close(L.group_std(one), [0.0, 0.0])
    close(L.rloo_advantages(one), [[0.0], [0.0]])
    same = torch.tensor([[2.0, 2.0, 2.0], [0.0, 1.0, 0.0]])
    close(L.group_advantages(same), [[0, 0, 0], [-1 / 3 / (math.sqrt(1 / 3) + 1e-4), 2 / 3 / (math.sqrt(1 / 3) + 1e-4),
                                                 -1 / 3 / (math.sqrt(1 / 3) + 1e-4)]])
    assert L.informative_groups(same).tolist() == [False, True]
    assert L.informative_groups(one).tolist() == [False, False]


def test_clipping_both_branches_with_separate_eps():
    # ratios 1.5, 1.5, 0.5, 0.5 with advantages +1, -1, -1, +1; eps_low 0.2, eps_high 0.28
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]]))
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, clipped = L.clipped_policy_losses(logp, old, adv, torch.ones_like(logp), eps_low=0.2, eps_high=0.28)
    # +A above 1 + eps_high: clipped to 1.28; -A above: unclipped 1.5 counts; -A below 1 - eps_low: 0.8; +A below: 0.5
    close(loss, [[-1.28, 1.5, 0.8, -0.5]])
    close(clipped, [[1, 0, 1, 0]])
    # a clipped token passes no gradient, an unclipped one -A r
    logp = logp.clone().requires_grad_()
    L.clipped_policy_losses(logp, old, adv, torch.ones_like(logp), 0.2, 0.28)[0].sum().backward()
    close(logp.grad, [[0.0, 1.5, 0.0, -0.5]])


def test_gspo_sequence_level_ratio():
    logp = torch.log(torch.tensor([[1.5, 0.5, 9.0]])).requires_grad_()  # third token outside the mask
    old, mask = torch.zeros(1, 3), torch.tensor([[1, 1, 0]])
    s = math.sqrt(0.75)  # exp(mean(log 1.5, log 0.5))
    loss, _ = L.clipped_policy_losses(logp, old, torch.tensor([1.0]), mask, 0.2, 0.2, ratio_level="sequence")
    close(loss, [[-s, -s, 0.0]])
    total, count = L.aggregate(loss, mask, "sequence")
    total.backward()
    close(logp.grad, [[-s / 2, -s / 2, 0.0]])  # d s / d logp_t = s / |y|, shared by the tokens
    loss, _ = L.clipped_policy_losses(logp, old, torch.tensor([-1.0]), mask, 0.1, 0.1, ratio_level="sequence")
    close(loss, [[0.9, 0.9, 0.0]])  # s = 0.866 < 1 - 0.1 with A < 0: the clipped 0.9 counts


def test_aggregation_modes():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 7.0], [4.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    total, count = L.aggregate(per_token, mask, "token")
    close([total, count], [10.0, 4.0])  # DAPO: 2.5 per token
    total, count = L.aggregate(per_token, mask, "sequence")
    close([total, count], [6 / 3 + 4 / 1, 2.0])  # GRPO: mean of sequence means, 3.0
    total, count = L.aggregate(per_token, mask, "constant", max_tokens=4)
    close([total, count], [10 / 4, 2.0])  # Dr. GRPO: 1.25
    # sum / count over two halves equals the whole batch's mean (the protocol the trainer relies on)
    halves = [L.aggregate(per_token[i:i + 1], mask[i:i + 1], "token") for i in (0, 1)]
    close(sum(t for t, _ in halves) / sum(c for _, c in halves), 2.5)
    with pytest.raises(ValueError):
        L.aggregate(per_token, mask, "constant")


def test_kl_estimators_coefficient_and_truncated_importance_sampling():
    logp, ref = torch.log(torch.tensor([[0.5]])), torch.log(torch.tensor([[0.25]]))
    close(L.kl_estimate(logp, ref, "k1"), [[LN(2)]])
    close(L.kl_estimate(logp, ref, "k2"), [[0.5 * LN(2) ** 2]])
    close(L.kl_estimate(logp, ref, "k3"), [[0.5 - 1 + LN(2)]])
    mask, adv = torch.ones(1, 1), torch.tensor([1.0])
    base = L.grpo_token_losses(logp, logp.detach(), adv, mask, 0.2, 0.2)  # coefficient 0: no reference needed
    close(base, [[-1.0]])
    for k, value in (("k1", LN(2)), ("k2", 0.5 * LN(2) ** 2), ("k3", LN(2) - 0.5)):
        close(L.grpo_token_losses(logp, logp.detach(), adv, mask, 0.2, 0.2, kl_coef=0.1, ref_logp=ref,
                                  kl_estimator=k), [[-1.0 + 0.1 * value]])
    trainer, rollout = torch.log(torch.tensor([[0.6, 0.3]])), torch.log(torch.tensor([[0.3, 0.6]]))
    close(L.truncated_is_weights(trainer, rollout, cap=1.5), [[1.5, 0.5]])  # ratio 2 capped; 0.5 kept
    weighted = L.grpo_token_losses(trainer, trainer.detach(), torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2,
                                   is_weights=L.truncated_is_weights(trainer, rollout, 1.5))
    close(weighted, [[-1.5, -0.5]])
    m = L.mismatch_metrics(trainer, rollout, torch.tensor([[1, 1]]))
    close([m["logp_abs_diff"], m["prob_ratio_mean"], m["prob_ratio_max"]], [LN(2), 1.25, 2.0])


def _gae_loop(rewards, values, mask, gamma, lam):
    adv = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        n = sum(mask[b])
        running = 0.0
        for t in reversed(range(n)):
            next_v = values[b][t + 1] if t + 1 < n else 0.0
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            running = delta + gamma * lam * running
            adv[b][t] = running
    return adv


def test_gae_by_hand_and_against_a_plain_loop():
    adv, ret = L.gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.ones(1, 2), 0.9, 0.8)
    close(adv, [[-0.05 + 0.72 * 0.5, 0.5]])  # delta_1 = 1 - 0.5; delta_0 = 0.9 * 0.5 - 0.5
    close(ret, [[0.81, 1.0]])
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 7, generator=g, dtype=torch.float64), torch.randn(4, 7, generator=g, dtype=torch.float64)
    lengths = [7, 3, 1, 5]
    mask = torch.tensor([[1] * n + [0] * (7 - n) for n in lengths])
    for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.5, 0.0)):
        adv, ret = L.gae(rewards, values, mask, gamma, lam)
        want = _gae_loop(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
        close(adv, want, tol=1e-12)
        close(ret, (torch.tensor(want, dtype=torch.float64) + values) * mask, tol=1e-12)


def test_clipped_value_loss_and_kl_penalised_rewards():
    v, old = torch.tensor([1.0, 1.0, 0.6]), torch.tensor([0.5, 0.5, 0.5])
    close(L.clipped_value_losses(v, old, torch.tensor([2.0, 0.0, 0.0]), clip=0.2),
          [0.5 * 1.3 ** 2, 0.5 * 1.0, 0.5 * 0.6 ** 2])  # clipped 0.7 farther; unclipped farther; inside the clip
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.5], [0.5, 0.25, 0.5]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards = L.kl_penalised_rewards(torch.tensor([1.0, 2.0]), logp, ref, mask, coef=0.1, estimator="k1")
    close(rewards, [[-0.1 * LN(2), 1.0, 0.0], [0.0, -0.1 * LN(2), 2.0]], tol=1e-6)
