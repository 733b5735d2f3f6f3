"""Online RL (`loom rl`): GRPO-family and PPO with loom's generation engine in the loop.

One step (`RLTrainer.train_step`), every phase timed into metrics.jsonl:

1. generation (`generation_s`): this data-parallel rank's prompts of the step, `rl.group_size` completions
   each, sampled by the engine (loom/infer/engine.py) with the rollout log-probabilities of every token.
   Every completion's seed is a function of (train.seed, step, its index in the global batch): the rollouts
   do not depend on the layout, and a resumed run draws what the uninterrupted one would have.
2. rewards (`reward_s`): `rl.reward` (a Python callable f(prompt, completion, **fields)) and/or a reward
   model (`rl.reward_model`, a `loom rm` run scoring prompt + completion), their sum.
3. log-probs (`logprobs_s`): a forward pass without gradients of the policy at the rollout weights (the
   "old" log-probs of the ratio; PPO's old values), and of the frozen reference policy when `rl.kl_coef`
   > 0. The trainer/engine mismatch is measured here: mean |log p_trainer - log p_engine| and the token
   probability ratio over the response tokens (`logp_abs_diff`, `prob_ratio_mean`, `prob_ratio_max`).
   With `rl.tis_cap` the policy loss is weighted by min(p_trainer / p_engine, cap) per token (truncated
   importance sampling): the engine's policy is never assumed to be the trainer's.
4. training (`training_s`): advantages (GRPO: group baselines; PPO: GAE on the value head's estimates),
   then `rl.epochs` x `rl.minibatches` optimizer steps through the run's step runner: the loss is the mean
   over the global batch's counted units (tokens or sequences, `rl.aggregation`) whatever the layout.
5. refit (`refit_s`): the engine's weights replaced in place by the updated policy's (gathered from FSDP
   or TP shards).

Layouts: data parallelism (replicated, FSDP, hybrid) and tensor parallelism (the engine then shards its
weights over the same tensor-parallel group, and every rank of the group runs the same requests). Groups
never straddle data-parallel ranks (train.global_batch / rl.group_size prompts per step, an equal share per
rank), so group statistics need no communication. Pipeline and context parallelism are refused for now.

The reference policy (KL term) is a second, frozen model in the same layout, loaded from train.init_from
(or initialised from train.seed, as the policy was): a resumed run gets the same reference.

PPO: the critic is a value head (Linear hidden -> 1) on the policy's final hidden state, trained with the
policy (loss = policy loss + rl.value_coef x clipped value loss); the sequence's reward at its last token,
minus rl.kl_coef x the KL estimate at every token (Ziegler et al. 2019), then GAE(gamma, lambda).
A shared trunk halves memory and compute against a separate critic model (NeMo, OpenRLHF); the price is
that value and policy gradients share the trunk.
"""

from __future__ import annotations

import hashlib
import importlib
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from loom.config import Config
from loom.data.jsonl import jsonl_records
from loom.data.tokenizer import Tokenizer
from loom.errors import UserError
from loom.models.losses import IGNORE, HeadInput
from loom.parallel.distributed import all_reduce_sum, local
from loom.post import losses as L
from loom.post import tasks
from loom.train.schedule import lr_at
from loom.train.trainer import Trainer

EXAMPLE = '{"prompt": "12+30=", "answer": "42"}'


# --- prompts ---------------------------------------------------------------------------------------------------


class PromptSet:
    """Prompts tokenized once: `ids[i]` the model's input, `texts[i]` what the reward function sees as the
    prompt, `fields[i]` the record's other fields (keyword arguments of the reward function)."""

    def __init__(self, specs: list[str], role: str, tokenizer: Tokenizer, template, max_prompt: int,
                 where: str):
        self.texts, self.ids, self.fields = [], [], []
        self.too_long = 0
        for spec in specs:
            path = Path(tasks.materialise(spec, role, where))
            if not path.is_file():
                raise UserError(f"{where} entry {spec!r} is not a file; give .jsonl files of records like {EXAMPLE}, "
                                "or addition:N")
            for line, record in jsonl_records(path, EXAMPLE):
                if record is None:
                    continue
                text, ids = self._encode(record, line, tokenizer, template)
                if len(ids) > max_prompt:
                    self.too_long += 1
                    continue
                self.texts.append(text)
                self.ids.append(ids)
                self.fields.append({k: v for k, v in record.items() if k != "prompt"})
        if not self.ids:
            raise UserError(f"{where} ({', '.join(specs)}): no prompt of at most {max_prompt} tokens ({self.too_long} "
                            "longer): raise train.seq_len or lower rl.max_new_tokens (train.seq_len + 1 holds prompt "
                            "and completion)")
        self.source = ", ".join(specs)

    @staticmethod
    def _encode(record, where: str, tokenizer: Tokenizer, template) -> tuple[str, list[int]]:
        prompt = record.get("prompt") if isinstance(record, dict) else None
        if isinstance(prompt, str) and prompt:
            if template is None:
                return prompt, tokenizer.encode(prompt)
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                       for m in prompt):
            if template is None:
                raise UserError(f"{where}: a chat prompt (a list of messages) needs rl.template (chatml, llama3, "
                                "auto or a file); rl.template=none takes string prompts only")
            text = template.render(prompt, add_generation_prompt=True)
            return text, tokenizer.encode(text)
        raise UserError(f"{where}: a prompt record needs \"prompt\": a non-empty string or a list of "
                        f"{{\"role\", \"content\"}} messages, e.g. {EXAMPLE}")

    def __len__(self) -> int:
        return len(self.ids)

    def part(self, lo: int, hi: int, source: str, too_long: int = 0) -> "PromptSet":
        """Prompts lo..hi-1 of this set, as a set of their own (`too_long`: left out before, for the banner)."""
        out = PromptSet.__new__(PromptSet)
        out.texts, out.ids, out.fields = self.texts[lo:hi], self.ids[lo:hi], self.fields[lo:hi]
        out.too_long, out.source = too_long, source
        return out

    def summary(self) -> str:
        dropped = f"; {self.too_long} longer prompts left out" if self.too_long else ""
        return f"{len(self)} prompts ({self.source}){dropped}"

    def order(self, epoch: int, seed: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(len(self))

    def take(self, start: int, count: int, seed: int) -> list[int]:
        """Prompt indices [start, start + count) of the run's stream: shuffled passes over the set."""
        orders: dict[int, np.ndarray] = {}
        out = []
        for k in range(start, start + count):
            epoch, i = divmod(k, len(self))
            if epoch not in orders:
                orders[epoch] = self.order(epoch, seed)
            out.append(int(orders[epoch][i]))
        return out

    def epoch_steps(self, global_batch: int) -> dict[int, str]:
        return {}


def build_datasets(cfg: Config, tokenizer: Tokenizer):
    rl = cfg.rl
    template = None
    if rl.template != "none":
        from loom.post.chat import load_template

        template = load_template(rl.template, None if cfg.data.tokenizer == "bpe" else cfg.data.tokenizer)
    max_prompt = engine_max_len(cfg) - rl.max_new_tokens
    if max_prompt < 1:
        raise UserError(f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt in train.seq_len + 1="
                        f"{engine_max_len(cfg)} tokens; raise train.seq_len or lower rl.max_new_tokens")
    train = PromptSet(rl.prompts, "rl", tokenizer, template, max_prompt, "rl.prompts")
    if rl.valid_prompts:
        valid = PromptSet(rl.valid_prompts, "valid", tokenizer, template, max_prompt, "rl.valid_prompts")
        valid.source = f"rl.valid_prompts ({', '.join(rl.valid_prompts)})"
        return train, valid
    (lo, hi), (vlo, vhi), _ = cfg.data.split_ranges(len(train))
    if vhi <= vlo:
        raise UserError(f"data.split={cfg.data.split} leaves no held-out prompts of the {len(train)} in rl.prompts; "
                        "give rl.valid_prompts or a split with a validation share, e.g. 90,10")
    valid = train.part(vlo, vhi, f"data.split={cfg.data.split}: prompts {vlo}..{vhi - 1} of rl.prompts")
    train = train.part(lo, hi, train.source, train.too_long)
    return train, valid


def engine_max_len(cfg: Config) -> int:
    """Prompt + completion tokens a rollout may hold: one more than a training row's inputs."""
    return min(cfg.train.seq_len + 1, cfg.model.max_seq_len)


def rollout_engine(cfg: Config, model: nn.Module):
    """The engine that generates the rollouts, on `model` (the engine's own copy of the policy). Decode steps are
    compiled per `rl.engine_compile`: "auto" (the default) is on on a GPU (a CUDA graph per step) and off on a
    CPU, decided by `loom.infer.engine.resolve_compile` as for `loom generate`."""
    from loom.infer.engine import Engine

    rl = cfg.rl
    return Engine(model, max_batch=rl.engine_batch, max_len=engine_max_len(cfg), seed=cfg.train.seed,
                  compile=rl.engine_compile, sync_every=rl.engine_sync_every)


# --- rewards ---------------------------------------------------------------------------------------------------


user_modules: list[str] = []  # the user's modules imported for rewards: `loom.cli._exit` keeps the ordinary exit


def load_callable(spec: str):
    """`package.module:function` -> the function; UserError naming what is wrong."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"rl.reward={spec!r}: cannot import {module_name!r} ({e}); give package.module:function "
                        "importable from this environment, e.g. loom.post.tasks:exact_match") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"rl.reward={spec!r}: {module_name} has no function {name!r}")
    if not module_name.startswith("loom."):
        user_modules.append(module_name)
    return fn


class Rewards:
    """The reward of each (prompt, completion): the callable's and/or the reward model's (times its coef)."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer, device: torch.device):
        rl = cfg.rl
        self.fn = load_callable(rl.reward) if rl.reward else None
        self.model = None
        self.coef = rl.reward_model_coef
        if rl.reward_model:
            from loom.post.pref import load_reward_model

            dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
            self.model, rm_cfg = load_reward_model(rl.reward_model, dtype)
            if rm_cfg.model.vocab_size != cfg.model.vocab_size:
                raise UserError(f"rl.reward_model={rl.reward_model} has vocab_size {rm_cfg.model.vocab_size}, the "
                                f"policy {cfg.model.vocab_size}: it must read the policy's tokens (same tokenizer)")
            self.model.to(device)
            self.device = device

    def __call__(self, texts: list[str], completions: list[str], fields: list[dict],
                 sequences: list[list[int]]) -> dict[str, torch.Tensor]:
        out = {}
        total = torch.zeros(len(texts), dtype=torch.float64)
        if self.fn is not None:
            values = torch.tensor([float(self.fn(p, c, **f)) for p, c, f in zip(texts, completions, fields)],
                                  dtype=torch.float64)
            out["reward_fn"] = values
            total += values
        if self.model is not None:
            scores = self.score(sequences)
            out["reward_model"] = scores
            total += self.coef * scores
        out["reward"] = total
        return out

    @torch.no_grad()
    def score(self, sequences: list[list[int]], batch: int = 16) -> torch.Tensor:
        from loom.post.pref import rewards_at

        out = []
        for i in range(0, len(sequences), batch):
            rows = sequences[i:i + batch]
            width = max(map(len, rows))
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            for b, r in enumerate(rows):
                ids[b, :len(r)] = torch.tensor(r)
            last = torch.tensor([len(r) - 1 for r in rows], device=self.device)
            hidden = self.model(ids.to(self.device), return_hidden=True)  # causal: padding after `last` unseen
            out.append(rewards_at(hidden, last, self.model.score).double().cpu())
        return torch.cat(out)


# --- the loss --------------------------------------------------------------------------------------------------


class PolicyLoss:
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

    def attach(self, model: nn.Module) -> None:
        """PPO: add the value head to the model on meta (before it is parallelised)."""
        if self.ppo:
            add_value_head(model)

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
        logp = local(L.token_logprobs(logits, batch["labels"]))
        mask = batch["mask"].to(logp.dtype)
        old = batch["old_logp"]
        is_weights = L.truncated_is_weights(old, batch["rollout_logp"], rl.tis_cap) if rl.tis_cap else None
        kl_coef = 0.0 if self.ppo else rl.kl_coef  # PPO folds the KL into the reward
        per_token = L.grpo_token_losses(logp, old, batch["advantages"], mask, rl.clip_low, rl.clip_high, rl.ratio,
                                        kl_coef, batch.get("ref_logp"), rl.kl_estimator, is_weights)
        total = self._agg(per_token, mask)
        _, clipped = L.clipped_policy_losses(logp.detach(), old, batch["advantages"], mask, rl.clip_low,
                                             rl.clip_high, rl.ratio)
        stats = {"policy_loss": total.detach(), "clip_fraction": self._agg(clipped, mask),
                 "ratio": self._agg(torch.exp(logp.detach() - old), mask)}
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

    def take_sums(self) -> dict[str, torch.Tensor]:
        out, self.sums = self.sums, {}
        return out


def add_value_head(model: nn.Module) -> None:
    model.value = nn.Linear(model.cfg.hidden, 1, bias=True, device=model.output.weight.device)
    model.fresh_parameters = ("value.weight", "value.bias")  # not in pretrained weights: keeps its initialisation


def value_of(hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """[batch, seq] value estimates in fp32 from the final hidden states."""
    return local(head(hidden)).squeeze(-1).float()


# --- rollouts --------------------------------------------------------------------------------------------------


def rollout_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of completion `index` of the global batch at `step`: the same in every layout."""
    digest = hashlib.sha256(f"{seed}/{step}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def rows_of(prompts: list[list[int]], completions, seq_len: int, pad: int) -> dict[str, torch.Tensor]:
    """Training rows of prompt + completion: `input_ids`, `labels` (IGNORE outside the completion),
    `mask` (1 on completion tokens) and `rollout_logp` (the engine's log-prob of each label), [rows, seq_len]."""
    n = len(prompts)
    ids = torch.full((n, seq_len + 1), pad, dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    rollout = torch.zeros(n, seq_len, dtype=torch.float32)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        seq = p + c.tokens
        ids[b, :len(seq)] = torch.tensor(seq)
        start = len(p) - 1  # label position of the first completion token
        labels[b, start:start + len(c.tokens)] = torch.tensor(c.tokens)
        rollout[b, start:start + len(c.tokens)] = torch.tensor(c.logprobs, dtype=torch.float32)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": labels, "mask": (labels != IGNORE).float(),
            "rollout_logp": rollout}


# --- the trainer -----------------------------------------------------------------------------------------------


def check(cfg: Config) -> None:
    """Settings an RL run cannot use, refused before launch."""
    rl, t, par = cfg.rl, cfg.train, cfg.parallel
    for name in ("pp", "cp"):
        if getattr(par, name) > 1:
            raise UserError(f"parallel.{name}={getattr(par, name)}: loom rl runs the policy with data and tensor "
                            f"parallelism (parallel.dp_shard, dp_replicate, tp) for now; set parallel.{name}=1")
    if par.sp:
        raise UserError("parallel.sp=true: loom rl does not run sequence parallelism yet; set parallel.sp=false")
    dp = par.dp_shard * par.dp_replicate
    if t.global_batch % rl.group_size:
        raise UserError(f"train.global_batch={t.global_batch} must be a multiple of rl.group_size={rl.group_size} "
                        "(a step's sequences are whole groups of completions of one prompt)")
    prompts = t.global_batch // rl.group_size
    if prompts % dp:
        raise UserError(f"train.global_batch / rl.group_size = {prompts} prompts per step must divide among the {dp} "
                        "data-parallel ranks (a group never straddles ranks)")
    per_rank = t.global_batch // dp
    if (prompts // dp) % rl.minibatches or (per_rank // rl.minibatches) % t.micro_batch:
        raise UserError(f"each rank's {prompts // dp} prompts ({per_rank} sequences) per step must split into "
                        f"rl.minibatches={rl.minibatches} minibatches of whole groups and whole "
                        f"train.micro_batch={t.micro_batch} micro-batches")
    if t.loss_chunk:
        raise UserError(f"train.loss_chunk={t.loss_chunk}: loom rl computes whole logits; set train.loss_chunk=0")
    if rl.reward:
        load_callable(rl.reward)


class RLTrainer(Trainer):
    """The training loop (checkpoints, resuming, metrics, run control) with an RL step in place of a batch."""

    def __init__(self, cfg: Config, run_dir=None, quiet: bool = False):
        loss = PolicyLoss(cfg)
        super().__init__(cfg, run_dir, quiet, loss=loss, datasets=build_datasets, extend_model=loss.attach,
                         setup=RLTrainer._setup_rl)

    # --- set-up ---------------------------------------------------------------------------------------------

    def _setup_rl(self) -> None:
        from loom.models.llama import build_model

        cfg, rl = self.cfg, self.cfg.rl
        if rl.algorithm == "ppo":
            self.loss.value_head = self.model.value
        dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else torch.float32
        engine_model = build_model(cfg.model, device=self.device, dtype=dtype, seed=0)
        if self.layout.tp > 1:
            from loom.parallel.tensor import apply_tensor_parallel

            apply_tensor_parallel(engine_model, self.layout.submesh("tp"), sp=False)
        self.engine = rollout_engine(cfg, engine_model)
        self.engine.refit(self.model)
        self.reference = self._build_reference() if rl.kl_coef else None
        self.rewards = Rewards(cfg, self.tokenizer, self.device)
        self.stop_ids = tuple(i for i in (self.tokenizer.eod_id,) if i is not None)

    def _build_reference(self) -> nn.Module:
        """The frozen initial policy in the run's layout: train.init_from's weights, or train.seed's."""
        from loom.models.llama import build_model
        from loom.parallel import parallelize
        from loom.parallel.materialize import materialize

        cfg = self.cfg
        model = build_model(cfg.model, device="meta")
        compute_dtype = torch.bfloat16 if cfg.train.dtype == "bfloat16" else None
        model = parallelize(model, self.layout, cfg, compute_dtype, None)
        materialize([model], self.device, cfg.train.seed)
        if cfg.train.init_from:
            from loom.interop.pretrained import load_pretrained

            load_pretrained(model, cfg.train.init_from)
        model.requires_grad_(False)
        return model.eval()

    # --- one step -------------------------------------------------------------------------------------------

    def _sampling(self, greedy: bool = False):
        from loom.infer.engine import SamplingParams

        rl = self.cfg.rl
        if greedy:
            return SamplingParams(temperature=0.0, max_new_tokens=rl.max_new_tokens, stop_token_ids=self.stop_ids)
        return SamplingParams(temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k,
                              max_new_tokens=rl.max_new_tokens, stop_token_ids=self.stop_ids)

    def rollouts(self, data: PromptSet, indices: list[int], repeat: int, seeds: list[int] | None, greedy: bool):
        """Completions of every prompt in `indices`, `repeat` times each (a group), with their texts."""
        import dataclasses

        base = self._sampling(greedy)
        prompts = [data.ids[i] for i in indices for _ in range(repeat)]
        params = [dataclasses.replace(base, seed=s) for s in seeds] if seeds else base
        done = self.engine.generate(prompts, params)
        stop = set(self.stop_ids)
        texts = [self.tokenizer.decode([t for t in c.tokens if t not in stop]) for c in done]
        return prompts, done, texts

    def score(self, data: PromptSet, indices: list[int], repeat: int, prompts, done, texts) -> dict:
        """The rewards (`Rewards`) of `rollouts(data, indices, repeat, ...)`'s completions."""
        prompt_texts = [data.texts[i] for i in indices for _ in range(repeat)]
        fields = [data.fields[i] for i in indices for _ in range(repeat)]
        return self.rewards(prompt_texts, texts, fields, [p + c.tokens for p, c in zip(prompts, done)])

    @torch.no_grad()
    def _forward_logp(self, model: nn.Module, batch: dict, values: bool = False):
        """Per-token log-probs of the labels (and PPO's values) without gradients, micro-batch by micro-batch."""
        from loom.parallel.tensor import loss_context
        from loom.train.steps import micro_batches, to_device

        logps, vals = [], []
        was_training = model.training
        model.eval()
        for mb in micro_batches({"input_ids": batch["input_ids"], "labels": batch["labels"]},
                                self.cfg.train.micro_batch):
            mb = to_device(mb, self.device)
            with self.runner.autocast(), loss_context(self.layout.tp):
                hidden = model(mb["input_ids"], return_hidden=True)
                logps.append(local(L.token_logprobs(model.output(hidden), mb["labels"])).float().cpu())
                if values:
                    vals.append(value_of(hidden, model.value).cpu())
        model.train(was_training)
        return torch.cat(logps), (torch.cat(vals) if values else None)

    def _global_mean(self, pairs: list[tuple[torch.Tensor | float, torch.Tensor | float]]) -> list[float]:
        """[(sum, count), ...] of this rank -> global means (tensor-parallel replicas counted once)."""
        flat = torch.tensor([[float(s), float(c)] for s, c in pairs], dtype=torch.float64, device=self.device)
        flat = all_reduce_sum(flat) / self.layout.tp
        return [s / c if c > 0 else float("nan") for s, c in flat.tolist()]

    def _global_sum(self, value) -> float:
        """This rank's number summed over the data-parallel ranks (tensor-parallel replicas counted once)."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        return (all_reduce_sum(t) / self.layout.tp).item()

    def _global_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.layout.distributed:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return t.item()

    def train_step(self) -> dict:
        cfg, rl, t, layout = self.cfg, self.cfg.rl, self.cfg.train, self.layout
        step = self.state.step
        prompts_per_step = t.global_batch // rl.group_size
        per_rank = prompts_per_step // layout.dp_size
        first = step * prompts_per_step + layout.dp_rank * per_rank
        indices = self.train_data.take(first, per_rank, t.seed)
        seeds = [rollout_seed(t.seed, step, first * rl.group_size + k) for k in range(per_rank * rl.group_size)]
        times = {}

        t0 = time.perf_counter()
        prompts, done, texts = self.rollouts(self.train_data, indices, rl.group_size, seeds, greedy=False)
        times["generation_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        rewards = self.score(self.train_data, indices, rl.group_size, prompts, done, texts)
        times["reward_s"] = time.perf_counter() - t0

        batch = rows_of(prompts, done, t.seq_len, self.tokenizer.eod_id or 0)
        t0 = time.perf_counter()
        ppo = rl.algorithm == "ppo"
        batch["old_logp"], old_values = self._forward_logp(self.model, batch, values=ppo)
        if self.reference is not None:
            batch["ref_logp"], _ = self._forward_logp(self.reference, batch)
        times["logprobs_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        mask = batch["mask"]
        delta = (batch["old_logp"] - batch["rollout_logp"]) * mask
        score = rewards["reward"].float()
        stats = self._advantages(batch, score, old_values)
        metrics = self._rollout_metrics(rewards, done, mask, delta, stats)
        # Minibatch m holds the groups whose index in the global batch is m modulo rl.minibatches: the same
        # sequences in every layout (a rank's contiguous share would mix others' under data parallelism).
        group_of_row = (first + torch.arange(per_rank)).repeat_interleave(rl.group_size)
        outs = []
        for _ in range(rl.epochs):
            for m in range(rl.minibatches):
                pick = (group_of_row % rl.minibatches == m).nonzero()[:, 0]
                part = {k: v[pick] for k, v in batch.items()}
                if self._global_sum(self.loss.count(part)) > 0:
                    outs.append(self.optimizer_step(part))
        times["training_s"] = time.perf_counter() - t0
        updates = len(outs)
        if not outs:  # every group left out (rl.drop_uniform_groups): nothing to learn from, no update
            outs = [{"loss": 0.0, "grad_norm": 0.0, "lr": lr_at(step, cfg.optim, t.steps),
                     "skipped_steps": self.control.skipped_steps}]

        times["refit_s"] = self.engine.refit(self.model)
        self.state.step += 1
        self.state.consumed_samples += t.global_batch
        last = outs[-1]
        out = {k: float(np.mean([o[k] for o in outs])) for k in outs[0] if isinstance(outs[0][k], (int, float))
               and k not in ("lr", "skipped_steps")}
        out.update(lr=last["lr"], skipped_steps=last["skipped_steps"], optimizer_steps=updates)
        return {**out, **metrics, **times}

    def _advantages(self, batch: dict, score: torch.Tensor, old_values) -> dict:
        """Fill batch["advantages"] (and PPO's "old_values", "returns"); leave out uniform groups if asked."""
        rl = self.cfg.rl
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

    def _rollout_metrics(self, rewards: dict, done, mask: torch.Tensor, delta: torch.Tensor, stats: dict) -> dict:
        n = len(done)
        ratio = torch.exp(delta)[mask.bool()]
        tokens = mask.sum()
        pairs = [(rewards["reward"].sum(), n), ((rewards["reward"] ** 2).sum(), n), (tokens, n),
                 (delta.abs().sum(), tokens), (ratio.sum(), tokens),
                 (sum(c.finish_reason == "stop" for c in done), n)]
        keys = ["reward", "reward_sq", "response_length", "logp_abs_diff", "prob_ratio_mean", "stopped"]
        if "reward_fn" in rewards and "reward_model" in rewards:
            pairs += [(rewards["reward_fn"].sum(), n), (rewards["reward_model"].sum(), n)]
            keys += ["reward_fn", "reward_model"]
        if stats:
            pairs.append((stats["uniform_groups"], stats["groups"]))
            keys.append("uniform_groups")
        values = dict(zip(keys, self._global_mean(pairs)))
        values["reward_std"] = max(values.pop("reward_sq") - values["reward"] ** 2, 0.0) ** 0.5
        values["prob_ratio_max"] = self._global_max(ratio.max().item() if ratio.numel() else 1.0)
        values["generated_tokens"] = int(self._global_sum(tokens))
        return values

    def timed_step(self) -> dict:
        out, dt = self.clocked_step("rl")
        return {"step": self.state.step, **out, "tokens_per_s": out["generated_tokens"] / out["generation_s"],
                "memory_gib": self.memory_gib(), "step_time_s": dt}

    # --- evaluation -----------------------------------------------------------------------------------------

    def evaluate(self) -> dict:
        """The held-out prompts (an equal share per data-parallel rank) completed greedily (`val_reward`: with
        an exact-match reward, the held-out accuracy) and once sampled as in training (`val_reward_sampled`,
        seeds fixed per prompt, so evaluations differ only by the weights), scored by the run's reward."""
        data, layout = self.val_data, self.layout
        mine = list(range(layout.dp_rank, len(data), layout.dp_size))
        sums = [(0.0, 0)] * 3
        if mine:
            done = self.rollouts(data, mine, 1, None, greedy=True)
            greedy = self.score(data, mine, 1, *done)
            seeds = [rollout_seed(self.cfg.train.seed, -1, i) for i in mine]
            hot = self.score(data, mine, 1, *self.rollouts(data, mine, 1, seeds, greedy=False))
            done = done[1]
            sums = [(greedy["reward"].sum().item(), len(mine)), (hot["reward"].sum().item(), len(mine)),
                    (sum(len(c.tokens) for c in done), len(mine))]
        reward, sampled_reward, length = self._global_mean(sums)
        return {"val_reward": reward, "val_reward_sampled": sampled_reward, "val_response_length": length}

    def _reporter(self):
        report = super()._reporter()
        if self.resumed_from is None:  # the starting point, before any update
            row = {"step": 0, **self.evaluate()}
            report.metrics.write(row)
            report.progress.evaluation(row)
        return report


def recipe(cfg: Config) -> dict:
    """What `loom rl` runs: its own trainer (the loop's set-up, with an RL step)."""
    return {"trainer": RLTrainer}


def prepare_data(cfg: Config, tokenizer: Tokenizer) -> None:
    """Write task prompts into the cache and check the prompt files once, before the workers start."""
    build_datasets(cfg, tokenizer)
