"""The generation engine's own costs, measured for a hardware profile (`loom plan --profile-hardware`; the
CLI hands `measure` to the profiler, which sits beside this package and does not import it).

- `decode_attention_gbps`: the key/value bytes per second of the engine's decode attention, per size of one
  layer's cache read ([[bytes, GB/s], ...]);
- `prefill_attention_tflops`: the rate of the engine's packed prefill attention, per prompt length
  ([[tokens, TFLOP/s], ...]);
- `engine_overhead_us`: what a decode step costs beyond its kernels' work, per layer, per step and per
  sequence in the batch;
- `decode_product` (not a measurement; the profiler measures its decode tables through it): how the engine
  multiplies a decode step's rows by a weight here, the packed CPU kernel where it runs
  (`loom.infer.cpu.decode_product`), else None (F.linear).

Both the decode attention and the products are measured the way an engine on this machine runs them: through
the CPU decode kernels where they are available (CPU, fp32), as `Engine` does by default.
"""

from __future__ import annotations

import statistics

import torch
from torch.utils.benchmark import Timer

from loom.config import ModelConfig
from loom.infer.cpu import decode_attention_kernel, decode_product
from loom.infer.engine import Engine
from loom.infer.kv import KVSlab
from loom.infer.sampling import SamplingParams
from loom.models.llama import build_model


def _seconds(fn, min_time: float = 0.2) -> float:
    """Median seconds per call (torch's benchmark timer: warm-up, CUDA synchronisation, blocked runs), with
    as many CPU threads as the engine would have: the timer's own default is one thread, which measures a
    CPU's decode attention slower than an engine runs it."""
    return Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()
                 ).blocked_autorange(min_run_time=min_time).median


def _attend_seconds(slab: KVSlab, rows: int, seq: int, kv_heads: int, d: int, quick: bool) -> float:
    """Median seconds of one layer's `attend` of the bound slab on random q [rows, 2 kv_heads, seq, d] and k, v
    [rows, kv_heads, seq, d] (two query heads per key/value head) in the slab's dtype and device: the slab's
    layers in turn, one call each, so a slab of more layers than the caches hold reads each from memory."""
    like = slab.k[0]
    q = torch.randn(rows, 2 * kv_heads, seq, d, device=like.device, dtype=like.dtype)
    k, v = (torch.randn(rows, kv_heads, seq, d, device=like.device, dtype=like.dtype) for _ in range(2))
    layers = list(slab.k)

    def run():
        for layer in layers:
            slab.attend(layer, q, k, v)

    with torch.no_grad():
        return _seconds(run, 0.1 if quick else 0.2) / len(layers)


def decode_attention_gbps(device: str, dtype: torch.dtype, quick: bool = False) -> list[list[float]]:
    """[[bytes, GB/s], ...]: key/value bytes per second that the engine's decode attention (`KVSlab.attend`:
    write the new token's keys and values, attend over the slot's cache) gets through, at one query per
    sequence and two query heads per key/value head, by the bytes one call reads (one layer's cache of the
    batch). Small reads are dominated by the call's fixed costs, reads that outgrow the caches by memory, so
    the rate is measured at several sizes: more sequences at a fixed context. Each size cycles over enough
    layers' caches to outgrow the last-level cache, as a decode step reads each layer's cache once between the
    model's weights: one layer's cache read again and again stays cached and runs faster than a decode step
    reads it."""
    kv_heads, d = (8, 128) if device == "cuda" else (4, 64)
    ctx = 1024 if device == "cuda" else 128
    stream = 1 << 28 if device == "cuda" else 1 << 27
    table = []
    for b in (1, 8, 32, 128):
        nbytes = 2 * b * kv_heads * ctx * d * torch.finfo(dtype).bits // 8
        slab = KVSlab(range(-(-stream // nbytes)), b, kv_heads, ctx, d, dtype, device)
        slab.decode_kernel = decode_attention_kernel(device, dtype)  # as an engine's slab on this machine
        slab.bind(list(range(b)), torch.full((b, 1), ctx - 1))
        t = _attend_seconds(slab, b, 1, kv_heads, d, quick)
        table.append([float(nbytes), round(nbytes / t / 1e9, 3)])
        del slab
    return table


def prefill_attention_tflops(device: str, dtype: torch.dtype, quick: bool = False) -> list[list[float]]:
    """[[prompt tokens, TFLOP/s], ...]: the causal-half FLOPs per second of the engine's packed prefill attention
    (`KVSlab.attend` on a `bind_packed` row: write the keys and values to their slots, spread the queries per
    slot, attend causally, pack the output back), at a few prompt lengths with the batch making up a fixed
    number of tokens; two query heads per key/value head. Training's attention rate (forward and backward,
    no cache) does not describe it: it runs well below a training step's attention rate on a CPU."""
    kv_heads, d, total = (8, 128, 16384) if device == "cuda" else (4, 64, 4096)
    lengths = (512, 2048, 8192) if device == "cuda" else (128, 512, 2048)
    table = []
    for s in lengths[:2] if quick else lengths:
        b = max(1, total // s)
        slab = KVSlab([0], b, kv_heads, s, d, dtype, device)
        slab.bind_packed(list(range(b)), [s] * b)
        t = _attend_seconds(slab, 1, b * s, kv_heads, d, quick)
        table.append([s, round(2 * 2 * b * 2 * kv_heads * s * s * d / 2 / t / 1e12, 5)])
    return table


def engine_overheads(device: str, quick: bool = False) -> dict[str, float]:
    """{"layer": us, "step": us, "row": us} that the engine spends on a decode step beyond its kernels' work:
    measured on Llama models too small for compute to matter (hidden 64). With 1 and 5 layers at batch 1, the
    slope is the per-layer cost (dispatching a layer's ops) and the intercept the step's (embedding, head,
    sampling, bookkeeping); with 1 layer at batch 1 and 16, the slope is the cost per sequence in the batch
    (its sampling, gathers and scatters, the host's bookkeeping of its tokens). Each model's cost per token is
    a generation of 65 tokens less one of 1, timed back to back; the three models take turns over five rounds
    (three when `quick`) and each keeps its median, so a shared machine's drift between seconds moves all three
    alike instead of one (a difference of differences amplifies it: best-of-three per model, one model after
    another, gave per-layer costs that varied by half between profiles a minute apart)."""
    engines = {}
    for layers, batch in ((1, 1), (5, 1), (1, 16)):
        cfg = ModelConfig(layers=layers, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=64, max_seq_len=96)
        torch.manual_seed(0)
        engines[layers, batch] = Engine(build_model(cfg).to(device).eval(), max_batch=batch, max_len=96)
    samples: dict = {key: [] for key in engines}
    for _ in range(3 if quick else 5):  # one round let a single stall make the slope negative (-1206 us a layer)
        for (layers, batch), engine in engines.items():
            prompts = [[1, 2, 3, 4]] * batch

            def run(n, engine=engine, prompts=prompts):
                return _seconds(lambda: engine.generate(prompts, SamplingParams(max_new_tokens=n)), 0.1)

            samples[layers, batch].append((run(65) - run(1)) / 64)
    per_token = {key: statistics.median(values) for key, values in samples.items()}
    layer = (per_token[5, 1] - per_token[1, 1]) / 4
    row = max(0.0, (per_token[1, 16] - per_token[1, 1]) / 15)
    return {"layer": round(1e6 * layer, 2), "step": round(1e6 * (per_token[1, 1] - layer - row), 2),
            "row": round(1e6 * row, 2)}


def measure(device: str, dtype: torch.dtype, quick: bool = False) -> dict:
    """The profile keys this module measures, for `profile_hardware(engine_probe=measure)`, and the engine's
    `decode_product` for the profiler's decode tables."""
    key = "bf16" if dtype == torch.bfloat16 else "fp32"
    return {"engine_overhead_us": engine_overheads(device, quick),
            "decode_attention_gbps": {key: decode_attention_gbps(device, dtype, quick)},
            "prefill_attention_tflops": {key: prefill_attention_tflops(device, dtype, quick)},
            "decode_product": decode_product(device, dtype)}
