"""The generation engine's own costs, measured for a hardware profile (`loom plan --profile-hardware`; the
CLI hands `measure` to the profiler, which sits beside this package and does not import it).

- `decode_attention_gbps`: the key/value bytes per second of the engine's decode attention;
- `engine_overhead_us`: what a decode step costs beyond its kernels' work, per layer and per step.
"""

from __future__ import annotations

import torch
from torch.utils.benchmark import Timer

from loom.config import ModelConfig
from loom.infer.engine import Engine, KVSlab, SamplingParams
from loom.models.llama import build_model


def _seconds(fn, min_time: float = 0.2) -> float:
    """Median seconds per call (torch's benchmark timer: warm-up, CUDA synchronisation, blocked runs)."""
    return Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_time).median


def decode_attention_gbps(device: str, dtype: torch.dtype) -> float:
    """Key/value bytes per second that the engine's decode attention (`KVSlab.attend`: write the new token's
    keys and values, attend over the slot's cache) gets through, at one query per sequence and two query
    heads per key/value head."""
    b, kv_heads, d, ctx = (32, 8, 128, 2048) if device == "cuda" else (8, 4, 64, 512)
    slab = KVSlab([0], b, kv_heads, ctx, d, dtype, device)
    slab.bind(list(range(b)), torch.full((b, 1), ctx - 1))
    q = torch.randn(b, 2 * kv_heads, 1, d, device=device, dtype=dtype)
    k, v = (torch.randn(b, kv_heads, 1, d, device=device, dtype=dtype) for _ in range(2))
    with torch.no_grad():
        t = _seconds(lambda: slab.attend(0, q, k, v))
    return round(2 * b * kv_heads * ctx * d * q.element_size() / t / 1e9, 3)


def engine_overheads(device: str, quick: bool = False) -> dict[str, float]:
    """{"layer": us, "step": us} that the engine spends on one decode step beyond its kernels' work: measured
    on Llama models too small for compute to matter (hidden 64) with 1 and 5 layers, batch 1, each time the
    best of three (one when `quick`). The slope is the per-layer cost (dispatching a layer's ops), the
    intercept the step's (embedding, head, sampling, bookkeeping)."""
    per_token = {}
    for layers in (1, 5):
        cfg = ModelConfig(layers=layers, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=64, max_seq_len=96)
        torch.manual_seed(0)
        engine = Engine(build_model(cfg).to(device).eval(), max_batch=1, max_len=96)

        def run(n):
            return min(_seconds(lambda: engine.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=n)))
                       for _ in range(1 if quick else 3))

        per_token[layers] = (run(65) - run(1)) / 64
    layer = (per_token[5] - per_token[1]) / 4
    return {"layer": round(1e6 * layer, 2), "step": round(1e6 * (per_token[1] - layer), 2)}


def measure(device: str, dtype: torch.dtype, quick: bool = False) -> dict:
    """The profile keys this module measures, for `profile_hardware(engine_probe=measure)`."""
    return {"engine_overhead_us": engine_overheads(device, quick),
            "decode_attention_gbps": {"bf16" if dtype == torch.bfloat16 else "fp32": decode_attention_gbps(device, dtype)}}
