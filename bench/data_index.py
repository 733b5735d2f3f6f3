"""The sample index on a synthetic web-scale dataset: build time and peak memory, the cost of opening an
existing index, and random batch reads — loom's streamed, memory-mapped index against the original
in-memory construction (loom before this change, kept below as `reference_*`).

    .venv/bin/python bench/data_index.py [--tokens 1000000000] [--documents 1000000] [--seq-len 2048 128]
        [--dir /tmp] [--out bench/results/data_index.json]

The dataset (random uint16 tokens, document sizes uniform in 1..2*mean-1 adjusted to the exact total) is
written straight in Megatron's .bin/.idx format with the PREFIX.stats.json record `loom preprocess` writes,
into a temporary directory that is removed afterwards. Every measurement runs in a fresh interpreter so
that its peak resident memory (getrusage ru_maxrss) is its own; `rss_growth_mib` is the peak minus the
resident memory just before the step (after imports and opening the dataset). Batch reads are timed with
the .bin in the page cache (it was just written), not from a cold disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mib() -> float:
    """This process's peak resident memory (VmHWM; ru_maxrss would include the parent's peak before exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak() -> bool:
    """Restart the peak-RSS count at the current RSS (Linux: writing 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# --- the original construction (loom before the streamed index), for comparison ----------------------


def reference_build(sizes, seq_len, num_samples, seed):
    total = int(sizes.sum(dtype=np.int64))
    epochs = max(1, -(-(num_samples * seq_len + 1) // total))
    rng = np.random.RandomState(seed % 2**32)
    order = [rng.permutation(len(sizes)) for _ in range(epochs)]
    doc_index = np.concatenate(order)
    doc_index = doc_index.astype(np.int32) if int(doc_index.max()) < 2**31 else doc_index
    ends = np.cumsum(sizes[doc_index], dtype=np.int64)
    starts = np.arange(num_samples, dtype=np.int64) * seq_len
    pos = np.searchsorted(ends, starts, side="right")
    offset = starts - (ends[pos] - sizes[doc_index[pos]])
    stacked = np.stack([pos, offset], axis=1)
    sample_index = stacked.astype(np.int32) if int(stacked.max()) < 2**31 else stacked
    shuffle = np.random.RandomState((seed + 1) % 2**32).permutation(num_samples)
    shuffle = shuffle.astype(np.int32) if int(shuffle.max()) < 2**31 else shuffle
    return doc_index, sample_index, shuffle


def reference_sample(ds, indices, seq_len, i):
    doc_index, sample_index, shuffle = indices
    pos, offset = (int(v) for v in sample_index[int(shuffle[i])])
    out = np.empty(seq_len + 1, dtype=np.int64)
    filled = 0
    while filled < len(out):
        doc = int(doc_index[pos])
        take = min(len(out) - filled, int(ds.sizes[doc]) - offset)
        out[filled : filled + take] = ds.get(doc, offset, take)
        filled += take
        pos, offset = pos + 1, 0
    return out


# --- measurements, each in its own interpreter ------------------------------------------------------


def child(args) -> dict:
    from loom.data.indexed import IndexedDataset, _sha256
    from loom.data.samples import SampleDataset

    t0 = time.perf_counter()
    ds = IndexedDataset(args.prefix)
    open_dataset_s = time.perf_counter() - t0
    before = rss_mib()
    out_reset = reset_peak()
    num_samples = args.tokens // args.seq_len
    out: dict = {"open_dataset_s": round(open_dataset_s, 4), "peak_reset_before_step": out_reset}
    t0 = time.perf_counter()
    if args.child == "build":  # streamed build into the cache
        sd = SampleDataset(ds, args.seq_len, num_samples, args.seed, Path(args.cache), name="bench")
        assert sd.built
    elif args.child == "open":  # the index exists: what every other process pays
        sd = SampleDataset(ds, args.seq_len, num_samples, args.seed, Path(args.cache), name="bench")
        assert not sd.built
    elif args.child == "reference":  # the original: whole-.idx hash for the cache key, in memory, np.save
        _sha256(ds.idx_path)
        indices = reference_build(np.asarray(ds.sizes), args.seq_len, num_samples, args.seed)
        Path(args.cache).mkdir(parents=True, exist_ok=True)
        for kind, array in zip(("doc", "sample", "shuffle"), indices):  # and saved, as it was
            np.save(Path(args.cache) / f"reference-{kind}.npy", array)
    elif args.child == "reference_open":  # the original's open of a cached index: hash the .idx, np.load
        _sha256(ds.idx_path)
    out["seconds"] = round(time.perf_counter() - t0, 4)
    out["peak_rss_mib"] = round(peak_mib(), 1)
    out["rss_before_mib"] = round(before, 1)
    out["rss_growth_mib"] = round(peak_mib() - before, 1)
    if args.child == "open":  # random batch reads through the opened index
        rng = np.random.default_rng(0)
        reads = {}
        for batch in (8, 64):
            indices = (sd.doc_index, sd.sample_index, sd.shuffle_index)
            starts = rng.integers(0, num_samples - batch, size=20)
            t0 = time.perf_counter()
            for s in starts:
                sd.rows(np.arange(s, s + batch))
            vec = (time.perf_counter() - t0) / len(starts)
            starts = rng.integers(0, num_samples - batch, size=20)  # other samples: no pages mapped by the first
            t0 = time.perf_counter()
            for s in starts:
                np.stack([reference_sample(ds, indices, args.seq_len, i) for i in range(s, s + batch)])
            loop = (time.perf_counter() - t0) / len(starts)
            check = rng.integers(0, num_samples, size=16)
            assert np.array_equal(sd.rows(check), np.stack([reference_sample(ds, indices, args.seq_len, int(i)) for i in check]))
            reads[f"batch{batch}"] = {"vectorised_ms": round(vec * 1e3, 3), "per_sample_loop_ms": round(loop * 1e3, 3)}
        out["batch_read"] = reads
    if args.child == "build":
        files = [*sd.cache_paths, sd.meta_path]
        out["index_files_mib"] = round(sum(p.stat().st_size for p in files) / 2**20, 1)
        out["epochs"] = sd.num_epochs
        out["num_samples"] = num_samples
    return out


def write_dataset(prefix: Path, tokens: int, documents: int, seed: int) -> dict:
    from loom.data import indexed

    rng = np.random.default_rng(seed)
    mean = tokens // documents
    sizes = rng.integers(1, 2 * mean, size=documents).astype(np.int64)  # uniform, mean about `mean`
    diff = tokens - int(sizes.sum())
    step = np.sign(diff)
    while diff:  # spread the difference over the documents, keeping every size >= 1
        k = min(abs(diff), documents)
        idx = rng.choice(documents, size=k, replace=False)
        idx = idx[sizes[idx] + step >= 1]
        sizes[idx] += step
        diff -= step * len(idx)
    t0 = time.perf_counter()
    with open(str(prefix) + ".bin", "wb") as f:
        left, chunk = tokens, 1 << 26
        while left:
            n = min(left, chunk)
            f.write(rng.integers(0, 50000, size=n, dtype=np.uint16).tobytes())
            left -= n
    pointers = np.zeros(documents, dtype=np.int64)
    np.cumsum(sizes[:-1] * 2, out=pointers[1:])
    idx = str(prefix) + ".idx"
    with open(idx, "wb") as f:
        f.write(indexed.HEADER.pack(indexed.MAGIC, 1, indexed.dtype_code(np.uint16), documents, documents + 1))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(documents + 1, dtype=np.int64).tobytes())
    digest = hashlib.sha256(Path(idx).read_bytes()).hexdigest()
    indexed.stats_path(prefix).write_text(json.dumps({
        "documents": documents, "tokens": tokens, "max_token_id": 49999, "idx_bytes": os.path.getsize(idx),
        "bin_bytes": os.path.getsize(str(prefix) + ".bin"), "idx_sha256": digest}) + "\n")
    return {"write_s": round(time.perf_counter() - t0, 1), "bin_gib": round(tokens * 2 / 2**30, 2),
            "idx_mib": round(os.path.getsize(idx) / 2**20, 1)}


def run_child(kind: str, prefix: Path, cache: Path, tokens: int, seq_len: int, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--prefix", str(prefix), "--cache", str(cache),
           "--tokens", str(tokens), "--seq-len", str(seq_len), "--seed", str(seed)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1_000_000_000)
    ap.add_argument("--documents", type=int, default=1_000_000)
    ap.add_argument("--seq-len", type=int, nargs="+", default=[2048, 128])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "data_index.json"))
    ap.add_argument("--child")
    ap.add_argument("--prefix")
    ap.add_argument("--cache")
    args = ap.parse_args()
    if args.child:
        args.seq_len = args.seq_len[0]
        print(json.dumps(child(args)))
        return 0

    from loom.provenance import stamp

    work = Path(tempfile.mkdtemp(prefix="loom-data-index-", dir=args.dir))
    try:
        prefix = work / "synthetic"
        dataset = write_dataset(prefix, args.tokens, args.documents, args.seed)
        print(f"dataset: {dataset}", flush=True)
        results = {"dataset": {"tokens": args.tokens, "documents": args.documents, "token_dtype": "uint16", **dataset},
                   "runs": []}
        for seq_len in args.seq_len:
            cache = work / f"cache-{seq_len}"
            row = {"seq_len": seq_len}
            for kind in ("build", "open", "reference", "reference_open"):
                row[kind] = run_child(kind, prefix, cache, args.tokens, seq_len, args.seed)
                print(f"seq_len {seq_len} {kind}: {row[kind]}", flush=True)
            results["runs"].append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    argv = " ".join(sys.argv[1:])
    results.update(stamp(f".venv/bin/python bench/data_index.py {argv}".strip()))
    results["nproc"] = os.cpu_count()
    results["numpy"] = np.__version__
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
