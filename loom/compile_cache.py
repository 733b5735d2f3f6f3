"""Carry torch.compile's caches from one machine to the next: compile once on a GPU, commit the artifacts, load
them on the next machine of the same kind before anything compiles.

A GPU is lent to this project rarely and briefly, and a cold process spends most of a short call compiling
(inductor's FX graphs, AOT autograd's joint graphs, the Triton kernels bundled into them). PyTorch serialises
what a process compiled or loaded into one blob (`torch.compiler.save_cache_artifacts`) and hot-loads such a
blob into a fresh process's caches (`load_cache_artifacts`). This module keeps those blobs in a folder with a
manifest that says what produced them:

    FOLDER/manifest.json   {"format": 1, "key": {torch, triton, cuda, device, capability}, "commit", "created",
                            "entries": {NAME: {"file", "bytes", "sha256", "artifacts"}}}
    FOLDER/NAME.bin.gz     one process's artifacts (gzip)

Loading refuses, with a note, a folder whose key differs from this process's in any field (another torch, Triton,
CUDA or GPU kind: its kernels could be wrong or fail to load there) and any blob whose checksum differs. A
folder written at another commit is loaded with a note: inductor's and AOT autograd's cache keys hash the traced
graph, its inputs' metadata and the compile settings, so an entry whose code changed can only miss, never be
used for the new code; the hit and miss counts (`hits()`) say how much was reused. What cannot be carried:
Dynamo's tracing (it runs in every process) and CUDA graphs (captured in the process that replays them).

Two environment variables drive it in any loom process (`loom` and the bench scripts call `activate()`):

    LOOM_COMPILE_CACHE_LOAD=FOLDER    load FOLDER's artifacts before the first compile
    LOOM_COMPILE_CACHE_SAVE=FOLDER    write this process's artifacts as FOLDER/NAME.bin.gz (`save()` after each
                                      measured row, and at exit); NAME from `activate(name)` and the pid
"""

from __future__ import annotations

import atexit
import gzip
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = 1
KEY_FIELDS = ("torch", "triton", "cuda", "device", "capability")


def current_key() -> dict:
    """What a compiled artifact depends on outside the code: the versions that generate and load kernels and the
    device kind they were tuned for."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None}


def key_mismatch(found: dict, want: dict) -> list[str]:
    """The key fields that differ, as `field: found != want`."""
    return [f"{k}: {found.get(k)!r} != {want.get(k)!r}" for k in KEY_FIELDS if found.get(k) != want.get(k)]


@dataclass
class LoadReport:
    folder: str
    loaded: list[str] = field(default_factory=list)
    artifacts: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"folder": self.folder, "loaded": self.loaded, "artifacts": self.artifacts, "notes": self.notes,
                "seconds": round(self.seconds, 3)}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_manifest(folder: Path) -> dict | None:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def load(folder, *, commit: str | None = None) -> LoadReport:
    """Hot-load every blob of `folder` whose manifest key matches this process; refuse the rest with a note."""
    import torch

    t0 = time.perf_counter()
    folder = Path(folder)
    report = LoadReport(str(folder))
    try:
        manifest = read_manifest(folder)
    except (OSError, ValueError) as e:
        report.notes.append(f"compile cache {folder}: manifest.json unreadable ({e}); ignored")
        return report
    if manifest is None:
        report.notes.append(f"compile cache {folder}: no manifest.json; nothing loaded (a cold start)")
        return report
    if manifest.get("format") != FORMAT:
        report.notes.append(f"compile cache {folder}: format {manifest.get('format')!r}, this loom reads "
                            f"{FORMAT}; ignored")
        return report
    if differ := key_mismatch(manifest.get("key", {}), current_key()):
        report.notes.append(f"compile cache {folder}: made for another machine ({'; '.join(differ)}); ignored, "
                            "everything compiles from scratch")
        return report
    if commit and manifest.get("commit") and manifest["commit"] != commit:
        report.notes.append(f"compile cache {folder}: compiled at commit {manifest['commit']}, this is {commit}: "
                            "graphs whose code changed will miss (inductor's keys hash the graph) and compile anew")
    for name, entry in sorted(manifest.get("entries", {}).items()):
        path = folder / entry["file"]
        try:
            blob = path.read_bytes()
        except OSError as e:
            report.notes.append(f"compile cache {folder}: {entry['file']} unreadable ({e}); skipped")
            continue
        if _sha256(blob) != entry.get("sha256"):
            report.notes.append(f"compile cache {folder}: {entry['file']} does not match its checksum; skipped")
            continue
        info = torch.compiler.load_cache_artifacts(gzip.decompress(blob))
        if info is not None:
            report.loaded.append(name)
            report.artifacts += sum(len(v) for v in info.artifacts.values())
    report.seconds = time.perf_counter() - t0
    return report


def save(folder, name: str, *, commit: str | None = None) -> Path | None:
    """Write what this process compiled or loaded so far as `folder/name.bin.gz` (atomically, replacing an
    earlier save of the same name) and enter it in the manifest. None when nothing was compiled."""
    import torch

    result = torch.compiler.save_cache_artifacts()
    if result is None:
        return None
    data, info = result
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    blob = gzip.compress(data, compresslevel=6, mtime=0)
    path = folder / f"{name}.bin.gz"
    _atomic_write(path, blob)
    _update_manifest(folder, name, {"file": path.name, "bytes": len(blob), "sha256": _sha256(blob),
                                    "artifacts": {k: len(v) for k, v in info.artifacts.items()}}, commit)
    return path


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _update_manifest(folder: Path, name: str, entry: dict, commit: str | None) -> None:
    """Add one entry, under a lock file: several processes of one device check save into the same folder."""
    lock = folder / ".manifest.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)
        key = current_key()
        manifest = read_manifest(folder) or {}
        if manifest.get("format") != FORMAT or key_mismatch(manifest.get("key", {}), key):
            manifest = {"format": FORMAT, "key": key, "entries": {}}
        manifest["commit"] = commit or manifest.get("commit")
        manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        manifest.setdefault("entries", {})[name] = entry
        _atomic_write(folder / "manifest.json", (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    finally:
        os.close(fd)


def hits() -> dict:
    """This process's cache lookups so far: FX graph (inductor) and AOT autograd hits and misses."""
    from torch._dynamo.utils import counters

    return {"fxgraph_hit": counters["inductor"].get("fxgraph_cache_hit", 0),
            "fxgraph_miss": counters["inductor"].get("fxgraph_cache_miss", 0),
            "aotautograd_hit": counters["aot_autograd"].get("autograd_cache_hit", 0),
            "aotautograd_miss": counters["aot_autograd"].get("autograd_cache_miss", 0)}


_active: dict = {}


def activate(name: str) -> LoadReport | None:
    """Load `LOOM_COMPILE_CACHE_LOAD` (if set) and arrange for `LOOM_COMPILE_CACHE_SAVE` (if set) to receive this
    process's artifacts at exit and at each `save_active()`. Prints what it did; once per process."""
    if _active:
        return _active.get("report")
    load_dir, save_dir = os.environ.get("LOOM_COMPILE_CACHE_LOAD"), os.environ.get("LOOM_COMPILE_CACHE_SAVE")
    if not (load_dir or save_dir):
        return None
    commit = os.environ.get("LOOM_COMMIT")
    report = None
    if load_dir:
        report = load(load_dir, commit=commit)
        for note in report.notes:
            print(f"note: {note}", flush=True)
        print(f"compile cache: loaded {report.artifacts} artifacts from {len(report.loaded)} blobs of {load_dir} "
              f"in {report.seconds:.1f} s", flush=True)
    _active.update(report=report, save=save_dir, name=f"{name}-{os.getpid()}", commit=commit)
    if save_dir:
        atexit.register(save_active)
    return report


def save_active() -> Path | None:
    """Save this process's artifacts where `activate` was told to; no-op when it was not."""
    if not _active.get("save"):
        return None
    try:
        return save(_active["save"], _active["name"], commit=_active["commit"])
    except Exception as e:  # a failed save must never fail the measurement it follows
        print(f"note: compile cache save to {_active['save']} failed: {type(e).__name__}: {e}", flush=True)
        return None
