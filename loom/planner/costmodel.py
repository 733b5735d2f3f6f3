"""Memory and step-time model of one training layout: the physics the planner ranks layouts with.

Everything derives from the architecture (`ModelConfig`), the layout, and the hardware numbers in
`hardware.py`; nothing is fitted to a particular published run. FLOPs and activation bytes come from
`loom.flops` — the same formulas `loom memory` is tested against.

Time of one micro-batch on one pipeline stage is the sum of
  gemm         linear-layer matmuls: 2mnk / (peak x ceiling), plus the expected half-wave tail of the
               kernel (tiles of 128x128 spread over the SMs), or the memory roofline if that is slower;
  attention    the s x s part: fused kernel FLOPs (causal half) over the efficiency of the kernel that runs
               it (torch SDPA's FlashAttention-2 for loom, Transformer Engine's cuDNN attention for
               Megatron), or with "math" attention two batched GEMMs plus the softmax/mask/dropout traffic;
  elementwise  norms, residual adds, activation functions, RoPE, dropout: bytes over HBM bandwidth, or
               over the rate a profile measured for loom's own layer at that working set (a CPU's
               are compute-bound) (backward moves twice the forward bytes);
  tp_comm      tensor-parallel all-reduces (or all-gather + reduce-scatter with SP) that are not
               overlapped, over NVLink when the group fits in a node, else the network (every collective
               across nodes moves one network port per group rank in a node: rail-optimised clusters);
  overhead     the gap between dependent kernels;
forward and backward (with recomputation's extra forward work). A step is then
  pipeline     (m + bubble) micro-batch slots of the slowest stage, bubble = (p-1)/v for 1F1B and
               interleaved, (p-1)/3 for zero-bubble; plus P2P transfers;
  dp_comm      the part of gradient reduction / parameter gathering not hidden behind backward;
  fsdp_copy    FSDP2's copies into and out of its flat collective buffers, on the compute stream;
  optimizer    the AdamW update, bytes over HBM bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from loom.config import ModelConfig
from loom.flops import layer_activation_bytes, train_flops_per_token
from loom.rules import grads_stay_sharded, rank_chunks, valid_split
from loom.planner.hardware import GPU

GIB = 2**30
TILE = 128  # GEMM tile edge for the wave-tail model
CONTEXT_GIB = 1.0  # CUDA context, cuBLAS workspace, NCCL buffers
FRAGMENTATION = 0.05  # allowance for allocator fragmentation, of everything else


@dataclass(frozen=True, eq=False)  # hashed by identity: the caches below key on it
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
    # Megatron's distributed optimizer (dp_style="distopt") is always priced as Megatron runs it.
    framework: str = "loom"
    # Megatron's gradient buffer: float32 (Megatron-LM's default for bf16, --accumulate-allreduce-grads-in-fp32)
    # or bfloat16 (NeMo's performance recipes: grad_reduce_in_fp32=False). loom keeps fp32 gradients.
    grad_dtype: str = "float32"
    # Mixture of experts: tokens routed to the busiest expert-parallel rank over the mean (1.0: balanced, as
    # Megatron-Bridge's and NeMo AutoModel's MoE benchmarks force). It scales the busiest rank's expert work,
    # activations and all-to-all volume.
    moe_imbalance: float = 1.0
    # LM head + cross-entropy this many tokens at a time, each chunk's logits recomputed in backward (loom's
    # train.loss_chunk; fused linear cross-entropy elsewhere): one chunk's logits alive instead of the
    # micro-batch's, for one more head forward. 0: whole micro-batch.
    loss_chunk: int = 0
    # Attention kernel: "sdpa" (torch's scaled_dot_product_attention, flash backend: FlashAttention-2, what
    # loom runs), "fused" (Transformer Engine's cuDNN fused attention), or "auto": fused when the framework
    # is megatron, else sdpa.
    attention_kernel: str = "auto"
    # Data parallelism through torch's fully_shard (FSDP2, per-parameter buffers: loom and PyTorch-native
    # trainers), whose copies into and out of its flat collective buffers run on the compute stream
    # (fsdp2_copy_bytes); False for a stack that gathers and reduces flat buffers in place (FSDP1's flat
    # parameters, Megatron's distributed optimizer).
    fsdp2: bool = True

    @property
    def usable_bytes(self) -> float:
        return (self.gpu.memory_gib - self.memory_margin_gib) * GIB

    @property
    def attention_efficiency(self) -> float:
        """The fraction of the 16-bit peak this workload's fused attention kernel sustains."""
        fused = self.attention_kernel == "fused" or (self.attention_kernel == "auto" and self.framework == "megatron")
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
            "step_time_s": round(self.step_time_s, 6),
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 3),
            "tflops_per_gpu": round(self.tflops_per_gpu, 3),
            "mfu": round(self.mfu, 5),
            "memory_gib": {k: round(v / GIB, 4) for k, v in self.memory.items()},
            "time_s": {k: round(v, 6) for k, v in self.time_terms.items()},
            "fits": self.fits,
        }


# ---------------------------------------------------------------------------------------------------------
# Parameters


def _norm_params(cfg: ModelConfig) -> int:
    return cfg.hidden * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def _mlp_params(cfg: ModelConfig, f: int) -> int:
    """One MLP of width f: 3 (SwiGLU) or 2 matrices, and their biases with model.bias."""
    gated = cfg.mlp == "swiglu"
    return (3 if gated else 2) * cfg.hidden * f + (((2 if gated else 1) * f + cfg.hidden) if cfg.bias else 0)


def layer_params(cfg: ModelConfig, moe: bool = False) -> int:
    """One layer's parameters; `moe`: a mixture-of-experts layer (router, routed experts, shared experts and
    their gate), as loom/models/moe.py builds it."""
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    attn = h * (a + 2 * g) * d + a * d * h
    mlp = moe_mlp_params(cfg) if moe else _mlp_params(cfg, f)
    norms = 2 * _norm_params(cfg)
    bias = ((a + 2 * g) * d + h) if cfg.bias else 0
    bias += (a + 2 * g) * d if cfg.qkv_bias and not cfg.bias else 0  # Qwen2: q/k/v biases only
    qk_norm = 2 * d if cfg.qk_norm else 0  # Qwen3: one weight of head size for queries, one for keys
    return attn + mlp + norms + bias + qk_norm


def expert_params(cfg: ModelConfig) -> int:
    """The routed experts of one MoE layer (stacked w1, w3, w2: no biases), what expert parallelism shards."""
    return cfg.moe_experts * (3 if cfg.mlp == "swiglu" else 2) * cfg.hidden * (cfg.moe_ffn_hidden or cfg.ffn_hidden)


def moe_mlp_params(cfg: ModelConfig) -> int:
    """An MoE layer's MLP: the router [E, h], the routed experts, the shared experts (one MLP shared_experts x
    moe.ffn_hidden wide) and their sigmoid gate [1, h]."""
    fe = cfg.moe_ffn_hidden or cfg.ffn_hidden
    shared = _mlp_params(cfg, cfg.moe_shared_experts * fe) if cfg.moe_shared_experts else 0
    gate = cfg.hidden if cfg.moe_shared_experts and cfg.moe_shared_gate else 0
    return cfg.moe_experts * cfg.hidden + expert_params(cfg) + shared + gate


def average_layer(cfg: ModelConfig) -> tuple[float, float]:
    """(parameters outside the routed experts, routed-expert parameters) of the model's average layer: the
    planner prices a pipeline stage of n layers as n average layers (MoE layers spread evenly)."""
    moe = cfg.moe_layers
    dense = (cfg.layers - moe) * layer_params(cfg) + moe * (layer_params(cfg, moe=True) - expert_params(cfg))
    return dense / cfg.layers, moe * expert_params(cfg) / cfg.layers


def linear_weights(cfg: ModelConfig) -> int:
    """Weights of one (dense) layer's linear layers (the ones fp8 training casts)."""
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    return h * (a + 2 * g) * d + a * d * h + (3 if cfg.mlp == "swiglu" else 2) * h * f


def embedding_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.hidden + (cfg.max_seq_len * cfg.hidden if cfg.position == "learned" else 0)


def head_params(cfg: ModelConfig) -> int:
    # A tied head still needs its own copy on the last stage when pp > 1 (Megatron does the same).
    return cfg.vocab_size * cfg.hidden + _norm_params(cfg)


def total_params(cfg: ModelConfig) -> int:
    head = _norm_params(cfg) + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden)
    moe = cfg.moe_layers
    layers = (cfg.layers - moe) * layer_params(cfg) + moe * layer_params(cfg, moe=True)
    return layers + embedding_params(cfg) + head


# ---------------------------------------------------------------------------------------------------------
# Kernels


def gemm_time(gpu: GPU, precision: str, m: int, n: int, k: int, batch: int = 1) -> float:
    """Seconds for `batch` independent (m x k) @ (k x n) products."""
    flops = 2.0 * m * n * k * batch
    table = gpu.gemm.get(precision)
    if table:
        rate = _measured_rate(tuple(map(tuple, table)), m, n, k) * 1e12
        compute = flops / rate
    else:
        rate = gpu.peak(precision) * 1e12 * gpu.matmul_efficiency.get(precision, 0.7)
        tiles = batch * math.ceil(m / TILE) * math.ceil(n / TILE)
        per_tile = 2.0 * TILE * TILE * k
        # Work is done in waves of `sms` tiles; on average half a wave is lost at the tail.
        tail = 0.5 * per_tile * gpu.sms if tiles > gpu.sms else per_tile * (gpu.sms - tiles)
        compute = (flops + tail) / rate
    elem = {"fp8": 1, "fp32": 4}.get(precision, 2)
    memory = batch * (m * k + k * n + m * n) * elem / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency)
    return max(compute, memory) + gpu.kernel_overhead_us * 1e-6


@lru_cache(maxsize=4096)
def _measured_rate(table: tuple, m: int, n: int, k: int) -> float:
    """TFLOP/s of the measured shape closest in log-space (a profile's table)."""
    best, rate = None, None
    for tm, tn, tk, tflops in table:
        dist = (math.log(m / tm)) ** 2 + (math.log(n / tn)) ** 2 + (math.log(k / tk)) ** 2
        if best is None or dist < best:
            best, rate = dist, tflops
    return rate


def _bytes_time(gpu: GPU, nbytes: float) -> float:
    return nbytes / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency)


def members_per_node(gpu: GPU, stride: int, size: int) -> int:
    """Ranks of a group of `size` ranks, `stride` apart in the world (tp innermost, as loom's mesh), that
    share one node."""
    return max(1, min(size, gpu.node_size // stride))


def collective_time(gpu: GPU, kind: str, nbytes: float, n: int, per_node: int) -> float:
    """Ring all-reduce / all-gather / reduce-scatter of `nbytes` (the full tensor) over n ranks, `per_node`
    of them in each node. Inside a node: NVLink. Across nodes the cluster is rail-optimised (DGX/HGX: one
    network port per GPU): NCCL runs one ring per port, each crossing every node boundary once, so a group
    with k ranks per node moves k ports' bandwidth between nodes (capped by NVLink, which the rings also
    cross). nccl-tests all-reduce over 8-GPU H100 nodes with 8 x 400 Gb/s NDR reaches 400-450 GB/s bus
    bandwidth, where one port is 50 GB/s; a group with one rank per node (dp across tp=8 nodes) gets one port."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    intra_node = per_node >= n
    link = gpu.nvlink_gbps if intra_node else min(gpu.nvlink_gbps, per_node * gpu.internode_gbps)
    bw = link * 1e9 * gpu.collective_efficiency
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    latency = gpu.collective_latency_us * 1e-6 * (2 if kind == "all_reduce" else 1) * (1 if intra_node else 2)
    return latency + factor * nbytes / bw


def p2p_time(gpu: GPU, nbytes: float, intra_node: bool) -> float:
    bw = (gpu.nvlink_gbps if intra_node else gpu.internode_gbps) * 1e9 * gpu.collective_efficiency
    return gpu.collective_latency_us * 1e-6 + nbytes / bw


# ---------------------------------------------------------------------------------------------------------
# One layer, one micro-batch


@dataclass(frozen=True)
class LayerTimes:
    fwd: dict
    bwd: dict  # including recomputation


def elementwise_bytes_per_token(cfg: ModelConfig, prec: str, tp: int = 1, sp: bool = False, moe: bool = False) -> float:
    """Bytes the elementwise ops of one layer's forward move per token on a rank: two norms, two residual
    adds (replicated over tp unless SP splits the sequence), the MLP's activation function and rotary
    embedding (split over tp), dropout and fp8 casts when present."""
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    half = 4 if prec == "fp32" else 2  # bytes of an activation element
    per_token_hidden = 2 * (2 * h * half) + 2 * (3 * h * half)  # two norms, two residual adds
    if cfg.dropout > 0:
        per_token_hidden += 2 * (2 * h * half + h)
    per_token_split = (3 if cfg.mlp == "swiglu" else 2) * f * half if not moe else 0.0  # activation function
    if cfg.position == "rope":
        per_token_split += 2 * (a + g) * d * half
    fp8_cast = 0.0
    if prec == "fp8":
        # Every linear input (forward) and output gradient (backward) is scaled and cast to fp8, plus a
        # transposed fp8 copy for the weight gradient: 4 bytes moved per input element over forward and
        # backward together. Half is counted here, in the forward's bytes; backward's 2x gives the rest.
        inputs_per_token = h + a * d / tp + h + f / tp  # QKV, out-proj, fc1, fc2 inputs on this rank
        fp8_cast = 4 * inputs_per_token / 2
    return per_token_hidden / (tp if sp else 1) + per_token_split / tp + fp8_cast


def elementwise_time(gpu: GPU, prec: str, nbytes: float) -> float:
    """Seconds for a layer's elementwise ops that move `nbytes` (as `elementwise_bytes_per_token` counts
    them): at the rate a profile measured for loom's own layer at the nearest working-set size (on a CPU
    these ops are compute- and dispatch-bound, far below the memory bandwidth, and faster while the
    working set fits in cache), else at the memory bandwidth."""
    table = gpu.elementwise_gbps.get("bf16" if prec == "fp8" else prec)  # fp8 runs these ops in bf16
    if not table or nbytes <= 0:
        return _bytes_time(gpu, nbytes)
    return nbytes / (log_interpolate(table, nbytes) * 1e9)


def log_interpolate(table, x: float) -> float | None:
    """The value of a [[x, y], ...] table at x, linear in log x between the rows either side (the end
    rows' values beyond them); None without a table."""
    if not table:
        return None
    curve = sorted(table)
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    return curve[-1][1]


def _layer_forward(w: Workload, tp: int, cp: int, mbs: int, sp: bool, moe: bool = False,
                   ep: int = 1) -> tuple[dict, dict]:
    """Forward time terms of one layer (`moe`: a mixture-of-experts layer with experts over `ep` ranks), and
    the part of them that belongs to the attention core."""
    cfg, gpu, prec = w.model, w.gpu, w.precision
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    s = w.seq_len // cp  # this rank's queries
    tokens = mbs * s
    half = 4 if prec == "fp32" else 2  # bytes of an activation element
    # Linear layers, split over tp (columns for QKV / fc1, rows for out / fc2).
    gemm = gemm_time(gpu, prec, tokens, (a + 2 * g) * d // tp, h) + gemm_time(gpu, prec, tokens, h, a * d // tp)
    moe_terms = _moe_forward(w, tokens, tp, sp, ep) if moe else None
    if moe_terms:
        gemm += moe_terms["gemm"]
    else:
        gemm += (gemm_time(gpu, prec, tokens, (2 if cfg.mlp == "swiglu" else 1) * f // tp, h)
                 + gemm_time(gpu, prec, tokens, h, f // tp))
    heads = a // tp
    core: dict = {}
    if cfg.attention == "math":
        # Scores and context as batched GEMMs over the keys, then scale+mask+softmax (+ dropout). One rank
        # computes the whole square; a cp rank its two chunks of c = S/(2cp) queries against their key
        # prefixes ((i+1)c and (2cp-i)c keys: on average c(2cp+1)/2 per query, the same on every rank).
        keys = w.seq_len if cp == 1 else w.seq_len * (2 * cp + 1) // (4 * cp)
        score = gemm_time(gpu, "bf16" if prec == "fp8" else prec, s, keys, d, mbs * heads)
        ctx = gemm_time(gpu, "bf16" if prec == "fp8" else prec, s, d, keys, mbs * heads)
        elems = mbs * heads * s * keys
        traffic = elems * 2 * half + (elems * (2 * half + 1) if cfg.attn_dropout > 0 else 0)
        core = {"attention": score + ctx, "elementwise": _bytes_time(gpu, traffic)}
    else:
        # Fused attention computes only the causal half of the score matrix.
        flops = 2 * 2 * mbs * heads * s * w.seq_len * d / 2
        peak16 = gpu.peak("bf16" if prec == "fp8" else prec)
        core = {"attention": flops / (peak16 * 1e12 * w.attention_efficiency), "elementwise": 0.0}
    elementwise = elementwise_time(gpu, prec, tokens * elementwise_bytes_per_token(cfg, prec, tp, sp, moe))
    if moe_terms:
        elementwise += moe_terms["elementwise"]
    tp_comm = 0.0
    if tp > 1:
        act = tokens * h * half
        per_node = members_per_node(gpu, 1, tp)
        if sp:
            tp_comm = 2 * (collective_time(gpu, "all_gather", act, tp, per_node)
                           + collective_time(gpu, "reduce_scatter", act, tp, per_node))
        else:
            tp_comm = 2 * collective_time(gpu, "all_reduce", act, tp, per_node)
    # Context parallelism as loom runs it: the keys and values of the whole sequence all-gathered over the cp
    # group before attention (their gradients reduce-scattered in backward), not overlapped with compute.
    cp_comm = 0.0
    if cp > 1:
        kv = 2 * mbs * w.seq_len * (g // tp if g >= tp else 1) * d * half
        cp_comm = collective_time(gpu, "all_gather", kv, cp, members_per_node(gpu, tp, cp))
    kernels = 14 + (4 if cfg.attention == "math" else 1) + (2 if cfg.dropout > 0 else 0) + (6 if cp > 1 else 0)
    if moe_terms:
        kernels += moe_terms["kernels"]
    fwd = {"gemm": gemm, "attention": core["attention"], "elementwise": elementwise + core["elementwise"],
           "tp_comm": tp_comm, "cp_comm": cp_comm, "ep_comm": moe_terms["ep_comm"] if moe_terms else 0.0,
           "overhead": kernels * gpu.kernel_overhead_us * 1e-6}
    return fwd, core


def _moe_forward(w: Workload, tokens: int, tp: int, sp: bool, ep: int) -> dict:
    """An MoE layer's MLP forward on one rank, in place of the dense MLP. MoE layers are not split over tp
    (loom/parallel/tensor.py): every tensor-parallel rank routes all the micro-batch's tokens (under SP it
    all-gathers them first and keeps its own shard of the output), sends each token's top_k rows to the
    experts' ranks and computes what it receives: tokens x top_k rows (x the imbalance on the busiest rank),
    spread over its E/ep experts as one grouped GEMM per weight (`batch` = local experts). The router is a
    small GEMM; the shared experts a whole dense MLP on every tp rank. Dispatch and combine are one all-to-all each over the ep ranks
    (each rank sends (ep-1)/ep of its rows away), inside a node when the ep group (stride tp) fits in one,
    else at the network's bandwidth for the part that leaves the node. Permuting the rows in and out and the
    experts' activation function are HBM traffic."""
    cfg, gpu, prec = w.model, w.gpu, w.precision
    h, k, E = cfg.hidden, cfg.moe_top_k, cfg.moe_experts
    fe = cfg.moe_ffn_hidden or cfg.ffn_hidden
    gated = cfg.mlp == "swiglu"
    half = 4 if prec == "fp32" else 2
    routed_tokens = tokens
    rows = routed_tokens * k * w.moe_imbalance
    local = E // ep
    per_expert = max(1, math.ceil(rows / local))
    gemm = (gemm_time(gpu, prec, per_expert, (2 if gated else 1) * fe, h, local)
            + gemm_time(gpu, prec, per_expert, h, fe, local)
            + gemm_time(gpu, "bf16" if prec == "fp8" else prec, routed_tokens, E, h))  # the router (fp32 in
    # loom; priced at the 16-bit rate: E x h per token is small next to the experts')
    if cfg.moe_shared_experts:
        fs = cfg.moe_shared_experts * fe
        gemm += gemm_time(gpu, prec, tokens, (2 if gated else 1) * fs, h) + gemm_time(gpu, prec, tokens, h, fs)
    # Bytes: rows gathered in and scattered back (read + write each), the activation function over the rows,
    # the router's softmax / top-k over E scores per token (fp32).
    traffic = rows * (2 * 2 * h * half + (3 if gated else 2) * fe * half) + routed_tokens * E * 4 * 3
    if cfg.moe_shared_experts:
        traffic += tokens * (3 if gated else 2) * cfg.moe_shared_experts * fe * half
    ep_comm = 0.0
    if ep > 1:
        volume = rows * h * half * (ep - 1) / ep  # bytes each rank sends per exchange
        in_node = max(1, min(ep, gpu.node_size // tp))  # ep peers sharing this rank's node
        out_share = (ep - in_node) / (ep - 1)
        seconds = max(volume * (1 - out_share) / (gpu.nvlink_gbps * 1e9 * gpu.collective_efficiency),
                      volume * out_share / (gpu.internode_gbps * 1e9 * gpu.collective_efficiency))
        ep_comm = 2 * (gpu.collective_latency_us * 1e-6 + seconds)
    return {"gemm": gemm, "elementwise": _bytes_time(gpu, traffic), "ep_comm": ep_comm, "kernels": 12}


@lru_cache(maxsize=65536)
def layer_times(w: Workload, tp: int, cp: int, mbs: int, sp: bool, recompute: str, ep: int = 1) -> LayerTimes:
    """The model's average layer: dense and MoE layers mixed in their proportion (model.moe.*)."""
    cfg = w.model
    dense = _one_layer_times(w, tp, cp, mbs, sp, recompute, False, ep)
    if not cfg.moe_layers:
        return dense
    moe = _one_layer_times(w, tp, cp, mbs, sp, recompute, True, ep)
    share = cfg.moe_layers / cfg.layers

    def mix(a: dict, b: dict) -> dict:
        return {key: (1 - share) * a[key] + share * b[key] for key in a}

    return LayerTimes(mix(dense.fwd, moe.fwd), mix(dense.bwd, moe.bwd))


def _one_layer_times(w: Workload, tp: int, cp: int, mbs: int, sp: bool, recompute: str, moe: bool,
                     ep: int) -> LayerTimes:
    fwd, core = _layer_forward(w, tp, cp, mbs, sp, moe, ep)
    # Backward: twice the matmul work (input and weight gradients), attention backward 2.5x its forward
    # for fused kernels (it recomputes the probabilities) or 2x for math, twice the elementwise bytes,
    # the same TP collectives (SP also re-gathers the saved input shards, overlapped with compute) and the
    # same all-to-alls (the gradients of the dispatched and combined rows go back the way they came).
    attn_bwd = (2.5 if w.model.attention != "math" else 2.0) * fwd["attention"]
    bwd = {"gemm": 2 * fwd["gemm"], "attention": attn_bwd, "elementwise": 2 * fwd["elementwise"],
           "tp_comm": fwd["tp_comm"], "cp_comm": fwd["cp_comm"], "ep_comm": fwd["ep_comm"],
           "overhead": 2 * fwd["overhead"]}
    if recompute == "full":
        for key in bwd:
            bwd[key] += fwd[key]
    elif recompute == "selective":
        bwd["attention"] += core["attention"]
        bwd["elementwise"] += core["elementwise"]
    return LayerTimes(fwd, bwd)


@lru_cache(maxsize=4096)
def head_times(w: Workload, tp: int, cp: int, mbs: int) -> tuple[float, float]:
    """Forward and backward seconds of the LM head and cross-entropy (fp32 logits) per micro-batch."""
    cfg, gpu = w.model, w.gpu
    tokens = mbs * w.seq_len // cp
    v = cfg.vocab_size // tp
    fwd = gemm_time(gpu, "bf16" if w.precision == "fp8" else w.precision, tokens, v, cfg.hidden)
    logits = tokens * v * 4
    fwd += _bytes_time(gpu, 3 * logits)  # cast to fp32, log-softmax, gather
    bwd = 2 * (fwd - _bytes_time(gpu, 3 * logits)) + _bytes_time(gpu, 3 * logits)
    if w.loss_chunk and w.loss_chunk < tokens:  # backward recomputes each chunk's logits first
        bwd += fwd
    if tp > 1:  # loss-parallel: max and sum-exp all-reduces of tokens floats
        fwd += 2 * collective_time(gpu, "all_reduce", tokens * 4, tp, members_per_node(gpu, 1, tp))
    return fwd, bwd


# ---------------------------------------------------------------------------------------------------------
# The step


def stage_layers(cfg: ModelConfig, pp: int) -> int:
    """Layers on the fullest stage of an (even as possible) split; inference's pipeline uses it."""
    return math.ceil(cfg.layers / pp)


@dataclass(frozen=True)
class StageShape:
    """What one pipeline rank runs: the layer counts of its chunks, whether it holds the embedding and
    the LM head, and how many micro-batches of each chunk's activations it holds at its peak."""
    chunks: tuple[int, ...]
    embedding: bool
    head: bool
    held: tuple[float, ...]
    layers: int = 0  # sum(chunks)
    held_layers: float = 0.0  # sum(chunk x held): layer-micro-batches of activations at the peak


def _shape(chunks: tuple[int, ...], embedding: bool, head: bool, held: tuple[float, ...]) -> StageShape:
    return StageShape(chunks, embedding, head, held, sum(chunks), sum(c * h for c, h in zip(chunks, held)))


def _held(pp: int, vpp: int, schedule: str, rank: int, m: int) -> tuple[float, ...]:
    """Micro-batches of each local chunk whose activations rank `rank` holds at its peak, following the
    order in which torch.distributed.pipelining's schedules run forwards before the first backward."""
    if schedule == "interleaved" and vpp > 1:
        # Megatron's interleaved warm-up: 2(p-r-1) + (v-1)p forwards, then one more before the first
        # backward; the k-th runs local chunk (k // p) % v.
        held = [0] * vpp
        for k in range(min(m * vpp, 2 * (pp - rank - 1) + (vpp - 1) * pp + 1)):
            held[(k // pp) % vpp] += 1
        return tuple(float(x) for x in held)
    if schedule == "zero_bubble" and vpp == 2:
        # ZB-V: 2p-r-1 forwards of the first chunk and r+1 of the second (each backed out at once).
        return (float(min(m, 2 * pp - rank - 1)), float(min(m, rank + 1)))
    return tuple(float(min(m, pp - rank)) for _ in range(vpp))  # 1F1B: rank r has p - r in flight


@lru_cache(maxsize=65536)
def pipeline_ranks(layers: int, pp: int, vpp: int, schedule: str, first: int, last: int,
                   m: int) -> tuple[StageShape, ...] | None:
    """The distinct rank shapes of a pipeline (None when the split is impossible)."""
    if pp == 1:
        return (_shape((layers,), True, True, (1.0,)),)
    counts = valid_split(layers, pp * vpp, first, last)
    if counts is None:
        return None
    shapes = []
    for r in range(pp):
        ids = rank_chunks(pp, vpp, schedule, r)
        shapes.append(_shape(tuple(counts[i] for i in ids), 0 in ids, pp * vpp - 1 in ids,
                             _held(pp, vpp, schedule, r, m)))
    return tuple(dict.fromkeys(shapes))


def _shapes(w: Workload, lay: Layout) -> tuple[StageShape, ...]:
    m = w.global_batch // (lay.dp * lay.micro_batch)
    shapes = pipeline_ranks(w.model.layers, lay.pp, lay.vpp, lay.schedule, lay.first_stage_layers,
                            lay.last_stage_layers, m)
    if shapes is None:
        raise ValueError(f"{w.model.layers} layers cannot be split as {lay}")
    return shapes


def max_chunk_layers(w: Workload, lay: Layout) -> int:
    """The largest chunk: recompute.num_layers (block method) counts layers per chunk, as loom applies it
    to each chunk a rank runs."""
    return max(max(s.chunks) for s in _shapes(w, lay))


def _recomputed(lay: Layout, chunk: int) -> int:
    """Layers of a chunk recomputed fully (0 unless recompute=full)."""
    if lay.recompute != "full":
        return 0
    return min(lay.recompute_layers or chunk, chunk)


@lru_cache(maxsize=1024)
def model_sizes(w: Workload) -> dict:
    """The parameter counts the cost model reuses for every layout of a workload (computed once)."""
    cfg = w.model
    dense_layer, expert_layer = average_layer(cfg)
    fe = cfg.moe_ffn_hidden or cfg.ffn_hidden
    # fp8 casts every linear weight: attention and dense MLPs, shared experts on MoE layers (routed experts apart).
    linear = linear_weights(cfg) - cfg.moe_layers / cfg.layers * (
        _mlp_params(cfg, cfg.ffn_hidden) - (_mlp_params(cfg, cfg.moe_shared_experts * fe) if cfg.moe_shared_experts else 0))
    return {"dense_layer": dense_layer, "expert_layer": expert_layer, "total": total_params(cfg),
            "experts": cfg.moe_layers * expert_params(cfg), "embedding": embedding_params(cfg),
            "head": head_params(cfg), "linear_layer": linear}


def _stage_params(w: Workload, lay: Layout, shape: StageShape) -> tuple[float, float]:
    """(parameters outside the routed experts, routed-expert parameters) of one pipeline rank, whole (before
    tensor or expert parallelism splits them)."""
    z = model_sizes(w)
    if lay.pp == 1:
        return z["total"] - z["experts"], z["experts"]
    # A tied head still needs its own copy on the last stage when pp > 1 (Megatron does the same).
    return (shape.layers * z["dense_layer"] + (z["embedding"] if shape.embedding else 0)
            + (z["head"] if shape.head else 0)), shape.layers * z["expert_layer"]


def local_params(w: Workload, lay: Layout, shape: StageShape) -> tuple[float, float]:
    """What one GPU of a pipeline rank holds before data-parallel sharding: the dense part split over tp, and
    its E/ep routed experts (not split over tp: every tensor-parallel rank of an expert-parallel rank holds
    the same experts, as loom's expert parallelism does)."""
    dense, experts = _stage_params(w, lay, shape)
    return dense / lay.tp, experts / lay.ep


def priced_as_megatron(w: Workload, lay: Layout) -> bool:
    """Whether a layout's memory and gradient traffic follow Megatron-Core (its distributed optimizer is
    Megatron's alone; --framework megatron asks for it on any layout)."""
    return w.framework == "megatron" or lay.dp_style == "distopt"


def megatron_layer_activation_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, tp: int, sp: bool,
                                    recompute: str, act_bytes: int, fp8: bool) -> float:
    """Bytes one layer keeps for backward under Megatron-Core with Transformer Engine's fused modules
    (NeMo's layer spec): per token, each fused norm+linear (TE LayerNormLinear) keeps its input (e*h) and
    the normalised output it feeds the GEMM (1 byte under fp8, which keeps the fp8 cast; e otherwise);
    flash attention keeps q, k, v and its output (e*h(2 + 2g/a)) plus fp32 log-sum-exp (4a); the output
    projection keeps its fp8 input copy under fp8 (in 16-bit it is the attention output already counted);
    the fused SwiGLU keeps fc1's output (2ef) and fc2 its input (1 byte under fp8, else e). Fused RoPE and
    bias-dropout-add keep nothing when dropout is 0. Compared with loom's own layer (loom.flops), there is
    no fp32 norm-input copy and no separate activation-function outputs. Under TP without SP the norm
    inputs and outputs are replicated; with SP everything is split. Old runs with unfused "math" attention
    are not priced here (Korthikanti's formula, loom.flops, is theirs)."""
    s, b, h, a, g, f = seq_len, micro_batch, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    e, lin = act_bytes, (1 if fp8 else act_bytes)
    sp_div = tp if sp else 1
    if recompute == "full":
        return e * s * b * h / sp_div
    replicated = 2 * (e + lin) * s * b * h  # two norm inputs and their normalised outputs
    if cfg.dropout > 0:
        replicated += 2 * s * b * h  # 1-byte masks after each sub-block
    attn = e * s * b * h * (2 + 2 * g / a) + (lin * s * b * h if fp8 else 0)
    mlp = ((2 if cfg.mlp == "swiglu" else 1) * e + lin) * s * b * f
    core = 0.0 if recompute == "selective" else 4 * a * s * b
    return replicated / sp_div + (attn + mlp + core) / tp


def moe_activation_delta(w: Workload, s: int, lay: Layout, recompute: str, e: int, mega: bool) -> float:
    """Bytes an MoE layer keeps for backward beyond a dense layer of the same model, on one rank. The dense
    MLP's activations go; per routed row (tokens x top_k x the busiest rank's load over the mean) come the
    dispatched input the experts' first GEMMs keep, the experts' MLP activations at moe.ffn_hidden (as a dense
    MLP's, loom's or Transformer Engine's) and the expert output the gate multiplies in the combine; per token
    the router's fp32 input copy, logits and probabilities (loom routes in fp32), and the shared experts' MLP.
    MoE layers are not split over tp: every tensor-parallel rank routes every token (under SP it also keeps
    the all-gathered input), and holds the shared experts' activations whole. Full recomputation keeps only
    the layer input, as for a dense layer."""
    cfg = w.model
    if recompute == "full":
        return 0.0
    b, h, f, k, E = lay.micro_batch, cfg.hidden, cfg.ffn_hidden, cfg.moe_top_k, cfg.moe_experts
    fe = cfg.moe_ffn_hidden or f
    fs = cfg.moe_shared_experts * fe
    gated = cfg.mlp == "swiglu"
    lin = 1 if mega and w.precision == "fp8" else e

    def mlp(width: float) -> float:  # one token's MLP activations at this width
        return ((2 if gated else 1) * e + lin) * width if mega else (4 if gated else 2) * e * width

    tokens = s * b
    rows = tokens * k * w.moe_imbalance
    routed = rows * (lin * h + mlp(fe) + e * h)
    router = tokens * ((0 if mega else 4 * h) + 2 * 4 * E)
    shared = tokens * mlp(fs)
    if lay.tp > 1 and lay.sp:
        routed += e * tokens * h  # the gathered input, kept for backward
    return routed + router + shared - s * b * mlp(f) / lay.tp


def memory(w: Workload, lay: Layout) -> dict:
    """Peak bytes per GPU on the most loaded pipeline rank."""
    cfg = w.model
    m = w.global_batch // (lay.dp * lay.micro_batch)
    moment_bytes = 4 if w.state_dtype == "bfloat16" else 8
    # Activations: per layer (loom.flops, the formula `loom memory` is tested against) x layers x in flight.
    act_bytes = 4 if w.precision == "fp32" else 2
    s = w.seq_len // lay.cp
    base = "selective" if lay.recompute == "selective" else "none"
    mega = priced_as_megatron(w, lay)
    fp8 = w.precision == "fp8"
    if mega and cfg.attention != "math":
        # Megatron-Core + TE; its context parallelism (TE's ring) keeps only the local keys/values.
        per_layer = megatron_layer_activation_bytes(cfg, s, lay.micro_batch, lay.tp, lay.sp, base, act_bytes, fp8)
    else:
        per_layer = layer_activation_bytes(cfg, s, lay.micro_batch, lay.tp, lay.sp, base, act_bytes)
    if lay.cp > 1 and not mega:  # attention keeps the gathered keys/values of the rest of the sequence for backward, and
        # its output twice (each chunk's attention output, and their concatenation for the out-projection)
        per_layer += 2 * lay.micro_batch * (w.seq_len - s) * max(1, cfg.kv_heads // lay.tp) * cfg.head_dim * act_bytes
        per_layer += lay.micro_batch * s * cfg.heads // lay.tp * cfg.head_dim * act_bytes
    full = (layer_activation_bytes(cfg, s, lay.micro_batch, lay.tp, lay.sp, "full", act_bytes)
            if lay.recompute == "full" else 0)
    if cfg.moe_layers:  # the average layer: MoE layers' MLP activations in place of dense ones
        per_layer += cfg.moe_layers / cfg.layers * moe_activation_delta(w, s, lay, base, act_bytes, mega)
    tokens = lay.micro_batch * s
    z = model_sizes(w)
    dense_layer, expert_layer = z["dense_layer"], z["expert_layer"]
    # Communication buffers: two layers' gathered 16-bit weights (FSDP prefetch), or DDP/optimizer buckets.
    buffers = 2 * 2 * (dense_layer / lay.tp + expert_layer / lay.ep) + (4 * 40e6 if lay.dp > 1 else 0)
    grad_bytes = 2 if mega and w.grad_dtype == "bfloat16" else 4
    sharded = grads_stay_sharded(w.grad_accum, lay.pp, m)

    def states(local: float, group: int, cp: int, style: str = lay.dp_style,
               grads_sharded: bool = sharded) -> tuple[float, float, float]:
        """(weights, gradients, optimizer) bytes of `local` parameters sharded over `group` ranks (the dp x cp
        ranks for dense parameters, the expert-data-parallel ranks for routed experts)."""
        if style == "replicate" and mega:  # Megatron without distopt: 16-bit weights, fp32 master copy
            return 2 * local, grad_bytes * local, (4 + moment_bytes) * local
        if style == "replicate":  # loom: fp32 master weights, fp32 gradients, moments, all replicated
            # (with cp > 1 loom shards over the cp ranks, HSDP with dp_shard_cp = cp: gradients as FSDP's)
            cp_grads = cp if sharded else 1
            return 4 * local / cp, 4 * local / cp_grads, moment_bytes * local / cp
        if style == "distopt":  # Megatron: 16-bit weights + fp32 grads replicated; master + moments split
            return 2 * local, grad_bytes * local, (4 + moment_bytes) * local / group
        # fsdp (loom dp_shard): everything split; gradients sharded or whole between micro-batches
        out = 4 * local / group, 4 * local / (group if grads_sharded else 1), moment_bytes * local / group
        if lay.pp > 1:  # a stage keeps its gathered compute-dtype weights through the step (no reshard)
            out = out[0] + act_bytes * local, out[1], out[2]
        return out

    worst = None
    for shape in _shapes(w, lay):
        dense, experts = local_params(w, lay, shape)
        dp = lay.dp * lay.cp  # the cp ranks join the shard group (loom's dp_shard_cp, Megatron's dp x cp)
        d_state = states(dense, dp, lay.cp)
        # loom's replicate style still fully_shards routed experts over the edp ranks (loom_shard_groups)
        dense_group, expert_group = loom_shard_groups(lay)
        e_style = "fsdp" if lay.dp_style == "replicate" and not mega and lay.ep > 1 else lay.dp_style
        e_state = (states(experts, expert_group if e_style == "fsdp" else dp // lay.ep, max(1, lay.cp // lay.ep),
                          e_style, sharded and dense_group > 1) if experts else (0.0, 0.0, 0.0))
        params, grads, optim = (a + b for a, b in zip(d_state, e_state))
        activations = shape.held_layers * per_layer
        if lay.recompute == "full":  # k layers of every chunk keep only their input
            activations -= sum(held * _recomputed(lay, c) for c, held in zip(shape.chunks, shape.held)) * (per_layer - full)
        # On the rank with the LM head. loom: fp32 logits, their gradient and the 16-bit output. Megatron's
        # vocab-parallel cross-entropy: the fp32 copy it softmaxes in place and keeps, next to the 16-bit
        # logits at the end of forward and to the 16-bit input gradient in backward (6 bytes).
        logit_bytes = 4 + 2 if mega else 4 + 4 + act_bytes
        alive = min(tokens, w.loss_chunk) if w.loss_chunk else tokens  # one chunk's at a time (train.loss_chunk)
        logits = alive * (cfg.vocab_size / lay.tp) * logit_bytes if shape.head else 0.0
        # Transformer Engine keeps each linear weight's fp8 cast and its transpose from the first
        # micro-batch to the last (its weight workspace cache): 2 bytes per linear weight on the rank.
        fp8_weights = (2 * shape.layers * (z["linear_layer"] / lay.tp + expert_layer / lay.ep)) if mega and fp8 else 0.0
        dynamic = params + grads + optim + activations + logits + buffers + fp8_weights
        total = dynamic * (1 + FRAGMENTATION) + CONTEXT_GIB * GIB
        if worst is None or total > worst["total"]:
            worst = {"params": params, "grads": grads, "optimizer": optim, "activations": activations,
                     "logits": logits, "buffers": buffers, "fp8_weights": fp8_weights, "reserve": CONTEXT_GIB * GIB + FRAGMENTATION * dynamic,
                     "total": total}
    return worst


def _intra(gpu: GPU, stride: int, size: int) -> bool:
    return stride * size <= gpu.node_size


def loom_shard_groups(lay: Layout) -> tuple[int, int]:
    """The ranks loom's fully_shard splits a rank's dense parameters and its routed experts over
    (loom/parallel): dp x cp for the fsdp style, the cp ranks for replicate (HSDP over dp_shard_cp); under
    expert parallelism the routed experts over the expert-data-parallel ranks (dp x cp / ep) whatever the
    style, else with the dense part. Gradients are reduced every micro-batch only when the dense group has
    more than one rank (loom/train/steps.py)."""
    dense = lay.cp if lay.dp_style == "replicate" else lay.dp * lay.cp
    return dense, (lay.dp * lay.cp // lay.ep if lay.ep > 1 else dense)


@lru_cache(maxsize=1024)
def _with_fused_attention(w: Workload) -> Workload:
    """`w` with Transformer Engine's fused attention (one object per workload, so the caches keyed on it hold)."""
    return replace(w, attention_kernel="fused")


def step_time(w: Workload, lay: Layout) -> dict:
    cfg, gpu = w.model, w.gpu
    m = w.global_batch // (lay.dp * lay.micro_batch)
    base = "selective" if lay.recompute == "selective" else "none"
    # A layout only Megatron runs (its distributed optimizer) runs Megatron's attention kernel too.
    kw = _with_fused_attention(w) if lay.dp_style == "distopt" and w.attention_kernel == "auto" else w
    lt = layer_times(kw, lay.tp, lay.cp, lay.micro_batch, lay.sp, base, lay.ep)
    ft = layer_times(kw, lay.tp, lay.cp, lay.micro_batch, lay.sp, "full", lay.ep) if lay.recompute == "full" else None
    hf, hb = head_times(kw, lay.tp, lay.cp, lay.micro_batch)
    # A micro-batch's forward + backward on each pipeline rank; the slowest rank sets the pace.
    shapes = _shapes(w, lay)
    terms, per_mb, n_layers = {}, -1.0, 0
    for shape in shapes:
        t = dict.fromkeys(("gemm", "attention", "elementwise", "tp_comm", "cp_comm", "ep_comm", "overhead"), 0.0)
        full_layers = sum(_recomputed(lay, c) for c in shape.chunks) if ft else 0
        for key in t:
            t[key] = shape.layers * (lt.fwd[key] + lt.bwd[key])
            if full_layers:
                t[key] += full_layers * ((ft.fwd[key] + ft.bwd[key]) - (lt.fwd[key] + lt.bwd[key]))
        t["head"] = hf + hb if shape.head else 0.0
        if sum(t.values()) > per_mb:
            terms, per_mb, n_layers = t, sum(t.values()), shape.layers
    # Pipeline: P2P of one activation per micro-batch each way between stages (split over tp with SP).
    p2p = 0.0
    if lay.pp > 1:
        act = lay.micro_batch * (w.seq_len // lay.cp) * cfg.hidden * 2 / (lay.tp if lay.sp else 1)
        intra = _intra(gpu, lay.tp * lay.cp * lay.dp, lay.pp)
        p2p = 2 * lay.vpp * p2p_time(gpu, act, intra)
    v = lay.vpp if lay.schedule in ("interleaved", "zero_bubble") else 1
    if lay.pp == 1:
        bubble_slots = 0.0
    elif lay.schedule == "zero_bubble":
        bubble_slots = (lay.pp - 1) / (3 * v)
    else:
        bubble_slots = (lay.pp - 1) / v
    step = {k: val * m for k, val in terms.items()}
    step["pp_p2p"] = p2p * m
    step["pp_bubble"] = bubble_slots * (per_mb + p2p)
    # Data parallel: gradient reduction and parameter gathering, minus what hides behind compute. Routed
    # experts (E/ep per rank) are reduced over the expert-data-parallel ranks, dp x cp / ep of them.
    dense, experts = max((local_params(w, lay, shape) for shape in shapes), key=sum)  # the largest rank's
    dp_comm = 0.0
    group = lay.dp * lay.cp  # gradients are reduced over the data-parallel ranks and their cp ranks
    egroup = group // lay.ep
    # Gradient element size on the wire: Megatron's buffer dtype (bf16 in NeMo's performance recipes), else fp32.
    gb = 2 if priced_as_megatron(w, lay) and w.grad_dtype == "bfloat16" else 4

    def coll(kind: str, per_param: float) -> float:
        """One collective over the dense parameters and one over the routed experts' expert-dp group."""
        return (collective_time(gpu, kind, per_param * dense, group, members_per_node(gpu, lay.tp, group))
                + collective_time(gpu, kind, per_param * experts, egroup,
                                  members_per_node(gpu, lay.tp * lay.ep, egroup)))

    if group > 1:
        bwd_mb = sum(lt.bwd.values()) * n_layers
        fwd_mb = sum(lt.fwd.values()) * n_layers
        if lay.dp_style == "replicate":
            grad = coll("all_reduce", gb)
            dp_comm = max(grad - bwd_mb, grad / n_layers) if w.overlap_grad_reduce else grad
        elif lay.dp_style == "distopt":
            grad = coll("reduce_scatter", gb)
            gather = coll("all_gather", 2)
            hidden_grad = max(grad - bwd_mb, grad / n_layers) if w.overlap_grad_reduce else grad
            dp_comm = hidden_grad + max(gather - fwd_mb, gather / n_layers)
        else:
            gather = coll("all_gather", 2)
            grad = coll("reduce_scatter", 4)
            hidden_gather = max(gather - fwd_mb, gather / n_layers)
            hidden_grad = max(grad - bwd_mb, grad / n_layers)
            if lay.pp > 1:
                # Pipeline stages gather their weights once per step and keep them; the schedule reduces
                # gradients after the stage's last backward, with no backward left to hide behind.
                dp_comm = hidden_gather + grad
            else:
                # 16-bit weights gathered before each layer's forward and backward of every micro-batch
                # (prefetched, overlapping the previous layer); gradients reduce-scattered every
                # micro-batch (sharded accumulation) or after the last one.
                sharded = grads_stay_sharded(w.grad_accum, lay.pp, m)
                dp_comm = m * (hidden_gather + max(gather - bwd_mb, gather / n_layers)) + (m if sharded else 1) * hidden_grad
        if w.fsdp2 and lay.dp_style in ("fsdp", "replicate") and not priced_as_megatron(w, lay):
            step["fsdp_copy"] = _bytes_time(gpu, fsdp2_copy_bytes(w, lay, dense, experts, m))
    step["dp_comm"] = dp_comm
    # AdamW: read param, grad, two moments; write param, moments (and a 16-bit copy); over the local shard.
    if lay.dp_style == "replicate":  # loom's replicate still shards the routed experts over the edp ranks
        shard = dense / lay.cp + experts / (max(1, lay.cp // lay.ep) if priced_as_megatron(w, lay)
                                            else loom_shard_groups(lay)[1])
    else:
        shard = dense / group + experts / egroup
    moment = 2 if w.state_dtype == "bfloat16" else 4
    step["optimizer"] = _bytes_time(gpu, shard * (4 + 4 + 2 * moment + 4 + 2 * moment + 2))
    return step


def fsdp2_copy_bytes(w: Workload, lay: Layout, dense: float, experts: float, m: int) -> float:
    """Bytes torch's fully_shard (FSDP2: loom's fsdp style, and its replicate style, which is fully_shard over
    a shard group of the cp ranks) copies on the compute stream in one step, for a rank holding `dense` and
    `experts` parameters before data-parallel sharding; NCCL's collectives overlap compute, these copies do
    not (torch/distributed/fsdp/_fully_shard):
    - each unshard copies the all-gather's flat output into the unsharded parameters
      (split_with_sizes_copy: e bytes read and written per element, e the compute dtype's size); a shard group
      of one skips the collective but casts the fp32 parameter to the compute dtype and copies it (4 + 3e);
    - without pipelining, blocks reshard after forward and gather again for backward; the last block and the
      root (embedding, final norm, head) gather once per micro-batch; a pipeline stage gathers once per step;
    - each reduction concatenates the unsharded gradients into the flat fp32 reduce-scatter buffer
      (chunk_cat: e read, 4 written) on every micro-batch when gradients stay sharded; otherwise the first
      micro-batch's gradients are cast to fp32 (e + 4), each later one is added in (4 + e read, 4 written),
      and the last chunk_cat copies fp32 (8).
    In fp32 (no mixed precision: a CPU's) there is no cast: an unshard is a copy (8) and gradients accumulate
    in autograd, so only the chunk_cat (8) per reduction is FSDP's. Shard groups: `loom_shard_groups`."""
    cfg = w.model
    e = 4 if w.precision == "fp32" else 2
    shard_dense, shard_experts = loom_shard_groups(lay)

    def unshard(n: int) -> float:
        return 2 * e if n > 1 or e == 4 else 4 + 3 * e

    once = dense * unshard(shard_dense) + experts * unshard(shard_experts)
    if lay.pp > 1:
        gathers = once
    else:
        z = model_sizes(w)
        root = (z["total"] - z["experts"] - cfg.layers * z["dense_layer"]) / lay.tp
        single = (root + z["dense_layer"] / lay.tp) * unshard(shard_dense) + z["expert_layer"] / lay.ep * unshard(shard_experts)
        gathers = m * (2 * once - single)
    local = dense + experts
    if shard_dense > 1 and grads_stay_sharded(w.grad_accum, lay.pp, m):
        reduces = m * local * (e + 4)
    elif e == 4:
        reduces = local * 8
    else:
        reduces = local * ((e + 4) + (m - 1) * (8 + e) + (8 if m > 1 else 0))
    return gathers + reduces


def evaluate(w: Workload, lay: Layout, mem: dict | None = None) -> Estimate:
    mem = mem if mem is not None else memory(w, lay)
    terms = step_time(w, lay)
    step = sum(terms.values())
    tokens = w.global_batch * w.seq_len
    flops = train_flops_per_token(w.model, w.seq_len) * tokens
    tflops = flops / step / w.gpus / 1e12
    return Estimate(layout=lay, step_time_s=step, time_terms=terms, memory=mem,
                    fits=mem["total"] <= w.usable_bytes,
                    tokens_per_s_per_gpu=tokens / step / w.gpus, tflops_per_gpu=tflops,
                    mfu=tflops / w.gpu.peak(w.precision))
