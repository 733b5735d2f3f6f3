"""Preference recipes on the one training loop: a reward model (`loom rm`) and DPO / IPO (`loom dpo`).

Both read pairs (loom/post/pref_data.py), usually starting from `train.init_from` (an SFT run), and report
per step and per evaluation the mean chosen and rejected rewards, their margin and the pair accuracy (the
share of pairs whose chosen reward is strictly higher); `val_accuracy` is the held-out pair accuracy.

Reward model: a scalar head `score` (Linear hidden -> 1, no bias, as Hugging Face's
LlamaForSequenceClassification) on the final-norm hidden state of each sequence's last token;
loss -log sigmoid(r_chosen - r_rejected), averaged over the global batch's pairs. The head is part of the
model: initialised from train.seed (the pretrained weights do not have it), sharded and checkpointed with
the rest; `load_reward_model` reads it back.

DPO: the reference log-probs come from the frozen initial policy, computed once in a pass over every pair
before the first step (`ReferencePass`) and kept as two numbers per pair, instead of a second, frozen copy
of the model sharded beside the policy (with LoRA, `lora.rank > 0`, the pass runs the model with its
adapters switched off: the base, at step 0 and on resuming alike). Reasons: the reference is a fixed function
of the data, so one forward pass per pair the run visits suffices where a frozen copy would run one per pair
per visit; no second model's weights in memory (which at scale is the difference between fitting and not);
and the pass runs through the same runner, in the same layout, as training. The numbers are written to
RUN/dpo_reference.pt, which a resumed run reads back (its weights are no longer the initial policy). Every
rank computes all of them (as evaluation scores the whole held-out set on every rank): a data-parallel split
would save compute, at the cost of a gather. Cost: one forward pass over the pairs the run visits, without gradients.

Layouts: data parallelism, replicated and fully sharded (FSDP), in any combination; what else is refused
before launch, and why, is in the rule book (loom/rules.py, `recipe_problem`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from loom.config import Config
from loom.data.dataset import held_out_split
from loom.data.tokenizer import Tokenizer
from loom.errors import UserError
from loom.models.lora import adapters_disabled
from loom.models.losses import HeadInput, Loss
from loom.post.chat import load_template
from loom.post.losses import dpo_losses, preference_sums, reward_model_losses, sequence_logprobs
from loom.post.pref_data import PairDataset, Pairs, pair_columns, prepare_pairs
from loom.train.recipe import Recipe

REFERENCE_FILE = "dpo_reference.pt"


def template_for(cfg: Config):
    return load_template(cfg.pref.template, None if cfg.data.tokenizer == "bpe" else cfg.data.tokenizer,
                         "pref.template")


def prepare_data(cfg: Config, tokenizer: Tokenizer):
    """((chosen, rejected) prefixes of the training pairs, of the held-out pairs), tokenized once into the cache."""
    template = template_for(cfg)
    columns = pair_columns(cfg.pref)
    valid = prepare_pairs(cfg.pref.valid_data, tokenizer, template, columns) if cfg.pref.valid_data else None
    return prepare_pairs(cfg.pref.data, tokenizer, template, columns), valid


def build_datasets(cfg: Config, tokenizer: Tokenizer) -> tuple[PairDataset, PairDataset]:
    t = cfg.train
    train_prefixes, valid_prefixes = prepare_data(cfg, tokenizer)
    pairs = Pairs(*train_prefixes)
    if valid_prefixes:
        held = Pairs(*valid_prefixes)
        train_members, valid_members = np.arange(len(pairs)), np.arange(len(held))
        source = f"pref.valid_data ({', '.join(cfg.pref.valid_data)})"
    else:
        (lo, hi), (vlo, vhi) = held_out_split(cfg.data, len(pairs), "validation pairs", f"of the {len(pairs)} in "
                                              "pref.data", "pref.valid_data or a split with a validation share")
        held, train_members, valid_members = pairs, np.arange(lo, hi), np.arange(vlo, vhi)
        source = f"data.split={cfg.data.split}: pairs {vlo}..{vhi - 1} of pref.data, never trained on"
    pad = tokenizer.eod_id or 0
    train = PairDataset(pairs, train_members, t.seq_len, t.steps * t.global_batch, t.seed, pad)
    val = PairDataset(held, valid_members, t.seq_len, None, 0, pad, shuffle=False)
    val.source = source
    return train, val


class _Sums(Loss):
    """Accumulates `preference_sums` over micro-batches until `take_sums` (the trainer's protocol)."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        for k, v in preference_sums(chosen, rejected).items():
            self.sums[k] = self.sums[k] + v if k in self.sums else v

    def take_sums(self) -> dict[str, torch.Tensor]:
        out, self.sums = self.sums, {}
        return out

    def count(self, batch) -> int:
        return batch["input_ids"].shape[0] // 2  # pairs


class DPOLoss(_Sums):
    """Summed DPO (or IPO) loss over the micro-batch's pairs; counts pairs."""

    def __init__(self, kind: str, beta: float):
        super().__init__()
        self.kind, self.beta = kind, beta

    def __call__(self, logits: torch.Tensor, batch) -> torch.Tensor:
        logps = sequence_logprobs(logits, batch["labels"])
        ref = batch["ref_logps"].to(logps)
        loss, chosen, rejected = dpo_losses(logps[0::2], logps[1::2], ref[0::2], ref[1::2], self.beta, self.kind)
        self.add(chosen, rejected)
        return loss.sum()


class RewardLoss(_Sums):
    """Summed -log sigmoid(r_chosen - r_rejected) over the micro-batch's pairs, rewards from the `score` head
    on the last token's hidden state; counts pairs. `attach(model)` adds the head to the model on meta."""

    wants_hidden = True

    def attach(self, model: nn.Module) -> None:
        add_score_head(model)
        self.score = model.score

    def __call__(self, output: HeadInput, batch) -> torch.Tensor:
        rewards = rewards_at(output.hidden, batch["last"].to(output.hidden.device), self.score)
        self.add(rewards[0::2], rewards[1::2])
        return reward_model_losses(rewards[0::2], rewards[1::2]).sum()


def add_score_head(model: nn.Module) -> None:
    model.score = nn.Linear(model.cfg.hidden, 1, bias=False, device=model.output.weight.device)
    model.fresh_parameters = ("score.weight",)  # not in pretrained weights: keeps its initialisation


def rewards_at(hidden: torch.Tensor, last: torch.Tensor, score: nn.Module) -> torch.Tensor:
    """[batch] rewards: the score head on each row's hidden state at position `last`, in fp32."""
    return score(hidden[torch.arange(hidden.shape[0], device=hidden.device), last]).squeeze(-1).float()


class ReferencePass:
    """DPO's set-up: the initial policy's summed reply log-probs for every pair of the training and held-out
    sets, before the first step (or read back from the run directory when resuming)."""

    def __call__(self, trainer) -> None:
        path = Path(trainer.run_dir) / REFERENCE_FILE
        datasets = [trainer.train_data, trainer.val_data]
        # LoRA: the reference is the base, the model with its adapters switched off, at any step: a resumed run
        # computes it again rather than trusting a file.
        if trainer.resumed_from is not None and not trainer.cfg.lora.enabled:
            if not path.is_file():
                raise UserError(f"{path} is missing: a resumed DPO run needs the reference log-probs its first start "
                                "wrote (the weights are no longer the initial policy); start a new run instead")
            saved = torch.load(path)
            for data, ref in zip(datasets, saved["reference"]):
                if torch.isnan(ref[torch.as_tensor(data.used_pairs())]).any():
                    raise UserError(f"{path} holds the reference log-probs of the pairs the run's first start would "
                                    "visit; this resumed run visits others (train.steps or the data changed), and the "
                                    "weights are no longer the initial policy to compute them: resume with the "
                                    "original settings, or start a new run with the final train.steps")
                data.ref = ref
            return
        for data in datasets:
            data.ref = self.compute(trainer, data)
        if trainer.is_main:
            tmp = path.with_name(path.name + ".tmp")
            torch.save({"reference": [d.ref for d in datasets]}, tmp)
            tmp.replace(path)

    @torch.no_grad()
    def compute(self, trainer, data: PairDataset) -> torch.Tensor:
        from loom.train.steps import model_kwargs, to_device

        runner, model = trainer.runner, trainer.model
        ref = torch.full((len(data.pairs), 2), float("nan"), dtype=torch.float64)
        members = data.used_pairs()  # a run shorter than an epoch needs only the pairs it visits
        per_batch = max(1, trainer.cfg.train.micro_batch // 2)
        was_training = model.training
        model.eval()
        for i in range(0, len(members), per_batch):
            ids = members[i:i + per_batch]
            batch = to_device(data.rows_of(ids), trainer.device)
            with runner.autocast(), adapters_disabled(model):  # LoRA: the base; else the initial policy itself
                logits = model(batch["input_ids"], **model_kwargs(batch))
            ref[torch.as_tensor(ids)] = sequence_logprobs(logits, batch["labels"]).double().cpu().view(-1, 2)
        model.train(was_training)
        return ref


class _Preference(Recipe):
    """A preference recipe: pairs (pref.data), refused settings checked before launch."""

    def check_settings(self, cfg: Config) -> None:
        """Pairs given, and pref.recipe filled from the command."""
        if not cfg.pref.data:
            raise UserError(f"loom {self.command} needs pref.data: .jsonl files of {{\"prompt\", \"chosen\", "
                            "\"rejected\"}} records (strings, or lists of chat messages), or synthetic:N, e.g. "
                            "--pref.data=pairs.jsonl")
        p = cfg.pref
        if p.recipe == "auto":
            p.recipe = self.command
        elif p.recipe != self.command:
            raise UserError(f"`loom {self.command}` but pref.recipe={p.recipe}; drop pref.recipe or run `loom {p.recipe}`")

    def prepare_data(self, cfg: Config, tokenizer: Tokenizer) -> None:
        prepare_data(cfg, tokenizer)

    def datasets(self, cfg: Config, tokenizer: Tokenizer) -> tuple[PairDataset, PairDataset]:
        return build_datasets(cfg, tokenizer)

    def chat_template(self, cfg: Config):
        return template_for(cfg)


class RewardModel(_Preference):
    """`loom rm`: a score head on the model, trained on -log sigmoid(r_chosen - r_rejected)."""

    command = "rm"

    def __init__(self):
        self.reward_loss = RewardLoss()

    def loss(self, cfg: Config) -> RewardLoss:
        return self.reward_loss

    def extend_model(self, model: nn.Module) -> None:
        self.reward_loss.attach(model)


class DPO(_Preference):
    """`loom dpo`: DPO or IPO (pref.loss) against the initial policy's log-probs, computed before the first step."""

    command = "dpo"

    def loss(self, cfg: Config) -> DPOLoss:
        return DPOLoss(cfg.pref.loss, cfg.pref.beta)

    def set_up(self, trainer) -> None:
        ReferencePass()(trainer)


def load_reward_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model with its `score` head, Config) from a reward-model run or checkpoint; reward of a batch of
    rows: `rewards_at(model(ids, return_hidden=True), last, model.score)`."""
    from loom.models.io import read_config, read_sharded_weights, resolve_model_dir
    from loom.models.llama import build_model

    directory = resolve_model_dir(path)
    cfg = read_config(directory)
    if cfg.lora.enabled:  # a LoRA reward model: its base, adapters and score head, the adapters merged
        from loom.interop.peft import load_adapted
        from loom.models.lora import merge

        model, cfg, _ = load_adapted(directory, extend=add_score_head)
        merge(model).to(dtype)
        model.reset_buffers()
        return model.eval(), cfg
    model = build_model(cfg.model, dtype=dtype)
    add_score_head(model)
    model.score.to(dtype)
    read_sharded_weights(directory, model)
    return model.eval(), cfg
