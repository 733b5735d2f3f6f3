"""Fixed-length training samples over an indexed dataset, and weighted blends of such datasets.

Like Megatron's GPTDataset, three index arrays are built once and cached:

- document index: the document order; each epoch is a fresh seeded permutation of all documents,
  repeated for as many epochs as `num_samples` needs;
- sample index: the (document position, token offset) where each sample starts in the stream that
  document order concatenates. Sample i is stream tokens [i*seq_len, i*seq_len + seq_len + 1), so
  consecutive samples share one token (the last target of one is the first input of the next);
- shuffle index: a seeded permutation of the samples.

`ds[i]` is a pure function of i, so a run resumes by skipping the samples already consumed.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
from typing import Sequence

import numpy as np

from loom.data.indexed import IndexedDataset
from loom.errors import UserError

INDEX_VERSION = "v1"  # bump when the index construction changes


def _compact(a: np.ndarray) -> np.ndarray:
    """int32 when every value fits, else int64."""
    return a.astype(np.int32) if a.size == 0 or int(a.max()) < 2**31 else a.astype(np.int64)


def _num_epochs(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    """Epochs whose concatenation holds num_samples * seq_len + 1 tokens."""
    need = num_samples * seq_len + 1
    return max(1, -(-need // tokens_per_epoch))


def build_document_index(num_docs: int, num_epochs: int, seed: int) -> np.ndarray:
    """Concatenated per-epoch permutations of the documents."""
    rng = np.random.RandomState(seed % 2**32)
    order = [rng.permutation(num_docs) for _ in range(num_epochs)]
    return _compact(np.concatenate(order) if order else np.zeros(0, np.int64))


def build_sample_index(sizes: np.ndarray, doc_index: np.ndarray, seq_len: int, num_samples: int) -> np.ndarray:
    """(position in doc_index, token offset) of each sample's first token, shape (num_samples, 2)."""
    ends = np.cumsum(sizes[doc_index], dtype=np.int64)  # stream position where each entry ends
    starts = np.arange(num_samples, dtype=np.int64) * seq_len
    pos = np.searchsorted(ends, starts, side="right")  # first entry ending after the start (skips empties)
    offset = starts - (ends[pos] - sizes[doc_index[pos]])
    return _compact(np.stack([pos, offset], axis=1))


def build_shuffle_index(num_samples: int, seed: int) -> np.ndarray:
    """A seeded permutation of the samples."""
    return _compact(np.random.RandomState((seed + 1) % 2**32).permutation(num_samples))


def _file_digest(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _save_npy(path: pathlib.Path, array: np.ndarray) -> None:
    """np.save via a temporary file and rename, so a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


class SampleDataset:
    """`num_samples` samples of `seq_len + 1` tokens (int64) drawn from `dataset`'s token stream."""

    def __init__(
        self,
        dataset: IndexedDataset,
        seq_len: int,
        num_samples: int,
        seed: int,
        cache_dir: pathlib.Path | None = None,
        name: str = "",
    ) -> None:
        if seq_len < 1:
            raise UserError(f"seq_len must be >= 1, got {seq_len}")
        if num_samples < 0:
            raise UserError(f"num_samples must be >= 0, got {num_samples}")
        self.dataset, self.seq_len, self.num_samples, self.seed = dataset, seq_len, num_samples, seed
        total = dataset.num_tokens
        if total < seq_len + 1:
            raise UserError(
                f"dataset {dataset.prefix} has {total} tokens in {len(dataset)} documents; "
                f"one sample of seq_len {seq_len} needs {seq_len + 1} tokens"
            )
        self.num_epochs = _num_epochs(total, seq_len, num_samples)
        if cache_dir is None:
            self.doc_index, self.sample_index, self.shuffle_index = self._build()
        else:
            self._load_or_build(pathlib.Path(cache_dir), name)

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        doc_index = build_document_index(len(self.dataset), self.num_epochs, self.seed)
        sample_index = build_sample_index(self.dataset.sizes, doc_index, self.seq_len, self.num_samples)
        return doc_index, sample_index, build_shuffle_index(self.num_samples, self.seed)

    def cache_key(self) -> str:
        """Hash of the dataset's index file and the sampling parameters."""
        idx = self.dataset.idx_path
        subset = getattr(self.dataset, "subset_key", "")
        params = (f"{INDEX_VERSION}|{idx.stat().st_size}|{_file_digest(idx)}|{self.seq_len}|{self.num_samples}|"
                  f"{self.seed}{'|' + subset if subset else ''}")
        return hashlib.sha256(params.encode()).hexdigest()[:20]

    def _load_or_build(self, cache_dir: pathlib.Path, name: str) -> None:
        stem = f"{name or pathlib.Path(self.dataset.prefix).name}-{self.cache_key()}"
        paths = [cache_dir / f"{stem}-{kind}.npy" for kind in ("doc", "sample", "shuffle")]
        self.cache_paths = paths
        if all(p.is_file() for p in paths):
            try:
                self.doc_index, self.sample_index, self.shuffle_index = (np.load(p, mmap_mode="r") for p in paths)
                if len(self.sample_index) == len(self.shuffle_index) == self.num_samples:
                    return
            except (OSError, ValueError):
                pass  # unreadable cache: rebuild it
        arrays = self._build()
        cache_dir.mkdir(parents=True, exist_ok=True)
        for path, array in zip(paths, arrays):
            _save_npy(path, array)
        self.doc_index, self.sample_index, self.shuffle_index = arrays

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        pos, offset = (int(v) for v in self.sample_index[int(self.shuffle_index[i])])
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        filled = 0
        while filled < len(out):
            doc = int(self.doc_index[pos])
            take = min(len(out) - filled, int(self.dataset.sizes[doc]) - offset)
            out[filled : filled + take] = self.dataset.get(doc, offset, take)
            filled += take
            pos, offset = pos + 1, 0
        return out


def blend_indices(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: each sample goes to the dataset furthest behind its target share.

    Returns (dataset of each sample, index of the sample within that dataset).
    """
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    which = np.empty(num_samples, dtype=np.int16 if len(w) < 2**15 else np.int32)
    within = np.empty(num_samples, dtype=np.int64)
    for i in range(num_samples):
        t = max(i, 1)
        best, best_err = 0, w[0] * t - counts[0]
        for d in range(1, len(w)):
            err = w[d] * t - counts[d]
            if err > best_err:
                best, best_err = d, err
        which[i] = best
        within[i] = counts[best]
        counts[best] += 1
    return which, within


class BlendedDataset:
    """`num_samples` samples mixed from `datasets` in proportion to `weights`."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int) -> None:
        if not datasets or len(datasets) != len(weights):
            raise UserError(f"a blend needs one weight per dataset; got {len(datasets)} datasets and {len(weights)} weights")
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
            raise UserError(f"blend weights must be >= 0 with a positive sum; got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = w / w.sum()
        self.num_samples = num_samples
        self.dataset_index, self.sample_index = blend_indices(self.weights, num_samples)
        need = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (ds, n) in enumerate(zip(self.datasets, need)):
            if n > len(ds):
                raise UserError(
                    f"blend dataset {d} (weight {self.weights[d]:.4f}) has {len(ds)} samples "
                    f"but the blend of {num_samples} takes {n} from it"
                )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        return self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]
