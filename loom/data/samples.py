"""Fixed-length training samples over an indexed dataset, and weighted blends of such datasets: the token
data a pre-training run reads (`TokenSamples`: batches, with document masking, and what the banner says).

Three index arrays are built once and cached (the arrays of Megatron's GPTDataset, but not its files: the
document order is shuffled per epoch and the samples per pass, so that no order depends on the run's length):

- document index: the document order; each epoch is a fresh seeded permutation of all documents,
  repeated for as many epochs as the samples need;
- sample index: the (document position, token offset) where each sample starts in the stream that
  document order concatenates. Sample i is stream tokens [i*seq_len, i*seq_len + seq_len + 1), so
  consecutive samples share one token (the last target of one is the first input of the next);
- shuffle index: pass k holds the samples that start in epoch k of the stream (`pass_bounds`), in a seeded
  permutation of their own, drawn pass after pass from one generator. The index always covers whole passes.

So every array is a prefix of the one built for more samples: a run resumed with a larger `train.steps`
reads, for the steps it has not taken, exactly what a run planned for that many steps reads. `ds[i]` is a
pure function of i, so a run resumes by skipping the samples already consumed.

The index is built once, by the launcher (or the first process to take the cache's lock), into `.npy`
files under the cache directory, named by a key of the dataset's fingerprint (`.bin` size and the `.idx`
hash recorded at preprocess time: nothing is read whole) and the sampling parameters (the number of passes,
not of samples: runs of any length within the same passes share one index). The build streams: it holds
one epoch's document permutation (4 bytes per document) and one pass's sample permutation (4 bytes per
sample) in memory, never the concatenated epochs or per-sample Python objects, and writes each file under
a temporary name renamed into place; a `-meta.json` written last marks the index complete. Every rank then
memory-maps the files. A batch's samples are located together, vectorised, and read from the memory-mapped
`.bin` (`SampleDataset.rows`).
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import Sequence

import numpy as np
import torch

from loom.data.dataset import Dataset
from loom.data.index_cache import INDEX_VERSION, ArrayWriter, cached_arrays
from loom.data.indexed import IndexedDataset, fingerprint
from loom.errors import UserError

CHUNK = 1 << 20  # document-index entries per step of the streaming sample-index build (~40 MiB working set)


def _index_dtype(largest: int) -> np.dtype:
    """int32 when every value (at most `largest`) fits, else int64."""
    return np.dtype(np.int32 if largest < 2**31 else np.int64)


def _num_epochs(tokens_per_epoch: int, seq_len: int, num_samples: int) -> int:
    """Epochs whose concatenation holds num_samples * seq_len + 1 tokens."""
    need = num_samples * seq_len + 1
    return max(1, -(-need // tokens_per_epoch))


def pass_bounds(tokens_per_epoch: int, seq_len: int, num_samples: int) -> np.ndarray:
    """[b_0 = 0, b_1, ..., b_E]: pass k is samples [b_k, b_k+1), those starting in epoch k of the stream
    (b_k = ceil(k * tokens_per_epoch / seq_len)), and E the fewest passes that hold `num_samples`."""
    passes = (num_samples - 1) * seq_len // tokens_per_epoch + 1 if num_samples > 0 else 0
    return -(-np.arange(passes + 1, dtype=np.int64) * tokens_per_epoch // seq_len)


def _permutation(n: int, rng: np.random.RandomState) -> np.ndarray:
    """`rng.permutation(n)` in the smallest integer dtype: numpy's legacy permutation is arange then an
    in-place Fisher-Yates shuffle whose draws do not depend on the dtype, so the values are the same."""
    out = np.arange(n, dtype=_index_dtype(max(n - 1, 0)))
    rng.shuffle(out)
    return out


def build_indices(sizes: np.ndarray, num_epochs: int, seq_len: int, bounds: np.ndarray, seed: int,
                  doc_out, sample_out, shuffle_out, chunk: int | None = None) -> None:
    """Stream the document, sample and shuffle indices of the passes `bounds` (`pass_bounds`) into the three
    writers (see the module docstring).

    Sample i starts at stream token s = i*seq_len: its entry is the first document position whose stream
    end lies after s (empty documents are skipped) and the offset of s within that document. Documents are
    taken a chunk at a time in stream order, so only the samples starting inside the current chunk are
    resolved against it."""
    num_docs, chunk, num_samples = len(sizes), chunk or CHUNK, int(bounds[-1])
    rng = np.random.RandomState(seed % 2**32)
    base = 0  # stream position where the current chunk starts
    entry = 0  # document-index position of the current chunk's first entry
    next_sample = 0
    for _ in range(num_epochs):
        order = _permutation(num_docs, rng)
        doc_out.write(order)
        for lo in range(0, num_docs, chunk):
            if next_sample >= num_samples:
                break
            lengths = sizes[order[lo : lo + chunk]].astype(np.int64)
            ends = np.cumsum(lengths)
            ends += base
            end = int(ends[-1])
            stop = min(num_samples, -(-end // seq_len))  # samples starting before `end`
            for first in range(next_sample, stop, chunk):  # at most `chunk` samples at a time
                starts = np.arange(first, min(first + chunk, stop), dtype=np.int64) * seq_len
                pos = np.searchsorted(ends, starts, side="right")
                rows = np.empty((len(starts), 2), dtype=sample_out.dtype)
                rows[:, 0] = entry + lo + pos
                rows[:, 1] = starts - (ends[pos] - lengths[pos])
                sample_out.write(rows)
            next_sample = max(next_sample, stop)
            base = end
        entry += num_docs
    rng = np.random.RandomState((seed + 1) % 2**32)
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):  # each pass shuffled within itself
        order = _permutation(hi - lo, rng).astype(shuffle_out.dtype)
        order += lo
        shuffle_out.write(order)


class TokenSamples(Dataset):
    """Samples of seq_len + 1 tokens as training rows: `batch` gives next-token `input_ids` and `labels` (and
    with `document_eod` set, data.document_mask, `doc_ids` and `positions`); `parts()` the sample datasets
    behind it (one, or a blend's)."""

    document_eod: int | None = None  # the end-of-document token when attention stays within documents

    def rows(self, ids) -> np.ndarray:
        raise NotImplementedError

    def parts(self) -> list["SampleDataset"]:
        raise NotImplementedError

    def batch(self, start: int, count: int) -> dict:
        tokens = torch.from_numpy(self.rows(np.arange(start, start + count)).astype(np.int64, copy=False))
        x, y = tokens[:, :-1], tokens[:, 1:]
        if self.document_eod is None:
            return {"input_ids": x, "labels": y}
        return {"input_ids": x, "labels": y, **documents(x, self.document_eod)}

    def data_summary(self) -> tuple[int, int]:
        """(tokens in the datasets behind it, samples in one pass over them at this sequence length)."""
        tokens = samples = 0
        for part in self.parts():
            n = int(part.dataset.num_tokens)
            tokens += n
            samples += max(1, (n - 1) // part.seq_len)
        return tokens, samples

    def summary(self, steps: int, global_batch: int) -> str:
        tokens, samples_per_pass = self.data_summary()
        run_tokens = steps * global_batch * self.parts()[0].seq_len
        epochs = steps * global_batch / samples_per_pass
        return (f"{tokens:,} tokens; {steps} steps read {run_tokens:,} tokens = {epochs:.2f} "
                "epochs" + (", attention within documents" if self.document_eod is not None else ""))

    def epoch_steps(self, global_batch: int) -> dict[int, str]:
        """{step: message} for each step after which the run has read one more full pass over a dataset behind
        it: the last sample of its pass k (`pass_bounds`: samples are shuffled within each pass)."""
        parts = self.parts()
        out: dict[int, str] = {}
        for d, part in enumerate(parts):
            if len(parts) == 1:
                drawn = np.arange(1, len(self) + 1)
            else:  # samples drawn from part d after each global sample of the blend
                drawn = np.cumsum(np.asarray(self.dataset_index) == d)
            read = int(drawn[-1]) if len(drawn) else 0
            for k, end in enumerate(part.pass_ends[1:].tolist(), 1):
                if end > read:
                    break
                i = int(np.searchsorted(drawn, end))  # the sample that completes pass k
                step = i // global_batch + 1
                name = part.dataset.prefix if len(parts) > 1 else "the training data"
                out[step] = (out.get(step, "") + "; " if step in out else "") + \
                    f"{name}: pass {k} complete, documents repeat from here"
        return out

    def scored_bytes(self, tokenizer) -> bytes:
        """The bytes of every predicted token (each sample's tokens after its first)."""
        return b"".join(tokenizer.token_bytes(self[i][1:].tolist()) for i in range(len(self)))


def documents(inputs: torch.Tensor, eod: int) -> dict[str, torch.Tensor]:
    """Document masking of sample rows [b, s] whose documents end with token `eod`: `doc_ids` (documents
    numbered along each row; an `eod` belongs to the document it ends) and `positions` (each token's position
    in its document, restarting after every `eod`; a row's first document counts from the row's start)."""
    ends = inputs == eod
    doc_ids = torch.cumsum(ends, dim=1) - ends.long()
    index = torch.arange(inputs.shape[1]).expand_as(inputs)
    starts = torch.ones_like(ends)
    starts[:, 1:] = ends[:, :-1]
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values
    return {"doc_ids": doc_ids, "positions": index - first}


class SampleDataset(TokenSamples):
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
        self._fingerprint: dict | None = None
        total = dataset.num_tokens
        if total < seq_len + 1:
            raise UserError(
                f"dataset {dataset.prefix} has {total} tokens in {len(dataset)} documents; "
                f"one sample of seq_len {seq_len} needs {seq_len + 1} tokens"
            )
        self.pass_ends = pass_bounds(total, seq_len, num_samples)  # indexed: whole passes, >= num_samples
        self.indexed = int(self.pass_ends[-1])
        self.num_epochs = _num_epochs(total, seq_len, self.indexed)
        self.built = False  # whether this object built the index (False: it opened an existing one)
        if cache_dir is None:
            self.doc_index, self.sample_index, self.shuffle_index = self._build_in_memory()
            self.built = True
        else:
            self._load_or_build(pathlib.Path(cache_dir), name)

    # --- the index ----------------------------------------------------------------------------------

    def _shapes(self) -> list[tuple[np.dtype, tuple[int, ...]]]:
        entries = self.num_epochs * len(self.dataset)
        return [(_index_dtype(max(len(self.dataset) - 1, 0)), (entries,)),
                (_index_dtype(entries), (self.indexed, 2)),  # offsets fit: sizes are int32
                (_index_dtype(max(self.indexed - 1, 0)), (self.indexed,))]

    def _build_in_memory(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        outs = [ArrayWriter(dtype, shape) for dtype, shape in self._shapes()]
        build_indices(self.dataset.sizes, self.num_epochs, self.seq_len, self.pass_ends, self.seed, *outs)
        return tuple(o.array for o in outs)

    def cache_key(self) -> str:
        """Hash of the dataset's fingerprint (its .bin size and recorded .idx hash; see
        loom.data.indexed.fingerprint), the document subset and the sampling parameters (passes, not samples)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.dataset.prefix)
        fp = self._fingerprint
        subset = self.dataset.subset_key
        params = (f"{INDEX_VERSION}|{fp['bin_bytes']}|{fp['idx_sha256']}|{self.seq_len}|{len(self.pass_ends) - 1}|"
                  f"{self.seed}{'|' + subset if subset else ''}")
        return hashlib.sha256(params.encode()).hexdigest()[:20]

    def _load_or_build(self, cache_dir: pathlib.Path, name: str) -> None:
        stem = f"{name or pathlib.Path(self.dataset.prefix).name}-{self.cache_key()}"
        meta = {"dataset": str(self.dataset.prefix), "subset": self.dataset.subset_key,
                "fingerprint": self._fingerprint, "seq_len": self.seq_len,
                "passes": len(self.pass_ends) - 1, "samples": self.indexed, "seed": self.seed,
                "epochs": self.num_epochs,
                "documents": len(self.dataset)}
        arrays, self.built, self.cache_paths, self.meta_path = cached_arrays(
            cache_dir, stem, ("doc", "sample", "shuffle"), self._shapes(),
            lambda outs: build_indices(self.dataset.sizes, self.num_epochs, self.seq_len, self.pass_ends,
                                       self.seed, *outs), meta)
        self.doc_index, self.sample_index, self.shuffle_index = arrays

    # --- samples -------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    def rows(self, ids) -> np.ndarray:
        """Samples `ids` as an int64 array [len(ids), seq_len + 1].

        Each sample is cut into its document spans, all samples at once (one vectorised pass per document a
        sample crosses, not a Python step per sample), then the spans are read from the memory-mapped `.bin`
        by `read_spans`."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n, width = len(ids), self.seq_len + 1
        if n and (ids.min() < -self.num_samples or ids.max() >= self.num_samples):
            bad = int(ids[(ids < -self.num_samples) | (ids >= self.num_samples)][0])
            raise IndexError(f"sample {bad} out of range for {self.num_samples} samples")
        ids = ids % max(self.num_samples, 1)
        where = np.asarray(self.sample_index[np.asarray(self.shuffle_index[ids], dtype=np.int64)], dtype=np.int64)
        pos, offset = where[:, 0].copy(), where[:, 1].copy()
        need = np.full(n, width, dtype=np.int64)
        row = np.arange(n, dtype=np.int64)
        parts = []  # (row, column, document, offset, length) of each span
        while row.size:
            doc = np.asarray(self.doc_index[pos], dtype=np.int64)
            take = np.minimum(self.dataset.sizes[doc].astype(np.int64) - offset, need)
            parts.append((row, width - need, doc, offset, take))
            need = need - take
            more = need > 0
            row, pos, need = row[more], pos[more] + 1, need[more]
            offset = np.zeros(row.size, dtype=np.int64)
        r, col, doc, off, length = (np.concatenate(k) for k in zip(*parts)) if parts else [np.zeros(0, np.int64)] * 5
        order = np.argsort(r * width + col, kind="stable")  # spans in output order
        return self.dataset.read_spans(doc[order], off[order], length[order], np.int64).reshape(n, width)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        return self.rows([i])[0]

    def parts(self) -> list["SampleDataset"]:
        return [self]


def blend_indices(weights: np.ndarray, num_samples: int, which_out=None, within_out=None,
                  chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's greedy blend: each sample goes to the dataset furthest behind its target share.

    Returns (dataset of each sample, index of the sample within that dataset); with writers, streams them
    into the writers instead, `chunk` samples at a time."""
    w = [float(x) for x in weights]
    in_memory = which_out is None
    if in_memory:
        which_out = ArrayWriter(_blend_dtype(len(w)), (num_samples,))
        within_out = ArrayWriter(np.int64, (num_samples,))
    chunk = chunk or CHUNK
    counts = [0] * len(w)
    for lo in range(0, num_samples, chunk):
        n = min(chunk, num_samples - lo)
        which = np.empty(n, dtype=which_out.dtype)
        within = np.empty(n, dtype=np.int64)
        for k in range(n):
            t = max(lo + k, 1)
            best, best_err = 0, w[0] * t - counts[0]
            for d in range(1, len(w)):
                err = w[d] * t - counts[d]
                if err > best_err:
                    best, best_err = d, err
            which[k] = best
            within[k] = counts[best]
            counts[best] += 1
        which_out.write(which)
        within_out.write(within)
    return (which_out.array, within_out.array) if in_memory else (None, None)


def _blend_dtype(num_datasets: int) -> np.dtype:
    return np.dtype(np.int16 if num_datasets < 2**15 else np.int32)


class BlendedDataset(TokenSamples):
    """`num_samples` samples mixed from `datasets` in proportion to `weights`."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int,
                 cache_dir: pathlib.Path | None = None, name: str = "blend") -> None:
        if not datasets or len(datasets) != len(weights):
            raise UserError(f"a blend needs one weight per dataset; got {len(datasets)} datasets and {len(weights)} weights")
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or (w < 0).any() or w.sum() <= 0:
            raise UserError(f"blend weights must be >= 0 with a positive sum; got {list(weights)}")
        self.datasets = list(datasets)
        self.weights = w / w.sum()
        self.num_samples = num_samples
        self.built = True
        if cache_dir is None:
            self.dataset_index, self.sample_index = blend_indices(self.weights, num_samples)
        else:  # built once (it depends only on the weights and the count), then memory-mapped
            key = hashlib.sha256(f"{INDEX_VERSION}|{self.weights.tolist()!r}|{num_samples}".encode()).hexdigest()[:20]
            specs = [(_blend_dtype(len(w)), (num_samples,)), (np.int64, (num_samples,))]
            arrays, self.built, self.cache_paths, self.meta_path = cached_arrays(
                cache_dir, f"{name}-{key}", ("dataset", "within"), specs,
                lambda outs: blend_indices(self.weights, num_samples, *outs),
                {"weights": self.weights.tolist(), "num_samples": num_samples})
            self.dataset_index, self.sample_index = arrays
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

    def rows(self, ids) -> np.ndarray:
        """Samples `ids` stacked, each constituent read with one `rows` call."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < -self.num_samples or ids.max() >= self.num_samples):
            raise IndexError(f"samples {ids.min()}..{ids.max()} out of range for {self.num_samples} samples")
        ids = ids % max(self.num_samples, 1)
        which, within = self.dataset_index[ids], self.sample_index[ids]
        out = None
        for d in np.unique(which):
            mask = which == d
            got = self.datasets[int(d)].rows(within[mask])
            if out is None:
                out = np.empty((len(ids), *got.shape[1:]), dtype=got.dtype)
            out[mask] = got
        return out if out is not None else np.zeros((0, 0), dtype=np.int64)

    def parts(self) -> list[SampleDataset]:
        return self.datasets
