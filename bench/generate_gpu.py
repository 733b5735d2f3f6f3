"""One GPU, one command: loom's generation engine on a Llama-3.2-1B-shaped model (issue 15's GPU items).

    python bench/generate_gpu.py --out bench/results/generate_gpu_h100.json          # on a GPU machine
    python bench/generate_gpu.py --profile bench/results/h100_profile.json ...         # + the planner (§3)
    python bench/generate_gpu.py --smoke --out /tmp/smoke.json                         # tiny, CPU (a test runs it)

The model has Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads, 8 key/value heads, MLP 8192, vocabulary
128256, tied embeddings; rope scaling left out, it does not change the speed) with random weights: built
with transformers, saved to a temporary directory and loaded by loom (`loom.load_model`), so both run the
same weights; bf16 on the GPU. Nothing is downloaded.

What it measures, each only from what ran:

- **Memory bandwidth** of this device, two ways: a read-only reduction over 4 GiB (`sum`), and a copy
  (bytes read plus written), each the median of 10 after warm-up; beside them the datasheet figure when the
  device name is one the table below knows.
- **Decode at batch 1, 64, 128, 256** (`--batches`): one engine with `compile=True` (decode steps through
  torch.compile with mode "reduce-overhead": a CUDA graph per batch bucket) and max_batch the largest
  batch; prompts of `--prompt` tokens, greedy, `--new` tokens each, no stop token. The decode step is
  (time of a generation of `new` tokens - time of a generation of 1 token) / (new - 1): prefill and the
  first token taken out; median over `--repeats` pairs. From it: decode tokens/s (batch / step), the bytes
  a step must read (every weight once, the tied head included, plus the key/value cache the batch's
  queries read at the mean context; a compiled step reads its whole key bucket, so it moves somewhat
  more), and that over the step time as a fraction of each bandwidth: the issue's goal is >= 70% of the
  bandwidth limit at batch 1. The same for an eager engine (`compile=False`) at every batch, to show
  what the graphs buy. `--kv paged` (the default) runs both engines on paged keys and values
  (`Engine(paged=True)`, blocks of 16 positions, the step's block table per bucket; the eager engine's
  attention reads each request's own blocks, `split_kv_decode`), `--kv slab` on the slab; the JSON's `kv`
  says which. `--paged-read split` (the default) reads each request's visible keys from its blocks (on a
  GPU with Triton, `triton_decode.paged_decode` in both engines), `gather` gathers the bucket's blocks
  densely and masks them; the JSON's `paged_read` says which, and `paged_kernel` whether the Triton kernels
  ran.
- **CUDA graphs ran**: `cudaGraphLaunch` calls counted by torch's profiler over one generation, per
  decode step.
- **Refit**: `engine.refit(model)` from a training copy of the model (fp32 master weights on the same
  device, as `loom train` keeps them; refit synchronises the device before it stops its clock), median of
  3; the slab's addresses before and after; and a generation after the refit, which must still launch
  graphs, beside the eager engine's on the same new weights (agreement, see below).
- **transformers**: `generate` (greedy, its default cache, SDPA) on the same weights and prompts at each
  batch, tokens/s of the whole call beside loom's whole call, and how far the greedy tokens agree
  (`agreement`: bf16 with random weights has nearly flat logits, so kernels that round differently split
  near-ties; reported, not asserted).
- **§3** (`--profile`, a `loom plan --profile-hardware` JSON of this device): `loom plan --inference`'s
  prefill time and decode step for each batch (tp = pp = 1, bf16) beside the engine's. The profile's
  engine costs are measured on an eager engine, so the error is given against the eager step
  (`decode_error_eager`) as well as the compiled one (`decode_error`).

The JSON is rewritten after every row, so a run cut short keeps what it measured.

`--smoke`: a 2-layer model in fp32 on the CPU, eager engine, batches 1 and 4, 8 new tokens; it checks that
the script runs end to end (tests/test_bench_generate_gpu.py), not speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import loom  # noqa: E402
from loom import compile_cache  # noqa: E402
from loom.infer.engine import Engine  # noqa: E402
from loom.infer.sampling import SamplingParams  # noqa: E402
from loom.provenance import stamp  # noqa: E402

SHAPES = {  # transformers LlamaConfig keyword arguments
    "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                        rope_theta=500000.0, max_position_embeddings=2048),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=256),
}
# Datasheet memory bandwidth, GB/s, by a substring of torch.cuda.get_device_name() (first match wins).
DATASHEET_GBPS = [("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
                  ("A100-SXM4-80GB", 2039.0), ("A100 80GB PCIe", 1935.0), ("A100", 1555.0)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_gbps(device: torch.device, gib: float, reps: int = 10) -> dict:
    """Measured bytes per second: a read-only reduction and a copy (read + write), medians of `reps`."""
    n = int(gib * 2**30) // 2
    x = torch.ones(n, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    out = {}
    for name, fn, moved in (("read_sum", lambda: x.sum(dtype=torch.float32), 2 * n),
                            ("copy_read_plus_write", lambda: y.copy_(x), 4 * n)):
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
        out[name] = round(moved / statistics.median(times) / 1e9, 1)
    del x, y
    return out


def datasheet_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gbps for key, gbps in DATASHEET_GBPS if key in name), None)


def build(path: Path, shape: str, device: torch.device, dtype: torch.dtype):
    """A transformers Llama with random weights, saved to `path`; returns it (on `device`, in `dtype`)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[shape])
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    hf.save_pretrained(path)
    return hf


def step_bytes(model, batch: int, context: float, dtype_bytes: int) -> float:
    """Bytes one decode step must read: every weight once (a tied head is the embedding, read once as the
    head; an untied embedding is only looked up, a row per sequence) and the key/value cache the batch's
    queries read at `context` positions."""
    cfg = model.cfg
    params = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter
    if not cfg.tie_embeddings:
        params -= cfg.vocab_size * cfg.hidden
    attention = next(iter(model.layers.values())).attention
    kv = 2 * cfg.layers * cfg.kv_heads * attention.head_dim * context * batch
    return (params + kv) * dtype_bytes


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


def timed(engine: Engine, prompts, new: int, device) -> tuple[float, list[list[int]]]:
    sync(device)
    start = time.perf_counter()
    done = engine.generate(prompts, SamplingParams(max_new_tokens=new))
    sync(device)
    elapsed = time.perf_counter() - start
    assert all(len(c.tokens) == new for c in done), "a request stopped early"
    return elapsed, [c.tokens for c in done]


def decode_split(engine: Engine, prompts, new: int, repeats: int, device) -> dict:
    """Prefill (a generation of one token), decode step (see the module doc) and the whole call: medians over
    `repeats` back-to-back pairs."""
    pairs = []
    for _ in range(repeats):
        one, _ = timed(engine, prompts, 1, device)
        full, tokens = timed(engine, prompts, new, device)
        pairs.append((one, full))
    return {"prefill_s": statistics.median(one for one, _ in pairs),
            "decode_step_s": statistics.median((full - one) / (new - 1) for one, full in pairs),
            "whole_s": statistics.median(full for _, full in pairs), "tokens": tokens}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two sets of greedy continuations agree: the fraction of sequences equal throughout, the
    fraction whose first token agrees, and the mean length of the common prefix. In bf16 with random
    weights the logits are nearly flat, so kernels that round differently split near-ties: this is
    reported, not asserted."""
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n)
    return {"sequences_equal": sum(x == y for x, y in zip(a, b)) / len(a),
            "first_token_equal": sum(x[:1] == y[:1] for x, y in zip(a, b)) / len(a),
            "mean_common_prefix_tokens": round(sum(prefix) / len(prefix), 2)}


def graph_launches(engine: Engine, prompts, new: int) -> int:
    """cudaGraphLaunch calls in one generation (torch's profiler, CPU-side runtime events)."""
    return profiled(engine, prompts, new)["cuda_graph_launches"]


def profiled(engine: Engine, prompts, new: int, top: int = 0) -> dict:
    """One generation of `new` tokens under torch's profiler: cudaGraphLaunch calls (CPU-side runtime events)
    and, with `top`, where the device's time went: the `top` kernels by total device time (name, calls,
    total and mean microseconds), the sum over all kernels, and the wall time of the profiled call (the gap
    between them is time the device waited on the host). Kernels replayed inside CUDA graphs are listed as
    far as the profiler (CUPTI) sees them; `kernels_seen` says how many distinct ones it saw."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_new_tokens=new))
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    table = prof.key_averages()
    out = {"cuda_graph_launches": sum(e.count for e in table if "cudaGraphLaunch" in e.key)}
    if not top:
        return out
    from kernel_table import top_kernels

    out.update(wall_ms=round(1e3 * wall, 3), **top_kernels(prof, top))
    return out


@torch.no_grad()
def speculative_row(model, plain: Engine, max_len: int, args, device, paged: bool) -> dict:
    """Batch 1, greedy, on a prompt of a passage repeated three times (what prompt lookup serves): the plain engine
    against `Engine(speculative="ngram")` (its verify step eager), tokens/s of each over `args.repeats` calls,
    whether the tokens agree, and the drafted tokens kept per verify step."""
    import random

    rng = random.Random(0)
    passage = [rng.randrange(model.cfg.vocab_size) for _ in range(max(4, args.prompt // 3))]
    prompt = [(passage * 3)[: args.prompt]]
    spec = Engine(model, max_batch=1, max_len=max_len, paged=paged, speculative="ngram", draft_tokens=args.speculative)
    out = {"batch": 1, "draft_tokens": args.speculative}
    for name, engine in (("plain", plain), ("speculative", spec)):
        timed(engine, prompt, 2, device)  # warm-up
        seconds, tokens = [], None
        for _ in range(args.repeats):
            s, tokens = timed(engine, prompt, args.new, device)
            seconds.append(s)
        out[f"{name}_tokens_per_s"] = round(args.new / statistics.median(seconds), 1)
        out[f"{name}_tokens"] = tokens
    out["speedup"] = round(out["speculative_tokens_per_s"] / out["plain_tokens_per_s"], 3)
    out["identical_greedy"] = out.pop("plain_tokens") == out.pop("speculative_tokens")
    stats = spec.stats
    steps = max(1, stats.get("spec_request_steps", 0))
    out["tokens_per_verify_step"] = round((stats.get("spec_accepted_tokens", 0) + steps) / steps, 3)
    out["drafts_kept"] = round(stats.get("spec_accepted_tokens", 0) / max(1, stats.get("spec_draft_tokens", 0)), 3)
    return out


def run_hf(hf, prompts, new: int, device) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
    sync(device)
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    sync(device)
    return time.perf_counter() - start, out[:, ids.shape[1]:].tolist()


def predictions(gpu, cfg, batch: int, prompt: int, new: int) -> dict:
    """`loom plan --inference`'s prefill and decode step on `gpu` (a loaded hardware profile)."""
    from loom.planner.workload import Workload
    from loom.planner.inference import evaluate_inference

    est = evaluate_inference(Workload(cfg, prompt, batch, 1, gpu, precision="bf16"), 1, 1, batch, prompt, new)
    return {"prefill_predicted_s": round(est.prefill_s, 5), "decode_step_predicted_ms": round(1e3 * est.decode_step_s, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64,128,256")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=128, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="leave transformers out")
    ap.add_argument("--profile", type=Path, default=None, help="a `loom plan --profile-hardware` JSON of this device")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script runs")
    ap.add_argument("--kv", choices=("paged", "slab"), default="paged",
                    help="the engines' key/value memory: paged blocks (Engine(paged=True), the default) or the slab")
    ap.add_argument("--paged-read", choices=("split", "gather"), default="split",
                    help="paged decode attention: each request's visible keys (split, the default) or the bucket's "
                         "blocks gathered densely (gather); Engine(paged_read=...)")
    ap.add_argument("--kernels", type=int, default=15,
                    help="per batch, the top N kernels of one profiled generation by device time (0: none)")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="also time batch 1 with prompt-lookup speculative decoding (Engine(speculative='ngram', "
                         "draft_tokens=K)) against the plain engine on a repetitive prompt (issue 57); 0: not")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    compile_cache.activate("generate_gpu")  # LOOM_COMPILE_CACHE_LOAD / _SAVE (bench/DEVICE.md)
    if args.smoke:
        shape, device, dtype, compile_mode = "tiny", torch.device("cpu"), torch.float32, False
        # three pairs: a single one let a stall of the 1-token call make the decode step negative on a busy CPU
        args.batches, args.new, args.prompt, args.repeats = "1,4", 8, 12, 3
    else:
        if not torch.cuda.is_available():
            print("generate_gpu.py: no CUDA device here (use --smoke on a CPU)", file=sys.stderr)
            return 2
        shape, device, dtype, compile_mode = "llama3.2-1b", torch.device("cuda"), torch.bfloat16, True
    batches = [int(b) for b in args.batches.split(",")]
    dtype_bytes = torch.finfo(dtype).bits // 8
    result = {"benchmark": "generate_gpu", "shape": shape, "dtype": str(dtype).replace("torch.", ""),
              "prompt_tokens": args.prompt, "new_tokens": args.new, "kv": args.kv,
              "paged_read": args.paged_read if args.kv == "paged" else None,
              **stamp("python bench/generate_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]))}
    if device.type == "cuda":
        result["cuda"] = torch.version.cuda
    bw = bandwidth_gbps(device, 0.0625 if args.smoke else 4.0)
    bw["datasheet"] = datasheet_gbps(device)
    result["bandwidth_gbps"] = bw
    print("bandwidth GB/s:", bw, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        hf = build(Path(tmp), shape, device, dtype)
        model = loom.load_model(tmp, dtype=dtype, device=str(device))
    cfg = model.cfg
    result["parameters"] = sum(p.numel() for p in model.parameters())
    max_len = args.prompt + args.new
    start = time.perf_counter()
    paged = args.kv == "paged"
    engine = Engine(model, max_batch=max(batches), max_len=max_len, compile=compile_mode, paged=paged,
                    paged_read=args.paged_read)
    result["paged_kernel"] = (paged and args.paged_read == "split"  # whether the Triton kernels read the keys
                              and getattr(engine.slab, "triton_kernel", None) is not None)
    result["engine_build_s"] = round(time.perf_counter() - start, 2)  # compiled: warm-up records every bucket
    print(f"engine built in {result['engine_build_s']} s", flush=True)
    eager = (Engine(model, max_batch=max(batches), max_len=max_len, paged=paged, paged_read=args.paged_read)
             if compile_mode else None)

    if args.profile:
        from loom.planner.hardware import load_gpu

        profile = load_gpu(str(args.profile))
    rows = []
    for batch in batches:
        prompts = prompts_for(batch, args.prompt, cfg.vocab_size, seed=batch)
        timed(engine, prompts, 2, device)  # warm-up (the first call of a bucket records its graph)
        m = decode_split(engine, prompts, args.new, args.repeats, device)
        context = args.prompt + args.new / 2  # mean key positions a decode step reads
        need = step_bytes(model, batch, context, dtype_bytes)
        achieved = need / m["decode_step_s"] / 1e9
        row = {"batch": batch, "prefill_s": round(m["prefill_s"], 5), "decode_step_ms": round(1e3 * m["decode_step_s"], 4),
               "decode_tokens_per_s": round(batch / m["decode_step_s"], 1),
               "whole_call_tokens_per_s": round(batch * args.new / m["whole_s"], 1),
               "step_bytes": int(need), "achieved_gbps": round(achieved, 1)}
        row["fraction_of_measured_read"] = round(achieved / bw["read_sum"], 3)
        if bw["datasheet"]:
            row["fraction_of_datasheet"] = round(achieved / bw["datasheet"], 3)
        if device.type == "cuda":
            try:  # the profiler's kernel table is new on this path: its failure must not cost the row
                prof = profiled(engine, prompts, args.new, top=args.kernels)
            except Exception as exc:  # noqa: BLE001
                prof = {"cuda_graph_launches": graph_launches(engine, prompts, args.new),
                        "error": f"{type(exc).__name__}: {exc}"[:500]}
            launches = prof.pop("cuda_graph_launches")
            row["cuda_graph_launches"] = launches
            row["cuda_graph_launches_per_decode_step"] = round(launches / (args.new - 1), 2)
            if args.kernels:
                row["device_time"] = prof  # where one generation's device time went (kernels, host gaps)
        if eager is not None:
            timed(eager, prompts, 2, device)
            e = decode_split(eager, prompts, args.new, args.repeats, device)
            row["eager_decode_step_ms"] = round(1e3 * e["decode_step_s"], 4)
            row["eager_fraction_of_measured_read"] = round(need / e["decode_step_s"] / 1e9 / bw["read_sum"], 3)
            row["agreement_with_eager"] = agreement(m["tokens"], e["tokens"])
        if not args.no_hf:
            run_hf(hf, prompts, 2, device)  # warm-up
            hf_s, hf_tokens = run_hf(hf, prompts, args.new, device)
            row["transformers_whole_call_tokens_per_s"] = round(batch * args.new / hf_s, 1)
            row["whole_call_ratio_vs_transformers"] = round(row["whole_call_tokens_per_s"] / row["transformers_whole_call_tokens_per_s"], 2)
            row["agreement_with_transformers"] = agreement(m["tokens"], hf_tokens)
        if args.profile:
            row.update(predictions(profile, cfg, batch, args.prompt, args.new))
            row["prefill_error"] = round(row["prefill_predicted_s"] / row["prefill_s"] - 1, 4)
            row["decode_error"] = round(row["decode_step_predicted_ms"] / row["decode_step_ms"] - 1, 4)
            if "eager_decode_step_ms" in row:
                row["decode_error_eager"] = round(row["decode_step_predicted_ms"] / row["eager_decode_step_ms"] - 1, 4)
        rows.append(row)
        compile_cache.save_active()  # a later batch's cut-off keeps this one's compiled kernels
        print(json.dumps(row), flush=True)
        result["rows"] = rows
        write(args.out, result)
    del hf
    if args.speculative:
        result["speculative"] = speculative_row(model, engine, max_len, args, device, paged)
        print("speculative:", json.dumps(result["speculative"]), flush=True)
        write(args.out, result)

    # Refit from a training copy: fp32 master weights on the same device, new values.
    from loom.models.llama import build_model

    trainer = build_model(cfg, device=device, dtype=torch.float32, seed=1)
    before = engine.slab.data_ptrs()
    times = [engine.refit(trainer) for _ in range(3)]
    prompts = prompts_for(1, args.prompt, cfg.vocab_size, seed=1)
    _, after_tokens = timed(engine, prompts, args.new, device)
    refit = {"seconds": [round(t, 4) for t in times], "median_s": round(statistics.median(times), 4),
             "weight_bytes": int(sum(p.numel() * p.element_size() for p in model.parameters())),
             "slab_addresses_unchanged": engine.slab.data_ptrs() == before}
    if device.type == "cuda":
        refit["cuda_graph_launches_after"] = graph_launches(engine, prompts, args.new)
        _, eager_tokens = timed(eager, prompts, args.new, device)
        refit["agreement_with_eager_after"] = agreement(after_tokens, eager_tokens)
    result["refit"] = refit
    print("refit:", refit, flush=True)
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    write(args.out, result)
    print(f"wrote {args.out}")
    return 0


def write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
