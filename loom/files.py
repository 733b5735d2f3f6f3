"""Where loom keeps files of its own, and their permissions.

`cache_dir()`: the one cache directory (tokenizers, tokenized datasets, sample indices, the CPU kernels' build):
$LOOM_CACHE, else $XDG_CACHE_HOME/loom or ~/.cache/loom, else (a read-only home) loom-<uid> in the temporary
directory. $LOOM_CACHE_DIR, the CPU kernels' earlier name for it, still works, with a note to rename it.

File permissions: the user's umask, as for any file a program creates.

Temporary files made by `tempfile.mkstemp` (and by safetensors, which writes through one) are created
0600; a file renamed into place from one keeps that mode, so a checkpoint or tokenizer shared through a
group-readable directory would be unreadable to the group. `honour_umask` gives such a file the mode a
plain `open(path, "w")` would have.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

CACHE_ENV = "LOOM_CACHE"
OLD_CACHE_ENV = "LOOM_CACHE_DIR"  # deprecated: read when LOOM_CACHE is unset
_noted: set[str] = set()


def cache_dir() -> Path:
    """$LOOM_CACHE (or the deprecated $LOOM_CACHE_DIR), else $XDG_CACHE_HOME/loom or ~/.cache/loom; where that
    cannot be created (a read-only home), loom-<uid> in the temporary directory, as inductor keeps its own."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if os.environ.get(OLD_CACHE_ENV):
        if OLD_CACHE_ENV not in _noted:
            _noted.add(OLD_CACHE_ENV)
            print(f"note: {OLD_CACHE_ENV} is deprecated; loom's one cache variable is {CACHE_ENV} (set "
                  f"{CACHE_ENV}={os.environ[OLD_CACHE_ENV]} instead)", file=sys.stderr)
        return Path(os.environ[OLD_CACHE_ENV])
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "loom"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"loom-{os.getuid()}"


def umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike) -> None:
    os.chmod(path, 0o666 & ~umask())
