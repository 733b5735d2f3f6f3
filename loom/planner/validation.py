"""Published training runs the planner is checked against (`loom plan --validate`, tests/test_plan.py).

Step times are compared, not TFLOP/s, because conventions differ (Narayanan et al. count recomputation;
NeMo counts GQA and SwiGLU exactly). Each run is modelled with the software it used and nothing else:
unfused softmax attention and dropout for the 2021/2022 Megatron runs, gradients reduced after backward
in Megatron-LM 2021 (`overlap_grad_reduce=False`), no sequence parallelism before Korthikanti et al., no
zero-bubble schedule before 2023. Knobs a paper leaves open (micro-batch, virtual stages) are the
planner's choice. The hardware numbers are the presets', unchanged.
"""

from __future__ import annotations

from loom.config import ModelConfig
from loom.planner.costmodel import Workload
from loom.planner.hardware import PRESETS


def megatron_gpt(layers: int, hidden: int, heads: int) -> ModelConfig:
    """GPT-3 shapes as in Megatron's papers: 4h GELU MLP, LayerNorm, learned positions, vocab 51200."""
    return ModelConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden,
                       vocab_size=51200, max_seq_len=2048, norm="layernorm", mlp="gelu", position="learned",
                       bias=True, tie_embeddings=True, attention="math", dropout=0.1, attn_dropout=0.1)


def narayanan_seconds(B, s, L, h, V, tflops, gpus) -> float:
    """Step time implied by Narayanan et al.'s Eq. 3 and their reported TFLOP/s per GPU."""
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)) / (tflops * 1e12 * gpus)


def published_runs() -> dict:
    """name -> (workload, the published layout, published seconds per step, source)."""
    a100, h100 = PRESETS["a100-80gb"], PRESETS["h100"]
    llama2_7b = ModelConfig(layers=32, hidden=4096, heads=32, kv_heads=32, ffn_hidden=11008, vocab_size=32000,
                            max_seq_len=4096)
    return {
        "narayanan-1.7b": (
            Workload(megatron_gpt(24, 2304, 24), 2048, 512, 32, a100, overlap_grad_reduce=False),
            dict(tp=1, pp=1, dp=32, sp=False, recompute="full", recompute_layers=0, dp_style="replicate"),
            narayanan_seconds(512, 2048, 24, 2304, 51200, 137, 32),
            "Narayanan et al. 2021, Table 1: 32 A100-80GB, 137 TFLOP/s/GPU by Eq. 3"),
        "narayanan-145.6b": (
            Workload(megatron_gpt(80, 12288, 96), 2048, 2304, 1536, a100, overlap_grad_reduce=False),
            dict(tp=8, pp=8, dp=24, sp=False, recompute="full", recompute_layers=0, dp_style="replicate"),
            narayanan_seconds(2304, 2048, 80, 12288, 51200, 148, 1536),
            "Narayanan et al. 2021, Table 1: 1536 A100-80GB, 148 TFLOP/s/GPU by Eq. 3"),
        "korthikanti-175b-selective": (
            Workload(megatron_gpt(96, 12288, 96), 2048, 64, 64, a100),
            dict(tp=8, pp=8, dp=1, micro_batch=1, sp=True, recompute="selective"), 13.75,
            "Korthikanti et al. 2022, Table 4: 64 A100-80GB, SP + selective"),
        "korthikanti-175b-full": (
            Workload(megatron_gpt(96, 12288, 96), 2048, 64, 64, a100),
            dict(tp=8, pp=8, dp=1, micro_batch=1, sp=True, recompute="full", recompute_layers=0), 18.13,
            "Korthikanti et al. 2022, Table 4: 64 A100-80GB, full recomputation"),
        "nemo-llama2-7b-fp8": (
            Workload(llama2_7b, 4096, 128, 8, h100, precision="fp8"),
            dict(tp=1, pp=1, dp=8, micro_batch=1, recompute="none", dp_style="distopt"),
            128 * 4096 / (16934 * 8),
            "NeMo 24.07 performance table: 8 H100, fp8, 16,934 tokens/s/GPU"),
    }


def predict(workload: Workload, fixed: dict):
    """The planner's best estimate for a published layout, among the schedules of that time."""
    from loom.planner.search import search

    found, _ = search(workload, fixed=fixed, top=1, schedules=("1f1b", "interleaved"))
    return found[0] if found else None


def validate() -> list[dict]:
    rows = []
    for name, (w, fixed, seconds, source) in published_runs().items():
        best = predict(w, fixed)
        rows.append({"run": name, "source": source, "published_s": round(seconds, 4),
                     "predicted_s": round(best.step_time_s, 4) if best else None,
                     "error": round(best.step_time_s / seconds - 1, 4) if best else None,
                     "fits": bool(best and best.fits),
                     "layout": best.to_json() if best else None})
    return rows
