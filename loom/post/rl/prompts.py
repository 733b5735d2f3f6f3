"""RL's prompts (`rl.prompts`, `rl.valid_prompts`): records tokenized once, as the model sees them, with the
fields the reward function reads, and the run's stream of them (shuffled passes). Files are .jsonl or .parquet
(or globs of them), read by loom/data/records.py; `rl.prompt_column` names the prompt's column, every
other column goes to the reward function; every malformed record is counted before the run stops, the first
few named by file and line or row."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loom.config import Config
from loom.data.dataset import Dataset, held_out_split
from loom.data.records import Malformed, expand, is_glob, records
from loom.data.tokenizer import Tokenizer
from loom.errors import UserError
from loom.post import tasks

EXAMPLE = '{"prompt": "12+30=", "answer": "42"}'


class PromptSet(Dataset):
    """Prompts tokenized once: `ids[i]` the model's input, `texts[i]` what the reward function sees as the
    prompt, `fields[i]` the record's other fields (keyword arguments of the reward function)."""

    def __init__(self, specs: list[str], role: str, tokenizer: Tokenizer, template, max_prompt: int,
                 where: str, prompt_column: str = "prompt"):
        self.texts, self.ids, self.fields = [], [], []
        self.too_long = 0
        malformed = Malformed("prompt records", f"fix or remove such records, or name the prompt's column with "
                              f"rl.prompt_column (now {prompt_column!r})")
        files = [p for spec in specs for p in (expand(spec, where) if is_glob(spec) else [spec])]
        for spec in map(str, files):
            path = Path(tasks.materialise(spec, role, where))
            if not path.is_file():
                raise UserError(f"{where} entry {spec!r} is not a file; give .jsonl or .parquet files (or globs) of "
                                f"records like {EXAMPLE}, or addition:N")
            for _, line, record in records(path, malformed, example=EXAMPLE, rename={"prompt": prompt_column}):
                try:
                    text, ids = self._encode(record, line, tokenizer, template)
                except UserError as e:
                    malformed.add(str(e), path)
                    continue
                if malformed:  # after the first malformed record the rest are only checked
                    continue
                if len(ids) > max_prompt:
                    self.too_long += 1
                    continue
                self.texts.append(text)
                self.ids.append(ids)
                self.fields.append({k: v for k, v in record.items() if k != "prompt"})
        malformed.check()
        if not self.ids and not self.too_long:
            raise UserError(f"{where} ({', '.join(specs)}): no records; give files with at least one prompt record "
                            f"like {EXAMPLE}")
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

    def summary(self, steps: int, global_batch: int) -> str:
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


def build_datasets(cfg: Config, tokenizer: Tokenizer):
    rl = cfg.rl
    template = None
    if rl.template != "none":
        from loom.post.chat import load_template

        template = load_template(rl.template, None if cfg.data.tokenizer == "bpe" else cfg.data.tokenizer,
                                 "rl.template")
    max_prompt = engine_max_len(cfg) - rl.max_new_tokens
    if max_prompt < 1:
        raise UserError(f"rl.max_new_tokens={rl.max_new_tokens} leaves no room for a prompt in train.seq_len + 1="
                        f"{engine_max_len(cfg)} tokens; raise train.seq_len or lower rl.max_new_tokens")
    train = PromptSet(rl.prompts, "rl", tokenizer, template, max_prompt, "rl.prompts", rl.prompt_column)
    if rl.valid_prompts:
        valid = PromptSet(rl.valid_prompts, "valid", tokenizer, template, max_prompt, "rl.valid_prompts",
                          rl.prompt_column)
        valid.source = f"rl.valid_prompts ({', '.join(rl.valid_prompts)})"
        return train, valid
    (lo, hi), (vlo, vhi) = held_out_split(cfg.data, len(train), "held-out prompts",
                                          f"of the {len(train)} in rl.prompts",
                                          "rl.valid_prompts or a split with a validation share")
    valid = train.part(vlo, vhi, f"data.split={cfg.data.split}: prompts {vlo}..{vhi - 1} of rl.prompts")
    train = train.part(lo, hi, train.source, train.too_long)
    return train, valid


def engine_max_len(cfg: Config) -> int:
    """Prompt + completion tokens a rollout may hold: one more than a training row's inputs."""
    return min(cfg.train.seq_len + 1, cfg.model.max_seq_len)
