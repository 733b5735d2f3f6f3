"""Arrays cached as memory-mapped `.npy` files, built once by whichever process takes the lock first and
opened by every other (the sample and blend indices of loom/data/samples.py): each file is streamed under a
temporary name and renamed into place, and a `-meta.json` renamed last marks the set complete, so no reader
ever sees part of one."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile
import time
from typing import Sequence

import numpy as np

from loom.errors import UserError

INDEX_VERSION = "v3"  # bump when the index construction or its files change (v2 shuffled all samples at once)


class NpyWriter:
    """An .npy file of known shape written front to back in pieces, under a temporary name until
    `commit()` renames it into place (a reader never sees half a file)."""

    def __init__(self, path: pathlib.Path, dtype, shape: tuple[int, ...]) -> None:
        self.path, self.dtype, self.shape = path, np.dtype(dtype), shape
        fd, self.tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        self.f = os.fdopen(fd, "wb")
        np.lib.format.write_array_header_1_0(
            self.f, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": shape})
        self.written = 0

    def write(self, array: np.ndarray) -> None:
        self.f.write(memoryview(np.ascontiguousarray(array, dtype=self.dtype)).cast("B"))  # no copy
        self.written += len(array)

    def commit(self) -> None:
        assert self.written == self.shape[0], (self.path, self.written, self.shape)
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        pathlib.Path(self.tmp).unlink(missing_ok=True)


class ArrayWriter:
    """The in-memory counterpart of NpyWriter (no cache directory)."""

    def __init__(self, dtype, shape: tuple[int, ...]) -> None:
        self.array, self.written, self.dtype = np.empty(shape, dtype), 0, np.dtype(dtype)

    def write(self, array: np.ndarray) -> None:
        self.array[self.written : self.written + len(array)] = array
        self.written += len(array)


def cached_arrays(cache_dir: pathlib.Path, stem: str, kinds: Sequence[str], specs: Sequence[tuple], build,
                  meta: dict) -> tuple[list[np.ndarray], bool, list[pathlib.Path], pathlib.Path]:
    """Memory-map the arrays `cache_dir/STEM-KIND.npy` (one per kind, of the given (dtype, shape)), building
    them first when they are not all there: `build(writers)` streams each array into its writer.

    One process builds, under an exclusive lock on `STEM.lock`; every other waits for it and then opens
    what it wrote. Each array is written under a temporary name and renamed into place, and `STEM-meta.json`
    (`meta`, the format version, the build time) is renamed last: an index is complete when its meta file
    exists, so no reader ever sees part of one. Returns (arrays, whether this call built them, the array
    paths, the meta path)."""
    cache_dir = pathlib.Path(cache_dir)
    paths = [cache_dir / f"{stem}-{kind}.npy" for kind in kinds]
    meta_path = cache_dir / f"{stem}-meta.json"

    def opened() -> list[np.ndarray] | None:
        try:
            recorded = json.loads(meta_path.read_text())
            arrays = [np.load(p, mmap_mode="r") for p in paths]
        except (OSError, ValueError):
            return None
        if recorded.get("version") != INDEX_VERSION or [a.shape for a in arrays] != [tuple(s) for _, s in specs]:
            return None
        return arrays

    if (arrays := opened()) is not None:
        return arrays, False, paths, meta_path
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the sample-index cache {cache_dir} ({exc}); set LOOM_CACHE to a "
                        "writable directory") from exc
    with _lock(cache_dir / f"{stem}.lock") as lock:  # one process builds; the others wait, then open its files
        if (arrays := opened()) is not None:
            return arrays, False, paths, meta_path
        t0 = time.perf_counter()
        outs = [NpyWriter(p, dtype, shape) for p, (dtype, shape) in zip(paths, specs)]
        try:
            build(outs)
            for o in outs:
                o.commit()
        except BaseException:
            for o in outs:
                o.abort()
            raise
        record = {"version": INDEX_VERSION, **meta, "build_s": round(time.perf_counter() - t0, 3)}
        fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=meta_path.name + ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record) + "\n")
        os.replace(tmp, meta_path)  # last: its presence means the index is complete
        lock.path.unlink(missing_ok=True)  # safe: whoever takes the lock (this inode or a new one) opens first
        if (arrays := opened()) is None:
            raise RuntimeError(f"the index just written to {cache_dir} ({stem}) does not read back")
        return arrays, True, paths, meta_path


class _lock:
    """An exclusive advisory lock on `path` (fcntl.flock) for the duration of a with-block. Where the file
    system does not support locks, nothing is held: the atomic renames keep concurrent builders harmless
    (they write the same bytes)."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path, self.fd = path, None

    def __enter__(self) -> "_lock":
        try:
            import fcntl

            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except (ImportError, OSError):
            if self.fd is not None:
                os.close(self.fd)
            self.fd = None
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock
