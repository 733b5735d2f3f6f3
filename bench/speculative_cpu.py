"""CPU speculative decoding with prompt-lookup drafts (`Engine(speculative="ngram")`) at batch 1 on a repetitive
task: tokens/s against the plain engine, greedy output compared token by token (issue 57's target: >= 1.5x with
identical greedy output).

The model is built here with random weights (no download): hidden 384, 6 layers, 6 heads, 2 key/value heads, MLP
1024, vocabulary 16000, fp32 (bench/generate_cpu.py's shape). The task is repetitive in the way prompt lookup
serves: a prompt of a 40-token passage repeated three times, and the random model's greedy continuation, which
falls into short cycles, as untrained and small models do (a trained model editing code or quoting its context
repeats its prompt instead). Each round times one `generate` of NEW tokens with each engine (order alternating);
figures are totals over the rounds, wall and CPU time of this process (`--threads`, default 1: on a shared
machine a single-threaded process's CPU time is what the load disturbs least).

    .venv/bin/python bench/speculative_cpu.py [--new 200] [--draft-tokens 4] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loom.config import ModelConfig  # noqa: E402
from loom.infer.engine import Engine  # noqa: E402
from loom.infer.sampling import SamplingParams  # noqa: E402
from loom.models.llama import Transformer  # noqa: E402
from loom.provenance import write_stamped  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=200)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench/results/speculative_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=16000, hidden=384, layers=6, heads=6, kv_heads=2, ffn_hidden=1024, max_seq_len=1024)
    model = Transformer(cfg).eval()
    g = random.Random(0)
    prompt = [g.randrange(cfg.vocab_size) for _ in range(40)] * 3
    params = SamplingParams(max_new_tokens=args.new)
    max_len = len(prompt) + args.new + 8
    engines = {"plain": Engine(model, max_batch=1, max_len=max_len),
               "ngram": Engine(model, max_batch=1, max_len=max_len, speculative="ngram",
                               draft_tokens=args.draft_tokens)}
    outputs = {name: e.generate([prompt], params)[0].tokens for name, e in engines.items()}  # warm-up
    totals = {name: [0.0, 0.0, 0] for name in engines}
    rounds = []
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        row = {}
        for name in order:
            wall, cpu = time.perf_counter(), time.process_time()
            out = engines[name].generate([prompt], params)[0]
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            totals[name][0] += wall
            totals[name][1] += cpu
            totals[name][2] += len(out.tokens)
            row[name] = {"wall_s": wall, "cpu_s": cpu, "tokens": len(out.tokens)}
            assert out.tokens == outputs[name]
        rounds.append(row)
    s = engines["ngram"].stats
    per = {name: {"tokens_per_s": t / w, "tokens_per_cpu_s": t / c} for name, (w, c, t) in totals.items()}
    result = {"model": {"hidden": cfg.hidden, "layers": cfg.layers, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                        "ffn_hidden": cfg.ffn_hidden, "vocab_size": cfg.vocab_size, "dtype": "float32"},
              "batch": 1, "prompt_tokens": len(prompt), "new_tokens": args.new, "draft_tokens": args.draft_tokens,
              "threads": args.threads, "load_average": os.getloadavg(), "engines": per,
              "speedup_wall": per["ngram"]["tokens_per_s"] / per["plain"]["tokens_per_s"],
              "speedup_cpu": per["ngram"]["tokens_per_cpu_s"] / per["plain"]["tokens_per_cpu_s"],
              "identical_greedy_output": outputs["ngram"] == outputs["plain"],
              "tokens_per_request_step": (s["spec_accepted_tokens"] + s["spec_request_steps"]) / s["spec_request_steps"],
              "draft_acceptance": s["spec_accepted_tokens"] / max(s["spec_draft_tokens"], 1), "rounds": rounds}
    print({k: v for k, v in result.items() if k != "rounds"})
    write_stamped(args.out, result, "python bench/speculative_cpu.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
