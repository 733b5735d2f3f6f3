"""A base model's fingerprint: what a LoRA run records of the weights its adapters were trained on, so that a base
whose weights changed since (rebuilt, re-downloaded at another revision, overwritten by another run) is refused
instead of silently used under adapters that were never trained on it.

A fingerprint hashes what identifies the weights without reading them whole (DESIGN 1.7: no rank reads a whole
model to start): of a safetensors directory (Hugging Face or loom), every `*.safetensors` file's name, size, header
(tensor names, dtypes, shapes, offsets) and `SAMPLES` blocks of its data spread evenly over it — a base trained or
re-initialised further changes every tensor, so every block; of a loom checkpoint, its `manifest.json`, which holds
the sha256 of every file (loom/train/checkpoint.py).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from loom.errors import UserError
from loom.interop.hf_config import is_hf_dir
from loom.models.io import DCP_METADATA, resolve_model_dir

SAMPLES = 16  # blocks read per weight file
BLOCK = 4096  # bytes per block
MANIFEST = "manifest.json"
STATE = "trainer_state.json"  # where a LoRA checkpoint records its base's fingerprint, as "lora_base_fingerprint"


def _file_digest(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with open(path, "rb") as f:
        head = f.read(8)
        header = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        h.update(head + f.read(min(header, size)))  # names, dtypes, shapes, offsets
        start = 8 + header
        span = max(size - start - BLOCK, 0)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(SAMPLES - 1, 1))
            h.update(f.read(BLOCK))


def weights_fingerprint(path: str | Path) -> str:
    """sha256 (hex) identifying the weights of the model `path` names (a Hugging Face or loom model directory, a
    loom run or checkpoint), reading a few blocks per file."""
    directory = Path(path) if is_hf_dir(path) else resolve_model_dir(path)
    h = hashlib.sha256()
    if (directory / DCP_METADATA).is_file():
        manifest = directory / MANIFEST
        if not manifest.is_file():
            raise UserError(f"{directory} has no {MANIFEST}; it is an incomplete checkpoint")
        h.update(manifest.read_bytes())
        return h.hexdigest()
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise UserError(f"{directory}: no *.safetensors weights to fingerprint")
    for file in files:
        _file_digest(h, file)
    return h.hexdigest()


def check_same_base(recorded: str | None, base: str | Path, where: str) -> None:
    """UserError when the weights at `base` are not those whose fingerprint `recorded` (from a LoRA checkpoint's
    trainer_state.json; None for a checkpoint written before fingerprints were recorded: nothing to check)."""
    if recorded is None:
        return
    now = weights_fingerprint(base)
    if now != recorded:
        raise UserError(f"{where}: its adapters were trained on the base model at {base}, whose weights have changed "
                        f"since (fingerprint {recorded[:12]} then, {now[:12]} now); adapters on other base weights "
                        "compute something else. Restore the base the run trained on (the same files), or train the "
                        "adapters again on this one")


def recorded_base(checkpoint: str | Path) -> str | None:
    """The base fingerprint a LoRA checkpoint directory recorded (None: none recorded, or no trainer state)."""
    state = Path(checkpoint) / STATE
    try:
        return json.loads(state.read_text()).get("lora_base_fingerprint") if state.is_file() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
