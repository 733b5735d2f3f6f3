"""File permissions for what loom writes: the user's umask, as for any file a program creates.

Temporary files made by `tempfile.mkstemp` (and by safetensors, which writes through one) are created
0600; a file renamed into place from one keeps that mode, so a checkpoint or tokenizer shared through a
group-readable directory would be unreadable to the group. `honour_umask` gives such a file the mode a
plain `open(path, "w")` would have.
"""

from __future__ import annotations

import os


def umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask


def honour_umask(path: str | os.PathLike) -> None:
    os.chmod(path, 0o666 & ~umask())
