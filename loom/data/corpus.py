"""The embedded default corpus: the running Python's standard library source.

Every machine that runs loom has it, so the demo trains on real text without a download. Files are
listed in sorted relative-POSIX-path order and split into "train" and "val" by a hash of that path,
so the split is fixed for a given Python version and does not depend on the file system's order.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import sysconfig
from typing import Iterator

from loom.errors import UserError, closest

SPLITS = ("train", "val")
VAL_PER_MILLE = 20  # ~2% of files are held out
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> pathlib.Path:
    """The directory holding the standard library's source."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _bucket(rel: str) -> int:
    """A stable number in [0, 1000) from a relative path."""
    return int.from_bytes(hashlib.sha1(rel.encode()).digest()[:8], "little") % 1000


@functools.lru_cache(maxsize=None)
def _split_files() -> dict[str, tuple[pathlib.Path, ...]]:
    root = stdlib_root()
    rels = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if p.is_file() and not _EXCLUDED_DIRS.intersection(p.relative_to(root).parts)
    )
    if len(rels) < 2:
        raise UserError(f"the embedded corpus needs Python source files under {root}; found {len(rels)}")
    val = {r for r in rels if _bucket(r) < VAL_PER_MILLE}
    if not val:  # tiny installs: hold out the file with the smallest hash
        val = {min(rels, key=lambda r: (_bucket(r), r))}
    return {
        "train": tuple(root / r for r in rels if r not in val),
        "val": tuple(root / r for r in rels if r in val),
    }


def corpus_files(split: str) -> list[pathlib.Path]:
    """The files of one split ("train" or "val") in deterministic order."""
    if split not in SPLITS:
        raise UserError(f"unknown corpus split {split!r}; valid: {', '.join(SPLITS)}{closest(split, SPLITS)}")
    return list(_split_files()[split])


def iter_documents(split: str, max_bytes: int = 0) -> Iterator[str]:
    """Yield the texts of a split's files (empty files skipped).

    With `max_bytes > 0`, stop once the UTF-8 size of the yielded texts reaches `max_bytes`;
    whole documents are yielded, and always at least one.
    """
    if max_bytes < 0:
        raise UserError(f"max_bytes must be >= 0 (0 = no limit), got {max_bytes}")
    total = 0
    for path in corpus_files(split):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text:
            continue
        yield text
        total += len(text.encode("utf-8"))
        if max_bytes and total >= max_bytes:
            return
