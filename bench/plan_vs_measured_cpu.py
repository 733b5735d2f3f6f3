"""The planner's predicted step time against `loom train` on this machine (CPU), for a Llama-shaped model.

1. `loom plan --profile-hardware` measures this machine (GEMM table, memory bandwidth, op overhead);
2. for each setting (micro-batch x recompute x sequence length) the planner predicts one process's step
   time with `--gpu PROFILE --precision fp32`;
3. `loom train` runs the same setting for a few steps; the median step time after warm-up is compared.

A shared machine's speed drifts between minutes by as much as the errors being measured (GEMM rates of
the same shape 40% apart in profiles taken ten minutes apart), so the three steps run in `--cycles`
cycles, each with a fresh profile just before its training runs; each cell's error is the median of its
cycles' own errors (the medians of predictions and measurements are listed beside it), and the JSON keeps
every cycle (`--summarize` re-renders them without running). The last cycle's profile is kept as
bench/results/cpu_profile_train.json.

Usage: python bench/plan_vs_measured_cpu.py [--steps 6] [--cycles 3]
       -> bench/results/plan_vs_measured_cpu.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.provenance import stamp  # noqa: E402

MODEL = ["--model.layers=4", "--model.hidden=512", "--model.heads=8", "--model.kv_heads=4",
         "--model.ffn_hidden=1376", "--model.vocab_size=4096", "--model.max_seq_len=1024", "--model.tie_embeddings=false"]
SETTINGS = [(mbs, rec, seq) for seq in (256, 1024) for mbs, rec in ((1, "none"), (4, "none"), (4, "selective"), (4, "full"))]


def loom(*args, **kw):
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True, cwd=ROOT, **kw)


def _footer(result: dict) -> str:
    m = result["machine"]
    commit = result["commit"][:10] + ("-dirty" if result["commit"].endswith("-dirty") else "")
    return (f"\n{m['cpu']}, {m['cores']} cores, torch {result['torch']}, commit {commit}, "
            f"{result['date']}: `{result['command']}`\n")


def cycle(profile: Path, steps: int) -> list[dict]:
    """A fresh profile, then every setting predicted from it and trained."""
    r = loom("plan", "--profile-hardware", str(profile))
    if r.returncode:
        sys.exit(r.stderr)
    rows = []
    for mbs, rec, seq in SETTINGS:
        plan = ["--mlp", "swiglu", "--norm", "rmsnorm", "--layers", "4", "--hidden", "512", "--heads", "8", "--kv-heads", "4", "--ffn", "1376",
                "--vocab", "4096", "--gpus", "1", "--gpu", str(profile), "--precision", "fp32", "--seq", str(seq),
                "--global-batch", str(mbs)]
        # loom train's recompute.mode=full recomputes every layer; fix that too (the search would otherwise pick
        # the fewest recomputed layers that fit)
        every = ",recompute_layers=0" if rec == "full" else ""
        r = loom("plan", *plan, "--layout", f"tp=1,pp=1,dp=1,mbs={mbs},recompute={rec}{every}", "--json")
        if r.returncode:
            sys.exit(r.stderr)
        cand = json.loads(r.stdout)["candidates"][0]
        with tempfile.TemporaryDirectory() as tmp:
            r = loom("train", "--config", "tiny", "--run-dir", tmp, *MODEL, f"--train.seq_len={seq}",
                     f"--train.micro_batch={mbs}", f"--train.global_batch={mbs}", f"--recompute.mode={rec}",
                     f"--train.steps={steps}", "--train.dtype=float32", "--train.device=cpu", "--train.eval_samples=1",
                     "--checkpoint.save_final=false", "--log.progress=none", "--data.corpus_max_bytes=2000000")
            if r.returncode:
                sys.exit(r.stderr[-3000:])
            times = [json.loads(x)["step_time_s"] for x in Path(tmp, "metrics.jsonl").read_text().splitlines()
                     if '"step_time_s"' in x]
        measured = statistics.median(times[2:])
        rows.append({"micro_batch": mbs, "recompute": rec, "seq_len": seq, "predicted_s": cand["step_time_s"],
                     "measured_s": round(measured, 5), "error": round(cand["step_time_s"] / measured - 1, 4),
                     "predicted_terms_s": cand["time_s"]})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--summarize", action="store_true",
                        help="re-summarise the cycles already in bench/results/plan_vs_measured_cpu.json (no runs)")
    args = parser.parse_args()
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.summarize:
        result = json.loads((out_dir / "plan_vs_measured_cpu.json").read_text())
        cycles = result["cycles"]
    else:
        cycles = [cycle(out_dir / "cpu_profile_train.json", args.steps) for _ in range(args.cycles)]
        result = stamp(" ".join(["python", "bench/plan_vs_measured_cpu.py"] + sys.argv[1:]))
    # Each cell: the median of its cycles' own errors (each cycle's prediction against what was measured
    # right after its profile), beside the medians of the predictions and of the measurements.
    rows = []
    for i, (mbs, rec, seq) in enumerate(SETTINGS):
        rows.append({"micro_batch": mbs, "recompute": rec, "seq_len": seq,
                     "predicted_s": round(statistics.median(c[i]["predicted_s"] for c in cycles), 5),
                     "measured_s": round(statistics.median(c[i]["measured_s"] for c in cycles), 5),
                     "error": round(statistics.median(c[i]["error"] for c in cycles), 4),
                     "cycle_errors": [c[i]["error"] for c in cycles]})
    result.update({"what": "planner prediction vs loom train, one process on this CPU, fp32; per cell the median "
                           "over cycles (each a fresh profile, then every setting) of the cycle's error",
                   "rows": rows, "mean_abs_error": round(statistics.mean(abs(r["error"]) for r in rows), 4),
                   "cycles": cycles})
    (out_dir / "plan_vs_measured_cpu.json").write_text(json.dumps(result, indent=1))
    lines = ["| micro-batch | recompute | seq | predicted s (median) | measured s (median) | error (median of cycles) "
             "| each cycle |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['micro_batch']} | {r['recompute']} | {r['seq_len']} | {r['predicted_s']:.4f} | {r['measured_s']:.4f} | "
              f"{100 * r['error']:+.1f}% | {', '.join(f'{100 * e:+.1f}%' for e in r['cycle_errors'])} |" for r in rows]
    (out_dir / "plan_vs_measured_cpu.md").write_text("\n".join(lines) + f"\n\nmean |error| {100 * result['mean_abs_error']:.1f}%\n" + _footer(result))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
