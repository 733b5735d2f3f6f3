"""Training checkpoints: sharded, atomic, verified, reshardable, optionally asynchronous.

`run/checkpoints/step-N/` holds

- `.metadata` and `__R_K.distcp`: model and optimizer state written with `torch.distributed.checkpoint`
  (DCP). Every rank writes its own shards, in parallel; keys are parameter names independent of the
  layout (pipeline stages keep the original names), so any layout — or one process — can load them;
- `config.toml`, `tokenizer.json` with the chat files beside it (`loom.models.io.TOKENIZER_FILES`),
  `trainer_state.json` (step, consumed samples, world size) and `rng-R.pt` (every RNG rank R draws from);
- `manifest.json`: size and sha256 of every file. Each rank hashes the files it wrote; the
  coordinator merges the parts once every rank has finished.

A checkpoint is written into `.tmp-step-N/` and renamed into place by rank 0 only after DCP's
coordinator has seen every rank finish; `latest` (a one-line file naming the step directory) is
replaced atomically afterwards. So `latest` never names a partial checkpoint, and a damaged file is
named on resume. With `checkpoint.async=true` the state is copied to memory while the step loop
waits, then written by a background thread (over a gloo group of its own, so its collectives never
interleave with training's); the rename happens when that write has completed everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from loom.config import Config
from loom.errors import UserError
from loom.models.io import CONFIG, atomic_write_text, copy_tokenizer_files, read_config, write_json

# One process saves and loads without a process group on purpose (DCP's no_dist mode).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
# Optimizer state keyed `state.<param>.<key>` / `param_groups.<param>.<key>`: the union over pipeline
# ranks is the whole optimizer, and each key means the same thing in every layout.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# LoRA (lora.rank > 0): the trained tensors only (adapters, a recipe's heads) and their optimizer state; the
# frozen base is train.init_from's (or train.seed's), which trainer_state.json's "lora_base" names and a resume
# loads again. A checkpoint of a 8B model's adapters is megabytes, not 16 bytes x 8B.
LORA_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


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


def _describe(path: Path) -> dict:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class _ManifestWriter(FileSystemWriter):
    """DCP's file writer, plus: each rank hashes what it wrote; the coordinator writes the manifest."""

    def __init__(self, path: Path, own_files: list[str]):
        super().__init__(path)
        self.own_files = own_files  # files this rank wrote outside DCP (RNG, config, ...)

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        names = {r.storage_data.relative_path for r in future.wait()} | set(self.own_files)
        write_json(Path(self.path) / f"manifest-{self.rank}.json", {n: _describe(Path(self.path) / n) for n in names})
        return future

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)  # writes .metadata, after every rank's write_data returned
        root = Path(self.path)
        parts = sorted(root.glob("manifest-*.json"))
        manifest = {".metadata": _describe(root / ".metadata")}
        for part in parts:
            manifest.update(json.loads(part.read_text()))
        write_json(root / MANIFEST, manifest)
        for part in parts:
            part.unlink()


def _fsync_dir(path: Path) -> None:
    for p in [*path.iterdir(), path] if path.is_dir() else [path]:
        if p.is_file() or p == path:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


class Checkpointer:
    """Saves and loads one run's checkpoints. `save`, `load` are collectives (every rank calls them)."""

    def __init__(self, root: Path, model, optimizer, cfg: Config, tokenizer_path: Path | None, group=None,
                 data_fingerprints: dict | None = None):
        self.root, self.model, self.optimizer, self.cfg = root, model, optimizer, cfg
        self.data_fingerprints = data_fingerprints or {}  # dataset prefix -> loom.data.indexed.fingerprint
        self.tokenizer_path, self.group = tokenizer_path, group
        dist = _dist()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
        self.pending = None  # (future, tmp dir, name) of an asynchronous save in flight
        self.base_fingerprint = None  # a LoRA run's base (loom/interop/fingerprint.py), recorded with every save
        if cfg.lora.enabled and cfg.train.init_from and self.rank == 0:
            from loom.interop.fingerprint import weights_fingerprint

            self.base_fingerprint = weights_fingerprint(cfg.train.init_from)

    @property
    def options(self) -> StateDictOptions:
        return LORA_OPTIONS if self.cfg.lora.enabled else OPTIONS

    def _state(self) -> dict:
        if hasattr(self.optimizer, "state_dicts"):  # the distributed optimizer: its master rows, as FSDP's
            from torch.distributed.checkpoint.state_dict import _get_fqns, get_model_state_dict

            names = {id(p): next(iter(_get_fqns(self.model, n))) for n, p in self.model.named_parameters()}
            model_state, optim_state = self.optimizer.state_dicts(
                get_model_state_dict(self.model, options=self.options), names)
            return {"model": model_state, "optim": optim_state}
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self.options)
        if self.cfg.lora.enabled:  # a tied head's second name survives ignore_frozen_params: keep trained names only
            from loom.models.lora import adapter_state

            trained = adapter_state(self.model)
            model_state = {k: v for k, v in model_state.items() if k in trained}
        return {"model": model_state, "optim": optim_state}

    def save(self, state: TrainState) -> float:
        """Write step `state.step`; return the seconds the caller was blocked. The commit (rename into
        place, `latest`) follows in `poll` or `wait` once the write has finished on every rank."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time
        name = f"step-{state.step}"
        tmp = self.root / f".tmp-{name}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in [*self.root.glob(".tmp-*"), *self.root.glob(".old-*")]:  # left by a killed run
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        if (dist := _dist()) is not None:
            dist.barrier()
        own = [f"rng-{self.rank}.pt"]
        torch.save(rng_state(), tmp / own[0])
        if self.rank == 0:
            (tmp / CONFIG).write_text(self.cfg.to_toml())
            write_json(tmp / STATE, {"step": state.step, "consumed_samples": state.consumed_samples,
                                     "world_size": self.world, "data": self.data_fingerprints,
                                     **({"lora_base": self.cfg.train.init_from or f"train.seed={self.cfg.train.seed}",
                                         "lora_base_fingerprint": self.base_fingerprint}
                                        if self.cfg.lora.enabled else {})})
            own += [CONFIG, STATE]
            own += copy_tokenizer_files(self.tokenizer_path, tmp)  # with its chat template and stop ids
        writer = _ManifestWriter(tmp, own)
        if self.cfg.checkpoint.async_save:
            # Copies the state to memory now; the write runs in a background thread.
            future = dcp.async_save(self._state(), storage_writer=writer, process_group=self.group,
                                    no_dist=self.world == 1)
        else:
            dcp.save(self._state(), storage_writer=writer, process_group=self.group, no_dist=self.world == 1)
            future = Future()
            future.set_result(None)
        self.pending = (future, tmp, name)  # committed by the next poll() or wait()
        return time.perf_counter() - t0

    def poll(self) -> None:
        """Commit a save whose write has finished (call once per step)."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is written and committed."""
        if self.pending is None:
            return
        future, tmp, name = self.pending
        self.pending = None
        future.result()
        self._commit(tmp, name)

    def _commit(self, tmp: Path, name: str) -> None:
        """Rank 0: the write is complete on every rank; move it into place, then point `latest` at it."""
        if self.rank != 0:
            return
        _fsync_dir(tmp)
        final, old = self.root / name, None
        if final.exists():  # re-saving the same step (e.g. after a resume): swap it whole
            old = self.root / f".old-{name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        atomic_write_text(self.root / "latest", name + "\n")
        _fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if self.cfg.checkpoint.keep_last:
            prune(self.root, self.cfg.checkpoint.keep_last)

    def load(self, path: Path) -> TrainState:
        """Restore model, optimizer and RNG from `path` (verified first) into this layout; return the state.

        RNG streams are restored per rank when the checkpoint was written by the same number of ranks
        (bit-exact resume); in another layout each rank keeps the fresh seed-derived stream.
        """
        verify_everywhere(path)
        check_compatible(path, self.cfg)
        check_same_data(path, self.data_fingerprints)
        state = self._state()  # this layout's tensors, filled in place from whatever layout saved them
        check_state_matches(path, state)  # bad input (exit 2) is decided here, before loading anything
        # Anything that fails from here on (I/O, memory, a collective) is not a mismatch: it keeps its
        # traceback and is never taken for a damaged checkpoint.
        dcp.load(state, checkpoint_id=path, process_group=self.group, no_dist=self.world == 1)
        if hasattr(self.optimizer, "loaded"):  # loaded in place into its master rows and moments
            self.optimizer.loaded()
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=self.options)
        from loom.train.optim import apply_hyperparameters

        apply_hyperparameters(self.optimizer, self.cfg.optim)
        meta = json.loads((path / STATE).read_text())
        rng_file = path / f"rng-{self.rank}.pt"
        if meta.get("world_size", 1) == self.world and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        return TrainState(step=meta["step"], consumed_samples=meta["consumed_samples"])


def check_state_matches(path: Path, state: dict) -> None:
    """UserError when the checkpoint's tensors do not fit this run's: a key it lacks, or another global
    shape or dtype (read from DCP's metadata, so nothing is loaded to find out)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    flat, _ = flatten_state_dict(state)
    problems = []
    for key, tensor in flat.items():
        if not torch.is_tensor(tensor):
            continue
        meta = saved.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            problems.append(f"{key} is missing")
        elif tuple(meta.size) != tuple(tensor.shape) or meta.properties.dtype != tensor.dtype:
            problems.append(f"{key} is {meta.properties.dtype} {tuple(meta.size)} in the checkpoint but "
                            f"{tensor.dtype} {tuple(tensor.shape)} here")
    if problems:
        raise UserError(
            f"checkpoint {path} does not fit this model and optimizer: {'; '.join(problems[:3])}"
            f"{f' (and {len(problems) - 3} more)' if len(problems) > 3 else ''}; resume with the same model "
            "settings and optim.state_dtype"
        )


def check_compatible(path: Path, cfg: Config) -> None:
    saved = read_config(path)
    old, new = saved.field_values(), cfg.field_values()
    fixed = ["train.seq_len", "train.global_batch", "train.seed", "data.paths", "data.weights", "data.tokenizer",
             "data.corpus_max_bytes"]
    changed = [f"{k}: {old[k]!r} in the checkpoint, {new[k]!r} now" for k in fixed if old[k] != new[k]]
    if changed:
        raise UserError(
            f"checkpoint {path} was trained with different data settings ({'; '.join(changed)}); the data order "
            "and position depend on them, so resume with the checkpoint's values (its config.toml)"
        )
    if saved.model != cfg.model or saved.lora.rank != cfg.lora.rank:
        diffs = [f"{k}: {old[k]!r} in the checkpoint, {new[k]!r} now"
                 for k in new if (k.startswith("model.") or k == "lora.rank") and old[k] != new[k]]
        raise UserError(
            f"checkpoint {path} was trained with a different model ({'; '.join(diffs)}); resume with the same "
            "model settings or use another --run-dir"
        )
    check_same_training(path, saved, cfg)
    if cfg.lora.enabled and cfg.train.init_from:  # the base a resumed LoRA run loads again: the one it trained on
        from loom.interop.fingerprint import check_same_base, recorded_base

        check_same_base(recorded_base(path), cfg.train.init_from, f"checkpoint {path}")


def check_same_training(path: Path, saved: Config, cfg: Config) -> None:
    """UserError naming each key of RESUME_GUARDED that differs from the checkpoint's and that
    checkpoint.allow_changes does not name: adapters a resume would drop or scale otherwise, examples it would
    render, pack or choose otherwise."""
    from loom.config.lora import hf_target, loom_targets
    from loom.config.training import RESUME_GUARDED

    def value(c: Config, key: str):
        v = c.field_values()[key]
        return loom_targets(v) if key == "lora.targets" else v

    lora = cfg.lora.enabled
    changed = [k for k in RESUME_GUARDED if k not in cfg.checkpoint.allow_changes
               and (lora or not k.startswith("lora.")) and value(saved, k) != value(cfg, k)]
    if not changed:
        return
    old, new = saved.field_values(), cfg.field_values()
    parts = []
    for k in changed:
        part = f"{k}: {old[k]!r} in the checkpoint, {new[k]!r} now"
        if k == "lora.targets" and (dropped := set(value(saved, k)) - set(value(cfg, k))):
            part += f" (the trained adapters of {', '.join(hf_target(n) for n in loom_targets(list(dropped)))} " \
                    "would be dropped)"
        parts.append(part)
    run = path.parent.parent
    raise UserError(
        f"checkpoint {path} was trained with other settings than this resume's: {'; '.join(parts)}. Resume with the "
        f"run's own values (--config {run / CONFIG}), or, if the change is intended, add "
        f"--checkpoint.allow_changes={','.join(changed)} (nothing was changed)"
    )


def check_same_data(path: Path, now: dict) -> None:
    """UserError naming each dataset whose contents changed since the checkpoint was written (a dataset
    rebuilt in place, e.g. by `loom preprocess --overwrite`): resuming would train on other data."""
    saved = json.loads((path / STATE).read_text()).get("data", {})
    changed = []
    for prefix, old in saved.items():
        new = now.get(prefix)
        if new is not None and new != old:
            what = (f".bin {old['bin_bytes']} -> {new['bin_bytes']} bytes" if old["bin_bytes"] != new["bin_bytes"]
                    else "its .idx (document lengths) differs")
            changed.append(f"{prefix} ({what})")
    if changed:
        raise UserError(
            f"the data changed since checkpoint {path} was written: {'; '.join(changed)}; the run's data position "
            "would point into other documents. Restore the datasets the run trained on, or start a new run "
            "(another --run-dir)"
        )


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


def verify(path: Path, rank: int = 0, world: int = 1) -> None:
    """Check the files (every `world`-th, from `rank`) against the manifest; raise UserError naming a damaged one."""
    manifest_file = path / MANIFEST
    try:
        manifest = json.loads(manifest_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"checkpoint {path} has no readable {MANIFEST} ({exc}); it is incomplete or damaged") from None
    for name in sorted(manifest)[rank::world]:
        meta, f = manifest[name], path / name
        if not f.is_file():
            raise UserError(f"checkpoint {path} is damaged: {name} is missing")
        if f.stat().st_size != meta["bytes"] or _describe(f)["sha256"] != meta["sha256"]:
            raise UserError(
                f"checkpoint {path} is damaged: {name} does not match its manifest checksum "
                f"(expected {meta['bytes']} bytes, sha256 {meta['sha256'][:12]}...)"
            )


def verify_everywhere(path: Path) -> None:
    """`verify` with the files split over the ranks; every rank raises the same error (a collective)."""
    dist = _dist()
    if dist is None:
        return verify(path)
    try:
        verify(path, dist.get_rank(), dist.get_world_size())
        error = None
    except UserError as exc:
        error = str(exc)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if first := next((e for e in errors if e), None):
        raise UserError(first)
