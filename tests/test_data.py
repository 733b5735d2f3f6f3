"""Tests for loom.data: corpus, tokenizer, indexed datasets, preprocess, samplers."""

from __future__ import annotations

import json
import os
import pathlib
import struct

import numpy as np
import pytest

from loom.data import corpus as corpus_mod
from loom.data.corpus import corpus_files, iter_documents
from loom.data.corpus_dataset import corpus_prefix
from loom.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from loom.data.preprocess import add_arguments, preprocess
from loom.data.samples import BlendedDataset, SampleDataset
from loom.data.tokenizer import Tokenizer, get_tokenizer, train_bpe
from loom.errors import UserError

MAX_BYTES = 300_000
VOCAB = 512
UNICODE_TEXT = "def f(x):\n    return 'héllo wörld' + \"日本語\"  # 😀 Ωμέγα\r\n\tç\x00 end  "


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Tokenizer:
    return train_bpe(VOCAB, MAX_BYTES)


# --- indexed datasets -------------------------------------------------------------------------------


def parse_idx(path: pathlib.Path) -> dict:
    """An independent reader of Megatron's .idx layout."""
    data = path.read_bytes()
    assert data[:9] == b"MMIDIDX\x00\x00"
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", data, 9)
    off = 9 + 8 + 1 + 8 + 8
    sizes = struct.unpack_from(f"<{n_seq}i", data, off)
    off += 4 * n_seq
    pointers = struct.unpack_from(f"<{n_seq}q", data, off)
    off += 8 * n_seq
    doc_index = struct.unpack_from(f"<{n_doc}q", data, off)
    off += 8 * n_doc
    assert off == len(data)
    return dict(version=version, code=code, n_seq=n_seq, n_doc=n_doc, sizes=sizes, pointers=pointers, doc_index=doc_index)


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.uint8, 1), (np.int64, 5)])
def test_indexed_round_trip(tmp_path, dtype, code):
    rng = np.random.default_rng()
    hi = min(np.iinfo(dtype).max, 100_000)
    docs = [rng.integers(0, hi, size=int(n)).astype(dtype) for n in rng.integers(0, 50, size=30)]
    prefix = tmp_path / "sub" / "ds"
    with IndexedDatasetBuilder(prefix, dtype=dtype) as b:
        for d in docs:
            b.add_document(d.tolist())
    ds = IndexedDataset(prefix)
    assert len(ds) == len(docs) and ds.dtype == np.dtype(dtype)
    assert ds.num_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        if len(d) > 3:
            np.testing.assert_array_equal(ds.get(i, 1, 2), d[1:3])
    with pytest.raises(IndexError):
        ds[len(docs)]

    idx = parse_idx(pathlib.Path(str(prefix) + ".idx"))
    item = np.dtype(dtype).itemsize
    assert idx["version"] == 1 and idx["code"] == code
    assert idx["n_seq"] == len(docs) and idx["n_doc"] == len(docs) + 1
    assert list(idx["sizes"]) == [len(d) for d in docs]
    assert list(idx["pointers"]) == list(np.cumsum([0] + [len(d) * item for d in docs[:-1]]))
    assert list(idx["doc_index"]) == list(range(len(docs) + 1))
    assert pathlib.Path(str(prefix) + ".bin").read_bytes() == b"".join(d.tobytes() for d in docs)
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["ds.bin", "ds.idx", "ds.stats.json"]  # no temporaries


def test_indexed_errors(tmp_path):
    prefix = tmp_path / "ds"
    with pytest.raises(UserError, match="does not exist"):
        IndexedDataset(prefix)
    with IndexedDatasetBuilder(prefix) as b:
        b.add_document([1, 2, 3])
        b.add_document([4, 5])
    idx, bin_ = pathlib.Path(f"{prefix}.idx"), pathlib.Path(f"{prefix}.bin")
    good = idx.read_bytes()

    idx.write_bytes(b"XXIDIDX\x00\x00" + good[9:])
    with pytest.raises(UserError, match=r"ds\.idx.*magic"):
        IndexedDataset(prefix)
    idx.write_bytes(good[:9] + struct.pack("<Q", 2) + good[17:])
    with pytest.raises(UserError, match="version is 2"):
        IndexedDataset(prefix)
    idx.write_bytes(good[:17] + bytes([9]) + good[18:])
    with pytest.raises(UserError, match="dtype code 9"):
        IndexedDataset(prefix)
    idx.write_bytes(good[:-4])
    with pytest.raises(UserError, match="bytes"):
        IndexedDataset(prefix)
    idx.write_bytes(good)
    bin_.write_bytes(bin_.read_bytes()[:-2])
    with pytest.raises(UserError, match=r"ds\.bin is truncated"):
        IndexedDataset(prefix)

    with pytest.raises(UserError, match="does not fit dtype uint16"):
        IndexedDatasetBuilder(tmp_path / "big").add_document([70_000])


def test_builder_leaves_nothing_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetBuilder(tmp_path / "ds") as b:
            b.add_document([1, 2])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    assert best_dtype(50_000) == np.uint16 and best_dtype(128_256) == np.int32


# --- corpus and tokenizer ---------------------------------------------------------------------------


def test_corpus_split_is_fixed_and_disjoint():
    train, val = corpus_files("train"), corpus_files("val")
    assert train and val and not set(train) & set(val)
    assert len(val) < 0.05 * len(train)
    root = corpus_mod.stdlib_root()
    rels = [p.relative_to(root).as_posix() for p in train]
    assert rels == sorted(rels) and not any("site-packages" in r for r in rels)
    corpus_mod._split_files.cache_clear()
    assert corpus_files("train") == train and corpus_files("val") == val
    docs = list(iter_documents("val", max_bytes=1000))
    assert len(docs) >= 1 and sum(len(d.encode()) for d in docs[:-1]) < 1000
    assert docs[0] == next(p for p in val if p.stat().st_size).read_text("utf-8", errors="replace")
    with pytest.raises(UserError, match="valid: train, val"):
        corpus_files("valid")


def test_tokenizer_round_trip(bpe):
    assert bpe.vocab_size == VOCAB and bpe.eod_id == 0
    for text in [UNICODE_TEXT, "".join(chr(c) for c in np.random.randint(32, 0x3000, size=200))]:
        ids = bpe.encode(text)
        assert all(0 < i < VOCAB for i in ids)
        assert bpe.decode(ids) == text
        assert bpe.token_bytes(ids) == text.encode("utf-8")
    assert len(bpe.encode("import os\nimport sys\n")) < len("import os\nimport sys\n")  # merges learned
    assert bpe.encode_batch(["a b", UNICODE_TEXT]) == [bpe.encode("a b"), bpe.encode(UNICODE_TEXT)]
    assert bpe.token_bytes([bpe.eod_id]) == b"\x00"
    with pytest.raises(UserError, match=">= 258"):
        train_bpe(257)


def test_get_tokenizer_cache(tmp_path):
    first = get_tokenizer("bpe", 300, MAX_BYTES)
    assert first.path is not None and first.path.is_file() and first.path.parent == tmp_path / "cache" / "tokenizers"
    mtime = first.path.stat().st_mtime_ns
    second = get_tokenizer("bpe", 300, MAX_BYTES)
    assert second.path == first.path and first.path.stat().st_mtime_ns == mtime
    assert second.sha256() == first.sha256()
    assert second.encode(UNICODE_TEXT) == first.encode(UNICODE_TEXT)
    assert not [p for p in first.path.parent.iterdir() if p.suffix == ".tmp"]
    assert get_tokenizer(str(first.path.parent / first.path.name), 0).sha256() == first.sha256()


def test_foreign_tokenizer_file(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["</s>"])
    (tmp_path / "tok").mkdir()
    hf.save(str(tmp_path / "tok" / "tokenizer.json"))
    tok = get_tokenizer(str(tmp_path / "tok"), 4)  # a directory holding tokenizer.json
    assert tok.eod_id == 1 and tok.vocab_size == 4
    assert tok.encode("hello world") == [2, 3]
    assert tok.token_bytes([2, 3]) == tok.decode([2, 3]).encode()

    hf_no_eos = HFTokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    hf_no_eos.save(str(tmp_path / "noeos.json"))
    no_eos = Tokenizer.from_file(tmp_path / "noeos.json")  # loads: an EOD token is required only where used
    assert no_eos.eod_id is None
    with pytest.raises(UserError, match="end-of-document"):
        no_eos.require_eod("--append-eod", "name one with --eod-token TOKEN")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="bad.json"):
        Tokenizer.from_file(tmp_path / "bad.json")
    with pytest.raises(UserError, match="missing.json"):
        get_tokenizer(str(tmp_path / "missing.json"), 10)


def test_corpus_prefix_cached(bpe, tmp_path):
    prefix = corpus_prefix(bpe, "val", max_bytes=20_000)
    ds = IndexedDataset(prefix)
    docs = list(iter_documents("val", 20_000))
    assert len(ds) == len(docs)
    for i, text in enumerate(docs):
        assert ds[i].tolist() == bpe.encode(text) + [bpe.eod_id]
    mtime = os.stat(prefix + ".bin").st_mtime_ns
    assert corpus_prefix(bpe, "val", max_bytes=20_000) == prefix
    assert os.stat(prefix + ".bin").st_mtime_ns == mtime


# --- preprocess -------------------------------------------------------------------------------------


def _write_inputs(root: pathlib.Path) -> list[str]:
    texts = [f"record {i}: " + "x = [1, 2, 3]\n" * (i % 7) + UNICODE_TEXT * (i % 3) for i in range(300)]
    (root / "b").mkdir(parents=True)
    with open(root / "a.jsonl", "w") as f:
        for t in texts[:200]:
            f.write(json.dumps({"id": 1, "text": t}) + "\n")
        f.write("\n")  # a blank line is skipped
    with open(root / "b" / "c.json", "w") as f:
        for t in texts[200:]:
            f.write(json.dumps({"text": t}) + "\n")
    whole = "whole file\nis one document é\n" * 5000  # the largest file, read last (sorted by path)
    (root / "z.txt").write_text(whole)
    (root / "ignored.csv").write_text("not,read\n")
    return texts + [whole]


def test_preprocess_directory_and_workers(bpe, tmp_path):
    texts = _write_inputs(tmp_path / "in")
    out1, out2 = tmp_path / "out" / "w1", tmp_path / "out" / "w2"
    stats = preprocess(str(tmp_path / "in"), str(out1), bpe, workers=1, append_eod=True, progress=False)
    preprocess(str(tmp_path / "in"), str(out2), bpe, workers=2, append_eod=True, progress=False)
    expected = [bpe.encode(t) + [bpe.eod_id] for t in texts]
    assert stats == {"documents": len(texts), "tokens": sum(map(len, expected)), "files": 3}
    ds = IndexedDataset(out1)
    assert ds.dtype == np.uint16 and [ds[i].tolist() for i in range(len(ds))] == expected
    for ext in (".bin", ".idx"):
        assert pathlib.Path(f"{out1}{ext}").read_bytes() == pathlib.Path(f"{out2}{ext}").read_bytes()


def test_preprocess_single_files(bpe, tmp_path):
    (tmp_path / "one.txt").write_text(UNICODE_TEXT)
    stats = preprocess(str(tmp_path / "one.txt"), str(tmp_path / "t"), bpe, progress=False)
    assert stats["documents"] == 1 and IndexedDataset(tmp_path / "t")[0].tolist() == bpe.encode(UNICODE_TEXT)
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "hello"}) + "\n" + json.dumps({"body": "world"}) + "\n")
    preprocess(str(tmp_path / "c.jsonl"), str(tmp_path / "c"), bpe, json_key="body", progress=False)
    ds = IndexedDataset(tmp_path / "c")
    assert [ds[0].tolist(), ds[1].tolist()] == [bpe.encode("hello"), bpe.encode("world")]  # no eod


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", r"bad\.jsonl, line 152: not valid JSON"),
        ("[1, 2]", r"bad\.jsonl, line 152: expected a JSON object"),
        ('{"txt": "a", "id": 3}', r"bad\.jsonl, line 152: no key 'text' \(keys here: 'txt', 'id'\)"),
        ('{"text": 5}', r"bad\.jsonl, line 152: 'text' must be a string"),
    ],
)
@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_bad_lines(bpe, tmp_path, line, message, workers):
    good = json.dumps({"text": "fine"})
    (tmp_path / "bad.jsonl").write_text(f"{good}\n" * 150 + f"\n{line}\n{good}\n")  # past the first chunks
    with pytest.raises(UserError, match=message):
        preprocess(str(tmp_path / "bad.jsonl"), str(tmp_path / "out" / "x"), bpe, workers=workers, progress=False)
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written


def test_preprocess_bad_inputs(bpe, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        preprocess(str(tmp_path / "nope.jsonl"), str(tmp_path / "o"), bpe, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"no \*\.jsonl"):
        preprocess(str(tmp_path / "empty"), str(tmp_path / "o"), bpe, progress=False)
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--input", "a", "--output-prefix", "b", "--tokenizer", "tiny", "--workers", "3", "--append-eod"])
    assert (args.json_key, args.workers, args.append_eod, args.tokenizer) == ("text", 3, True, "tiny")


# --- samplers ---------------------------------------------------------------------------------------


def _random_dataset(path: pathlib.Path, num_docs: int = 40) -> tuple[IndexedDataset, list[np.ndarray]]:
    rng = np.random.default_rng()
    docs = [rng.integers(0, 1000, size=int(n)) for n in rng.integers(0, 30, size=num_docs)]
    docs[0] = rng.integers(0, 1000, size=5)  # at least a few tokens
    with IndexedDatasetBuilder(path) as b:
        for d in docs:
            b.add_document(d)
    return IndexedDataset(path), docs


def test_sample_dataset_matches_stream(tmp_path):
    ds, docs = _random_dataset(tmp_path / "ds")
    seq_len, n = 16, 200
    total = sum(len(d) for d in docs)
    sd = SampleDataset(ds, seq_len, n, seed=7)
    # Whole passes are indexed: pass k holds the windows that start in epoch k of the stream.
    passes = (n - 1) * seq_len // total + 1
    indexed = -(-passes * total // seq_len)
    epochs = -(-(indexed * seq_len + 1) // total)
    # Independently rebuild the stream: each epoch is a permutation of all documents.
    order = np.asarray(sd.doc_index)
    assert len(order) == epochs * len(docs)
    for e in range(epochs):
        assert sorted(order[e * len(docs) : (e + 1) * len(docs)]) == list(range(len(docs)))
    stream = np.concatenate([docs[j] for j in order])
    shuffle = np.asarray(sd.shuffle_index)
    assert len(sd) == n and len(shuffle) == indexed
    starts = shuffle.astype(np.int64) * seq_len
    for i in range(n):
        s = sd[i]
        assert s.dtype == np.int64 and len(s) == seq_len + 1
        np.testing.assert_array_equal(s, stream[starts[i] : starts[i] + seq_len + 1])
    assert sorted(starts) == list(range(0, indexed * seq_len, seq_len))  # every window exactly once
    assert list(starts // total) == sorted(starts // total)  # pass after pass, epoch by epoch
    assert list(starts[:n]) != sorted(starts[:n])  # shuffled
    # The first pass covers the first epoch's stream.
    first_epoch = -(-total // seq_len)
    covered = np.concatenate([stream[k * seq_len : k * seq_len + seq_len] for k in sorted(shuffle[:first_epoch])])
    np.testing.assert_array_equal(covered[:total], stream[:total])


def test_sample_dataset_determinism_and_cache(tmp_path):
    ds, _ = _random_dataset(tmp_path / "ds")
    cache = tmp_path / "idxcache"
    a = SampleDataset(ds, 8, 300, seed=1, cache_dir=cache, name="train")
    files = sorted(p.name for p in cache.iterdir())
    assert len(files) == 4 and all(f.startswith("train-") for f in files)  # doc, sample, shuffle .npy; meta.json
    assert sum(f.endswith(".npy") for f in files) == 3 and files[1].endswith("-meta.json")
    mtimes = [p.stat().st_mtime_ns for p in sorted(cache.iterdir())]
    b = SampleDataset(ds, 8, 300, seed=1, cache_dir=cache, name="train")  # from cache
    c = SampleDataset(ds, 8, 300, seed=1)  # no cache
    assert mtimes == [p.stat().st_mtime_ns for p in sorted(cache.iterdir())]
    for i in range(300):
        np.testing.assert_array_equal(a[i], b[i])
        np.testing.assert_array_equal(a[i], c[i])
    d = SampleDataset(ds, 8, 300, seed=2, cache_dir=cache, name="train")
    assert len(list(cache.iterdir())) == 8
    n = len(ds)
    assert not np.array_equal(a.doc_index[:n], d.doc_index[:n])  # document order depends on the seed
    assert not np.array_equal(a.doc_index[:n], np.arange(n)) and not np.array_equal(a.doc_index[:n], a.doc_index[n : 2 * n])
    assert any(not np.array_equal(a[i], d[i]) for i in range(300))


def test_sample_dataset_too_small(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "small") as b:
        b.add_document([1, 2, 3])
        b.add_document([4])
    with pytest.raises(UserError, match="has 4 tokens.*needs 9 tokens"):
        SampleDataset(IndexedDataset(tmp_path / "small"), 8, 10, seed=0)
    IndexedDatasetBuilder(tmp_path / "empty").finalize()
    with pytest.raises(UserError, match="has 0 tokens"):
        SampleDataset(IndexedDataset(tmp_path / "empty"), 8, 10, seed=0)
    sd = SampleDataset(IndexedDataset(tmp_path / "small"), 3, 1, seed=0)
    assert sd[0].tolist() in ([1, 2, 3, 4], [4, 1, 2, 3])


class _Tagged:
    """A stand-in dataset whose sample j of dataset d is (d, j)."""

    def __init__(self, tag: int, n: int) -> None:
        self.tag, self.n = tag, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> tuple[int, int]:
        assert 0 <= j < self.n
        return self.tag, j


def test_blended_proportions():
    weights, n = [0.5, 0.3, 0.2], 10_000
    sets = [_Tagged(d, int(np.ceil(w * n * 1.005)) + 1) for d, w in enumerate(weights)]
    blend = BlendedDataset(sets, [5, 3, 2], n)  # normalised
    items = [blend[i] for i in range(n)]
    counts = np.bincount([d for d, _ in items], minlength=3)
    np.testing.assert_allclose(counts / n, weights, atol=0.01)
    for d in range(3):  # each constituent is read in order, without repeats
        assert [j for t, j in items if t == d] == list(range(counts[d]))
    for k in (100, 1000):  # the prefix is balanced too
        assert np.abs(np.bincount(blend.dataset_index[:k], minlength=3) / k - weights).max() < 0.02
    again = BlendedDataset(sets, [0.5, 0.3, 0.2], n)
    assert np.array_equal(again.dataset_index, blend.dataset_index)
    assert np.array_equal(again.sample_index, blend.sample_index)


def test_blended_errors():
    sets = [_Tagged(0, 10), _Tagged(1, 10)]
    with pytest.raises(UserError, match="positive sum"):
        BlendedDataset(sets, [1.0, -1.0], 5)
    with pytest.raises(UserError, match="positive sum"):
        BlendedDataset(sets, [0.0, 0.0], 5)
    with pytest.raises(UserError, match="one weight per dataset"):
        BlendedDataset(sets, [1.0], 5)
    with pytest.raises(UserError, match="has 10 samples"):
        BlendedDataset(sets, [0.9, 0.1], 20)


def test_one_cache_directory_variable_and_the_old_name_still_works(tmp_path, monkeypatch, capsys):
    """LOOM_CACHE names the one cache directory (tokenizers, datasets, indices, the CPU kernels' build);
    LOOM_CACHE_DIR, the kernels' earlier name, still works when LOOM_CACHE is unset, with a note to rename it."""
    from loom.data.tokenizer import cache_dir as data_cache
    from loom.files import cache_dir
    from loom.infer.cpu.kernels import cache_dir as kernels_cache

    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "old"))
    assert data_cache() == kernels_cache() == cache_dir() == tmp_path / "cache"  # LOOM_CACHE wins
    monkeypatch.delenv("LOOM_CACHE")
    assert data_cache() == kernels_cache() == tmp_path / "old"
    assert "LOOM_CACHE_DIR is deprecated; loom's one cache variable is LOOM_CACHE" in capsys.readouterr().err
    monkeypatch.delenv("LOOM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_cache() == kernels_cache() == tmp_path / "xdg" / "loom"
