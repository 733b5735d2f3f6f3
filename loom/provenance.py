"""Where a measurement came from: machine, software versions, commit. Stamped on every result file."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def commit() -> str:
    """HEAD's sha (+ "-dirty"), or $LOOM_COMMIT where it is set: the device check's machine gets a copy of the
    tree whose git metadata is the session's first checkout, not the commit that runs (its H200 JSONs of
    2026-11-26 say 4485b9a-dirty for 385f0d9 and bd1a91c)."""
    if os.environ.get("LOOM_COMMIT"):
        return os.environ["LOOM_COMMIT"]
    try:
        sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True, stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.check_output(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, text=True)
        return sha + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def stamp(command: str) -> dict:
    return {"machine": machine(), "torch": torch.__version__, "commit": commit(), "command": command,
            "date": time.strftime("%Y-%m-%d")}


def write_stamped(path, payload: dict, command: str) -> None:
    """Write a bench result as JSON: `payload` and its `stamp(command)`, into `path` (folders made as needed);
    says where it went."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**payload, **stamp(command)}, indent=1) + "\n")
    print(f"wrote {path}")
