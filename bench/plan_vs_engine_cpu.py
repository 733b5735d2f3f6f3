"""`loom plan --inference` against loom's generation engine on this CPU (issue 15 §3).

1. `loom plan --profile-hardware` measures this machine (GEMM table, memory bandwidth, op overhead), unless
   --profile names an existing profile;
2. for batch 1, 8 and 32 the planner predicts prefill time and the decode step at the mean context for one
   process (`planner.inference.evaluate_inference`, tp = pp = 1, fp32);
3. the engine runs the same model and batch: prefill = a generation of one token (the first token comes
   from the prefill's logits), decode step = (a generation of `output` tokens - that) / (output - 1),
   the two timed back to back in each of at least --repeats pairs and --seconds; medians over the pairs;
4. steps 1-3 are repeated --cycles times (a fresh profile each time: this shared machine's speed drifts
   by 10-30% between minutes) and each cell reports the median over cycles, every cycle kept in the JSON.

Usage: python bench/plan_vs_engine_cpu.py [--repeats 3] [--seconds 4] [--cycles 3] [--profile bench/results/cpu_profile.json]
       -> bench/results/plan_vs_engine_cpu.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from loom.config import ModelConfig  # noqa: E402
from loom.infer.engine import Engine  # noqa: E402
from loom.infer.sampling import SamplingParams  # noqa: E402
from loom.models.llama import build_model  # noqa: E402
from loom.planner.hardware import load_gpu  # noqa: E402
from loom.planner.inference import evaluate_inference  # noqa: E402
from loom.planner.workload import Workload  # noqa: E402
from loom.provenance import stamp  # noqa: E402

# The Llama-shaped model of bench/plan_vs_measured_cpu.py.
MODEL = dict(layers=4, hidden=512, heads=8, kv_heads=4, ffn_hidden=1376, vocab_size=4096, max_seq_len=1024,
             tie_embeddings=False)


def timed(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    start = time.perf_counter()
    done = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(c.tokens) == new_tokens for c in done), "a request stopped early"
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3, help="the fewest (prefill, generation) pairs per batch")
    parser.add_argument("--seconds", type=float, default=4.0, help="the least time of pairs per batch")
    parser.add_argument("--input", type=int, default=128, help="prompt tokens")
    parser.add_argument("--output", type=int, default=32, help="generated tokens")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--profile", type=Path, default=None, help="an existing --profile-hardware JSON")
    parser.add_argument("--cycles", type=int, default=3, help="profile-then-measure cycles; cells are medians")
    args = parser.parse_args()
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = ModelConfig(**MODEL)
    model = build_model(cfg).float().eval()
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {b: torch.randint(0, cfg.vocab_size, (b, args.input)).tolist() for b in batches}
    cycles = []
    for cycle in range(args.cycles):
        profile = args.profile
        if profile is None:  # a fresh profile each cycle: the machine's speed drifts between minutes
            profile = out_dir / "cpu_profile.json"
            r = subprocess.run([sys.executable, "-m", "loom.cli", "plan", "--profile-hardware", str(profile)],
                               capture_output=True, text=True, cwd=ROOT)
            if r.returncode:
                sys.exit(r.stderr)
        gpu = load_gpu(str(profile))
        rows = []
        for batch in batches:
            engine = Engine(model, max_batch=batch, max_len=args.input + args.output)
            timed(engine, prompts[batch], 2)  # warm-up
            # Pairs of (prefill only, whole generation) back to back, so a drift in the machine's speed
            # moves both halves of each pair alike; medians over the pairs.
            # At least --repeats pairs and --seconds of them: a batch-1 pair takes a third of a second, and
            # five of them sample this machine's speed over too short a window.
            pairs, start = [], time.perf_counter()
            while len(pairs) < args.repeats or time.perf_counter() - start < args.seconds:
                pairs.append((timed(engine, prompts[batch], 1), timed(engine, prompts[batch], args.output)))
            prefill = statistics.median(one for one, _ in pairs)
            decode = statistics.median((full - one) / (args.output - 1) for one, full in pairs)
            w = Workload(cfg, args.input, batch, 1, gpu, precision="fp32")
            est = evaluate_inference(w, 1, 1, batch, args.input, args.output)
            rows.append({"batch": batch, "input": args.input, "output": args.output,
                         "prefill_predicted_s": round(est.prefill_s, 5), "prefill_measured_s": round(prefill, 5),
                         "prefill_error": round(est.prefill_s / prefill - 1, 4),
                         "decode_predicted_ms": round(1e3 * est.decode_step_s, 3),
                         "decode_measured_ms": round(1e3 * decode, 3),
                         "decode_error": round(est.decode_step_s / decode - 1, 4)})
            print(f"cycle {cycle + 1}: {rows[-1]}", flush=True)
        cycles.append(rows)
    # Each cell: the median over cycles of predicted and measured, and of the per-cycle error.
    rows = []
    for i, batch in enumerate(batches):
        row = {"batch": batch, "input": args.input, "output": args.output}
        for key in ("prefill_predicted_s", "prefill_measured_s", "decode_predicted_ms", "decode_measured_ms",
                    "prefill_error", "decode_error"):
            row[key] = round(statistics.median(c[i][key] for c in cycles), 5)
        rows.append(row)
    errors = [abs(r[k]) for r in rows for k in ("prefill_error", "decode_error")]
    result = {"what": "loom plan --inference (tp=1, pp=1, fp32, this CPU's profile) vs loom's engine, one process",
              "model": MODEL, "profile": str(profile.relative_to(ROOT) if profile.is_relative_to(ROOT) else profile),
              "rows": rows, "cycles": cycles, "mean_abs_error": round(statistics.mean(errors), 4), "max_abs_error": round(max(errors), 4),
              "load_average_before": __import__("os").getloadavg()[0],
              **stamp(" ".join(["python", "bench/plan_vs_engine_cpu.py"] + sys.argv[1:]))}
    (out_dir / "plan_vs_engine_cpu.json").write_text(json.dumps(result, indent=1))
    lines = ["| batch | prefill predicted s | measured s | error | decode predicted ms | measured ms | error |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['prefill_predicted_s']:.4f} | {r['prefill_measured_s']:.4f} | {100 * r['prefill_error']:+.1f}% | "
              f"{r['decode_predicted_ms']:.2f} | {r['decode_measured_ms']:.2f} | {100 * r['decode_error']:+.1f}% |" for r in rows]
    m = result["machine"]
    per_cycle = "; ".join(
        f"cycle {n + 1}: " + ", ".join(f"b{r['batch']} {100 * r['prefill_error']:+.0f}/{100 * r['decode_error']:+.0f}%"
                                      for r in c) for n, c in enumerate(cycles))
    footer = (f"\nEach cell: the median over {len(cycles)} cycles (a fresh profile, then the engine); errors per cycle "
              f"(prefill/decode): {per_cycle}.\n"
              f"\nmean |error| {100 * result['mean_abs_error']:.1f}%, max {100 * result['max_abs_error']:.1f}%\n\n"
              f"{m['cpu']}, {m['cores']} cores, torch {result['torch']}, commit {result['commit'][:10]}, "
              f"{result['date']}: `{result['command']}`\n")
    (out_dir / "plan_vs_engine_cpu.md").write_text("\n".join(lines) + "\n" + footer)
    print("\n".join(lines) + footer)


if __name__ == "__main__":
    main()
