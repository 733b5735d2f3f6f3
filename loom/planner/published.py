"""Published training runs as the planner's workloads, layouts and step times (priced by validation.py).

Step times are compared, not TFLOP/s (Narayanan et al. count recomputation; NeMo counts GQA and SwiGLU exactly).
Each run is modelled with the software it used: unfused softmax attention and dropout for the 2021/2022 Megatron
runs, gradients reduced after backward in Megatron-LM 2021, no sequence parallelism before Korthikanti et al., no
zero-bubble schedule before 2023. Knobs a paper leaves open are the planner's; the hardware is the presets'.
"""

from __future__ import annotations

from loom.config import ModelConfig
from loom.planner.hardware import PRESETS
from loom.planner.workload import Workload


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


def megatron_recipe(model, seq, batch, gpus, precision="fp8", fsdp=False, fused_ce=False, **fixed):
    """(workload, layout) of a NeMo / Megatron-Bridge / DGX Cloud performance recipe on H100: Megatron-Core +
    Transformer Engine, bf16 gradient sync, the distributed optimizer (Megatron-FSDP with `fsdp`), micro-batch 1
    and no recomputation unless `fixed` says otherwise; `fused_ce` where the recipe sets
    cross_entropy_loss_fusion (NeMo-Framework-Launcher base_configs/llama3_8b.yaml does, gpt3.yaml does not)."""
    w = Workload(model, seq, batch, gpus, PRESETS["h100"], precision=precision, framework="megatron",
                 grad_dtype="bfloat16", fsdp2=not fsdp, ce_fusion=fused_ce)
    layout = dict(micro_batch=1, recompute="none", dp_style="fsdp" if fsdp else "distopt") | fixed
    layout["dp"] = gpus // (layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1))
    return w, layout


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

    def nemo(model, seq, batch, gpus, tok_s, fused_ce=True, **fixed):
        """NeMo 24.07's fp8 Llama rows fuse the cross-entropy; its GPT-3 rows pass `fused_ce=False`."""
        w, layout = megatron_recipe(model, seq, batch, gpus, fused_ce=fused_ce, **fixed)
        return w, layout, tokens_seconds(batch, seq, tok_s, gpus), NEMO_2407 + f": {gpus} GPUs, {tok_s:,} tokens/s/GPU"

    def bridge(model, seq, batch, gpus, tok_s, **fixed):
        w, layout, seconds, _ = nemo(model, seq, batch, gpus, tok_s, **fixed)
        return w, layout, seconds, (BRIDGE_2511 + f": {gpus} GPUs, {tok_s:,} tokens/s/GPU")

    def dgxc_bf16(model, seq, batch, gpus, seconds, **fixed):
        """A bf16 run of the DGX Cloud recipes, set up as `nemo` sets NeMo's (its launcher's performance
        settings: distributed optimizer, bf16 gradient sync), with its published seconds per step."""
        w, layout = megatron_recipe(model, seq, batch, gpus, precision="bf16", fused_ce=True, **fixed)
        return w, layout, seconds, DGXC_2409 + f": {gpus} GPUs, {seconds} s/step"

    def meta(gpus, tflops, cp=1, seq=8192):
        batch = 16 * 2**20 // seq  # 16M tokens per step
        w = Workload(llama3_405b if seq == 8192 else llama(126, 16384, 128, 8, 53248, 128256, seq),
                     seq, batch, gpus, h100, framework="loom", attention_kernel="fused", elementwise_kernels="fused",
                     fsdp2=False)
        return (w, dict(tp=8, pp=16, cp=cp, dp=gpus // (128 * cp), dp_style="fsdp"),
                flops_seconds(w.model, batch, seq, tflops, gpus),
                f"Llama 3 paper (Dubey et al. 2024), Table 4: {gpus} H100, bf16, {tflops} TFLOP/s/GPU, Meta's "
                "FSDP + 4D parallelism (its own stack, 2024: FSDP's flat parameters, no FSDP2 buffer copies; "
                "attention and elementwise kernels not stated: priced as fused ones); "
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
        "nemo-gpt3-175b-128gpu-fp8": nemo(gpt175, 2048, 256, 128, 726, fused_ce=False, tp=4, pp=8, vpp=6, sp=True,
                                          recompute="selective"),
        "nemo-gpt3-175b-512gpu-fp8": nemo(gpt175, 2048, 2048, 512, 782, fused_ce=False, tp=4, pp=8, vpp=6, micro_batch=2,
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
            Workload(qwen3_30b, 4096, 512, 8, h100, loss_chunk=4096, attention_kernel="fused", elementwise_kernels="fused",
                     state_dtype="bfloat16"),
            dict(tp=1, pp=1, ep=8, dp=8, micro_batch=4, dp_style="fsdp"), 21.773,
            "NeMo AutoModel performance summary (NVIDIA-NeMo/Automodel docs/performance-summary.md, 2025-10-02): "
            "Qwen3 MoE 30B, 8 H100, bf16, FSDP8 + EP8, PyTorch + TE (fused attention) + DeepEP, balanced gate, "
            "21.773 s/step; its "
            "fused linear cross-entropy priced as a 4096-token loss chunk; the model built in bf16 (from_config's "
            "torch_dtype auto), so torch.optim.Adam's moments are bf16 (state_dtype)"),
        "automodel-llama31-70b-fsdp-cp2": (
            Workload(llama3_70b, 8192, 128, 64, h100, framework="loom", attention_kernel="sdpa",
                     elementwise_kernels="fused"),
            dict(tp=1, pp=1, cp=2, dp=32, micro_batch=1, sp=False, recompute="full", recompute_layers=0,
                 dp_style="fsdp"), 18.90,
            "NeMo AutoModel performance summary (NVIDIA-NeMo/Automodel docs/performance-summary.mdx; recipe "
            "examples/llm_benchmark/llama3_3/custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml): Llama-3.1 70B, "
            "64 H100, bf16, PyTorch FSDP2 over 32 x CP2 (bf16 gather, fp32 reduce-scatter every micro-batch), "
            "full activation checkpointing, torch.compile, SDPA, TE kernels, 18.90 s/step (866.77 tokens/s/GPU)"),
        "meta-llama3-405b-8k": meta(8192, 430),
        "meta-llama3-405b-16k": meta(16384, 400),
    }


ZOO_QWEN3 = ("Megatron MoE model zoo (github.com/yanring/Megatron-MoE-ModelZoo, best_practice/Qwen3/readme.md): "
             "Qwen3-235B-A22B, 256 H100 (8 x 50 GB/s InfiniBand per node), bf16, seq 4096, GBS 2048, expert tensor "
             "parallelism 1, Megatron-LM's pretrain script with the zoo's model_configs/benchmarking/"
             "Qwen3-235B-A22B.yaml and sbatch_benchmarking.sh, neither of which passes --grad-reduce-in-bf16: "
             "Megatron-LM then accumulates and reduces bf16 runs' gradients in fp32")
BRIDGE_QWEN3_H100 = ("Megatron-Bridge performance summary, NeMo 25.11 (github.com/NVIDIA-NeMo/Megatron-Bridge "
                     "docs/performance-summary.md, DGX-H100 table): Qwen3-235B-A22B, 256 H100, fp8 current scaling, "
                     "TP2 PP8 VP4 EP32 MBS1, 1,575 tokens/s/GPU (233 TFLOP/s); the row lost its GBS column, 2048 is "
                     "the recipe's (scripts/performance/configs/qwen/qwen3_workload_base_configs.py, "
                     "QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V1: alltoall dispatcher, expert tensor parallelism "
                     "1, all-to-all overlapped with the other micro-batch's compute, which the planner does not "
                     "price) and the 25.09 row's, which reported 1,204 tokens/s/GPU for the same layout (token drop)")
DGXC_GROK1 = ("NVIDIA DGX Cloud benchmarking recipe (github.com/NVIDIA/dgxc-benchmarking grok1/README.md, NeMo "
              "25.04): Grok-1 314B (64 layers, hidden 6144, 48 heads / 8 groups, 8 experts of 32768, top-2, the "
              "Llama-3 tokenizer's 128,256 vocabulary), 512 H100, seq 8192, TP4 PP8 CP2 EP8 ETP1 VP8 MBS1 GBS1024")


def published_moe_runs() -> dict:
    """Published Megatron-Core MoE runs with tensor parallelism, each with its routing: name -> (workload, the
    published layout, published seconds per step, source, routing). Megatron runs the experts over tensor-
    and data-parallel ranks there (expert tensor parallelism 1), what `Workload.experts_over_tp` prices.
    Routing: "forced balanced" where the source says it forced balanced routing; otherwise the source does
    not say, and the run is priced balanced (moe_imbalance 1) all the same. Left out: layouts the planner
    cannot express (DeepSeek-V3's MLA, GPT-OSS's sliding windows, Llama-4 Maverick's expert tensor parallelism
    4, runs with the all-to-all overlapped
    across micro-batches when a non-overlapped row of the same layout exists) and Megatron-Bridge's
    Qwen3-30B-A3B on 16 H100, whose two releases report 5,275 and 10,494 tokens/s/GPU for one layout. The model
    zoo's PP32 x VPP3 split of 94 layers into 96 chunks (embedding and loss counted in the split) is in the
    held-out table, `published_moe_heldout_runs`."""
    h100 = PRESETS["h100"]
    qwen3_235b = moe(ModelConfig(layers=94, hidden=4096, heads=64, kv_heads=4, explicit_head_dim=128, qk_norm=True,
                                 ffn_hidden=12288, vocab_size=151936, max_seq_len=4096), 128, 8, 1536)
    grok1 = moe(llama(64, 6144, 48, 8, 32768, 128256, 8192), 8, 2, 32768)

    def megatron(model, seq, batch, gpus, precision, grad_dtype="bfloat16", **kw) -> Workload:
        """NeMo's and Megatron-Bridge's performance recipes reduce gradients in bf16; the model zoo's Megatron-LM
        runs keep Megatron-LM's fp32 default (ZOO_QWEN3)."""
        return Workload(model, seq, batch, gpus, h100, precision=precision, framework="megatron",
                        grad_dtype=grad_dtype, **kw)

    def layout(gpus, **fixed) -> dict:
        out = dict(micro_batch=1, sp=True, dp_style="distopt") | fixed
        out["dp"] = gpus // (out.get("tp", 1) * out.get("pp", 1) * out.get("cp", 1))
        return out

    unstated = "not stated (priced balanced)"
    return {
        "bridge-qwen3-235b-a22b-fp8": (
            megatron(qwen3_235b, 4096, 2048, 256, "fp8", ce_fusion=True),
            layout(256, tp=2, pp=8, vpp=4, ep=32, recompute="none"), tokens_seconds(2048, 4096, 1575, 256),
            BRIDGE_QWEN3_H100, "forced balanced (the summary: balanced token distribution, dropless)"),
        "zoo-qwen3-235b-tp2-ep32": (
            megatron(qwen3_235b, 4096, 2048, 256, "bf16", "float32", moe_dispatcher="deepep"),
            layout(256, tp=2, pp=8, vpp=4, ep=32), 19.7,
            ZOO_QWEN3 + ": DeepEP, TP2 PP8 VPP4 EP32 MBS1, recompute of norms and expert activations (not a "
            "loom recompute mode: left to the search), 19.7 s/step without the 1F1B all-to-all overlap",
            "likely forced balanced (best_practice/qwen3/run_235b.sh runs this layout, with the overlap, with "
            "--moe-router-force-load-balancing; priced balanced)"),
        "zoo-qwen3-235b-tp4-ep8": (
            megatron(qwen3_235b, 4096, 2048, 256, "bf16", "float32", moe_dispatcher="deepep"),
            layout(256, tp=4, pp=8, vpp=4, ep=8, recompute="none"), 29.0,
            ZOO_QWEN3 + ": DeepEP, TP4 PP8 VPP4 EP8 MBS1, no recompute, 29.0 s/step", unstated),
        "zoo-qwen3-235b-fsdp-ep8": (
            megatron(qwen3_235b, 4096, 2048, 256, "bf16", "float32", moe_dispatcher="deepep", fsdp2=False),
            layout(256, tp=2, pp=1, ep=8, micro_batch=4, dp_style="fsdp", recompute="full", recompute_layers=0),
            17.6, ZOO_QWEN3 + ": DeepEP, TP2 EP8 Megatron-FSDP over 128, MBS4, full recompute, 17.6 s/step",
            unstated),
        "dgxc-grok1-314b-bf16": (
            megatron(grok1, 8192, 1024, 512, "bf16"), layout(512, tp=4, pp=8, cp=2, vpp=8, ep=8, recompute="none"),
            15.933, DGXC_GROK1 + ", bf16: 15.933 s/step", unstated),
        "dgxc-grok1-314b-fp8": (
            megatron(grok1, 8192, 1024, 512, "fp8"), layout(512, tp=4, pp=8, cp=2, vpp=8, ep=8, recompute="none"),
            13.433, DGXC_GROK1 + ", fp8: 13.433 s/step", unstated),
    }


# The routing of the MoE runs in `published_runs` (both benchmarks force balanced routing).
PUBLISHED_MOE_ROUTING = {"mcore-mixtral-8x7b": "forced balanced", "automodel-qwen3-30b-a3b": "forced balanced (fake "
                         "balanced gate)"}


def megatron_core_seconds(B, s, L, h, ffn, V, tflops, gpus) -> float:
    """Step time implied by a TFLOP/s per GPU that Megatron-LM reports (megatron/training/training.py,
    num_floating_point_operations, core_r0.8.0): 12 B s L h^2 ((2 + s/h) + ffn/h + V/(2 L h)) for
    multi-head attention and a non-gated MLP (attention scores counted unmasked)."""
    return 12 * B * s * L * h * h * (2 + s / h + ffn / h + V / (2 * L * h)) / (tflops * 1e12 * gpus)


NARAYANAN_T1 = ("Narayanan et al. 2021 (arXiv 2104.04473), Table 1; the same rows in Megatron-LM's README of 2021 "
                "(images/cases_april2021.png, 'TP=8 and PP=8' for model-parallel size 64): A100-80GB on Selene, "
                "seq 2048, vocab 51200, Megatron-LM 2021")
MCORE_080 = ("Megatron-LM README (commit f2e5db4, 2024-07, images/model_table.png): Megatron-Core r0.8.0 weak "
             "scaling on H100, seq 4096, vocab 131072, GPT (4h MLP, untied head: the parameter counts match), "
             "overlapped data-, tensor- and pipeline-parallel communication (--overlap-grad-reduce "
             "--overlap-param-gather --tp-comm-overlap: distributed optimizer and SP); precision not stated, MFU "
             "quoted against the bf16 peak: priced bf16 with Megatron-LM's fp32 gradient buffer; norm, position "
             "embedding and dropout not stated (priced LayerNorm, RoPE, none); micro-batch, virtual stages and "
             "recomputation not stated (the planner's choice)")
NEMO_2407_RUNS = ("NeMo 24.07 performance summary (NVIDIA/NeMo docs/source/performance/performance_summary.md, "
                  "commit 4c73f77), DGX-H100, fp8")


def published_wide_runs() -> dict:
    """A wider set of published dense runs than `published_runs` (issue 38: the model must generalise): the
    rest of Narayanan et al.'s weak-scaling table, Megatron-Core's 2024 H100 weak scaling, NeMo 24.07's
    other rows, later Megatron-Bridge rows and Meta's 128k-context layout; name -> (workload, the
    published layout, published seconds per step, source). Modelled as `published_runs` models their kind.
    Left out: NeMo 24.07's GPT3-20B (TP2 MBS2, 5,851 tokens/s/GPU) and Nemotron-340B (TP8 PP8 VP12, GBS 32,
    322), whose published layouts the memory model puts over an H100's 79.6 GiB (80.1 and 91.6 GiB)."""
    a100, h100 = PRESETS["a100-80gb"], PRESETS["h100"]

    def narayanan(params, heads, hidden, layers, tp, pp, gpus, batch, tflops):
        w = Workload(megatron_gpt(layers, hidden, heads), 2048, batch, gpus, a100, overlap_grad_reduce=False,
                     framework="megatron")
        return (w, dict(tp=tp, pp=pp, dp=gpus // (tp * pp), sp=False, recompute="full", recompute_layers=0,
                        dp_style="replicate"),
                narayanan_seconds(batch, 2048, layers, hidden, 51200, tflops, gpus),
                NARAYANAN_T1 + f": {params}B, t={tp} p={pp}, {gpus} GPUs, batch {batch}, {tflops} TFLOP/s/GPU by Eq. 3")

    def mcore(params, heads, hidden, layers, tp, pp, gpus, batch, tflops):
        cfg = ModelConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden,
                          vocab_size=131072, max_seq_len=4096, norm="layernorm", mlp="gelu")
        w = Workload(cfg, 4096, batch, gpus, h100, framework="megatron")
        return (w, dict(tp=tp, pp=pp, dp=gpus // (tp * pp), sp=tp > 1, dp_style="distopt"),
                megatron_core_seconds(batch, 4096, layers, hidden, 4 * hidden, 131072, tflops, gpus),
                MCORE_080 + f": {params}B, TP{tp} PP{pp} DP{gpus // (tp * pp)}, batch {batch}, {tflops} TFLOP/s/GPU "
                "by Megatron's FLOP count")

    def nemo(model, seq, batch, gpus, tok_s, source, **recipe):
        """`megatron_recipe` with the source's tokens/s: the Llama rows fuse the cross-entropy, GPT-3's and
        Nemotron's launcher configs are priced unfused."""
        w, layout = megatron_recipe(model, seq, batch, gpus, **recipe)
        return w, layout, tokens_seconds(batch, seq, tok_s, gpus), source + f": {gpus} GPUs, {tok_s:,} tokens/s/GPU"

    def gpt(layers, hidden, heads, vocab):
        """NeMo launcher conf/training/gpt3/5b.yaml: GPT-2 BPE padded to 128 x tp; no dropout, as the launcher's
        fp8 performance config of that size (5b_fp8_performance.yaml, 2023-11)."""
        return ModelConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden,
                           vocab_size=vocab, max_seq_len=2048, norm="layernorm", mlp="gelu", position="learned",
                           bias=True, tie_embeddings=True)

    def nemotron(layers, hidden, heads, kv_heads):
        """NeMo launcher conf/training/nemotron/nemotron_{8b,22b}.yaml: LayerNorm(1p), RoPE, no bias, untied,
        a 4h squared-ReLU MLP (priced as the 4h GELU MLP: the same two GEMMs), Nemotron-4's 256,000-token
        vocabulary (Parmar et al. 2024; NeMo's 653 TFLOP/s at 12,701 tokens/s for the 8B implies it)."""
        return ModelConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=4 * hidden,
                           vocab_size=256000, max_seq_len=4096, norm="layernorm", mlp="gelu")

    llama3_8b = llama(32, 4096, 32, 8, 14336, 128256, 8192)
    llama3_70b = llama(80, 8192, 64, 8, 28672, 128256, 8192)
    llama3_405b = llama(126, 16384, 128, 8, 53248, 128256, 8192)
    bridge = ("Megatron-Bridge performance summary (NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md{}), "
              "DGX-H100, fp8")
    meta_w = Workload(llama(126, 16384, 128, 8, 53248, 128256, 131072), 131072, 128, 16384, h100, framework="loom",
                      attention_kernel="fused", elementwise_kernels="fused", fsdp2=False)
    return {
        "narayanan-3.6b": narayanan(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
        "narayanan-7.5b": narayanan(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
        "narayanan-18.4b": narayanan(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
        "narayanan-39.1b": narayanan(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
        "narayanan-76.1b": narayanan(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
        "narayanan-310.1b": narayanan(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
        "narayanan-529.6b": narayanan(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
        "narayanan-1008b": narayanan(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
        "mcore-1.7b-48gpu": mcore(1.7, 16, 2048, 24, 1, 1, 48, 192, 408.8),
        "mcore-7.1b-96gpu": mcore(7.1, 32, 4096, 30, 2, 1, 96, 192, 465.9),
        "mcore-16b-192gpu": mcore(16, 48, 6144, 32, 4, 1, 192, 192, 489.1),
        "mcore-32b-384gpu": mcore(32, 56, 7168, 48, 8, 1, 384, 192, 459.6),
        "mcore-70b-768gpu": mcore(70, 64, 8192, 84, 8, 2, 768, 384, 419.7),
        "mcore-119b-1536gpu": mcore(119, 80, 10240, 92, 8, 4, 1536, 768, 420.5),
        "mcore-177b-2304gpu": mcore(177, 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
        "mcore-314b-3072gpu": mcore(314, 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
        "mcore-462b-6144gpu": mcore(462, 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
        "nemo-gpt3-5b-fp8": nemo(gpt(24, 4096, 32, 50304), 2048, 2048, 64, 22521, NEMO_2407_RUNS + ", GPT3-5B, "
                                 "TP1 PP1 MBS4 GBS2048", micro_batch=4),
        "nemo-nemotron-8b-fp8": nemo(nemotron(32, 4096, 32, 32), 4096, 256, 64, 12701, NEMO_2407_RUNS +
                                     ", Nemotron-8B, TP2 PP1 MBS4 GBS256, SP", tp=2, micro_batch=4, sp=True),
        "nemo-nemotron-22b-fp8": nemo(nemotron(40, 6144, 48, 48), 4096, 256, 64, 4256, NEMO_2407_RUNS +
                                      ", Nemotron-22B, TP2 PP4 VP10 MBS2 GBS256, SP", tp=2, pp=4, vpp=10,
                                      micro_batch=2, sp=True),
        "bridge-llama3-8b-fsdp-fp8": nemo(llama3_8b, 8192, 128, 8, 14451, bridge.format(", 25.11 container") +
                                          " current scaling, Llama-3 8B, Megatron-FSDP over 8, MBS1 GBS128", fsdp=True,
                                          fused_ce=True),
        "bridge-70b-gbs256-fp8": nemo(llama3_70b, 8192, 256, 64, 1664, bridge.format(
            "-archive.md, 26.04.01 container") + ", Llama-3 70B, TP4 PP8 VP5 MBS1 GBS256", tp=4, pp=8, vpp=5,
            fused_ce=True),
        "bridge-405b-gbs1536-fp8": nemo(llama3_405b, 8192, 1536, 1024, 326, bridge.format(
            "-archive.md, 26.06 container") + ", Llama-3.1 405B, TP8 PP8 CP2 VP8 MBS1 GBS1536", tp=8, pp=8, cp=2,
            vpp=8, fused_ce=True),
        "meta-llama3-405b-128k": (
            meta_w, dict(tp=8, pp=16, cp=16, dp=8, dp_style="fsdp"),
            flops_seconds(meta_w.model, 128, 131072, 380, 16384),
            "Llama 3 paper (Dubey et al. 2024), Table 4: 16,384 H100, TP8 CP16 PP16 DP8, seq 131,072, 16M tokens per "
            "step, bf16, 380 TFLOP/s/GPU; modelled as meta-llama3-405b-8k; step time from TFLOP/s with loom's FLOP "
            "count"),
    }


def megatron_moe_seconds(cfg: ModelConfig, batch: int, seq: int, tflops: float, gpus: int) -> float:
    """Step time implied by a TFLOP/s per GPU that Megatron-LM reports for a GQA model whose every MLP is a
    routed-expert SwiGLU layer (megatron/training/training.py, num_floating_point_operations since mid-2025):
    12 B s L h^2 ((1 + g/a + s/(2h)) q/h + 1.5 k f_e/h + V/(2 L h)), causal attention halved, q the query
    projection width. The model zoo's own rows pin the convention: TP2 EP32's 245 TFLOP/s at 19.7 s/step and
    TP4 EP8's 167 at 29.0 s are what this count gives (246.2 and 167.3; 277.7 and 188.7 unhalved)."""
    h, a, g, L = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.layers
    ratio = cfg.heads * cfg.head_dim / h
    mlp = 1.5 * cfg.moe.top_k * cfg.moe.ffn_hidden / h
    flops = 12 * batch * seq * L * h * h * ((1 + g / a + seq / (2 * h)) * ratio + mlp + cfg.vocab_size / (2 * L * h))
    return flops / (tflops * 1e12 * gpus)


ZOO_COMMIT = "e865051"
ZOO_LONG = ("Megatron MoE model zoo (github.com/yanring/Megatron-MoE-ModelZoo, commit " + ZOO_COMMIT + ", "
            "best_practice/qwen3/readme.md, 'Long Context'): Qwen3-235B-A22B, 32 nodes of 8 H100 (8 x 50 GB/s "
            "InfiniBand), bf16, DeepEP, PP8 VPP4 EP8 MBS1 GBS256, --recompute-granularity selective "
            "--recompute-modules layernorm moe, no all-to-all overlap (A2A_OVERLAP=0), Megatron-LM's fp32 "
            "gradients (ZOO_QWEN3); step time from the forced-balance TFLOP/s with Megatron-LM's FLOP count "
            "(megatron_moe_seconds)")
BRIDGE_MB = "github.com/NVIDIA-NeMo/Megatron-Bridge"


def published_moe_heldout_runs() -> dict:
    """Published MoE runs on H100 held out from the cost model's fitting (issue 55): name -> (workload, the
    published layout, published seconds per step, source, routing). Long sequences under context parallelism
    (the model zoo's Qwen3-235B-A22B at 16k to 128k tokens), the zoo's 8-GPU-wide-EP layout with 32 pipeline
    stages, and Megatron-Bridge's later H100 rows (Qwen3-235B-A22B at GBS 8192; Qwen3-30B-A3B with EP16 over
    16 GPUs). Modelled as `published_moe_runs` models its rows; recomputation the source names but loom
    cannot express (Megatron's --recompute-modules) is left to the search. Left out for the reasons
    `published_moe_runs` gives: DeepSeek-V3 (MLA), GPT-OSS-120B (sliding windows, attention sinks), Nemotron-3
    (Mamba layers), Bridge 26.02's Qwen3-30B-A3B (PP2 VP12, 5,113 tokens/s/GPU, 9,058 in 26.02.01 for the same
    layout: left out rather than fitted)."""
    h100 = PRESETS["h100"]
    qwen3_235b = moe(ModelConfig(layers=94, hidden=4096, heads=64, kv_heads=4, explicit_head_dim=128, qk_norm=True,
                                 ffn_hidden=12288, vocab_size=151936, max_seq_len=131072), 128, 8, 1536)
    qwen3_30b = moe(ModelConfig(layers=48, hidden=2048, heads=32, kv_heads=4, explicit_head_dim=128, qk_norm=True,
                                ffn_hidden=6144, vocab_size=151936, max_seq_len=4096), 128, 8, 768)

    def layout(gpus, **fixed) -> dict:
        out = dict(micro_batch=1, sp=fixed.get("tp", 1) > 1, dp_style="distopt") | fixed
        out["dp"] = gpus // (out.get("tp", 1) * out.get("pp", 1) * out.get("cp", 1))
        return out

    def zoo_long(seq, cp, tflops):
        w = Workload(qwen3_235b, seq, 256, 256, h100, precision="bf16", framework="megatron", grad_dtype="float32",
                     moe_dispatcher="deepep")
        # At CP8, dp = 1: Megatron's distributed optimizer still shards over dp x cp = 8 ranks, a style the
        # search offers only for dp > 1 (loom/planner/search.py candidates), so that row finds no layout.
        return (w, layout(256, tp=4, pp=8, vpp=4, cp=cp, ep=8), megatron_moe_seconds(qwen3_235b, 256, seq, tflops, 256),
                ZOO_LONG + f": seq {seq:,}, TP4 CP{cp}, {tflops} TFLOP/s/GPU (forced balance)",
                "forced balanced (--moe-router-force-load-balancing)")

    def bridge(model, gpus, batch, tok_s, commit, release, recipe, **fixed):
        w = Workload(model, 4096, batch, gpus, h100, precision="fp8", framework="megatron", grad_dtype="bfloat16",
                     ce_fusion=True, **({"moe_dispatcher": "deepep"} if fixed.pop("flex", False) else {}))
        return (w, layout(gpus, recompute="none", **fixed), tokens_seconds(batch, 4096, tok_s, gpus),
                f"Megatron-Bridge performance summary ({BRIDGE_MB} docs/performance-summary-archive.md at commit "
                f"{commit}, {release} NeMo container, DGX-H100): fp8 current scaling, {tok_s:,} tokens/s/GPU; "
                f"recipe scripts/performance/configs/qwen/qwen3_workload_base_configs.py {recipe} (no "
                "recomputation: qwen3_llm_pretrain.py clears it)",
                "forced balanced (the summary: force-balanced token distribution, dropless)")

    def gpt_oss(layers, experts):
        """GPT-OSS (openai/gpt-oss-20b and -120b config.json): hidden 2880, 64 query heads of 64 over 8 groups,
        experts of 2880, top-4, vocabulary 201,088, untied. Its alternate layers' 128-token sliding window and
        attention sinks are priced as full causal attention (about 5% of the step at 4096 tokens, an over-count
        of time; none of memory: flash and flex attention keep no score matrix)."""
        return moe(ModelConfig(layers=layers, hidden=2880, heads=64, kv_heads=8, explicit_head_dim=64, ffn_hidden=2880,
                               vocab_size=201088, max_seq_len=4096, qkv_bias=True), experts, 4, 2880)

    def automodel(model, gpus, batch, mbs, seconds, config, kernels):
        """NeMo AutoModel (PyTorch FSDP2 + EP, TE linears and norms, DeepEP/HybridEP, fake balanced gate), as
        `published_runs`' automodel-qwen3-30b-a3b; its MaskedCrossEntropy (fp32_upcast false) computes whole
        logits (no loss chunk). Its benchmark configs name no model dtype: from_config builds the model in bf16
        (nemo_automodel/_transformers/auto_model.py, torch_dtype "auto" -> torch.bfloat16, so since the
        summary's first release, 2025-10-06), and torch.optim.Adam keeps its moments in the parameters' dtype:
        priced with bf16 moments (state_dtype); its bf16 weights and gradients are priced as loom's fp32 ones
        (the planner has no knob for them: an over-count of 4 bytes per parameter on the rank's shard)."""
        w = Workload(model, 4096, batch, gpus, h100, attention_kernel="fused", elementwise_kernels="fused",
                     moe_dispatcher="deepep", state_dtype="bfloat16")
        return (w, dict(tp=1, pp=1, ep=gpus, dp=gpus, micro_batch=mbs, dp_style="fsdp", recompute="none"), seconds,
                "NeMo AutoModel performance summary (github.com/NVIDIA-NeMo/Automodel docs/performance-summary.mdx, "
                f"commit cb9765441, DGX-H100 BF16 table): {config}, {gpus} H100, bf16, FSDP{gpus} + EP{gpus}, MBS "
                f"{mbs}, GBS {batch}, seq 4096, {kernels}, {seconds} s/step; config examples/llm_benchmark/gpt_oss/",
                "forced balanced (fake balanced gate)")

    return {
        "zoo-qwen3-235b-16k-cp1": zoo_long(16384, 1, 295),
        "zoo-qwen3-235b-32k-cp2": zoo_long(32768, 2, 335),
        "zoo-qwen3-235b-64k-cp4": zoo_long(65536, 4, 368),
        "zoo-qwen3-235b-128k-cp8": zoo_long(131072, 8, 389),
        "zoo-qwen3-235b-a2a-pp32": (
            Workload(qwen3_235b, 4096, 2048, 256, h100, precision="bf16", framework="megatron", grad_dtype="float32"),
            layout(256, tp=2, pp=32, vpp=3, ep=8), 24.2,
            "Megatron MoE model zoo (github.com/yanring/Megatron-MoE-ModelZoo, commit " + ZOO_COMMIT + ", "
            "best_practice/qwen3/readme.md, H100 table): Qwen3-235B-A22B, 256 H100, bf16, alltoall dispatcher, "
            "TP2 PP32 VPP3 EP8 MBS1 GBS2048, recompute of norms and expert activations, 24.2 s/step (96 virtual "
            "stages for 94 layers: Megatron counts the embedding and the loss in the split)",
            "not stated (priced balanced)"),
        "bridge-qwen3-235b-gbs8192-fp8": bridge(
            qwen3_235b, 256, 8192, 1712, "4ab94dfad", "26.04.01", "QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V2 "
            "(TP2 PP8 VP4 EP32, ETP1, alltoall dispatcher, moe_a2a_overlap on, which the planner does not price; "
            "26.02 to 26.04 reported 1,633, 1,611 and 1,686)", tp=2, pp=8, vpp=4, ep=32),
        "bridge-qwen3-30b-ep16-fp8": bridge(
            qwen3_30b, 16, 1024, 8826, "4ab94dfad", "26.06", "QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 (TP1 "
            "PP1 EP16 over 16 GPUs, ETP1, HybridEP flex dispatcher priced as DeepEP, no all-to-all overlap; 26.04 "
            "and 26.04.01 reported 8,901 and 8,960)", ep=16, flex=True),
        "automodel-gpt-oss-20b": automodel(gpt_oss(24, 32), 8, 256, 2, 10.04, "GPT-OSS 20B",
                                           "TE + DeepEP + FlexAttn (gptoss_20b_te_deepep.yaml)"),
        "automodel-gpt-oss-120b": automodel(gpt_oss(36, 128), 64, 512, 2, 4.30, "GPT-OSS 120B",
                                            "TE + DeepEP (gptoss_120b_te_deepep.yaml)"),
    }
