"""Per-token cost of a JSON-schema token mask on the CPU: llguidance, xgrammar and outlines-core, on loom's
tokenizers (HF `tokenizers` byte-level BPEs), for the grammar library `loom serve`'s `response_format` uses.

    python bench/structured_mask.py --out bench/results/structured_mask_cpu.json
    PYTHONPATH=/tmp/libs python bench/structured_mask.py --vocab 300 32000 --out F.json   # libraries elsewhere

For each tokenizer (byte-level BPEs trained here on loom's embedded corpus, of --vocab sizes; nothing is
downloaded) and each library that imports: the schema below compiled once (`compile_ms`, the tokenizer's
preparation counted apart as `tokenizer_ms`), then a valid document's tokens replayed --repeats times through a
fresh matcher: per token, the mask of allowed next tokens computed (as a bitmask the sampler can apply) and the
token consumed. `mask_us`: microseconds per token, median and p90 over tokens of all repeats, and the mean.
A library that does not import (not installed) or fails is reported with its error. `--engine`: also loom's engine
on a random model (4 layers, hidden 256, the largest --vocab), --batch greedy requests of --engine-tokens new
tokens, free and under the schema (llguidance, as `loom serve` runs it): decode tokens per second of each
(`engine` in the JSON). The JSON (machine, torch, versions, commit, command, results) is written at the end.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "kind": {"enum": ["person", "robot", "other"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "kind", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace of the Analytical Engine", "age": 36, "email": "ada@example.org",
            "tags": ["mathematics", "poetry of science", "the first program", "notes"], "kind": "person",
            "address": {"city": "London", "zip": "W1"}}


def tokenizer(vocab: int):
    from loom.data.tokenizer import get_tokenizer

    return get_tokenizer("bpe", vocab)  # the whole corpus (cached under LOOM_CACHE)


def time_replay(tokens: list[int], start, step, repeats: int) -> list[float]:
    """Per token seconds of step(state, token) (mask, then consume) over `repeats` fresh replays."""
    times = []
    for _ in range(repeats):
        state = start()
        for t in tokens:
            t0 = time.perf_counter()
            step(state, t)
            times.append(time.perf_counter() - t0)
    return times


def run_llguidance(tok, tokens, repeats):
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok._json, n_vocab=tok.vocab_size, eos_token=tok.eod_id)
    prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    first = llguidance.LLMatcher(lltok, grammar)
    assert not first.is_error(), first.get_error()
    compiled = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, tok.vocab_size)

    def step(m, t):
        lt.fill_next_token_bitmask(m, mask, 0)
        assert m.consume_token(t), m.get_error()

    times = time_replay(tokens, lambda: llguidance.LLMatcher(lltok, grammar), step, repeats)
    return llguidance.__version__ if hasattr(llguidance, "__version__") else version("llguidance"), prep, compiled, times


def run_xgrammar(tok, tokens, repeats):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.tok)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.vocab_size, stop_token_ids=[tok.eod_id])
    compiler = xgr.GrammarCompiler(info)
    prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled_grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                  separators=(",", ":"))
    compiled = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)

    def step(m, t):
        m.fill_next_token_bitmask(mask, 0)
        assert m.accept_token(t)

    times = time_replay(tokens, lambda: xgr.GrammarMatcher(compiled_grammar), step, repeats)
    return version("xgrammar"), prep, compiled, times


def run_outlines_core(tok, tokens, repeats):
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if i != tok.eod_id:
            table.setdefault(tok.token_bytes([i]), []).append(i)
    vocabulary = Vocabulary(tok.eod_id, table)
    prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), vocabulary)
    compiled = time.perf_counter() - t0
    words = (tok.vocab_size + 31) // 32
    mask = torch.zeros(words, dtype=torch.int32)

    def step(g, t):
        g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        g.advance(t)

    times = time_replay(tokens, lambda: Guide(index), step, repeats)
    return version("outlines_core"), prep, compiled, times


def run_engine(tok, batch: int, new_tokens: int) -> dict:
    """Decode tokens/s of `batch` greedy requests on a random 4-layer model, free and schema-constrained."""
    import torch

    from loom.config import ModelConfig
    from loom.infer.engine import Engine
    from loom.infer.grammar import Grammars
    from loom.infer.sampling import SamplingParams
    from loom.models.llama import build_model

    cfg = ModelConfig(layers=4, hidden=256, heads=4, kv_heads=2, ffn_hidden=768, vocab_size=tok.vocab_size,
                      max_seq_len=512)
    model = build_model(cfg, seed=0).eval()
    prompts = [tok.encode(f"record {i}: ") for i in range(batch)]
    grammars = Grammars(tok, tok.vocab_size, (tok.eod_id,))
    grammar = grammars.json_schema(SCHEMA)
    # no stop token: every request decodes new_tokens (a finished document allows only the end token: the
    # constrained ones are given the end token as a stop they never see, so they run the same length)
    params = SamplingParams(max_new_tokens=new_tokens)
    out = {}
    for mode in ("free", "schema", "free", "schema"):  # the second round is timed
        engine = Engine(model, max_batch=batch, max_len=512, sync_every=4)
        with torch.no_grad():
            requests = [engine.submit(p, params, constraint=grammars.matcher(grammar) if mode == "schema" else None)
                        for p in prompts]
            engine.step()  # the prefill and a first window
            start, tokens = time.perf_counter(), sum(len(r.out.tokens) for r in requests)
            while not all(r.done for r in requests):
                engine.step()
            seconds = time.perf_counter() - start
        out[mode] = round((sum(len(r.out.tokens) for r in requests) - tokens) / seconds, 1)
    return {"batch": batch, "new_tokens": new_tokens, "vocab": tok.vocab_size,
            "decode_tokens_per_s": out, "model": "layers=4 hidden=256 heads=4 kv_heads=2 ffn=768, fp32, random"}


def version(name: str) -> str:
    from importlib.metadata import version as v

    return v(name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[300, 32000])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", required=True)
    p.add_argument("--engine", action="store_true", help="also time loom's engine, free and constrained")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--engine-tokens", type=int, default=64)
    args = p.parse_args()
    import torch

    text = json.dumps(DOCUMENT, separators=(",", ":"))
    results = []
    for vocab in args.vocab:
        tok = tokenizer(vocab)
        tokens = tok.encode(text)
        for name, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar),
                         ("outlines-core", run_outlines_core)):
            row = {"library": name, "vocab": tok.vocab_size, "document_tokens": len(tokens)}
            try:
                ver, prep, compiled, times = fn(tok, tokens, args.repeats)
                us = sorted(t * 1e6 for t in times)
                row.update(version=ver, tokenizer_ms=round(prep * 1e3, 2), compile_ms=round(compiled * 1e3, 2),
                           mask_us={"p50": round(us[len(us) // 2], 1), "p90": round(us[int(len(us) * 0.9)], 1),
                                    "mean": round(statistics.fmean(us), 1)})
            except Exception as e:  # noqa: BLE001 (reported, the others still run)
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            print(json.dumps(row), flush=True)
            results.append(row)
    engine = run_engine(tok, args.batch, args.engine_tokens) if args.engine else None
    if engine is not None:
        print(json.dumps(engine), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    out = {"benchmark": "structured_mask", "schema": SCHEMA, "document": text,
           "machine": {"cpu": platform.processor() or platform.machine(), "platform": platform.platform(),
                       "python": platform.python_version(), "torch_threads": torch.get_num_threads()},
           "torch": torch.__version__, "commit": commit.stdout.strip(),
           "command": "python " + " ".join(sys.argv), "results": results,
           **({"engine": engine} if engine is not None else {})}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
