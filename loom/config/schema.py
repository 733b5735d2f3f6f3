"""The whole config: one section per component, the checks that span sections, and its TOML form."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.config.data import DataConfig
from loom.config.lora import LoRAConfig, check_lora_model
from loom.config.model import ModelConfig
from loom.config.post import PrefConfig, RLConfig, SFTConfig
from loom.config.section import Section, flat_values, leaves
from loom.config.toml_io import dumps_toml
from loom.config.training import (CheckpointConfig, LogConfig, OptimConfig, ParallelConfig, RecomputeConfig,
                                  TrainConfig)
from loom.errors import UserError
from loom.rules import check_layout


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    pref: PrefConfig = field(default_factory=PrefConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    log: LogConfig = field(default_factory=LogConfig)
    name: str = "custom"

    def sections(self) -> dict[str, Section]:
        """Section name -> section, in the order of SECTIONS (and of the TOML this config writes)."""
        return {name: value for name, value in vars(self).items() if isinstance(value, Section)}

    def field_values(self) -> dict[str, Any]:
        """`section.field` -> value for every field of every section, by Python path (`model.moe.experts`,
        `model.explicit_head_dim`)."""
        return {f"{name}.{path}": value for name, section in self.sections().items()
                for path, value in flat_values(section).items()}

    def validate(self) -> "Config":
        for section in self.sections().values():
            section.validate()
        check_layout(self)
        if self.sft.data and (self.data.paths or self.data.valid_paths):
            raise UserError("sft.data and data.paths/data.valid_paths are both set; an SFT run reads its examples "
                            "from sft.data (and sft.valid_data) only: clear data.paths and data.valid_paths")
        if self.pref.data and (self.sft.data or self.data.paths or self.data.valid_paths):
            raise UserError("pref.data is set together with sft.data or data.paths; a preference run (loom dpo, "
                            "loom rm) reads its pairs from pref.data (and pref.valid_data) only: clear the others")
        if self.rl.prompts and (self.pref.data or self.sft.data or self.data.paths or self.data.valid_paths):
            raise UserError("rl.prompts is set together with pref.data, sft.data or data.paths; an RL run (loom rl) "
                            "reads its prompts from rl.prompts (and rl.valid_prompts) only: clear the others")
        check_lora_model(self.lora, self.model)
        if self.train.seq_len > self.model.max_seq_len:
            raise UserError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                f"valid: 1..{self.model.max_seq_len} (or raise model.max_seq_len)"
            )
        return self

    def to_dict(self) -> dict:
        out = {}
        for section, obj in self.sections().items():
            table: dict = {}
            for key, _, owner, f in leaves(obj):  # a dotted key (`moe.experts`) is a nested table, as TOML reads it
                *parents, leaf = key.split(".")
                node = table
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = copy.deepcopy(vars(owner)[f.name])
            out[section] = table
        return out

    def to_toml(self) -> str:
        return dumps_toml(self.to_dict())

    def default_run_dir(self) -> Path:
        """runs/NAME-YYYYmmdd-HHMMSS: where a run without --run-dir writes (here, not in the trainer, so that
        the launcher finds it without importing the training stack before its workers start)."""
        from datetime import datetime

        return Path("runs") / f"{self.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


SECTIONS = [f.name for f in dataclasses.fields(Config) if f.name != "name"]
