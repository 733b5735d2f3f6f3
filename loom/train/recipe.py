"""What a subcommand trains: a `Recipe`, chosen once from the subcommand (`loom.post.recipe_for`).

The training loop (trainer.py) is the same for every recipe; a recipe names what differs, and the trainer
calls exactly these hooks, passing itself (`trainer`, a `loom.train.trainer.Trainer`) where a hook needs the
run (the defaults are pre-training's, `loom train`):

- `check(cfg)`: settings it cannot run, refused before launch: its own (`check_settings(cfg)`), then the
  rule book's layout facts about it (loom/rules.py `recipe_problem`);
- `prepare_data(cfg, tokenizer)`: shared caches built once by the launcher, before the workers start;
- `datasets(cfg, tokenizer)`: the training and held-out `Dataset`s (loom/data/dataset.py);
- `loss(cfg)`: its `Loss` (loom/models/losses.py);
- `extend_model(model)`: modules added to the model on meta, before the layout is applied (a score head);
- `set_up(trainer)`: once the model holds its starting weights (DPO's reference pass, RL's engine);
- `start(trainer)`: a metrics row before the first step, or None (RL's step-0 evaluation);
- `train_step(trainer)`: one step and its metrics;
- `throughput(trainer, out, seconds)`: the step's speed columns of metrics.jsonl;
- `evaluate(trainer)`: the held-out metrics;
- `runs_user_code(cfg)`: whether the run imports the user's own modules (then the process exits the ordinary
  way, so that their files are flushed by their finalisers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loom.config import Config
from loom.data.dataset import Dataset
from loom.data.tokenizer import Tokenizer
from loom.errors import UserError
from loom.models.losses import Loss, TokenCrossEntropy, run_loss_chunk
from loom.rules import recipe_problem

if TYPE_CHECKING:
    from torch import nn


class Recipe:
    """Pre-training (`loom train`): next-token loss over the token datasets; the base of every recipe."""

    command = "train"

    def check(self, cfg: Config) -> None:
        self.check_settings(cfg)
        if problem := recipe_problem(self.command, cfg):
            raise UserError(problem)

    def check_settings(self, cfg: Config) -> None:
        """The recipe is the subcommand's, never inferred from which data is set: another recipe's data is
        refused, naming the command that trains on it."""
        for given, field, command in ((cfg.rl.prompts, "rl.prompts", "loom rl"), (cfg.sft.data, "sft.data", "loom sft"),
                                      (cfg.pref.data, "pref.data", "loom dpo or loom rm")):
            if given:
                raise UserError(f"{field} is set, but `loom train` runs pre-training on data.paths (or the embedded "
                                f"corpus) and never reads {field}: run {command} to train on it, or clear {field}")

    def prepare_data(self, cfg: Config, tokenizer: Tokenizer) -> None:
        self.datasets(cfg, tokenizer)

    def datasets(self, cfg: Config, tokenizer: Tokenizer) -> tuple[Dataset, Dataset]:
        from loom.data.token_datasets import build_datasets

        return build_datasets(cfg, tokenizer)

    def loss(self, cfg: Config) -> Loss:
        return TokenCrossEntropy(run_loss_chunk(cfg))

    def extend_model(self, model: "nn.Module") -> None:
        pass

    def set_up(self, trainer) -> None:
        pass

    def start(self, trainer) -> dict | None:
        return None

    def train_step(self, trainer) -> dict:
        return trainer.batch_step()

    def throughput(self, trainer, out: dict, seconds: float) -> dict:
        """Tokens read and per second, model TFLOP/s per device and MFU."""
        tps = trainer.tokens_per_step / seconds
        tflops = tps * trainer.flops_per_token / 1e12 / trainer.layout.world_size  # per device
        return {"tokens": trainer.state.consumed_samples * trainer.cfg.train.seq_len, "tokens_per_s": tps,
                "tflops_per_device": tflops, "mfu": tflops / trainer.peak_tflops if trainer.peak_tflops else None}

    def evaluate(self, trainer) -> dict:
        return trainer.evaluator.evaluate()

    def runs_user_code(self, cfg: Config) -> bool:
        return False

    def chat_template(self, cfg: Config):
        """The chat template (loom.post.chat.ChatTemplate) the recipe renders its data with, written into the
        run directory's tokenizer files when none came with the tokenizer; None: no chat data."""
        return None
