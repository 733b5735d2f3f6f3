"""What the planner prices: a workload (model, batch, cluster and the framework choices that run it), a
parallel layout of it, and the estimate the cost model gives for the pair."""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.config import ModelConfig
from loom.rules import compile_problem, experts_span_tp
from loom.planner.hardware import GPU

GIB = 2**30


@dataclass(frozen=True, eq=False)  # hashed by identity: the cost model's caches key on it
class Workload:
    model: ModelConfig
    seq_len: int
    global_batch: int
    gpus: int
    gpu: GPU
    precision: str = "bf16"  # bf16 | fp16 | fp8 (fp8: linear layers only, attention stays 16-bit)
    state_dtype: str = "float32"  # AdamW moments
    # Gradient reduction overlapped with backward (loom's FSDP2, Megatron-Core's --overlap-grad-reduce).
    # Megatron-LM before 2023 reduced after the last backward; validation of those runs turns it off.
    overlap_grad_reduce: bool = True
    # FSDP gradients over a step's micro-batches (loom's parallel.grad_accum): "sharded" reduce-scatters
    # every micro-batch, "unsharded" holds them whole until the last; pipelines always reduce once.
    grad_accum: str = "sharded"
    # GiB per GPU kept free beyond the modelled total (allocator caching and spikes the model does not see);
    # `loom plan --memory-margin`, default 5% of the GPU's memory there; 0 here (library and validation).
    memory_margin_gib: float = 0.0
    # Which framework runs the layout, for its memory: "loom" (the formulas `loom memory` is tested against)
    # or "megatron" (Megatron-Core with Transformer Engine, as NeMo runs it; see megatron_layer_activation_bytes).
    # dp_style="distopt" is Megatron's distributed optimizer under "megatron", loom's (loom/parallel/distopt.py)
    # under "loom".
    framework: str = "loom"
    # Megatron's gradient buffer: float32 (Megatron-LM's default for bf16, --accumulate-allreduce-grads-in-fp32)
    # or bfloat16 (NeMo's performance recipes: grad_reduce_in_fp32=False). loom keeps fp32 gradients.
    grad_dtype: str = "float32"
    # Mixture of experts: tokens routed to the busiest expert-parallel rank over the mean (1.0: balanced, as
    # Megatron-Bridge's and NeMo AutoModel's MoE benchmarks force). It scales the busiest rank's expert work,
    # activations and all-to-all volume.
    moe_imbalance: float = 1.0
    # Mixture of experts: how tokens reach their experts' ranks. "alltoall": every routed row is sent to its
    # expert's rank (loom's all-to-all, Megatron's alltoall dispatcher); "deepep": DeepEP's kernels (Megatron's
    # flex dispatcher) send a token across the network once per node it goes to, forwarding it over NVLink there.
    moe_dispatcher: str = "alltoall"
    # Expert parallelism's exchange pipelined in this many chunks (loom's parallel.ep_overlap_chunks): all but
    # the first dispatch and the last combine can hide behind the routed experts' products (`_moe_forward`).
    ep_overlap_chunks: int = 1
    # LM head + cross-entropy this many tokens at a time, the head's gradients computed in forward (loom's
    # train.loss_chunk; fused linear cross-entropy elsewhere): one chunk's logits alive instead of the
    # micro-batch's, plus the kept gradients (hidden states', fp32 head weight's); no extra head forward.
    # 0: whole micro-batch; "auto": loom's default (train.loss_chunk=auto), chunks of loom.rules.AUTO_LOSS_CHUNK
    # on a layout of loom's own runtime with tp = pp = 1 on a GPU, else whole (`at_layout`).
    loss_chunk: int | str = 0
    # Megatron-Core's cross-entropy: False, its unfused vocab-parallel loss (Megatron-LM's default); True, the
    # fused one (--cross-entropy-loss-fusion, which NeMo's Llama recipes and Megatron-Bridge set). Prices the
    # loss's passes over the logits (`layertime.CE_BYTES_PER_LOGIT`); loom's own loss is neither.
    ce_fusion: bool = False
    # Attention kernel: "sdpa" (torch's scaled_dot_product_attention, flash backend: FlashAttention-2, what
    # loom runs), "fused" (Transformer Engine's cuDNN fused attention), or "auto": fused when the framework
    # is megatron, else sdpa.
    attention_kernel: str = "auto"
    # Whose kernels run the layer's norms, residual adds, activation function and rotary embedding: "loom"
    # (loom's own modules: one eager kernel per op unless the block is compiled, `GPU.eager_elementwise_fraction`),
    # "fused" (a stack that fuses them: Transformer Engine's modules, Meta's), or "auto": fused when the
    # framework is megatron (or the layout runs Megatron's distributed optimizer, `steptime`), else loom.
    elementwise_kernels: str = "auto"
    # Data parallelism through torch's fully_shard (FSDP2, per-parameter buffers: loom and PyTorch-native
    # trainers), whose copies into and out of its flat collective buffers run on the compute stream
    # (fsdp2_copy_bytes); False for a stack that gathers and reduces flat buffers in place (FSDP1's flat
    # parameters, Megatron's distributed optimizer).
    fsdp2: bool = True
    # The loom command that will run the layout (train, sft, rm, dpo, rl): its recipe's refusals
    # (loom.rules.recipe_problem, e.g. DPO on data parallelism only) rule layouts out as `loom <recipe>` would.
    recipe: str = "train"
    # LoRA (lora.rank > 0): the base frozen in the training dtype (no gradients, no optimizer state) and adapters
    # of this rank on `lora_targets` (loom's module names: wq, wk, wv, wo, w1, w2, w3) trained in fp32.
    lora_rank: int = 0
    lora_targets: tuple = ()
    # Transformer blocks compiled (loom's train.compile: inductor fuses each block's elementwise ops into
    # Triton kernels, priced by `kernels.compiled_elementwise_time`): "on", "off", or "auto", what loom's
    # GPU path runs: compiled wherever the rule book lets train.compile run (`runs_compiled`; every layout
    # but the zero-bubble schedule since issue 52, tests/test_compile_layouts.py), on loom's own runtime,
    # eager on a CPU. The compiled rate is the one measured for tp = 1 dense blocks on an H200; the
    # tensor-parallel, context-parallel and MoE blocks' compiled rate (their graph breaks at the collectives)
    # is the device check's to measure. The step-time model resolves "auto" per layout
    # (`steptime.compiled_workload`).
    compile: str = "auto"

    @property
    def usable_bytes(self) -> float:
        return (self.gpu.memory_gib - self.memory_margin_gib) * GIB

    def at_layout(self, lay: "Layout") -> "Workload":
        """This workload as layout `lay` runs it: `loss_chunk="auto"` resolved as `loom.rules.loss_chunk_tokens`
        resolves loom's setting (a CPU profile, Megatron's runtime, tp or pp > 1: whole logits)."""
        if self.loss_chunk != "auto":
            return self
        from dataclasses import replace

        from loom.rules import loss_chunk_tokens

        # loom rl, dpo and rm compute whole logits (their losses read every position's log-probs)
        chunks = self._loom_gpu_runtime(lay) and self.recipe not in ("rl", "dpo", "rm")
        return replace(self, loss_chunk=loss_chunk_tokens("auto", "cuda" if chunks else "cpu", lay.tp, lay.pp))

    def _loom_gpu_runtime(self, lay: "Layout") -> bool:
        """Whether layout `lay` runs on loom's own runtime (not Megatron's) on a GPU (a CPU profile's name starts
        with "cpu", profile.py)."""
        return self.framework == "loom" and not self.gpu.is_cpu

    def runs_compiled(self, lay: "Layout") -> bool:
        """Whether the blocks of layout `lay` run compiled (see `compile`)."""
        if self.compile != "auto":
            return self.compile == "on"
        # loom's GPU path compiles every block wherever the rule book lets train.compile run
        # (`loom.rules.compile_problem`: all layouts but the zero-bubble schedule), and the config the planner
        # writes says so. What stays eager inside a compiled layout (the collectives at the graph breaks, the
        # experts between the expert-parallel all-to-alls) is priced by its own terms, not by this one.
        return self._loom_gpu_runtime(lay) and compile_problem(lay.schedule) is None

    def experts_over_tp(self, tp: int, sp: bool, ep: int) -> bool:
        """Whether each rank routes only its own sequence shard (its tokens / tp) to routed experts spread over
        tensor- as well as data- and context-parallel ranks, no expert replicated across tensor-parallel ranks:
        loom's layout under sequence parallelism with ep a multiple of tp (`loom.rules.experts_span_tp`), and
        Megatron-Core's (--framework megatron) whenever tp > 1 with sequence parallelism (expert tensor
        parallelism 1, what its MoE recipes set; Megatron requires SP for MoE with TP). Otherwise every
        tensor-parallel rank computes the whole MoE layer on all its group's tokens."""
        if not self.model.moe_layers:
            return False
        if self.framework == "megatron":
            return tp > 1 and sp
        return experts_span_tp(tp, sp, ep)

    def loom_attention_tflops(self, prec: str) -> float | None:
        """TFLOP/s of loom's own attention at this sequence length from a profile's `attention_tflops` (log-
        interpolated between measured lengths), or None: no table, or a kernel other than loom's SDPA. The
        table of the head dim nearest the model's (in ratio): `prec` holds head dim 128, `f"{prec}:d{D}"`
        head dim D (`profile.attention_table`)."""
        import math

        from loom.planner.kernels import log_interpolate

        loom_sdpa = self.attention_kernel == "sdpa" or (self.attention_kernel == "auto" and self.framework == "loom")
        tables = {128: self.gpu.attention_tflops.get(prec)}
        for key, rows in self.gpu.attention_tflops.items():
            name, _, dim = key.partition(":d")
            if name == prec and dim.isdigit():
                tables[int(dim)] = rows
        dims = [dim for dim, rows in tables.items() if rows]
        if not loom_sdpa or not dims:
            return None
        nearest = min(dims, key=lambda dim: (abs(math.log(dim / self.model.head_dim)), -dim))
        return log_interpolate(tables[nearest], self.seq_len)

    def fused_elementwise(self) -> bool:
        """Whether the layer's elementwise ops run as fused kernels (`kernels.compiled_elementwise_time`): a
        compiled block, or a stack with fused kernels (`elementwise_kernels`); else loom's eager ops."""
        if self.elementwise_kernels not in ("auto", "loom", "fused"):
            raise ValueError(f"elementwise_kernels={self.elementwise_kernels!r}; valid: auto, loom, fused")
        return self.compile == "on" or self.elementwise_kernels == "fused" or (
            self.elementwise_kernels == "auto" and self.framework == "megatron")

    @property
    def attention_efficiency(self) -> float:
        """The fraction of the 16-bit peak this workload's fused attention kernel sustains."""
        # "auto": Megatron runs Transformer Engine's cuDNN attention. loom's SDPA puts cuDNN's fused attention
        # first on Hopper and newer (loom.train.steps.attention_kernels): a profile measured on such a GPU times
        # that kernel (`profile.attention_rate`, fused_attention_efficiency) and loom is priced with it; a
        # preset with a fused figure (Hopper) prices loom's with it too, as loom's own H200 run measured it
        # (hardware.py, `fused_attention_efficiency`). A profile without the fused figure keeps its own rate.
        measured_cudnn = self.gpu.source != "preset" and self.gpu.fused_attention_efficiency > 0
        hopper_preset = self.gpu.source == "preset" and self.gpu.fused_attention_efficiency > 0
        fused = self.attention_kernel == "fused" or (self.attention_kernel == "auto" and (
            self.framework == "megatron" or measured_cudnn or hopper_preset))
        return (self.gpu.fused_attention_efficiency or self.gpu.attention_efficiency) if fused else self.gpu.attention_efficiency


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    sp: bool = False
    recompute: str = "none"  # none | selective | full
    recompute_layers: int = 0  # full: layers per chunk recomputed, as loom's recompute.num_layers (0 = all)
    dp_style: str = "fsdp"  # replicate | distopt | fsdp
    schedule: str = "1f1b"  # 1f1b | interleaved | zero_bubble
    # Uneven pipeline split (loom's parallel.first/last_stage_layers): layers in the first / last chunk,
    # the other chunks splitting the rest evenly; 0 = even split.
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    # Megatron-Core's split counting the embedding / the head and loss as a layer each (loom's
    # parallel.embedding_in_split / loss_in_split): pp x vpp up to layers + 2.
    embedding_in_split: bool = False
    loss_in_split: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


@dataclass
class Estimate:
    layout: Layout
    step_time_s: float
    time_terms: dict  # seconds per step, each term
    memory: dict  # bytes per GPU
    fits: bool
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    notes: list = field(default_factory=list)

    def to_json(self) -> dict:
        lay = self.layout
        rec = lay.recompute
        return {
            "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep,
            "micro_batch": lay.micro_batch, "sp": lay.sp, "recompute": rec,
            "recompute_layers": lay.recompute_layers, "dp_style": lay.dp_style, "schedule": lay.schedule,
            "first_stage_layers": lay.first_stage_layers, "last_stage_layers": lay.last_stage_layers,
            "embedding_in_split": lay.embedding_in_split, "loss_in_split": lay.loss_in_split,
            "step_time_s": round(self.step_time_s, 6),
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 3),
            "tflops_per_gpu": round(self.tflops_per_gpu, 3),
            "mfu": round(self.mfu, 5),
            "memory_gib": {k: round(v / GIB, 4) for k, v in self.memory.items()},
            "time_s": {k: round(v, 6) for k, v in self.time_terms.items()},
            "fits": self.fits,
        }
