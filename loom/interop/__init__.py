"""Conversion between loom model directories and other ecosystems' checkpoints."""

from loom.interop.hf import (
    convert,
    export_hf,
    hf_config_from_model,
    import_hf,
    is_hf_dir,
    load_hf_state_dict,
    model_config_from_hf,
)

__all__ = [
    "convert",
    "export_hf",
    "hf_config_from_model",
    "import_hf",
    "is_hf_dir",
    "load_hf_state_dict",
    "model_config_from_hf",
]
