"""Experiment tracking in Weights & Biases (`log.wandb=true`), beside metrics.jsonl and TensorBoard.

Rank 0 logs every row metrics.jsonl gets, at the row's `step` (an evaluation row joins its step's
training row), and the resolved config (`Config.to_dict()`). The W&B run id is kept in run-dir/wandb_id,
so a resumed run continues the same W&B run (`resume="allow"`); a fresh run in the same directory starts
a new one. W&B ignores rows at steps it has already seen, so the steps a resume repeats (past its
checkpoint) keep their first values there while metrics.jsonl keeps the repeated ones.

wandb is an optional extra: this module imports it only when a run asks for it, so `import loom` and
runs without log.wandb never load it.
"""

from __future__ import annotations

import os
import secrets
import string
from pathlib import Path

from loom.errors import UserError

ID_FILE = "wandb_id"


def new_id() -> str:
    """A fresh W&B run id: 8 lowercase letters and digits, as wandb makes them."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def run_id(run_dir: Path, resumed: bool, new_id) -> str:
    """The W&B run id of this run: the stored one when resuming, else `new_id()` (stored for later resumes)."""
    path = run_dir / ID_FILE
    if resumed and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    rid = new_id()
    tmp = path.with_name(ID_FILE + ".tmp")
    tmp.write_text(rid + "\n")
    os.replace(tmp, path)
    return rid


class WandbTracker:
    """One W&B run for the life of a training run (opened on rank 0 only)."""

    def __init__(self, cfg, run_dir: Path, resumed: bool):
        log = cfg.log
        try:
            import wandb
        except ImportError:
            raise UserError('log.wandb=true needs the wandb package, which is not installed: pip install '
                            '"loom[wandb]" (or set log.wandb=false)') from None
        kwargs = {}
        if log.wandb_mode != "auto":  # auto: wandb reads WANDB_MODE itself
            kwargs["mode"] = log.wandb_mode
        rid = run_id(run_dir, resumed, new_id)
        try:
            self.run = wandb.init(
                project=log.wandb_project, name=log.wandb_name or run_dir.resolve().name, tags=list(log.wandb_tags),
                config=cfg.to_dict(), id=rid, resume="allow", dir=os.environ.get("WANDB_DIR") or str(run_dir),
                # console="off": the progress display and loom's messages stay loom's; metrics come from log().
                settings=wandb.Settings(console="off"), **kwargs)
        except Exception as e:  # wandb raises its own types (no login, no network, a bad project name)
            raise UserError(f"log.wandb=true: W&B could not start a run ({type(e).__name__}: {e}); log in with "
                            "`wandb login`, or run offline with log.wandb_mode=offline (`wandb sync` uploads "
                            "later), or set log.wandb=false") from None

    def log(self, row: dict) -> None:
        # None has no W&B value; a non-finite float goes as is (metrics.jsonl writes it as null).
        self.run.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()
