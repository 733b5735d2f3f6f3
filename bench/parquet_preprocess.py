"""`loom preprocess` on a Parquet file larger than the memory it may use: peak resident memory and time.

    .venv/bin/python bench/parquet_preprocess.py [--gib 2.0] [--dir /tmp] [--workers 1] [--tokenizer tiny]
        [--keep] [--out bench/results/parquet_preprocess.json]

Builds a Parquet text file of about `--gib` GiB (one `text` column of generated pseudo-words, documents of
varied length, uncompressed so that the file size is the text size, written row group by row group so the
build itself holds one row group), then runs `loom preprocess` on it in a subprocess and polls
/proc every 50 ms for the resident memory of that process and all its descendants (tokenizer workers
included) added together; `peak_rss_mib` is the largest sum seen, `ru_maxrss_children_mib` the kernel's
peak of the largest single child (getrusage). The bar (issue 36): peak under 1 GiB for a 2 GiB file.
The file and the output are removed afterwards unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
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

ROW_GROUP_DOCS = 16384  # ~16 MiB of text per row group at the mean document length


def words(rng: np.random.Generator, n: int) -> np.ndarray:
    """n pseudo-words of 2..9 lowercase letters (a Zipf-like reuse of a fixed list, as text has)."""
    lengths = rng.integers(2, 10, size=n)
    letters = rng.integers(97, 123, size=int(lengths.sum()), dtype=np.uint8).tobytes().decode()
    cuts = np.concatenate([[0], np.cumsum(lengths)])
    return np.array([letters[a:b] for a, b in zip(cuts[:-1], cuts[1:])], dtype=object)


def build(path: Path, gib: float, seed: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    vocab = words(rng, 20000)
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()
    target = int(gib * 2**30)
    rows = groups = 0
    schema = pa.schema([("id", pa.int64()), ("text", pa.string())])
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        while path.stat().st_size < target:
            sizes = rng.integers(20, 400, size=ROW_GROUP_DOCS)  # words per document
            picks = vocab[rng.choice(len(vocab), size=int(sizes.sum()), p=weights)]
            cuts = np.concatenate([[0], np.cumsum(sizes)])
            texts = [" ".join(picks[a:b]) + "." for a, b in zip(cuts[:-1], cuts[1:])]
            ids = np.arange(rows, rows + len(texts), dtype=np.int64)
            writer.write_table(pa.table({"id": ids, "text": texts}, schema=schema), row_group_size=ROW_GROUP_DOCS)
            rows += len(texts)
            groups += 1
    return {"bytes": path.stat().st_size, "rows": rows, "row_groups": groups, "compression": "none"}


def tree_rss_kib(pid: int) -> int:
    """Resident memory of `pid` and all its descendants, KiB (0 once it has exited)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def run(command: list[str]) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss_kib(proc.pid))
        time.sleep(0.05)
    seconds = time.perf_counter() - t0
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{output}")
    return {"seconds": round(seconds, 1), "peak_rss_mib": round(peak / 1024, 1),
            "ru_maxrss_children_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
            "output": output.strip().splitlines()[-1]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--tokenizer", default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--data", help="an existing Parquet file with a text column (built by an earlier --keep run)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "parquet_preprocess.json"))
    args = ap.parse_args()

    import pyarrow

    from loom.provenance import stamp

    work = Path(tempfile.mkdtemp(prefix="loom-parquet-", dir=args.dir))
    try:
        data = work / "text.parquet"
        t0 = time.perf_counter()
        if args.data:
            import pyarrow.parquet as pq

            data, meta = Path(args.data), pq.ParquetFile(args.data).metadata
            dataset = {"bytes": data.stat().st_size, "rows": meta.num_rows, "row_groups": meta.num_row_groups,
                       "compression": meta.row_group(0).column(1).compression.lower()}
        else:
            dataset = build(data, args.gib, args.seed)
            dataset["build_s"] = round(time.perf_counter() - t0, 1)
        print(f"{'read' if args.data else 'built'} {data}: {dataset}", flush=True)
        loom = Path(sys.executable).with_name("loom")
        command = [str(loom), "preprocess", "--input", str(data), "--output-prefix", str(work / "out"),
                   "--tokenizer", args.tokenizer, "--column", "text", "--append-eod", "--workers", str(args.workers)]
        result = run(command)
        result["output"] = result["output"].replace(str(work), "WORKDIR")
        stats = json.loads((work / "out.stats.json").read_text())
        print(f"preprocess: {result}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out = {"file": {**dataset, "gib": round(dataset["bytes"] / 2**30, 3)},
           "preprocess": {"documents": stats["documents"], "tokens": stats["tokens"], **result,
                          "mib_per_s": round(dataset["bytes"] / 2**20 / result["seconds"], 1),
                          "under_1_gib": result["peak_rss_mib"] < 1024},
           "preprocess_command": " ".join(["loom", *command[1:]]).replace(str(work), "WORKDIR").replace(
               str(data), "WORKDIR/text.parquet"),
           **stamp(".venv/bin/python bench/parquet_preprocess.py " + " ".join(sys.argv[1:])),
           "pyarrow": pyarrow.__version__, "workers": args.workers}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if out["preprocess"]["under_1_gib"] else 1


if __name__ == "__main__":
    sys.exit(main())
