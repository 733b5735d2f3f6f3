"""CPU prefill with the paged engine's prefix cache: a second request that shares a 1,024-token prefix with the
first prefills only its own tokens (issue 57's target: at most 0.2x the first's time).

The model is built here with random weights (no download): hidden 256, 4 layers, 8 heads, 2 key/value heads, MLP
704, vocabulary 4000, fp32. Each round empties the cache, then times `Engine.generate` of one request with
max_new_tokens=1 (its prefill and first token, nothing decoded): first a prompt of PREFIX + SUFFIX tokens (nothing
cached), then another prompt with the same PREFIX and another SUFFIX (its prefix's whole blocks found), and the
same second prompt on an engine without the cache. Medians over the rounds, wall and CPU time of this process; the
JSON keeps every round and checks the cached and uncached second requests give the same first token and log-prob.

    .venv/bin/python bench/prefix_cache_cpu.py [--prefix 1024] [--suffix 32] [--rounds 5] [--out F.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def timed(engine: Engine, prompt: list[int]):
    wall, cpu = time.perf_counter(), time.process_time()
    out = engine.generate([prompt], SamplingParams(max_new_tokens=1))[0]
    return time.perf_counter() - wall, time.process_time() - cpu, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "bench/results/prefix_cache_cpu.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4000, hidden=256, layers=4, heads=8, kv_heads=2, ffn_hidden=704,
                      max_seq_len=args.prefix + 2 * args.suffix + 8)
    model = Transformer(cfg).eval()
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, cfg.vocab_size, (args.prefix,), generator=g).tolist()
    first, second = (prefix + torch.randint(0, cfg.vocab_size, (args.suffix,), generator=g).tolist() for _ in range(2))
    kw = dict(max_batch=1, max_len=cfg.max_seq_len, paged=True, block_size=args.block_size)
    cached, plain = Engine(model, **kw), Engine(model, prefix_cache=False, **kw)
    timed(cached, first), timed(plain, first)  # warm-up: the CPU kernels, the allocator
    rounds = []
    for _ in range(args.rounds):
        cached.slab.cache.clear()
        before = dict(cached.stats)
        a_wall, a_cpu, _ = timed(cached, first)
        b_wall, b_cpu, b = timed(cached, second)
        c_wall, c_cpu, c = timed(plain, second)
        rounds.append({"first_s": a_wall, "second_cached_s": b_wall, "second_uncached_s": c_wall,
                       "first_cpu_s": a_cpu, "second_cached_cpu_s": b_cpu, "second_uncached_cpu_s": c_cpu,
                       "hit_tokens": cached.stats["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"],
                       "prefilled_tokens": cached.stats["prefilled_tokens"] - before["prefilled_tokens"],
                       "same_first_token": b.tokens == c.tokens,
                       "logprob_diff": abs(b.logprobs[0] - c.logprobs[0])})
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k.endswith("_s")}
    result = {"model": {"hidden": cfg.hidden, "layers": cfg.layers, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                        "ffn_hidden": cfg.ffn_hidden, "vocab_size": cfg.vocab_size, "dtype": "float32"},
              "prefix_tokens": args.prefix, "suffix_tokens": args.suffix, "block_size": args.block_size,
              "threads": torch.get_num_threads(), "load_average": os.getloadavg(), "median": med,
              "second_over_first": med["second_cached_s"] / med["first_s"],
              "second_over_first_cpu": med["second_cached_cpu_s"] / med["first_cpu_s"],
              "same_tokens": all(r["same_first_token"] for r in rounds),
              "max_logprob_diff": max(r["logprob_diff"] for r in rounds), "rounds": rounds}
    print({k: v for k, v in result.items() if k != "rounds"})
    write_stamped(args.out, result, "python bench/prefix_cache_cpu.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
