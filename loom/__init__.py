"""loom: train large transformer language models, from a laptop CPU to a GPU cluster."""

from __future__ import annotations

__version__ = "0.1.0"


def load_model(path, dtype=None, device="cpu"):
    """A model in eval mode from a Hugging Face directory (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, Qwen3
    dense) or any loom directory.

    `path` may be a Hugging Face directory (config.json + safetensors weights), a loom run directory,
    its checkpoints/ directory, a checkpoint step directory, a converted model directory, or a PEFT LoRA
    adapter directory (merged into the base its adapter_config.json names).
    `model(input_ids)` ([batch, seq] integer tokens) returns logits [batch, seq, vocab].
    `dtype` defaults to torch.float32.
    """
    from pathlib import Path

    import torch

    from loom.errors import UserError
    from loom.interop import import_hf, is_hf_dir
    from loom.interop.peft import load_model_dir  # a LoRA checkpoint: its base and adapters, merged

    dtype = torch.float32 if dtype is None else dtype
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"model path {str(path)!r} does not exist or is not a directory; give a Hugging "
                        "Face Llama/Qwen directory (config.json + model.safetensors) or a loom run, checkpoint "
                        "or model directory")
    from loom.interop.peft import is_peft_dir, load_peft_dir

    if is_peft_dir(p):  # a PEFT LoRA adapter directory: its base (base_model_name_or_path) with the adapters merged
        return load_peft_dir(p, dtype=dtype, device=device)
    if is_hf_dir(p):
        model, _, _ = import_hf(p, dtype=dtype, device=device)
        return model.eval()
    model, _, _ = load_model_dir(p, dtype=dtype, device=device)
    return model.eval()


__all__ = ["__version__", "load_model"]
