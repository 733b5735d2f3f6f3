"""Configuration: one dataclass per component, TOML files, dotted overrides, validation.

A config is built in three layers, later wins: the dataclass defaults, a TOML file from `configs/`
(or any path), then `--section.key=value` overrides from the command line. Every value is checked
while parsing: an unknown key names the closest valid one, a wrong type or an impossible value names
the field, the value and what would be valid (`UserError`, exit code 2).

The sections live in `model`, `training` (parallel, train, optim, checkpoint, recompute, log), `data`,
`post` (sft, pref, rl) and `lora` (adapters); `schema` joins them into `Config`; `load` builds one from files
and overrides; `toml_io` converts values to and from TOML and command-line text.
"""

from loom.config.data import DataConfig
from loom.config.load import CONFIG_DIR, available_configs, config_from_dict, load_config, resolve_config_path
from loom.config.lora import LoRAConfig
from loom.config.model import ModelConfig, MoEConfig
from loom.config.post import PrefConfig, RLConfig, SFTConfig
from loom.config.schema import SECTIONS, Config
from loom.config.section import flat_values, key_of, leaves
from loom.config.toml_io import dumps_toml
from loom.config.training import (CheckpointConfig, LogConfig, OptimConfig, ParallelConfig, RecomputeConfig,
                                  TrainConfig)

__all__ = [
    "CONFIG_DIR",
    "SECTIONS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoRAConfig",
    "LogConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimConfig",
    "ParallelConfig",
    "PrefConfig",
    "RLConfig",
    "RecomputeConfig",
    "SFTConfig",
    "TrainConfig",
    "available_configs",
    "config_from_dict",
    "dumps_toml",
    "flat_values",
    "key_of",
    "leaves",
    "load_config",
    "resolve_config_path",
]
