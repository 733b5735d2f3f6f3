"""Conversion between loom model directories and other ecosystems' checkpoints: Hugging Face tensor names
(`hf_names`), config.json <-> ModelConfig (`hf_config`), reading and writing checkpoints (`hf_io`),
training from pretrained weights (`pretrained`), and LoRA runs' adapters and merged models (`peft`)."""

from loom.interop.hf_config import hf_config_from_model, is_hf_dir, model_config_from_hf
from loom.interop.hf_io import export_hf, import_hf, load_hf_state_dict
from loom.interop.peft import convert  # loom <-> Hugging Face, and a LoRA run's adapters (peft) or merged model

__all__ = [
    "convert",
    "export_hf",
    "hf_config_from_model",
    "import_hf",
    "is_hf_dir",
    "load_hf_state_dict",
    "model_config_from_hf",
]
