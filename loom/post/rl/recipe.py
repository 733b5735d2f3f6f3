"""Online RL (`loom rl`): GRPO-family and PPO with loom's generation engine in the loop.

One step (`RL.train_step`, the recipe's step in the one training loop), every phase timed into metrics.jsonl:

1. generation (`generation_s`): this data-parallel rank's prompts of the step, `rl.group_size` completions
   each, sampled by the engine (loom/infer/engine.py) with the rollout log-probabilities of every token.
   Every completion's seed is a function of (train.seed, step, its index in the global batch): the rollouts
   do not depend on the layout, and a resumed run draws what the uninterrupted one would have.
2. rewards (`reward_s`): `rl.reward` (a Python callable f(prompt, completion, **fields), or loom.rewards'
   built-in rewards with weights) and/or a reward model (`rl.reward_model`, a `loom rm` run scoring prompt +
   completion), their sum. With `rl.dynamic_sampling` (DAPO), groups whose rewards are all equal are replaced
   by informative groups of more prompts (`dynamic_sampling_s`, `refilled_groups`; loom/post/rl/dynamic.py).
3. log-probs (`logprobs_s`): a forward pass without gradients of the policy at the rollout weights (the
   "old" log-probs of the ratio; PPO's old values), and of the frozen reference policy when `rl.kl_coef`
   > 0. The trainer/engine mismatch is measured here: mean |log p_trainer - log p_engine| and the token
   probability ratio over the response tokens (`logp_abs_diff`, `prob_ratio_mean`, `prob_ratio_max`).
   On-policy GRPO (`rl.epochs` = `rl.minibatches` = 1, no dropout: `reuses_policy_logp`) skips the policy's
   pass: its one update starts at the rollout weights, so the old log-probs are the training forward's own,
   detached (the ratio is 1, its gradient the policy gradient, as in TRL with one iteration); the mismatch
   is then measured on that forward (`PolicyLoss.take_mismatch`). On the H200 the two passes were 19% of a
   1B step (bench/results/device_check_h200_2026-11-26_c/rl_gpu.json).
   With `rl.tis_cap` the policy loss is weighted by min(p_trainer / p_engine, cap) per token (truncated
   importance sampling): the engine's policy is never assumed to be the trainer's.
4. training (`training_s`): advantages (GRPO: group baselines; PPO: GAE on the value head's estimates),
   then `rl.epochs` x `rl.minibatches` optimizer steps through the run's step runner: the loss is the mean
   over the global batch's counted units (tokens or sequences, `rl.aggregation`) whatever the layout.
5. refit (`refit_s`): the engine's weights replaced in place by the updated policy's (gathered from FSDP
   or TP shards); with LoRA by the merged weights W + (alpha / rank) B A (the engine has no adapters), and the
   KL term's reference is the policy with its adapters switched off (no second model).

Layouts: data parallelism (replicated, FSDP, hybrid) and tensor parallelism (the engine then shards its
weights over the same tensor-parallel group, and every rank of the group runs the same requests). Groups
never straddle data-parallel ranks (train.global_batch / rl.group_size prompts per step, an equal share per
rank), so group statistics need no communication. Pipeline and context parallelism are refused for now
(loom/rules.py, `recipe_problem`).

The reference policy (KL term) is a second, frozen model in the same layout (built as the policy is,
loom/build.py), loaded from train.init_from
(or initialised from train.seed, as the policy was): a resumed run gets the same reference.

PPO: the critic is a value head (Linear hidden -> 1) on the policy's final hidden state, trained with the
policy (loss = policy loss + rl.value_coef x clipped value loss); the sequence's reward at its last token,
minus rl.kl_coef x the KL estimate at every token (Ziegler et al. 2019), then GAE(gamma, lambda).
A shared trunk halves memory and compute against a separate critic model (NeMo, OpenRLHF); the price is
that value and policy gradients share the trunk.
"""

from __future__ import annotations

from dataclasses import replace

import time

import numpy as np
import torch
from torch import nn

from loom.build import build_in_layout, parallelized, tensor_parallel, torch_dtype
from loom.config import Config
from loom.data.tokenizer import Tokenizer
from loom.errors import UserError
from loom.models.lora import adapters_disabled, lora_layers, merged_state_dict
from loom.parallel.distributed import all_reduce_sum, full_tensor
from loom.post import losses as L
from loom.post.rl.policy import PolicyLoss, add_value_head, value_of
from loom.post.rl.prompts import PromptSet, build_datasets
from loom.post.rl.rewards import Rewards, is_user_code, reward_function
from loom.post.rl.dynamic import Groups, refill
from loom.post.rl.environments import Turns, load_environment, run_episodes
from loom.post.rl.rollouts import rollout_engine, rollout_seed, rows_of, stops
from loom.train.recipe import Recipe
from loom.train.schedule import lr_at
from loom.train.trainer import Trainer


def policy_weights(model: nn.Module) -> nn.Module | dict:
    """What the engine is refitted with: the policy, or with LoRA its merged weights (W + scale B A, shard by
    shard), so that the engine, which has no adapters, samples from the trained policy."""
    return merged_state_dict(model) if lora_layers(model) else model


class RL(Recipe):
    """`loom rl`: the training loop (checkpoints, resuming, metrics, run control) with an RL step in place of a
    batch; the engine, the reference policy and the rewards are set up once the policy holds its weights."""

    command = "rl"

    def __init__(self):
        self.trainer: Trainer | None = None
        self.policy_loss: PolicyLoss | None = None

    # --- before launch and set-up -------------------------------------------------------------------------

    def check_settings(self, cfg: Config) -> None:
        """RL's prompts, and its reward function importable before launch."""
        if not cfg.rl.prompts:
            raise UserError("loom rl needs rl.prompts: .jsonl files of {\"prompt\": ...} records (other fields go to "
                            "the reward function), or addition:N, e.g. --rl.prompts=prompts.jsonl "
                            "--rl.reward=mypkg.rewards:score")
        if cfg.rl.reward:
            reward_function(cfg)
        if cfg.rl.environment:
            load_environment(cfg.rl.environment)
        if cfg.rl.mode == "async":  # loom/post/rl/async_loop.py
            from loom.post.rl.async_loop import check_async

            check_async(cfg)

    def prepare_data(self, cfg: Config, tokenizer: Tokenizer) -> None:
        """Write task prompts into the cache and check the prompt files once, before the workers start."""
        build_datasets(cfg, tokenizer)

    def datasets(self, cfg: Config, tokenizer: Tokenizer) -> tuple[PromptSet, PromptSet]:
        if cfg.rl.mode == "async":  # the generation ranks start here: their start-up overlaps the trainer's
            from loom.post.rl.async_loop import AsyncRollouts

            self.launched = AsyncRollouts(cfg)
            self.launched.start(type(self))
        return build_datasets(cfg, tokenizer)

    def loss(self, cfg: Config) -> PolicyLoss:
        self.policy_loss = PolicyLoss(cfg)
        return self.policy_loss

    def extend_model(self, model: nn.Module) -> None:
        """PPO: the value head, added on meta (before the model is parallelised)."""
        if self.policy_loss.ppo:
            add_value_head(model)

    def runs_user_code(self, cfg: Config) -> bool:
        return is_user_code(cfg.rl.reward)

    def chat_template(self, cfg: Config):
        from loom.post.chat import load_template

        if cfg.rl.template == "none":
            return None
        return load_template(cfg.rl.template, None if cfg.data.tokenizer == "bpe" else cfg.data.tokenizer, "rl.template")

    def set_up(self, trainer: Trainer) -> None:
        self.trainer = trainer
        cfg, rl = trainer.cfg, trainer.cfg.rl
        if rl.algorithm == "ppo":
            self.policy_loss.value_head = trainer.model.value
        # The engine's own copy of the policy, in train.dtype, sharded over the tensor-parallel group; its
        # initial values are replaced by the policy's at once.
        engine_model = build_in_layout(cfg, trainer.device, tensor_parallel(trainer.layout), dtype=torch_dtype(cfg),
                                       seed=0).model
        self.engine = rollout_engine(cfg, engine_model, trainer.tokenizer.decode)
        self.engine.refit(policy_weights(trainer.model))
        # rl.mode=async: rollouts from the generation ranks; the engine here evaluates only (refitted for it).
        self.generation = self.launched.connect(trainer, torch_dtype(cfg)) if rl.mode == "async" else None
        # LoRA: the reference is the policy with its adapters switched off (the base), not a second model.
        self.reference = self._build_reference() if rl.kl_coef and not cfg.lora.enabled else None
        self.rewards = Rewards(cfg, trainer.tokenizer, trainer.device)
        # rl.environment: multi-turn episodes (environments.py) in place of single completions
        self.environment = load_environment(rl.environment) if rl.environment else None
        self.turns = Turns(trainer.tokenizer, self.chat_template(cfg))
        # Completions end at the end-of-turn / end-of-sequence (and rl.stop text): what follows is never trained on.
        self.stop_ids, self.stop_texts = stops(cfg, trainer.tokenizer)

    def _build_reference(self) -> nn.Module:
        """The frozen initial policy in the run's layout: train.init_from's weights, or train.seed's."""
        cfg = self.trainer.cfg
        # It never takes a gradient: no recomputation (budget and auto plan only the policy's layers).
        cfg = replace(cfg, recompute=replace(cfg.recompute, mode="none"))
        model = build_in_layout(cfg, self.trainer.device, parallelized(cfg, self.trainer.layout),
                                init_from=cfg.train.init_from).model
        model.requires_grad_(False)
        return model.eval()

    def start(self, trainer: Trainer) -> dict | None:
        """The starting point, evaluated before any update (not when resuming)."""
        return {"step": 0, **self.evaluate(trainer)} if trainer.resumed_from is None else None

    def throughput(self, trainer: Trainer, out: dict, seconds: float) -> dict:
        return {"tokens_per_s": out["generated_tokens"] / out["generation_s"]}

    # --- one step -------------------------------------------------------------------------------------------

    def _sampling(self, greedy: bool = False):
        from loom.infer.sampling import SamplingParams

        rl = self.trainer.cfg.rl
        stop = self.stop_texts
        if greedy:
            return SamplingParams(temperature=0.0, max_new_tokens=rl.max_new_tokens, stop_token_ids=self.stop_ids,
                                  stop=stop)
        return SamplingParams(temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                              max_new_tokens=rl.max_new_tokens, stop_token_ids=self.stop_ids, stop=stop)

    def rollouts(self, data: PromptSet, indices: list[int], repeat: int, seeds: list[int] | None, greedy: bool):
        """Completions of every prompt in `indices`, `repeat` times each (a group), with their texts."""
        import dataclasses

        base = self._sampling(greedy)
        prompts = [data.ids[i] for i in indices for _ in range(repeat)]
        params = [dataclasses.replace(base, seed=s) for s in seeds] if seeds else base
        if self.environment is not None:  # multi-turn: episodes, whose first input is the environment's
            records = [{"prompt": data.texts[i], **data.fields[i]} for i in indices for _ in range(repeat)]
            wheres = [f"prompt record {i} of {data.source}" for i in indices for _ in range(repeat)]
            done = run_episodes(self.engine, self.environment, records, wheres,
                                params if seeds else [base] * len(records), self.turns, self.trainer.cfg.rl.max_turns,
                                self.trainer.tokenizer.decode)
            return [e.prompt for e in done], done, [e.text(self.trainer.tokenizer.decode) for e in done]
        done = self.engine.generate(prompts, params)
        texts = [c.text(self.trainer.tokenizer.decode) for c in done]  # without the stop token or string
        return prompts, done, texts

    def score(self, data: PromptSet, indices: list[int], repeat: int, prompts, done, texts) -> dict:
        """The rewards (`Rewards`) of `rollouts(data, indices, repeat, ...)`'s completions."""
        prompt_texts = [data.texts[i] for i in indices for _ in range(repeat)]
        fields = [data.fields[i] for i in indices for _ in range(repeat)]
        records = [f"prompt record {i} of {data.source}" for i in indices for _ in range(repeat)]
        if self.environment is None:
            return self.rewards(prompt_texts, texts, fields, [p + c.tokens for p, c in zip(prompts, done)], records)
        # episodes: the environment's rewards, plus rl.reward's / the reward model's of the transcript if set
        out = {"reward": torch.zeros(len(done), dtype=torch.float64)}
        if self.rewards.fn is not None or self.rewards.model is not None:
            out = self.rewards(prompt_texts, texts, fields, [p + c.tokens for p, c in zip(prompts, done)], records)
        out["reward_env"] = torch.tensor([e.reward for e in done], dtype=torch.float64)
        out["turns"] = torch.tensor([float(e.turns) for e in done], dtype=torch.float64)
        out["reward"] = out["reward"] + out["reward_env"]
        return out

    def reuses_policy_logp(self) -> bool:
        """Whether the old log-probs are the training forward's own (see the module docstring, phase 3)."""
        cfg = self.trainer.cfg
        rl, m = cfg.rl, cfg.model
        # Sinkhorn routing balances differently in training mode: the no-grad pass (eval) is kept there
        return (rl.algorithm == "grpo" and rl.epochs == 1 and rl.minibatches == 1 and m.dropout == 0
                and m.attn_dropout == 0 and not (m.moe_layers and m.moe.router == "sinkhorn"))

    @torch.no_grad()
    def _forward_logp(self, model: nn.Module, batch: dict, values: bool = False):
        """Per-token log-probs of the labels (and PPO's values) without gradients, micro-batch by micro-batch."""
        from loom.parallel.tensor import loss_context
        from loom.train.steps import micro_batches, to_device

        logps, vals = [], []
        was_training = model.training
        model.eval()
        for mb in micro_batches({"input_ids": batch["input_ids"], "labels": batch["labels"]},
                                self.trainer.cfg.train.micro_batch):
            mb = to_device(mb, self.trainer.device)
            with self.trainer.runner.autocast(), loss_context(self.trainer.layout.tp):
                hidden = model(mb["input_ids"], return_hidden=True)
                logps.append(full_tensor(L.token_logprobs(model.output(hidden), mb["labels"])).float().cpu())
                if values:
                    vals.append(value_of(hidden, model.value).cpu())
        model.train(was_training)
        return torch.cat(logps), (torch.cat(vals) if values else None)

    def _global_mean(self, pairs: list[tuple[torch.Tensor | float, torch.Tensor | float]]) -> list[float]:
        """[(sum, count), ...] of this rank -> global means (tensor-parallel replicas counted once)."""
        flat = torch.tensor([[float(s), float(c)] for s, c in pairs], dtype=torch.float64, device=self.trainer.device)
        flat = all_reduce_sum(flat) / self.trainer.layout.tp
        return [s / c if c > 0 else float("nan") for s, c in flat.tolist()]

    def _global_sum(self, value) -> float:
        """This rank's number summed over the data-parallel ranks (tensor-parallel replicas counted once)."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.trainer.device)
        return (all_reduce_sum(t) / self.trainer.layout.tp).item()

    def _global_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.trainer.device)
        if self.trainer.layout.distributed:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.item()

    def train_step(self, trainer: Trainer) -> dict:
        """Generate, score, compute log-probs and advantages, train `rl.epochs` x `rl.minibatches` optimizer steps,
        refit the engine (the module docstring's phases)."""
        cfg, rl, t, layout = trainer.cfg, trainer.cfg.rl, trainer.cfg.train, trainer.layout
        step = trainer.state.step
        prompts_per_step = t.global_batch // rl.group_size
        per_rank = prompts_per_step // layout.dp_size
        first = step * prompts_per_step + layout.dp_rank * per_rank
        indices = trainer.train_data.take(first, per_rank, t.seed)
        seeds = [rollout_seed(t.seed, step, first * rl.group_size + k) for k in range(per_rank * rl.group_size)]
        times = {}

        t0 = time.perf_counter()
        made = None
        if self.generation is None:
            prompts, done, texts = self.rollouts(trainer.train_data, indices, rl.group_size, seeds, greedy=False)
        else:  # made ahead by the generation ranks; the wait for them is generation_s
            prompts, done, versions, made = self.generation.take(step)
            texts = [c.text(trainer.tokenizer.decode) for c in done]
        times["generation_s"] = time.perf_counter() - t0

        if made is not None:  # rl.dynamic_sampling, async: scored and refilled by the generation ranks
            indices, rewards = made["indices"], made["rewards"]
            times.update(reward_s=made["reward_s"], dynamic_sampling_s=made["dynamic_sampling_s"],
                         refilled_groups=self._global_sum(made["refilled"]),
                         dynamic_sampling_rounds=self._global_max(made["rounds"]))
        else:
            t0 = time.perf_counter()
            rewards = self.score(trainer.train_data, indices, rl.group_size, prompts, done, texts)
            times["reward_s"] = time.perf_counter() - t0
        if rl.dynamic_sampling and made is None:  # uniform groups replaced by informative ones of more prompts
            t0 = time.perf_counter()
            groups, refilled = self._dynamic_sampling(step, first, Groups(indices, prompts, done, texts, rewards))
            indices, prompts, done, texts, rewards = (groups.indices, groups.prompts, groups.done, groups.texts,
                                                      groups.rewards)
            times.update(refilled, dynamic_sampling_s=time.perf_counter() - t0)

        batch = rows_of(prompts, done, t.seq_len, trainer.tokenizer.eod_id or 0,
                        None if self.environment is None else [e.model_mask for e in done])
        staleness = {} if self.generation is None else self.generation.staleness(self, batch, step, versions)
        t0 = time.perf_counter()
        ppo = rl.algorithm == "ppo"
        reuse = self.reuses_policy_logp()
        old_values = None
        if reuse:  # every response token's mismatch, also in groups left out below
            batch["rollout_mask"] = batch["mask"].clone()
        else:
            batch["old_logp"], old_values = self._forward_logp(trainer.model, batch, values=ppo)
        if self.reference is not None:
            batch["ref_logp"], _ = self._forward_logp(self.reference, batch)
        elif rl.kl_coef:  # LoRA: the base
            with adapters_disabled(trainer.model):
                batch["ref_logp"], _ = self._forward_logp(trainer.model, batch)
        times["logprobs_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        mask = batch["mask"]  # every response token (before uniform groups are left out)
        score = rewards["reward"].float()
        if not reuse:
            mismatch = L.mismatch_metrics(batch["old_logp"], batch["rollout_logp"], mask, self._global_mean,
                                          self._global_max)
        self.policy_loss.take_mismatch()  # from zero
        stats = self._advantages(batch, score, old_values)
        metrics = self._rollout_metrics(rewards, done, mask, stats)
        if self.environment is not None:  # episodes: model turns, and the environment's part of the reward
            metrics.update(zip(("turns", "reward_env"), self._global_mean(
                [(rewards["turns"].sum(), len(done)), (rewards["reward_env"].sum(), len(done))])))
        # Minibatch m holds the groups whose index in the global batch is m modulo rl.minibatches: the same
        # sequences in every layout (a rank's contiguous share would mix others' under data parallelism).
        group_of_row = (first + torch.arange(per_rank)).repeat_interleave(rl.group_size)
        outs = []
        for _ in range(rl.epochs):
            for m in range(rl.minibatches):
                pick = (group_of_row % rl.minibatches == m).nonzero()[:, 0]
                part = {k: v[pick] for k, v in batch.items()}
                total = self._global_sum(self.policy_loss.count(part))  # counted once, on the host: it decides
                if total > 0:
                    outs.append(trainer.optimizer_step(part, total))
        if reuse:  # measured on the training forward; a step that trained nothing measures it by itself
            sums = self.policy_loss.take_mismatch()
            if sums is None:
                logp, _ = self._forward_logp(trainer.model, batch)
                sums = L.mismatch_sums(logp, batch["rollout_logp"], batch["rollout_mask"])
            mismatch = L.reduce_mismatch(sums, self._global_mean, self._global_max)
        times["training_s"] = time.perf_counter() - t0
        updates = len(outs)
        if not outs:  # every group left out (rl.drop_uniform_groups): nothing to learn from, no update
            outs = [{"loss": 0.0, "grad_norm": 0.0, "lr": lr_at(step, cfg.optim, t.steps),
                     "skipped_steps": trainer.control.skipped_steps}]

        if self.generation is None:
            times["refit_s"] = self.engine.refit(policy_weights(trainer.model))
        else:  # the generation ranks' engines, by broadcast
            times["refit_s"] = self.generation.publish(step + 1)
        trainer.state.step += 1
        trainer.state.consumed_samples += t.global_batch
        last = outs[-1]
        out = {k: float(np.mean([o[k] for o in outs])) for k in outs[0] if isinstance(outs[0][k], (int, float))
               and k not in ("lr", "skipped_steps")}
        out.update(lr=last["lr"], skipped_steps=last["skipped_steps"], optimizer_steps=updates)
        if rl.tis_cap:  # the largest truncated importance weight: min(max p_trainer / p_engine, cap)
            out["is_weight_max"] = min(mismatch["prob_ratio_max"], rl.tis_cap)
        return {**out, **metrics, **mismatch, **staleness, **times}

    def _dynamic_sampling(self, step: int, first: int, groups: Groups) -> tuple[Groups, dict]:
        """`refill_groups` on this rank's groups; the number of groups refilled (summed over ranks) and the most
        rounds a rank drew, for metrics.jsonl."""
        groups, refilled, rounds = self.refill_groups(self.trainer.train_data, step, first, groups)
        return groups, {"refilled_groups": self._global_sum(refilled), "dynamic_sampling_rounds": self._global_max(rounds)}

    def refill_groups(self, data: PromptSet, step: int, first: int, groups: Groups) -> tuple[Groups, int, int]:
        """`dynamic.refill` with draws of a data-parallel rank's share of prompts (`first`: its first prompt's place
        in the global batch), round r's prompts and seeds a function of (train.seed, step, r, first): what the
        synchronous loop and a generation rank (rl.mode=async) draw alike. (groups, refilled, rounds)."""
        rl, seed = self.trainer.cfg.rl, self.trainer.cfg.train.seed
        count = len(groups.indices)

        def draw(r: int) -> Groups:
            indices = data.take(first, count, rollout_seed(seed, step, f"refill{r}"))
            seeds = [rollout_seed(seed, step, f"refill{r}/{first * rl.group_size + k}") for k in range(count * rl.group_size)]
            prompts, done, texts = self.rollouts(data, indices, rl.group_size, seeds, greedy=False)
            return Groups(indices, prompts, done, texts, self.score(data, indices, rl.group_size, prompts, done, texts))

        return refill(groups, draw, rl.dynamic_sampling_max_rounds)

    def _advantages(self, batch: dict, score: torch.Tensor, old_values) -> dict:
        """Fill batch["advantages"] (and PPO's "old_values", "returns"); leave out uniform groups if asked."""
        rl = self.trainer.cfg.rl
        mask = batch["mask"]
        if rl.algorithm == "grpo":
            groups = score.view(-1, rl.group_size)
            if rl.baseline == "rloo":
                adv = L.rloo_advantages(groups)
                if rl.scale == "std":
                    adv = adv / (L.group_std(groups, rl.std_estimator).unsqueeze(-1) + rl.std_eps)
            else:
                adv = L.group_advantages(groups, rl.scale, rl.std_eps, rl.std_estimator)
            informative = L.informative_groups(groups)
            if rl.drop_uniform_groups:
                keep = informative.repeat_interleave(rl.group_size).float()
                batch["mask"] = mask * keep[:, None]
            batch["advantages"] = adv.reshape(-1).float()
            return {"uniform_groups": (~informative).sum().item(), "groups": groups.shape[0]}
        ref = batch.get("ref_logp", batch["old_logp"])
        token_rewards = L.kl_penalised_rewards(score, batch["old_logp"], ref, mask, rl.kl_coef, rl.kl_estimator)
        adv, returns = L.gae(token_rewards, old_values * mask, mask, rl.gamma, rl.lam)
        if rl.whiten_advantages:
            n = mask.sum()
            mean_ = self._global_mean([((adv * mask).sum(), n)])[0]
            var = self._global_mean([(((adv - mean_) ** 2 * mask).sum(), n)])[0]
            adv = (adv - mean_) / (var ** 0.5 + 1e-8) * mask
        batch["advantages"], batch["returns"], batch["old_values"] = adv, returns, old_values * mask
        return {}

    def _rollout_metrics(self, rewards: dict, done, mask: torch.Tensor, stats: dict) -> dict:
        n = len(done)
        tokens = mask.sum()
        pairs = [(rewards["reward"].sum(), n), ((rewards["reward"] ** 2).sum(), n), (tokens, n),
                 (sum(c.finish_reason == "stop" for c in done), n)]
        keys = ["reward", "reward_sq", "response_length", "stopped"]
        if "reward_fn" in rewards and "reward_model" in rewards:
            pairs += [(rewards["reward_fn"].sum(), n), (rewards["reward_model"].sum(), n)]
            keys += ["reward_fn", "reward_model"]
        if stats:
            pairs.append((stats["uniform_groups"], stats["groups"]))
            keys.append("uniform_groups")
        values = dict(zip(keys, self._global_mean(pairs)))
        values["reward_std"] = max(values.pop("reward_sq") - values["reward"] ** 2, 0.0) ** 0.5
        values["generated_tokens"] = int(self._global_sum(tokens))
        return values

    # --- evaluation -----------------------------------------------------------------------------------------

    def evaluate(self, trainer: Trainer) -> dict:
        """The held-out prompts (an equal share per data-parallel rank) completed greedily (`val_reward`: with
        an exact-match reward, the held-out accuracy) and once sampled as in training (`val_reward_sampled`,
        seeds fixed per prompt, so evaluations differ only by the weights), scored by the run's reward."""
        data, layout = trainer.val_data, trainer.layout
        if self.generation is not None:  # the engine here is refitted for evaluations only
            self.engine.refit(policy_weights(trainer.model))
        mine = list(range(layout.dp_rank, len(data), layout.dp_size))
        sums = [(0.0, 0)] * 3
        if mine:
            done = self.rollouts(data, mine, 1, None, greedy=True)
            greedy = self.score(data, mine, 1, *done)
            seeds = [rollout_seed(trainer.cfg.train.seed, -1, i) for i in mine]
            hot = self.score(data, mine, 1, *self.rollouts(data, mine, 1, seeds, greedy=False))
            done = done[1]
            sums = [(greedy["reward"].sum().item(), len(mine)), (hot["reward"].sum().item(), len(mine)),
                    (sum(len(c.tokens) for c in done), len(mine))]
        reward, sampled_reward, length = self._global_mean(sums)
        return {"val_reward": reward, "val_reward_sampled": sampled_reward, "val_response_length": length}
