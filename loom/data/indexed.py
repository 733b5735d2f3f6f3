"""Megatron-compatible indexed datasets: `PREFIX.bin` (raw tokens) + `PREFIX.idx` (the index).

`.idx` layout, little-endian: 9-byte magic `MMIDIDX\\0\\0`, uint64 version (1), uint8 dtype code,
uint64 sequence count, uint64 document count, int32 sizes[sequences], int64 pointers[sequences]
(byte offsets into `.bin`), int64 document_index[documents] (starts with 0, ends with sequences).
Here every document is one sequence. Files written by Megatron's preprocess_data.py read as is.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from array import array
from typing import Iterable

import numpy as np

from loom.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
SPAN_COPY_MIN = 64  # read_spans copies slice by slice when spans average at least this many tokens


def best_dtype(vocab_size: int) -> np.dtype:
    """The smallest token dtype for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def dtype_code(dtype) -> int:
    """Megatron's code for a numpy dtype."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        valid = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
        raise UserError(f"indexed datasets cannot store dtype {dt.name}; valid: {valid}")
    return _CODE_OF[dt]


def _paths(prefix: str | os.PathLike) -> tuple[pathlib.Path, pathlib.Path]:
    p = str(prefix)
    return pathlib.Path(p + ".bin"), pathlib.Path(p + ".idx")


def stats_path(prefix: str | os.PathLike) -> pathlib.Path:
    """PREFIX.stats.json: what the builder knew when it wrote the dataset (documents, tokens, largest
    token id), so readers need not scan the .bin; Megatron's readers ignore it."""
    return pathlib.Path(str(prefix) + ".stats.json")


def _sha256(path: pathlib.Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _recorded(prefix: str | os.PathLike) -> dict | None:
    """PREFIX.stats.json when loom's builder wrote it for exactly these files (same .bin and .idx sizes)."""
    bin_path, idx_path = _paths(prefix)
    try:
        recorded = json.loads(stats_path(prefix).read_text())
        sizes = (bin_path.stat().st_size, idx_path.stat().st_size)
        if recorded.get("idx_sha256") and (recorded.get("bin_bytes"), recorded.get("idx_bytes")) == sizes:
            return recorded
    except (OSError, ValueError, AttributeError):
        pass
    return None


def fingerprint(prefix: str | os.PathLike) -> dict:
    """What identifies a dataset's contents: the .bin's size and the sha256 of its .idx (every document's
    length). The hash is recorded in PREFIX.stats.json when the dataset is written, so a start reads two
    file sizes and a small JSON file; only a dataset without that record (written by an older loom or
    another tool), or whose files no longer have the recorded sizes, has its .idx hashed here. The .bin
    is never read."""
    bin_path, idx_path = _paths(prefix)
    recorded = _recorded(prefix)
    if recorded:
        return {"bin_bytes": recorded["bin_bytes"], "idx_sha256": recorded["idx_sha256"]}
    return {"bin_bytes": bin_path.stat().st_size, "idx_sha256": _sha256(idx_path)}


class IndexedDatasetBuilder:
    """Writes an indexed dataset, one document at a time; nothing appears at `prefix` until finalize().

    Data goes to unique temporary files next to the prefix, renamed into place by `finalize()`.
    As a context manager it finalizes on a clean exit and removes the temporaries on an exception.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16) -> None:
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.bin_path, self.idx_path = _paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._tag = tag = f".tmp-{os.getpid()}-{id(self):x}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + tag)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + tag)
        self._bin = open(self._bin_tmp, "wb")
        self._sizes = array("q")
        self._max_id = -1
        self._done = False
        if self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            self._range: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._range = None

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one document (a 1-D sequence of token ids)."""
        arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens))
        if arr.ndim != 1:
            raise ValueError(f"a document must be 1-D, got shape {arr.shape}")
        if arr.size and self._range is not None:
            lo, hi = int(arr.min()), int(arr.max())
            self._max_id = max(self._max_id, hi)
            if lo < self._range[0] or hi > self._range[1]:
                raise UserError(
                    f"token id {hi if hi > self._range[1] else lo} does not fit dtype {self.dtype.name} "
                    f"(valid: {self._range[0]}..{self._range[1]}) while writing {self.bin_path}"
                )
        if arr.size >= 2**31:
            raise UserError(f"a document of {arr.size} tokens is too long for the index (int32 sizes)")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._sizes.append(arr.size)

    def __len__(self) -> int:
        return len(self._sizes)

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        if self._done:
            return
        self._bin.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int64) if len(self._sizes) else np.zeros(0, np.int64)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_index = np.arange(len(sizes) + 1, dtype=np.int64)
        with open(self._idx_tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, self._code, len(sizes), len(doc_index)))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_index.astype("<i8").tobytes())
        stats = stats_path(str(self.bin_path)[:-4])
        stats_tmp = stats.with_name(stats.name + self._tag)  # per process, as the .bin and .idx: ranks may race
        stats_tmp.write_text(json.dumps({"documents": len(sizes), "tokens": int(sizes.sum()),
                                         "max_token_id": self._max_id, "idx_bytes": self._idx_tmp.stat().st_size,
                                         "bin_bytes": self._bin_tmp.stat().st_size,
                                         "idx_sha256": _sha256(self._idx_tmp)}) + "\n")
        os.replace(self._bin_tmp, self.bin_path)  # .idx last: its presence means both are complete
        os.replace(stats_tmp, stats)
        os.replace(self._idx_tmp, self.idx_path)
        self._done = True

    def abort(self) -> None:
        """Drop everything written so far."""
        self._bin.close()
        self._bin_tmp.unlink(missing_ok=True)
        self._idx_tmp.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        elif not self._done:
            self.abort()


class IndexedDataset:
    """Memory-mapped reader: `ds[i]` is document i's tokens as a read-only numpy array."""

    subset_key = ""  # the whole dataset (a `DocumentRange` names its documents)

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = _paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise UserError(f"indexed dataset file {p} does not exist; expected PREFIX.bin and PREFIX.idx")
        self._read_index()
        self._read_bin()

    def _bad(self, what: str) -> UserError:
        return UserError(f"{self.idx_path} is not a valid indexed dataset index: {what}")

    def _read_index(self) -> None:
        idx = np.memmap(self.idx_path, dtype=np.uint8, mode="r") if self.idx_path.stat().st_size else b""
        if len(idx) < HEADER.size:
            raise self._bad(f"file is {len(idx)} bytes, shorter than the {HEADER.size}-byte header")
        magic, version, code, n_seq, n_doc = HEADER.unpack(bytes(idx[: HEADER.size]))
        if magic != MAGIC:
            raise self._bad(f"magic is {magic!r}, expected {MAGIC!r} (Megatron MMIDIDX format)")
        if version != VERSION:
            raise self._bad(f"version is {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise self._bad(f"unknown dtype code {code}; valid: {sorted(DTYPE_CODES)}")
        need = HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if len(idx) < need:
            raise self._bad(f"file is {len(idx)} bytes; {n_seq} sequences and {n_doc} documents need {need}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        off = HEADER.size
        self.sizes = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=off)
        self.pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=off + 4 * n_seq)
        self.document_index = np.frombuffer(idx, dtype="<i8", count=n_doc, offset=off + 12 * n_seq)
        if n_doc < 1 or self.document_index[0] != 0 or self.document_index[-1] != n_seq:
            raise self._bad(f"document index must run from 0 to {n_seq} ({n_doc} entries found)")
        # loom's builder wrote these exact files (its stats record matches their sizes): its pointers are the
        # running sum of non-negative sizes, so the last document ends furthest and nothing else is scanned.
        # Any other index gets every size and pointer checked (12 bytes per document read).
        self._trusted = _recorded(self.prefix) is not None
        if n_seq and not self._trusted and int(self.sizes.min()) < 0:
            raise self._bad("negative sequence size")
        self._idx = idx  # keep the mapping alive

    def _read_bin(self) -> None:
        size = self.bin_path.stat().st_size
        if not len(self):
            end = 0
        elif self._trusted:
            end = int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize
        else:
            end = int((self.pointers + self.sizes.astype(np.int64) * self.dtype.itemsize).max())
        if end > size:
            raise UserError(
                f"{self.bin_path} is truncated: it has {size} bytes but {self.idx_path} points to {end}; "
                "rebuild the dataset"
            )
        self._bin = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        self._tokens = None  # the .bin as one token array, made on first use by read_spans

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        """Total tokens over all documents."""
        return int(self.sizes.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of document i (to its end when length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents in {self.prefix}")
        i %= n
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens {offset}:{offset + length} out of range for document {i} of {size} tokens")
        start = int(self.pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def read_spans(self, docs: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, dtype=None) -> np.ndarray:
        """Tokens `offsets[k] : offsets[k] + lengths[k]` of documents `docs[k]`, concatenated (as `dtype`, default
        the dataset's), from the memory-mapped .bin; the caller has checked the spans lie inside documents.

        Long spans are copied slice by slice (one memcpy each); many short ones are fetched by one vectorised
        gather (an index per token), which is faster than a Python step per span."""
        docs, offsets, lengths = (np.asarray(a, dtype=np.int64) for a in (docs, offsets, lengths))
        dtype = np.dtype(dtype or self.dtype)
        item = self.dtype.itemsize
        total = int(lengths.sum())
        byte_starts = self.pointers[docs]
        if self._tokens is None:
            self._tokens = np.frombuffer(self._bin, dtype=self.dtype, count=len(self._bin) // item)
        if item > 1 and (byte_starts % item).any():  # unaligned documents (not written by Megatron or loom)
            parts = [self.get(int(d), int(o), int(n)) for d, o, n in zip(docs, offsets, lengths)]
            return np.concatenate(parts + [np.zeros(0, self.dtype)]).astype(dtype, copy=False)
        firsts = byte_starts // item + offsets
        if len(docs) * SPAN_COPY_MIN <= total:
            out = np.empty(total, dtype=dtype)
            at = 0
            for first, n in zip(firsts.tolist(), lengths.tolist()):
                out[at : at + n] = self._tokens[first : first + n]
                at += n
            return out
        before = np.cumsum(lengths) - lengths  # where each span starts in the output
        index = np.repeat(firsts - before, lengths) + np.arange(total, dtype=np.int64)
        return self._tokens[index].astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, documents={len(self)}, tokens={self.num_tokens}, dtype={self.dtype})"

    def max_token_id(self) -> int:
        """The largest token id: from PREFIX.stats.json when the builder wrote one for this index, else
        one numpy pass over the .bin (datasets made by older tools), -1 when empty."""
        stats = stats_path(self.prefix)
        if stats.is_file() and stats.stat().st_mtime_ns <= self.idx_path.stat().st_mtime_ns:
            try:
                data = json.loads(stats.read_text())
                if data.get("documents") == len(self) and data.get("tokens") == self.num_tokens:
                    return int(data["max_token_id"])
            except (OSError, ValueError, KeyError, TypeError):
                pass  # unreadable: scan instead
        if not len(self) or not self.num_tokens:
            return -1
        flat = np.frombuffer(self._bin, dtype=self.dtype, count=self.num_tokens, offset=int(self.pointers[0]))
        return int(max(int(flat[lo:lo + (1 << 24)].max()) for lo in range(0, flat.size, 1 << 24)))

    def first_token_at_least(self, limit: int) -> tuple[int, int] | None:
        """(document, token id) of the first token >= `limit`, or None: one vectorised pass over the .bin."""
        if not len(self) or not self.num_tokens:
            return None
        start = int(self.pointers[0])
        flat = np.frombuffer(self._bin, dtype=self.dtype, count=self.num_tokens, offset=start)
        chunk = 1 << 24
        for lo in range(0, flat.size, chunk):  # bounded memory for the comparison mask
            hits = np.flatnonzero(flat[lo:lo + chunk] >= limit)
            if hits.size:
                pos = lo + int(hits[0])
                ends = np.cumsum(self.sizes.astype(np.int64))
                return int(np.searchsorted(ends, pos, side="right")), int(flat[pos])
        return None


class DocumentRange:
    """Documents [lo, hi) of an indexed dataset, with the reader's interface (a train/valid/test split)."""

    def __init__(self, dataset: IndexedDataset, lo: int, hi: int) -> None:
        self.base, self.lo, self.hi = dataset, lo, hi
        self.prefix, self.idx_path, self.bin_path, self.dtype = dataset.prefix, dataset.idx_path, dataset.bin_path, dataset.dtype
        self.sizes = dataset.sizes[lo:hi]
        self.subset_key = f"docs{lo}-{hi}"

    def __len__(self) -> int:
        return self.hi - self.lo

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"document {i} out of range for {len(self)} documents")
        return self.base.get(self.lo + i, offset, length)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def read_spans(self, docs: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, dtype=None) -> np.ndarray:
        return self.base.read_spans(np.asarray(docs, dtype=np.int64) + self.lo, offsets, lengths, dtype)
