"""The sample index at scale: built once into memory-mapped files (streamed, bounded memory, atomic),
opened by every other process, and giving exactly the samples of the original in-memory construction,
which is kept here as the independent reference."""

import json
import multiprocessing
import tracemalloc

import numpy as np
import pytest
import torch

import loom.data.indexed as indexed
import loom.data.samples as samples
from loom.data.indexed import DocumentRange, IndexedDataset, IndexedDatasetBuilder
from loom.data.samples import BlendedDataset, SampleDataset
from loom.errors import UserError


# --- the reference: loom's original construction (whole arrays in memory, one sample at a time) -------


def ref_indices(sizes, seq_len, num_samples, seed):
    """Whole passes: pass k is the samples whose first token lies in epoch k of the stream, shuffled among
    themselves; as many passes as hold `num_samples`."""
    total = int(np.sum(sizes, dtype=np.int64))
    starts = np.arange(0, num_samples * seq_len + 2 * total, seq_len, dtype=np.int64)
    passes = int(starts[num_samples - 1] // total) + 1 if num_samples else 0
    indexed = int(np.sum(starts < passes * total))
    epochs = max(1, -(-(indexed * seq_len + 1) // total))
    rng = np.random.RandomState(seed % 2**32)
    doc_index = np.concatenate([rng.permutation(len(sizes)) for _ in range(epochs)])
    ends = np.cumsum(np.asarray(sizes)[doc_index], dtype=np.int64)
    starts = starts[:indexed]
    pos = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[pos] - np.asarray(sizes)[doc_index[pos]])
    sample_index = np.stack([pos, offset], axis=1)
    rng = np.random.RandomState((seed + 1) % 2**32)
    epoch_of = starts // total
    shuffle = np.concatenate([np.flatnonzero(epoch_of == k)[rng.permutation(int(np.sum(epoch_of == k)))]
                              for k in range(passes)] + [np.zeros(0, np.int64)])
    return doc_index, sample_index, shuffle


def ref_sample(docs, indices, seq_len, i):
    doc_index, sample_index, shuffle = indices
    pos, offset = (int(v) for v in sample_index[shuffle[i]])
    out = np.empty(seq_len + 1, dtype=np.int64)
    filled = 0
    while filled < len(out):
        doc = int(doc_index[pos])
        take = min(len(out) - filled, len(docs[doc]) - offset)
        out[filled : filled + take] = docs[doc][offset : offset + take]
        filled += take
        pos, offset = pos + 1, 0
    return out


def ref_blend(weights, num_samples):
    w = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    counts, which, within = [0] * len(w), [], []
    for i in range(num_samples):
        err = [w[d] * max(i, 1) - counts[d] for d in range(len(w))]
        best = int(np.argmax(err))  # the first of equal errors, as Megatron's
        which.append(best)
        within.append(counts[best])
        counts[best] += 1
    return np.array(which), np.array(within)


def write(prefix, docs, dtype=np.uint16):
    with IndexedDatasetBuilder(prefix, dtype=dtype) as b:
        for d in docs:
            b.add_document(d)
    return IndexedDataset(prefix)


def synthetic(prefix, sizes, dtype=np.uint16):
    """A dataset of the given document sizes written straight in Megatron's format, all tokens 0 (a sparse
    .bin): the index build reads only the sizes."""
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(str(prefix) + ".idx", "wb") as f:
        f.write(indexed.HEADER.pack(indexed.MAGIC, 1, indexed.dtype_code(dtype), len(sizes), len(sizes) + 1))
        f.write(sizes.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(sizes) + 1, dtype=np.int64).tobytes())
    with open(str(prefix) + ".bin", "wb") as f:
        f.truncate(int(sizes.sum(dtype=np.int64)) * np.dtype(dtype).itemsize)
    return IndexedDataset(prefix)


def random_docs(n, longest, seed, vocab=60000):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, size=int(k)) for k in rng.integers(0, longest, size=n)]  # empty ones too
    docs[0] = rng.integers(0, vocab, size=3)
    return docs


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(samples, "CHUNK", 7)  # many chunks per epoch, samples crossing chunk boundaries


@pytest.mark.parametrize("seq_len,num_samples,longest", [(16, 500, 30), (5, 900, 12), (64, 40, 200), (3, 1, 4)])
@pytest.mark.parametrize("span_copy_min", [1, 10**9])  # read_spans: slice copies / one gather
def test_index_and_samples_equal_the_reference(tmp_path, monkeypatch, seq_len, num_samples, longest, span_copy_min):
    monkeypatch.setattr(indexed, "SPAN_COPY_MIN", span_copy_min)
    docs = random_docs(53, longest, seed=seq_len)
    ds = write(tmp_path / "ds", docs)
    ref = ref_indices(ds.sizes, seq_len, num_samples, seed=11)
    for cache in (None, tmp_path / "cache"):
        sd = SampleDataset(ds, seq_len, num_samples, seed=11, cache_dir=cache, name="t")
        for got, want in zip((sd.doc_index, sd.sample_index, sd.shuffle_index), ref):
            np.testing.assert_array_equal(got, want)
        if cache is not None:
            assert isinstance(sd.sample_index, np.memmap)  # opened from the files, not held in memory
        want = np.stack([ref_sample(docs, ref, seq_len, i) for i in range(num_samples)])
        np.testing.assert_array_equal(sd.rows(np.arange(num_samples)), want)
        for i in (0, num_samples - 1, -1):
            np.testing.assert_array_equal(sd[i], want[i])
        b = sd.batch(num_samples // 3, min(7, num_samples))
        x, y = b["input_ids"], b["labels"]
        assert x.dtype == torch.int64
        np.testing.assert_array_equal(x.numpy(), want[num_samples // 3 : num_samples // 3 + 7, :-1])
        np.testing.assert_array_equal(y.numpy(), want[num_samples // 3 : num_samples // 3 + 7, 1:])
    with pytest.raises(IndexError, match="out of range"):
        sd.rows([0, num_samples])


def test_document_ranges_and_blends_equal_the_reference(tmp_path):
    docs = random_docs(80, 25, seed=3)
    ds = write(tmp_path / "ds", docs, dtype=np.int32)
    part = DocumentRange(ds, 10, 70)
    ref = ref_indices(part.sizes, 8, 300, seed=5)
    sd = SampleDataset(part, 8, 300, seed=5, cache_dir=tmp_path / "cache", name="p")
    want = np.stack([ref_sample(docs[10:70], ref, 8, i) for i in range(300)])
    np.testing.assert_array_equal(sd.rows(np.arange(300)), want)
    other = SampleDataset(ds, 8, 200, seed=6, cache_dir=tmp_path / "cache", name="q")
    blend = BlendedDataset([sd, other], [0.6, 0.4], 400)
    np.testing.assert_array_equal(blend.batch(17, 50)["input_ids"].numpy(), np.stack([blend[i][:-1] for i in range(17, 67)]))


def test_built_once_then_opened_without_hashing(tmp_path, monkeypatch):
    ds = write(tmp_path / "ds", random_docs(40, 30, seed=1))
    cache = tmp_path / "cache"
    first = SampleDataset(ds, 8, 300, seed=1, cache_dir=cache, name="train")
    assert first.built
    files = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    assert sorted(files)[1].endswith("-meta.json") and len(files) == 4  # no lock or temporary left behind
    meta = json.loads(first.meta_path.read_text())
    passes = -(-300 * 8 // int(ds.sizes.sum()))  # whole passes: the ones sample 299 needs
    assert (meta["passes"], meta["samples"], meta["seq_len"], meta["documents"]) == (passes, first.indexed, 8, 40)
    assert first.indexed >= 300 and len(first) == 300

    def must_not_run(*args, **kwargs):
        raise AssertionError("rebuilt or hashed on open")

    monkeypatch.setattr(samples, "build_indices", must_not_run)
    monkeypatch.setattr(indexed, "_sha256", must_not_run)  # identity from the recorded hash, not the .idx
    again = SampleDataset(ds, 8, 300, seed=1, cache_dir=cache, name="train")
    assert not again.built and {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == files
    np.testing.assert_array_equal(again.rows(np.arange(300)), first.rows(np.arange(300)))
    longer = SampleDataset(ds, 8, first.indexed, seed=1, cache_dir=cache, name="train")  # the same passes
    assert not longer.built and len(longer) == first.indexed
    with pytest.raises(AssertionError, match="rebuilt"):  # other parameters need their own index
        SampleDataset(ds, 8, first.indexed + 1, seed=1, cache_dir=cache, name="train")


def test_changed_data_gets_a_new_index(tmp_path):
    cache = tmp_path / "cache"
    old = SampleDataset(write(tmp_path / "ds", random_docs(40, 30, seed=1)), 8, 200, seed=2, cache_dir=cache)
    docs = random_docs(45, 30, seed=2)
    for ext in (".bin", ".idx", ".stats.json"):
        (tmp_path / f"ds{ext}").unlink()
    new = SampleDataset(write(tmp_path / "ds", docs), 8, 200, seed=2, cache_dir=cache)
    assert new.built and new.cache_paths != old.cache_paths
    ref = ref_indices(new.dataset.sizes, 8, 200, seed=2)
    np.testing.assert_array_equal(new.rows(np.arange(200)), np.stack([ref_sample(docs, ref, 8, i) for i in range(200)]))


def test_a_failed_or_partial_build_is_never_read(tmp_path, monkeypatch):
    ds = write(tmp_path / "ds", random_docs(40, 30, seed=1))
    cache = tmp_path / "cache"
    real = samples._permutation
    calls = []

    def dies_at_the_shuffle(n, rng):  # the doc and sample files are written by then
        calls.append(n)
        if n != 40:  # not a permutation of the 40 documents: the first pass's shuffle
            raise KeyboardInterrupt
        return real(n, rng)

    monkeypatch.setattr(samples, "_permutation", dies_at_the_shuffle)
    with pytest.raises(KeyboardInterrupt):
        SampleDataset(ds, 8, 300, seed=1, cache_dir=cache)
    assert calls[-1] != 40 and len(calls) > 1 and [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    good = SampleDataset(ds, 8, 300, seed=1, cache_dir=cache)
    want = good.rows(np.arange(300))
    # Index files without the meta record (a builder died between renames) or damaged ones are rebuilt.
    good.meta_path.unlink()
    assert SampleDataset(ds, 8, 300, seed=1, cache_dir=cache).built
    good.cache_paths[1].write_bytes(good.cache_paths[1].read_bytes()[:100])
    again = SampleDataset(ds, 8, 300, seed=1, cache_dir=cache)
    assert again.built
    np.testing.assert_array_equal(again.rows(np.arange(300)), want)


def _open_in_child(args):
    prefix, cache, barrier = args
    barrier.wait()
    sd = SampleDataset(IndexedDataset(prefix), 8, 20000, seed=3, cache_dir=cache)
    return sd.built, sd.rows(np.arange(0, 20000, 997)).tolist()


def test_concurrent_processes_build_once(tmp_path):
    ds = write(tmp_path / "ds", random_docs(3000, 100, seed=4))
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Manager().Barrier(3)
    with ctx.Pool(3) as pool:
        results = pool.map(_open_in_child, [(str(ds.prefix), str(tmp_path / "cache"), barrier)] * 3)
    assert sorted(built for built, _ in results) == [False, False, True]  # one built, two waited and opened
    assert results[0][1] == results[1][1] == results[2][1]
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".json", ".npy", ".npy", ".npy"]


def test_build_memory_is_bounded(tmp_path, monkeypatch):
    """Heap peak (numpy reports its allocations to tracemalloc) of the streamed build against the reference
    construction, on 1M documents with 2 epochs of 8-token samples."""
    monkeypatch.setattr(samples, "CHUNK", 1 << 16)
    n_docs, seq_len = 1_000_000, 8
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 16, size=n_docs).astype(np.int32)
    num_samples = int(sizes.sum()) * 2 // seq_len - 1  # two epochs
    ds = synthetic(tmp_path / "big", sizes)
    peaks = {}
    for name in ("reference", "streamed"):
        tracemalloc.start()
        if name == "reference":
            ref = ref_indices(ds.sizes, seq_len, num_samples, seed=1)
        else:
            sd = SampleDataset(ds, seq_len, num_samples, seed=1, cache_dir=tmp_path / "cache")
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # Two passes; the last samples of the second reach into a third epoch of documents.
    assert sd.built and len(sd.pass_ends) == 3 and sd.num_epochs == 3
    for got, want in zip((sd.doc_index, sd.sample_index, sd.shuffle_index), ref):
        np.testing.assert_array_equal(got, want)
    # One epoch's permutation (4 bytes/document) and one pass's sample permutation (4 bytes/sample) plus chunks.
    bound = 4 * n_docs + 4 * num_samples // 2 + 64 * (1 << 16) + (4 << 20)
    assert peaks["streamed"] < bound, peaks
    assert peaks["streamed"] * 4 < peaks["reference"], peaks


def test_unwritable_cache_is_bad_input(tmp_path):
    ds = write(tmp_path / "ds", random_docs(40, 30, seed=1))
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(UserError, match="cannot create the sample-index cache .*file/idx.*LOOM_CACHE"):
        SampleDataset(ds, 8, 30, seed=0, cache_dir=tmp_path / "file" / "idx")


def test_blend_index_built_once_and_equal_to_the_reference(tmp_path, monkeypatch):
    ds = write(tmp_path / "ds", random_docs(60, 30, seed=8))
    parts = [SampleDataset(ds, 8, n, seed=s, cache_dir=tmp_path / "cache") for s, n in ((1, 400), (2, 300), (3, 200))]
    weights = [0.5, 0.3, 0.2]
    blend = BlendedDataset(parts, weights, 700, cache_dir=tmp_path / "cache", name="train-blend")
    assert blend.built and isinstance(blend.dataset_index, np.memmap)
    which, within = ref_blend(weights, 700)
    np.testing.assert_array_equal(blend.dataset_index, which)
    np.testing.assert_array_equal(blend.sample_index, within)
    uncached = BlendedDataset(parts, weights, 700)
    np.testing.assert_array_equal(uncached.dataset_index, which)
    monkeypatch.setattr(samples, "blend_indices", lambda *a, **k: pytest.fail("blend rebuilt"))
    again = BlendedDataset(parts, [5, 3, 2], 700, cache_dir=tmp_path / "cache", name="train-blend")
    assert not again.built
    want = np.stack([parts[d][j] for d, j in zip(which[100:140], within[100:140])])
    np.testing.assert_array_equal(again.rows(np.arange(100, 140)), want)


def test_a_run_builds_its_indices_once(tmp_path, monkeypatch):
    """What the launcher builds before the workers start, each worker opens: the blend, its parts and the
    held-out split all come from the cache the second time."""
    from conftest import small_config
    from loom.data.token_datasets import build_datasets

    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    paths = [str(write(tmp_path / f"ds{k}", random_docs(300, 40, seed=k, vocab=500)).prefix) for k in (1, 2)]
    cfg = small_config(f"data.paths={','.join(paths)}", "data.weights=0.7,0.3", "data.split=90,10,0")

    def built(datasets):
        train, val = datasets
        return [train.built, *(p.built for p in train.datasets), *(p.built for p in val.datasets)]

    first = build_datasets(cfg, None)
    assert built(first) == [True] * 5
    second = build_datasets(cfg, None)
    assert built(second) == [False] * 5
    np.testing.assert_array_equal(first[0].rows(np.arange(len(first[0]))), second[0].rows(np.arange(len(second[0]))))


def test_more_samples_extend_the_order_of_fewer(tmp_path, monkeypatch):
    """The sample order of a run is a prefix of a longer run's (issue 53): a run resumed with a larger
    train.steps reads what a run planned for it reads. Single datasets across passes, and a blend of two
    through build_datasets, as `loom train` builds them for 4 and for 9 steps."""
    from conftest import small_config
    from loom.data.token_datasets import build_datasets

    ds = write(tmp_path / "ds", random_docs(53, 30, seed=9))
    short = SampleDataset(ds, 8, 100, seed=3)
    for n in (101, 250, 1000):  # the same pass, the next ones
        longer = SampleDataset(ds, 8, n, seed=3, cache_dir=tmp_path / "cache")
        np.testing.assert_array_equal(longer.rows(np.arange(100)), short.rows(np.arange(100)))
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))
    paths = ",".join(str(write(tmp_path / f"b{k}", random_docs(300, 40, seed=k, vocab=500)).prefix) for k in (1, 2))
    rows = {}
    for steps in (4, 9):
        cfg = small_config(f"data.paths={paths}", "data.weights=0.7,0.3", f"train.steps={steps}")
        train, _ = build_datasets(cfg, None)
        assert len(train) == steps * 8
        rows[steps] = train.rows(np.arange(len(train)))
    np.testing.assert_array_equal(rows[9][: 4 * 8], rows[4])
