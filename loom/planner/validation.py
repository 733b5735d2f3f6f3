"""Published training runs the planner is checked against (`loom plan --validate`, tests/test_plan.py).

Step times are compared, not TFLOP/s, because conventions differ (Narayanan et al. count recomputation;
NeMo counts GQA and SwiGLU exactly). Each run is modelled with the software it used and nothing else:
unfused softmax attention and dropout for the 2021/2022 Megatron runs, gradients reduced after backward
in Megatron-LM 2021 (`overlap_grad_reduce=False`), no sequence parallelism before Korthikanti et al., no
zero-bubble schedule before 2023. Knobs a paper leaves open (micro-batch, virtual stages) are the
planner's choice. The hardware numbers are the presets', unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

from loom.config import ModelConfig
from loom.planner.workload import Workload
from loom.planner.hardware import PRESETS


def megatron_gpt(layers: int, hidden: int, heads: int) -> ModelConfig:
    """GPT-3 shapes as in Megatron's papers: 4h GELU MLP, LayerNorm, learned positions, vocab 51200."""
    return ModelConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden,
                       vocab_size=51200, max_seq_len=2048, norm="layernorm", mlp="gelu", position="learned",
                       bias=True, tie_embeddings=True, attention="math", dropout=0.1, attn_dropout=0.1)


def narayanan_seconds(B, s, L, h, V, tflops, gpus) -> float:
    """Step time implied by Narayanan et al.'s Eq. 3 and their reported TFLOP/s per GPU."""
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)) / (tflops * 1e12 * gpus)


def llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int) -> ModelConfig:
    """Llama 2/3 shapes: RMSNorm, SwiGLU, RoPE, untied head, fused attention, no dropout."""
    return ModelConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn,
                       vocab_size=vocab, max_seq_len=seq)


def nemo_gpt(layers: int, hidden: int, heads: int) -> ModelConfig:
    """NeMo's GPT-3 configs (launcher conf/training/gpt3): LayerNorm, 4h GELU, learned positions, dropout
    0.1, GPT-2 vocabulary padded to 128 x tp (50688 at tp=4), Transformer Engine's fused attention."""
    return ModelConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden,
                       vocab_size=50688, max_seq_len=2048, norm="layernorm", mlp="gelu", position="learned",
                       bias=True, tie_embeddings=True, dropout=0.1, attn_dropout=0.1)


def moe(cfg: ModelConfig, experts: int, top_k: int, ffn: int) -> ModelConfig:
    """`cfg` with every MLP a mixture of `experts` SwiGLU experts of `ffn`, top_k of them per token."""
    cfg.moe.experts, cfg.moe.top_k, cfg.moe.ffn_hidden, cfg.moe.renormalize = experts, top_k, ffn, True
    return cfg


def tokens_seconds(global_batch: int, seq: int, tokens_per_s_per_gpu: float, gpus: int) -> float:
    return global_batch * seq / (tokens_per_s_per_gpu * gpus)


def flops_seconds(cfg: ModelConfig, global_batch: int, seq: int, tflops: float, gpus: int) -> float:
    """Step time implied by a reported TFLOP/s per GPU, counted with loom's model FLOPs (6N plus the
    attention score/context FLOPs, no recomputation)."""
    from loom.flops import train_flops_per_token

    return global_batch * seq * train_flops_per_token(cfg, seq) / (tflops * 1e12 * gpus)


NEMO_2407 = ("NeMo 24.07 performance summary (NVIDIA/NeMo docs/source/performance/performance_summary.md), "
             "DGX-H100, fp8, Megatron-Core + Transformer Engine, distributed optimizer, bf16 gradient sync "
             "(launcher examples: optim.grad_sync_dtype=bf16)")


BRIDGE_2511 = ("Megatron-Bridge performance summary, NeMo 25.11 container (NVIDIA-NeMo/Megatron-Bridge "
               "docs/performance-summary.md), DGX-H100, fp8 current scaling, distributed optimizer")


DGXC_2409 = ("NVIDIA DGX Cloud benchmarking recipe (NVIDIA/dgxc-benchmarking llama3.1/README_8b.md), NeMo 24.09, "
             "DGX-H100, bf16, Megatron-Core + Transformer Engine, distributed optimizer")


def published_runs() -> dict:
    """name -> (workload, the published layout, published seconds per step, source)."""
    a100, h100 = PRESETS["a100-80gb"], PRESETS["h100"]
    llama2_7b = llama(32, 4096, 32, 32, 11008, 32000, 4096)
    llama2_13b = llama(40, 5120, 40, 40, 13824, 32000, 4096)
    llama2_70b = llama(80, 8192, 64, 8, 28672, 32000, 4096)
    llama3_8b = llama(32, 4096, 32, 8, 14336, 128256, 8192)
    llama3_70b = llama(80, 8192, 64, 8, 28672, 128256, 8192)
    llama3_405b = llama(126, 16384, 128, 8, 53248, 128256, 8192)
    gpt175 = nemo_gpt(96, 12288, 96)
    mixtral = moe(llama(32, 4096, 32, 8, 14336, 32000, 4096), 8, 2, 14336)
    qwen3_30b = moe(ModelConfig(layers=48, hidden=2048, heads=32, kv_heads=4, explicit_head_dim=128, qk_norm=True,
                                ffn_hidden=6144, vocab_size=151936, max_seq_len=4096), 128, 8, 768)

    def nemo(model, seq, batch, gpus, tok_s, **fixed):
        w = Workload(model, seq, batch, gpus, h100, precision="fp8", framework="megatron", grad_dtype="bfloat16")
        layout = dict(micro_batch=1, recompute="none", dp_style="distopt") | fixed
        layout["dp"] = gpus // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
        return w, layout, tokens_seconds(batch, seq, tok_s, gpus), NEMO_2407 + f": {gpus} GPUs, {tok_s:,} tokens/s/GPU"

    def bridge(model, seq, batch, gpus, tok_s, **fixed):
        w, layout, seconds, _ = nemo(model, seq, batch, gpus, tok_s, **fixed)
        return w, layout, seconds, (BRIDGE_2511 + f": {gpus} GPUs, {tok_s:,} tokens/s/GPU")

    def dgxc_bf16(model, seq, batch, gpus, seconds, **fixed):
        """A bf16 run of the DGX Cloud recipes, set up as `nemo` sets NeMo's (its launcher's performance
        settings: distributed optimizer, bf16 gradient sync), with its published seconds per step."""
        w = Workload(model, seq, batch, gpus, h100, precision="bf16", framework="megatron", grad_dtype="bfloat16")
        layout = dict(micro_batch=1, recompute="none", dp_style="distopt") | fixed
        layout["dp"] = gpus // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
        return w, layout, seconds, DGXC_2409 + f": {gpus} GPUs, {seconds} s/step"

    def meta(gpus, tflops, cp=1, seq=8192):
        batch = 16 * 2**20 // seq  # 16M tokens per step
        w = Workload(llama3_405b if seq == 8192 else llama(126, 16384, 128, 8, 53248, 128256, seq),
                     seq, batch, gpus, h100, framework="loom", attention_kernel="fused", fsdp2=False)
        return (w, dict(tp=8, pp=16, cp=cp, dp=gpus // (128 * cp), dp_style="fsdp"),
                flops_seconds(w.model, batch, seq, tflops, gpus),
                f"Llama 3 paper (Dubey et al. 2024), Table 4: {gpus} H100, bf16, {tflops} TFLOP/s/GPU, Meta's "
                "FSDP + 4D parallelism (its own stack, 2024: FSDP's flat parameters, no FSDP2 buffer copies; "
                "attention kernel not stated: priced at the fused rate); "
                "step time from TFLOP/s with loom's FLOP count")
    return {
        "narayanan-1.7b": (
            Workload(megatron_gpt(24, 2304, 24), 2048, 512, 32, a100, overlap_grad_reduce=False, framework="megatron"),
            dict(tp=1, pp=1, dp=32, sp=False, recompute="full", recompute_layers=0, dp_style="replicate"),
            narayanan_seconds(512, 2048, 24, 2304, 51200, 137, 32),
            "Narayanan et al. 2021, Table 1: 32 A100-80GB, 137 TFLOP/s/GPU by Eq. 3"),
        "narayanan-145.6b": (
            Workload(megatron_gpt(80, 12288, 96), 2048, 2304, 1536, a100, overlap_grad_reduce=False,
                     framework="megatron"),
            dict(tp=8, pp=8, dp=24, sp=False, recompute="full", recompute_layers=0, dp_style="replicate"),
            narayanan_seconds(2304, 2048, 80, 12288, 51200, 148, 1536),
            "Narayanan et al. 2021, Table 1: 1536 A100-80GB, 148 TFLOP/s/GPU by Eq. 3"),
        "korthikanti-175b-selective": (
            Workload(megatron_gpt(96, 12288, 96), 2048, 64, 64, a100, framework="megatron"),
            dict(tp=8, pp=8, dp=1, micro_batch=1, sp=True, recompute="selective"), 13.75,
            "Korthikanti et al. 2022, Table 4: 64 A100-80GB, SP + selective"),
        "korthikanti-175b-full": (
            Workload(megatron_gpt(96, 12288, 96), 2048, 64, 64, a100, framework="megatron"),
            dict(tp=8, pp=8, dp=1, micro_batch=1, sp=True, recompute="full", recompute_layers=0), 18.13,
            "Korthikanti et al. 2022, Table 4: 64 A100-80GB, full recomputation"),
        "nemo-llama2-7b-fp8": nemo(llama2_7b, 4096, 128, 8, 16847),
        "nemo-llama2-13b-fp8": nemo(llama2_13b, 4096, 128, 16, 8646, pp=4, vpp=10),
        "nemo-llama2-70b-fp8": nemo(llama2_70b, 4096, 128, 64, 1707, tp=4, pp=4, vpp=20),
        "nemo-llama3-8b-fp8": nemo(llama3_8b, 8192, 128, 8, 12036, cp=2),
        # The bf16 row of the same layout one release later (Llama 3.1 8B: Llama 3 8B's shapes; its RoPE
        # frequency scaling does not change the step): 12.91 s/step, 81,222 tokens/s on 8 GPUs (10,153 per GPU).
        "dgxc-llama31-8b-bf16": dgxc_bf16(llama3_8b, 8192, 128, 8, 12.91, cp=2),
        "nemo-llama3-70b-fp8": nemo(llama3_70b, 8192, 128, 64, 1533, tp=4, pp=4, cp=2, vpp=5),
        "nemo-gpt3-175b-128gpu-fp8": nemo(gpt175, 2048, 256, 128, 726, tp=4, pp=8, vpp=6, sp=True,
                                          recompute="selective"),
        "nemo-gpt3-175b-512gpu-fp8": nemo(gpt175, 2048, 2048, 512, 782, tp=4, pp=8, vpp=6, micro_batch=2,
                                          sp=True, recompute="selective"),
        "bridge-llama3-70b-pp8-fp8": bridge(llama3_70b, 8192, 128, 64, 1602, tp=4, pp=8, vpp=5),
        "bridge-llama31-405b-fp8": bridge(llama3_405b, 8192, 512, 1024, 292, tp=8, pp=8, cp=2, vpp=8),
        # Mixture of experts. Every one of these benchmarks forces balanced routing (moe_imbalance = 1).
        "mcore-mixtral-8x7b": (
            Workload(mixtral, 4096, 256, 64, h100, framework="megatron"),
            dict(tp=1, pp=4, vpp=8, ep=8, dp=16, micro_batch=1, dp_style="distopt"),
            flops_seconds(mixtral, 256, 4096, 468, 64),
            "Megatron-Core MoE (megatron/core/transformer/moe/README.md): Mixtral 8x7B, 64 H100, bf16, TP1 EP8 "
            "PP4 VPP8, 468 TFLOP/s/GPU; step time from TFLOP/s with loom's FLOP count (active experts)"),
        "automodel-qwen3-30b-a3b": (
            Workload(qwen3_30b, 4096, 512, 8, h100, loss_chunk=4096, attention_kernel="fused"),
            dict(tp=1, pp=1, ep=8, dp=8, micro_batch=4, dp_style="fsdp"), 21.773,
            "NeMo AutoModel performance summary (NVIDIA-NeMo/Automodel docs/performance-summary.md, 2025-10-02): "
            "Qwen3 MoE 30B, 8 H100, bf16, FSDP8 + EP8, PyTorch + TE (fused attention) + DeepEP, balanced gate, "
            "21.773 s/step; its "
            "fused linear cross-entropy priced as a 4096-token loss chunk"),
        "automodel-llama31-70b-fsdp-cp2": (
            Workload(llama3_70b, 8192, 128, 64, h100, framework="loom", attention_kernel="sdpa"),
            dict(tp=1, pp=1, cp=2, dp=32, micro_batch=1, sp=False, recompute="full", recompute_layers=0,
                 dp_style="fsdp"), 18.90,
            "NeMo AutoModel performance summary (NVIDIA-NeMo/Automodel docs/performance-summary.mdx; recipe "
            "examples/llm_benchmark/llama3_3/custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml): Llama-3.1 70B, "
            "64 H100, bf16, PyTorch FSDP2 over 32 x CP2 (bf16 gather, fp32 reduce-scatter every micro-batch), "
            "full activation checkpointing, torch.compile, SDPA, TE kernels, 18.90 s/step (866.77 tokens/s/GPU)"),
        "meta-llama3-405b-8k": meta(8192, 430),
        "meta-llama3-405b-16k": meta(16384, 400),
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


MEASURED = Path(__file__).with_name("measured_runs.json")


def measured_validation(compile: str = "auto") -> list[dict]:
    """loom's own runs measured on a GPU (`measured_runs.json`, numbers copied from the bench files it names),
    each predicted from the profile measured on that machine with its layout fixed as `loom plan --layout`
    fixes it; memory compared as the planner's total less its reserve (CUDA context, fragmentation) against
    torch.cuda.max_memory_allocated. Empty when the profile is not there (an installed package without
    the repository's bench/ folder)."""
    from loom.planner.hardware import load_gpu
    from loom.planner.steptime import evaluate
    from loom.planner.workload import Layout

    if not MEASURED.is_file():
        return []
    data = json.loads(MEASURED.read_text())
    root = Path(__file__).resolve().parents[2]
    gpus = {}  # a run's own "profile" (the machine it ran on), else the file's
    rows = []
    for run in data["runs"]:
        profile = root / run.get("profile", data["profile"])
        if not profile.is_file():
            continue
        if profile not in gpus:
            gpus[profile] = load_gpu(str(profile))
        gpu = gpus[profile]
        seq = run["seq"]
        shape = {"tie_embeddings": True, **data["shapes"][run["shape"]]}  # Llama-3.2's tied head unless unset
        cfg = ModelConfig(**shape, max_seq_len=seq, rope_theta=500000.0)
        w = Workload(cfg, seq, run["micro_batch"], 1, gpu, precision=run["precision"], loss_chunk=run["loss_chunk"],
                     compile=compile)
        # One process: loom's replicate style (fully_shard over one rank); recompute.mode=full recomputes
        # every layer (recompute_layers=0), as bench/gpu_train.py ran it.
        spec = f"tp=1,pp=1,dp=1,cp=1,mbs={run['micro_batch']},recompute={run['recompute']},style=replicate"
        best = evaluate(w, Layout(micro_batch=run["micro_batch"], recompute=run["recompute"], recompute_layers=0,
                                  dp_style="replicate"))
        memory = (best.memory["total"] - best.memory["reserve"]) / 2**30
        rows.append({"run": run["run"], "source": run["source"], "layout": spec,
                     "measured_s": round(run["step_s"], 4), "predicted_s": round(best.step_time_s, 4),
                     "error": round(best.step_time_s / run["step_s"] - 1, 4),
                     "measured_gib": round(run["peak_memory_gib"], 2), "predicted_gib": round(memory, 2),
                     "memory_error": round(memory / run["peak_memory_gib"] - 1, 4),
                     "time_s": {k: round(v, 4) for k, v in best.time_terms.items() if v}})
    return rows
