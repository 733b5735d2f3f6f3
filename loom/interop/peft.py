"""LoRA runs outside training: loading one (base + adapters), PEFT adapter directories, merged exports.

A LoRA checkpoint (loom/train/checkpoint.py) holds the trained tensors only (adapters, a recipe's heads);
its base is the run's `train.init_from` (a path its config.toml records, also named in trainer_state.json's
"lora_base"), or the weights `train.seed` initialises when it has none. `load_adapted` rebuilds the adapted
model in one process; `load_model_dir` is `loom.models.io.load_model_dir` for any checkpoint, a LoRA one
returned merged (a plain model: what `loom generate` and `loom.load_model` run).

`loom convert RUN DST --to peft` writes what Hugging Face's `peft` reads on the base model:
adapter_config.json (`LoraConfig` fields) and adapter_model.safetensors with PEFT's key names
(base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight, [rank, in]; lora_B [out, rank]).
`--to hf --merge` folds the adapters into the base weights and writes a full Hugging Face model.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch

from loom.config import Config
from loom.config.lora import hf_target, loom_targets
from loom.errors import UserError
from loom.interop.fingerprint import check_same_base, recorded_base
from loom.interop.hf_config import is_hf_dir
from loom.interop.hf_io import TARGETS as HF_TARGETS
from loom.interop.hf_io import _atomic_dir, _check_free, export_hf
from loom.interop.hf_io import convert as convert_hf
from loom.interop.hf_names import loom_to_hf_name
from loom.models.io import CONFIG, DCP_METADATA, TOKENIZER, read_config, resolve_model_dir

TARGETS = (*HF_TARGETS, "peft")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Files of a checkpoint that are not the model's (written by the trainer for resuming).


def is_lora_checkpoint(path: str | Path) -> bool:
    try:
        return read_config(resolve_model_dir(path)).lora.enabled
    except UserError:
        return False


def load_adapted(path: str | Path, extend=None):
    """(model with its adapters, unmerged, float32, Config, directory) from a LoRA run or checkpoint: the base
    from the run's train.init_from (or train.seed), then the checkpoint's trained tensors. `extend(model)`: a
    recipe's heads (a reward model's score), added before the adapters as training added them."""
    from loom.interop.pretrained import load_pretrained
    from loom.models.llama import build_model
    from loom.models.lora import adapter_state, apply_lora

    model_dir = resolve_model_dir(path)
    cfg = read_config(model_dir)
    if not cfg.lora.enabled:
        raise UserError(f"{model_dir} is not a LoRA checkpoint (its lora.rank is 0): it holds the whole model")
    if not (model_dir / DCP_METADATA).is_file():
        raise UserError(f"{model_dir}: a LoRA checkpoint is a sharded training checkpoint ({DCP_METADATA} + *.distcp)")
    model = build_model(cfg.model, dtype=torch.float32, seed=cfg.train.seed)
    if extend is not None:
        extend(model)
    apply_lora(model, cfg.lora, torch.float32)
    base = cfg.train.init_from
    if base:
        if not Path(base).is_dir():
            relative = "" if Path(base).is_absolute() else (
                f" from {Path.cwd()} (a relative path: the run recorded it from the directory it was started in)")
            raise UserError(f"{model_dir} holds LoRA adapters only; their base model, train.init_from={base} in its "
                            f"{CONFIG}, does not exist{relative} (any more). Restore it at that path, or set "
                            f"train.init_from in {model_dir / CONFIG} to where the same base model is now")
        check_same_base(recorded_base(model_dir), base, str(model_dir))
        load_pretrained(model, base)
    _read_trained(model_dir, adapter_state(model))
    return model.eval(), cfg, model_dir


def _read_trained(model_dir: Path, params: dict[str, torch.Tensor]) -> None:
    import torch.distributed.checkpoint as dcp

    state = {name: p.detach() for name, p in params.items()}
    try:
        with warnings.catch_warnings():  # one process, no process group: DCP warns that it assumes so
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, checkpoint_id=model_dir, no_dist=True)
    except Exception as exc:  # CheckpointException: a missing entry, another shape
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"{model_dir}: its adapters cannot be read as its config.toml's lora.* settings describe "
                        f"({first}); the checkpoint is damaged or its config.toml was edited") from None


def plain_config(cfg: Config) -> Config:
    """The config of the merged model: the same network, no adapters."""
    import copy

    merged = copy.deepcopy(cfg)
    merged.lora.rank = 0
    return merged


def load_model_dir(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model in eval mode, Config, directory) as loom.models.io.load_model_dir, a LoRA checkpoint merged."""
    from loom.models import io
    from loom.models.lora import merge

    if not is_lora_checkpoint(path):
        return io.load_model_dir(path, dtype=dtype, device=device)
    model, cfg, model_dir = load_adapted(path)
    model = merge(model).to(device=device, dtype=dtype)
    model.reset_buffers()  # rotary tables stay fp32
    return model.eval(), plain_config(cfg), model_dir


def is_peft_dir(path: str | Path) -> bool:
    """A PEFT adapter directory (adapter_config.json beside its weights), as `--to peft` or peft itself writes."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def peft_base(path: str | Path) -> Path:
    """The base model directory a PEFT adapter directory names (`base_model_name_or_path`), which must exist here:
    nothing is downloaded."""
    path = Path(path)
    base = json.loads((path / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise UserError(f"{path / ADAPTER_CONFIG} names base_model_name_or_path={base!r}, which is not a directory "
                        "here (nothing is downloaded); put the base model there, or write its local path into "
                        f"{ADAPTER_CONFIG}")
    return Path(base)


def read_peft_dir(path: str | Path) -> tuple[float, list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """(scale, [(loom weight name, lora_A [r, in], lora_B [out, r]), ...]) of a PEFT LoRA adapter directory: scale
    lora_alpha / r, or / sqrt(r) with use_rslora. Refuses what plain LoRA merging does not cover (DoRA, layer or
    module subsets, trained modules beside the adapters). The adapters are small: read whole."""
    import math

    from safetensors.torch import load_file

    from loom.interop.hf_names import hf_to_loom_name

    path = Path(path)
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    unsupported = {k: config.get(k) for k in ("use_dora", "layers_to_transform", "modules_to_save", "fan_in_fan_out",
                                              "layer_replication") if config.get(k)}
    if config.get("peft_type", "LORA") != "LORA" or unsupported:
        raise UserError(f"{path / ADAPTER_CONFIG}: loom merges plain LoRA adapters (peft_type LORA) and this one has "
                        f"{unsupported or {'peft_type': config.get('peft_type')}}; merge it with peft "
                        "(merge_and_unload) and serve the merged model")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise UserError(f"{path} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}")
    tensors = load_file(str(weights))
    pairs = []
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        hf = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight") + ".weight"
        b = tensors.get(key.replace(".lora_A.weight", ".lora_B.weight"))
        if b is None:
            raise UserError(f"{weights}: {key} has no lora_B beside it")
        pairs.append((hf_to_loom_name(hf), a, b))
    if not pairs:
        raise UserError(f"{weights} holds no lora_A/lora_B pairs")
    return scale, pairs


@torch.no_grad()
def merge_peft_adapters(model: torch.nn.Module, path: str | Path) -> int:
    """Add the PEFT adapters at `path` to `model`'s weights in place: W + scale x B A, each rank only its own
    slice of every adapted weight (plain tensors whole; tensor-parallel DTensors their local rows or columns:
    B's rows times A's columns of the slice), computed in float32. Returns how many weights it changed."""
    from loom.interop.pretrained import local_slice

    scale, pairs = read_peft_dir(path)
    params = dict(model.named_parameters())
    for name, a, b in pairs:
        if name not in params:
            raise UserError(f"{Path(path) / ADAPTER_WEIGHTS}: an adapter for {name}, which the base model "
                            f"{peft_base(path)} does not have as one weight")
        local, where = local_slice(params[name])
        delta = scale * (b.float()[where[0]] @ a.float()[:, where[1]])
        local.copy_((local.float() + delta).to(local.dtype))
    return len(pairs)


def load_peft_dir(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A PEFT LoRA adapter directory on its base (`peft_base`), merged (`merge_peft_adapters`) in float32, then
    `dtype`."""
    import loom

    model = loom.load_model(peft_base(path), dtype=torch.float32)
    merge_peft_adapters(model, path)
    return model.to(device=device, dtype=dtype).eval()


def peft_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's names for every adapter of `model` (unmerged, one process)."""
    from loom.models.lora import lora_layers

    out = {}
    for name, layer in lora_layers(model).items():
        hf = loom_to_hf_name(f"{name}.weight").removesuffix(".weight")
        out[f"base_model.model.{hf}.lora_A.weight"] = layer.lora_A.detach().float().contiguous()
        out[f"base_model.model.{hf}.lora_B.weight"] = layer.lora_B.detach().float().contiguous()
    return out


def peft_config(cfg: Config) -> dict:
    """adapter_config.json: peft's LoraConfig fields for what loom trained."""
    lo = cfg.lora
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lo.rank, "lora_alpha": lo.alpha,
        "lora_dropout": lo.dropout, "target_modules": [hf_target(n) for n in loom_targets(lo.targets)],
        "base_model_name_or_path": str(Path(cfg.train.init_from).resolve()) if cfg.train.init_from else None,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None, "use_rslora": False, "use_dora": False, "layers_to_transform": None,
        "revision": None,
    }


def export_peft(src: str | Path, dst: str | Path) -> Path:
    """Write a PEFT adapter directory for the LoRA run or checkpoint `src`."""
    from safetensors.torch import save_file

    from loom.files import honour_umask

    model_dir = resolve_model_dir(src)
    cfg = read_config(model_dir)
    merged = f"loom convert {src} {dst} --to hf --merge"
    if not cfg.train.init_from:
        raise UserError(f"{model_dir} trained adapters on a base initialised from train.seed, not on a saved model; "
                        f"peft loads adapters onto a base model directory, so export the merged model instead: {merged}")
    base = cfg.train.init_from
    if Path(base).is_dir() and not is_hf_dir(base):  # a loom run, checkpoint or model directory (e.g. an SFT run)
        what = "a LoRA run, whose own adapters are part of that base" if is_lora_checkpoint(base) else "a loom directory"
        raise UserError(f"{model_dir}'s adapters were trained on train.init_from={base}, {what}; peft loads adapters "
                        "onto a Hugging Face model directory only, and on any other base (that run's own base, say) "
                        f"they compute something else. Export the adapted model merged instead: {merged} (or convert "
                        "the base to a Hugging Face directory, `loom convert BASE DIR --to hf`, adding --merge for a "
                        "LoRA run, and train the adapters on DIR)")
    model, cfg, model_dir = load_adapted(src)
    if cfg.pref.recipe == "rm":
        raise UserError(f"{model_dir} is a reward model: its score head, trained beside the adapters, has no place in "
                        "a PEFT causal-LM adapter directory; load it with loom (rl.reward_model=RUN)")
    with _atomic_dir(Path(dst)) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(peft_config(cfg), indent=2) + "\n")
        save_file(peft_state(model), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt", "producer": "loom"})
        honour_umask(tmp / ADAPTER_WEIGHTS)
        for f in model_dir.iterdir():  # the tokenizer and chat template the adapters were trained with, as PEFT saves
            if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",
                                                                             "chat_template.jinja")):
                shutil.copyfile(f, tmp / f.name)
    return Path(dst)


def convert(src: str | Path, dst: str | Path, to: str, dtype: torch.dtype | None = None, merge: bool = False,
            **kwargs) -> Path:
    """`loom convert`: loom <-> Hugging Face (loom/interop/hf_io.py `convert`), and for LoRA runs `--to peft`
    (the adapters) or `--to hf --merge` (the merged full model)."""
    if to not in TARGETS:
        raise UserError(f"convert target {to!r} is not valid; valid: {', '.join(TARGETS)}")
    lora = to != "loom" and is_lora_checkpoint(src)
    if to == "peft":
        if not lora:
            raise UserError(f"--to peft writes a LoRA run's adapters, and {src} has none (not a loom run with "
                            "lora.rank > 0); use --to hf for a whole model")
        if merge:
            raise UserError("--merge writes a full model: use it with --to hf, not --to peft")
        return export_peft(src, dst)
    if merge and not lora:
        raise UserError(f"--merge folds a LoRA run's adapters into its base, and {src} has none; drop --merge")
    if lora and not merge:
        raise UserError(f"{src} holds LoRA adapters only; write them as a PEFT adapter directory (--to peft) or "
                        "merged into a full Hugging Face model (--to hf --merge)")
    if not lora:
        return convert_hf(src, dst, to, dtype=dtype, **kwargs)
    # Merged: the adapters folded into the base, written by the one Hugging Face export with the tokenizer and
    # chat files carried beside the checkpoint's tokenizer.json, as for any run.
    _check_free(Path(dst))
    model, cfg, model_dir = load_model_dir(src, dtype=dtype or torch.float32)
    tokenizer = model_dir / TOKENIZER
    return export_hf(model, cfg, dst, tokenizer_path=tokenizer if tokenizer.is_file() else None, **kwargs)
