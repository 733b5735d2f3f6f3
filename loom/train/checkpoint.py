"""Training checkpoints: atomic, verified, resumable.

`run/checkpoints/step-N/` is a model directory (see `loom.models.io`) plus `optimizer.pt`,
`trainer_state.json` (step, consumed samples), `rng-R.pt` (every RNG rank R draws from) and
`manifest.json` (size and sha256 of every file). A checkpoint is written into a hidden temporary
directory and renamed into place only when complete; `latest` (a one-line file naming the step
directory) is replaced atomically afterwards. So `latest` never names a partial checkpoint, and a
damaged file is detected on resume and named.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from loom.config import Config
from loom.errors import UserError
from loom.models.io import WEIGHTS, atomic_write_text, read_config, read_weights, save_model_dir, write_json

MANIFEST = "manifest.json"


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    consumed_samples: int = 0


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    if (dist := _dist()) is not None:
        dist.barrier()


def full_state(model, optimizer) -> tuple[dict, dict]:
    """Whole (unsharded) model and optimizer state, keyed by parameter name, whatever the layout.

    Saving the full state makes a checkpoint loadable into any other layout. It is a collective:
    every rank must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dist = _dist()
    pipeline = dist is not None and getattr(model, "is_pipeline_view", False)
    # cpu_offload keeps the full state on global rank 0 only; pipeline stages need it on their first rank.
    opts = StateDictOptions(full_state_dict=True, cpu_offload=not pipeline)
    model_state = get_model_state_dict(model, options=opts)
    optim_state = get_optimizer_state_dict(model, optimizer, options=opts)
    if pipeline:
        # Each pipeline rank holds some stages: the first rank of every stage group sends its part to
        # rank 0, which merges them (the mesh is (pp, ...), so stage groups are contiguous ranks).
        rank, per_stage = dist.get_rank(), dist.get_world_size() // model.pp_size
        mine = _to_cpu((model_state, optim_state)) if rank % per_stage == 0 else None
        parts = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if parts is None:
            return {}, {}
        model_state, optim_state = _merge([p for p in parts if p is not None])
    return model_state, optim_state


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _merge(parts) -> tuple[dict, dict]:
    model_state, state, groups = {}, {}, []
    for m, o in parts:
        model_state.update(m)
        state.update(o["state"])
        for i, g in enumerate(o["param_groups"]):
            if i == len(groups):
                groups.append({**g, "params": []})
            groups[i]["params"] += [p for p in g["params"] if p not in groups[i]["params"]]
    return model_state, {"state": state, "param_groups": groups}


def _restrict(optim_state: dict, names: set) -> dict:
    """The part of a full optimizer state that concerns the parameters `names` (a pipeline rank's)."""
    return {
        "state": {k: v for k, v in optim_state["state"].items() if k in names},
        "param_groups": [{**g, "params": [p for p in g["params"] if p in names]} for g in optim_state["param_groups"]],
    }


def save_checkpoint(ckpt_root: Path, model, optimizer, cfg: Config, state: TrainState,
                    tokenizer_path: Path | None, keep_last: int = 0) -> Path:
    """Collective: every rank calls it; rank 0 writes the model and optimizer, each rank its RNG."""
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    model_state, optim_state = full_state(model, optimizer)
    name = f"step-{state.step}"
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}"
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    try:
        torch.save(rng_state(), tmp / f"rng-{rank}.pt")
        _barrier()
        if rank == 0:
            save_model_dir(model_state, cfg, tmp, tokenizer_path)
            torch.save(optim_state, tmp / "optimizer.pt")
            write_json(tmp / "trainer_state.json", {"step": state.step, "consumed_samples": state.consumed_samples,
                                                    "world_size": dist.get_world_size() if dist else 1})
            files = sorted(p.name for p in tmp.iterdir())
            write_json(tmp / MANIFEST, {f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in files})
            _fsync_dir(tmp)
            old = None
            if final.exists():  # re-saving the same step (e.g. after a resume): swap it whole
                old = ckpt_root / f".old-{name}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            atomic_write_text(ckpt_root / "latest", name + "\n")
            _fsync_dir(ckpt_root)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            if keep_last:
                prune(ckpt_root, keep_last)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    return final


def _fsync_dir(path: Path) -> None:
    for p in [*path.iterdir(), path] if path.is_dir() else [path]:
        if p.is_file() or p == path:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    steps = [p for p in ckpt_root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(steps, key=lambda p: int(p.name[5:]))


def prune(ckpt_root: Path, keep_last: int) -> None:
    for old in list_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    pointer = ckpt_root / "latest"
    if not pointer.is_file():
        # A crash right after the first rename leaves a complete step directory and no pointer yet.
        steps = list_checkpoints(ckpt_root) if ckpt_root.is_dir() else []
        return steps[-1] if steps else None
    path = ckpt_root / pointer.read_text().strip()
    if not path.is_dir():
        raise UserError(f"{pointer} names {path.name!r}, which does not exist; the checkpoints directory is damaged")
    return path


def verify(path: Path) -> None:
    """Check every file against the manifest; raise UserError naming the first damaged file."""
    manifest_file = path / MANIFEST
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"checkpoint {path} has no readable {MANIFEST} ({exc}); it is incomplete or damaged") from None
    for name, meta in manifest.items():
        f = path / name
        if not f.is_file():
            raise UserError(f"checkpoint {path} is damaged: {name} is missing")
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise UserError(
                f"checkpoint {path} is damaged: {name} does not match its manifest checksum "
                f"(expected {meta['bytes']} bytes, sha256 {meta['sha256'][:12]}...)"
            )


def load_checkpoint(path: Path, model, optimizer, cfg: Config) -> TrainState:
    """Restore model, optimizer and RNG from `path` (verified first) into any layout; return the state.

    RNG streams are restored per rank when the checkpoint was written by the same number of ranks
    (bit-exact resume); in another layout each rank keeps the fresh seed-derived stream.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    verify(path)
    saved = read_config(path)
    fixed = [("train", "seq_len"), ("train", "global_batch"), ("train", "seed"), ("data", "paths"),
             ("data", "weights"), ("data", "tokenizer"), ("data", "corpus_max_bytes")]
    changed = [f"{a}.{b}" for a, b in fixed if getattr(getattr(saved, a), b) != getattr(getattr(cfg, a), b)]
    if changed:
        raise UserError(
            f"checkpoint {path} was trained with different {', '.join(changed)}; the data order and position "
            "depend on them, so resume with the values in its config.toml"
        )
    if saved.model != cfg.model:
        diffs = [k for k in vars(cfg.model) if getattr(saved.model, k) != getattr(cfg.model, k)]
        raise UserError(
            f"checkpoint {path} was trained with a different model ({', '.join(f'model.{k}' for k in diffs)} differ); "
            "resume with the same model settings or use another --run-dir"
        )
    opts = StateDictOptions(full_state_dict=True)
    partial = getattr(model, "is_pipeline_view", False)
    set_model_state_dict(model, read_weights(path / WEIGHTS, model, partial=partial), options=opts)
    optim_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    if partial:
        optim_state = _restrict(optim_state, {n for n, _ in model.named_parameters()})
    try:
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state, options=opts)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise UserError(f"the optimizer state in {path} does not fit this run's parameter groups ({exc}); "
                        "resume with the same optim.decay_norms_and_biases and model") from None
    from loom.train.optim import apply_hyperparameters

    apply_hyperparameters(optimizer, cfg.optim)
    dist = _dist()
    rng_file = path / f"rng-{dist.get_rank() if dist else 0}.pt"
    meta = json.loads((path / "trainer_state.json").read_text())
    if meta.get("world_size", 1) == (dist.get_world_size() if dist else 1) and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return TrainState(step=meta["step"], consumed_samples=meta["consumed_samples"])
