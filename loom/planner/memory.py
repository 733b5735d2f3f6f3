"""Peak memory per GPU of one training layout: weights, gradients and optimizer state as the data-parallel
style shards them, activations per layer (`loom.flops`, the formulas `loom memory` is tested against, or
Megatron-Core with Transformer Engine's) times the micro-batches in flight, the logits, communication
buffers, fp8 weight caches and a reserve for the CUDA context and allocator fragmentation."""

from __future__ import annotations

from loom.config import ModelConfig
from loom.flops import layer_activation_bytes
from loom.rules import (adam_moment_bytes, grads_stay_sharded, lora_bytes_per_param,
                        zero3_keeps_compute_rows)
from loom.planner.params import lora_params, model_sizes
from loom.planner.stages import (expert_data_parallel, expert_row_padding, local_params, loom_shard_groups,
                                 priced_as_megatron, rank_shapes, recomputed_layers)
from loom.planner.workload import GIB, Layout, Workload

CONTEXT_GIB = 1.0  # CUDA context, cuBLAS workspace, NCCL buffers
FRAGMENTATION = 0.05  # allowance for allocator fragmentation, of everything else


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
    # q and the attention output are heads x head_dim wide, k and v kv_heads x head_dim: TE's DotProductAttention
    # saves q, k, v and out at their own widths (hidden x (2 + 2g/a) only when head_dim = hidden / heads; Qwen3's
    # 64 heads of 128 over hidden 4096 keep twice that for q and out)
    qw, kvw = a * cfg.head_dim, g * cfg.head_dim
    attn = e * s * b * (2 * qw + 2 * kvw) + (lin * s * b * qw if fp8 else 0)
    mlp = ((2 if cfg.mlp == "swiglu" else 1) * e + lin) * s * b * f
    core = 0.0 if recompute == "selective" else 4 * a * s * b
    return replicated / sp_div + (attn + mlp + core) / tp


def compiled_layer_activation_bytes(cfg: ModelConfig, seq_len: int, micro_batch: int, act_bytes: int,
                                    fp8: bool = False, tp: int = 1, sp: bool = False) -> float:
    """Bytes one compiled loom block (train.compile, no dropout, no recomputation) keeps for backward on one
    tensor-parallel rank. Inductor's partitioner saves what its fused backward needs and recomputes the rest,
    which changes the saved set from eager loom's (`loom.flops.layer_activation_bytes`): no fp32 copies of the
    norm inputs (the norms' backward is recomputed from their normalised 16-bit outputs and fp32 1/rms). Per
    token, in the activation dtype e, read off the saved tensors of compiled blocks on CPU in bf16
    (bench/compiled_saved_bytes.py; tests/test_plan.py):
    - whole on every tensor-parallel rank (split by tp under SP, whose gathers keep only the sequence shard):
      the block input, the normalised attention and MLP inputs (3h), two fp32 1/rms (8 bytes), and with tp > 1
      the residual after attention (h);
    - split by heads / ffn over tp: q and the attention output (2h), k and v (2hg/a), w1's and w3's outputs and
      their gated product (3f), fp32 log-sum-exp (4a), and with tp = 1 the attention output's contiguous copy
      that the out-projection reads (h; under tp the DTensor path keeps no separate copy).
    At tp = 1 that is e(6h + 2hg/a + 3f) + 4a + 8 against eager's e(6h + 2hg/a + 4f) + 8h + 4a + 8. Context
    parallelism's additions (the gathered keys/values and one more h: the residual at tp = 1, the out-projection's
    copy at tp > 1) are `memory`'s, as for eager blocks.
    `fp8` (torchao's Float8Linear, compiled, tp = 1): the block saves no fp8 copies and neither normalised input
    nor the gated product: their casts for backward are recomputed from the block input, the residual and
    w1's and w3's outputs, e(4h + 2hg/a + 2f) + 4a + 8 (read off the same way, rowwise and tensorwise)."""
    s, b, h, a, g, f = seq_len, micro_batch, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    gated = 3 if cfg.mlp == "swiglu" else 2  # w1, w3 and their product; or fc1's output and the activation
    if fp8:
        return s * b * (act_bytes * (4 * h + 2 * h * g / a + (gated - 1) * f) + 4 * a + 8)
    whole = act_bytes * (3 * h + (h if tp > 1 else 0)) + 8
    split = act_bytes * (2 * h + (h if tp == 1 else 0) + 2 * h * g / a + gated * f) + 4 * a
    return s * b * (whole / (tp if sp else 1) + split / tp)


def gate_in_activation(w: Workload, mega: bool) -> bool:
    """Whether the routed experts multiply each row by its gate weight inside a fused weighted SwiGLU rather
    than in the combine: Megatron-Core's grouped experts (TEGroupedMLP with --moe-permute-fusion and the alltoall
    or flex dispatcher: megatron/core/transformer/moe/experts.py bias_act_func -> fusions/fused_bias_swiglu.py
    weighted_bias_swiglu_impl; the unpermute then runs without probs), and NeMo AutoModel's DeepEP experts
    (github.com/NVIDIA-NeMo/Automodel nemo_automodel/components/moe/experts.py GroupedExpertsDeepEP.forward:
    gmm, expert_activation(output1, permuted_probs), gmm), a fused-kernel stack (`elementwise_kernels="fused"`)
    with the DeepEP dispatcher. loom's own experts multiply in the combine (loom/models/moe.py)."""
    return mega or (w.elementwise_kernels == "fused" and w.moe_dispatcher == "deepep")


def moe_activation_delta(w: Workload, s: int, lay: Layout, recompute: str, e: int, mega: bool) -> float:
    """Bytes an MoE layer keeps for backward beyond a dense layer of the same model, on one rank. The dense
    MLP's activations go; per routed row (tokens x top_k x the busiest rank's load over the mean) come the
    dispatched input the experts' first GEMMs keep, the experts' MLP activations at moe.ffn_hidden (as a dense
    MLP's, loom's or Transformer Engine's) and the expert output the gate multiplies in the combine (loom; Megatron
    folds the gate into the fused SwiGLU and keeps its fp32 weight instead); per token
    the router's fp32 input copy, logits and probabilities (loom routes in fp32), and the shared experts' MLP.
    With experts spread over tensor-parallel ranks (`Workload.experts_over_tp`) all of these are for the
    rank's own sequence shard (s x b / tp tokens) and nothing is gathered; otherwise MoE layers are not split
    over tp: every tensor-parallel rank routes every token (under SP it also keeps the all-gathered input),
    and holds the shared experts' activations whole. Full recomputation keeps only the layer input, as for a
    dense layer."""
    cfg = w.model
    if recompute == "full":
        return 0.0
    b, h, f, k, E = lay.micro_batch, cfg.hidden, cfg.ffn_hidden, cfg.moe.top_k, cfg.moe.experts
    fe = cfg.moe.ffn_hidden or f
    fs = cfg.moe.shared_experts * fe
    gated = cfg.mlp == "swiglu"
    lin = 1 if mega and w.precision == "fp8" else e

    def mlp(width: float, fused: bool = mega, routed: bool = False) -> float:  # one token's MLP activations
        # at this width; loom's routed experts keep SwiGLU's two inputs and the product (loom/models/swiglu.py)
        eager = (3 if routed else 4) if gated else 2
        return ((2 if gated else 1) * e + lin) * width if fused else eager * e * width

    span = w.experts_over_tp(lay.tp, lay.sp, lay.ep)
    tokens = s * b // lay.tp if span else s * b  # the tokens this rank routes
    rows = tokens * k * w.moe_imbalance
    # After the experts' second GEMM: loom multiplies each row's output by its gate weight in the combine and
    # keeps that output for the weight's gradient (e*h). Stacks that fold the gate weight into a fused SwiGLU
    # (`gate_in_activation`) keep each row's fp32 weight (4 bytes) instead, and of the MLP only fc1's output and
    # fc2's input; their combine keeps nothing.
    # (loom's SwiGLU experts fold the gate in too, with or without the exchange: loom/models/moe.py)
    fused = gate_in_activation(w, mega) or (not mega and gated)
    routed = rows * (lin * h + mlp(fe, fused, routed=not mega) + (4 if fused else e * h))
    router = tokens * ((0 if mega else 4 * h) + 2 * 4 * E)
    shared = tokens * mlp(fs)
    if lay.tp > 1 and lay.sp and not span:
        routed += e * tokens * h  # the gathered input, kept for backward
    return routed + router + shared - s * b * mlp(f) / lay.tp


def grouped_experts(w: Workload) -> bool:
    """Whether loom's routed experts run `torch._grouped_mm` on this workload's GPU (`loom.models.moe.use_grouped_mm`:
    compute capability 9.0 or newer and bf16 activations, which fp8 runs keep for their experts), else the loop of
    one matmul per expert."""
    return w.gpu.compute_capability[0] >= 9 and w.precision in ("bf16", "fp8")


def compiled_moe_activation_bytes(cfg: ModelConfig, tokens: int, rows: float, e: int, local_experts: int,
                                  experts: str, exchange: bool, fp8: bool = False) -> float:
    """Bytes a compiled MoE layer (train.compile, tp = 1, no recomputation) keeps for backward beyond a compiled
    dense layer (`compiled_layer_activation_bytes`), on one rank routing `tokens` tokens into `rows` rows, which
    its `local_experts` experts compute `experts` "traced" (in the block's graph), "grouped" (eager grouped GEMMs)
    or "looped" (eager, one matmul per expert), behind expert parallelism's exchange when `exchange`. Read off the
    saved tensors of a compiled one-layer MoE block on CPU in bf16 (tests/test_plan_moe_memory.py checks every path
    to the byte, the exchange over a one-rank group). In bytes, with e the activation element size:

    - per token, every path: the dense MLP's activations go (e*3f, GELU e*2f); the router's fp32 input copy
      stays (4h: inductor keeps it for the router weight's gradient, and the 16-bit normalised MLP input goes,
      -e*h), two fp32 E-vectors (8E; on the loop, the router's probabilities and the z-loss's gradient for the
      logits, which the graph after the experts computes ahead), the chosen experts (int64, 8k). Shared experts
      keep their MLP as a compiled dense one (e*3fs, GELU e*2fs) and the normalised input again (e*h); a shared
      gate also its output and sigmoid (e*(h + 1)).
    - experts traced in the block (grouped and without expert parallelism: one graph through router, dispatch, grouped
      GEMMs and combine): per token one fp32 E-vector only, the logits (-4E), and the softmax's max and sum and the
      z-loss's log-sum-exp (12); per routed row its expert output for the gate multiply (e*h), its 16-bit gate (e)
      and three int64 indices (24); per padded row (the rows + 16 per local expert, `GroupedExperts._grouped`'s
      buffer) the padded input (e*h) and the experts' MLP as a compiled dense one (e*3fe, GELU e*2fe). (The padded
      buffer, the combine's output and the balance loss's one-hot are allocated flat: as [rows, h] and [tokens, E]
      zeros inductor merged them with the zeros that the backward of the row gathers and of the router's top-k
      creates and kept them, e*h more per padded row and per token and 4E per token.)
    - experts eager (between expert parallelism's all-to-alls: `ExpertParallel` is a graph break; or the
      per-expert loop where there is no grouped kernel): SwiGLU experts take each row's fp32 gate into their
      activation (the exchange carries it: loom/parallel/expert.py) and keep it, 4 bytes a row (looped) or a padded
      row (grouped), and the combine keeps nothing; GELU experts' outputs are weighted in the combine, which keeps
      the expert output and the 16-bit gate (e*h + e a row). Per routed row too: int64 indices (24 grouped, 16
      looped; + 16 for the exchange's row order and its inverse), and the experts' MLP (w1's and w3's outputs and
      their product, loom/models/swiglu.py: e*3fe, GELU e*2fe) per row with the rows the per-expert matmuls read
      (e*h: loop), or per padded row with the padded input (e*h: grouped; its `index_put` keeps no other copy of
      the rows).
    - per layer: the router weight's fp32 copy (4Eh) and a few E-sized vectors (8E).
    - `fp8` (torchao's Float8Linear on the shared experts and attention; the routed experts and the router stay
      16-bit): against the compiled fp8 dense layer, which keeps neither the normalised MLP input nor the gated
      product, e*(2f + h) per token go instead of e*(3f + h) on every path; shared experts keep w1's and w3's
      outputs (e*2fs) and 1 byte, and behind the exchange's graph break also the normalised input's fp8 cast (h).

    Against the eager layer's MoE part (`moe_activation_delta`: per row the dispatched input e*h, the experts' MLP
    e*3fe and the fp32 gate, or GELU's e*2fe and the expert output e*h; per token 4h + 8E + e*4fs): the traced path
    keeps the padding rows' inputs and MLP too and int64 indices, and recomputes the fp32 probabilities.
    Routed rows are tokens x top_k x the busiest rank's load over the mean (`Workload.moe_imbalance`), as
    `moe_activation_delta` counts them. Priced for the softmax router with a balance loss (the other routers,
    and no auxiliary loss, differ by a few fp32 values per token)."""
    h, f, k, E = cfg.hidden, cfg.ffn_hidden, cfg.moe.top_k, cfg.moe.experts
    fe = cfg.moe.ffn_hidden or f
    fs = cfg.moe.shared_experts * fe
    # compiled and eager MLP activations per width: eager routed experts keep SwiGLU's two inputs and the product
    # (loom/models/swiglu.py); GELU's input and output
    mlp, eager_mlp = (3, 3) if cfg.mlp == "swiglu" else (2, 2)
    out = tokens * (4 * h + 8 * E + 8 * k - e * mlp * f) + 4 * E * h + 8 * E
    if fp8:  # the fp8 dense layer kept neither the gated product nor the normalised MLP input
        out += tokens * e * (f + h)
    if fs:
        if fp8:
            out += tokens * (e * (mlp - 1) * fs + 1 + (0 if experts == "traced" else h))
        else:
            out += tokens * e * (mlp * fs + h)
        if cfg.moe.shared_gate:
            out += tokens * e * (h + 1)
    padded = rows + 16 * local_experts
    out -= tokens * e * h  # the normalised MLP input, on every path
    # SwiGLU experts take each row's fp32 gate into their activation (loom/models/moe.py, swiglu.py's
    # weighted_swiglu): they keep the gate (4 a row) and the combine keeps no output (e*h) or 16-bit gate
    folded = cfg.mlp == "swiglu"
    if experts == "traced":
        gate = padded * 4 if folded else rows * (e * h + e)
        return out + tokens * (12 - 4 * E) + rows * 24 + gate + padded * e * (h + mlp * fe)
    out += rows * ((0 if folded else e * h + e) + (16 if experts == "looped" else 24) + (16 if exchange else 0))
    if experts == "grouped":
        return out + padded * (e * (h + eager_mlp * fe) + (4 if folded else 0))
    return out + rows * (e * h + e * eager_mlp * fe + (4 if folded else 0))


def compiled_moe_activation_delta(w: Workload, s: int, lay: Layout, e: int) -> float:
    """`compiled_moe_activation_bytes` for one rank of layout `lay` (tp = 1): its s x micro-batch tokens routed into
    tokens x top_k x `Workload.moe_imbalance` rows (as `moe_activation_delta` counts them) for its experts / ep
    experts; the experts traced in the block where they run grouped (`grouped_experts`) without expert
    parallelism, whose exchange is a graph break that leaves them eager."""
    cfg = w.model
    tokens = s * lay.micro_batch
    rows = tokens * cfg.moe.top_k * w.moe_imbalance
    grouped = grouped_experts(w)
    experts = ("traced" if lay.ep == 1 else "grouped") if grouped else "looped"
    return compiled_moe_activation_bytes(cfg, tokens, rows, e, cfg.moe.experts // lay.ep, experts, lay.ep > 1,
                                         w.precision == "fp8")


def zero3_buffer_bytes(layer: float, head: float, largest: float, e: int, n: int, tied: bool,
                       fused_head: bool = True, largest_n: int | None = None) -> float:
    """What loom's sharded weights (loom/parallel/zero.py) hold beside the states at their peak, for a layer of
    `layer` parameters (its routed experts padded as zero.py splits them), a head of `head`, a layer's largest
    parameter `largest`, compute-dtype size `e`, `n` ranks sharing the rows. A weight's fp32 gradient buffer lives
    until the next weight's buffer is made: the one being computed and the one before it being reduce-scattered
    (with its 1/n output: 4 (1 + 1/n) bytes a parameter), not a whole unit's:

    - at the loss: the head gathered (e) and its fresh fp32 gradient buffer (4), plus its 16-bit `.grad` when the
      chunked loss does not write into the buffer (loom/parallel/headgrad.py);
    - as the last block's backward starts (untied): it gathered (e per layer parameter) beside the head's reduction
      in flight, which is added in before the block before it is fetched (at the block's first weight gradient);
    - at a block's second weight gradient: the block and the one before gathered, less its first weight (released
      once its gradient is computed), the first weight's reduction in flight and the second's buffer, both a
      layer's largest (a block's backward starts with its MLP's output projection, then its input ones);
    - a tied embedding belongs to the head unit, its gradient reduced once both uses' parts are in, at the end of
      backward. With the chunked loss writing the head's part into its fp32 rows (loom/parallel/headgrad.py) those
      rows are held beside the blocks' above, and the weight is released as backward starts (nothing in backward
      reads it); at the loss, the weight gathered and the fresh rows. Without: the weight (e) and its first use's
      gradient (e, autograd's) beside the blocks'. At the end, its buffer beside the first block's last reduction
      (and autograd's 16-bit gradient of the embedding's use, when the activations are gone: not a step's peak).
    `largest_n`: the ranks sharing the largest weight's rows, when they are not all `n` (a routed expert's: the
    expert-data-parallel ranks, n / ep, whose reduce-scatter output is 1/largest_n of it).
    The largest is the peak (tests/test_zero.py measures a step's, untied and tied, dense and MoE, to the byte)."""
    spill = 1 + 1 / n
    spill_largest = 1 + 1 / (largest_n or n)
    blocks = 2 * e * layer + largest * (4 * spill_largest + 4 - e)
    if tied and fused_head:
        return max(blocks + 4 * head, e * head + 4 * head, 4 * head * spill + 4 * largest * spill_largest)
    if tied:
        return max(blocks + 2 * e * head, 4 * head * spill + 4 * largest * spill_largest + e * head)
    at_loss = e * head + 4 * head + (0 if fused_head else e * head)
    return max(at_loss, e * layer + 4 * head * spill, blocks)


def memory(w: Workload, lay: Layout) -> dict:
    """Peak bytes per GPU on the most loaded pipeline rank."""
    w = w.at_layout(lay)
    cfg = w.model
    m = w.global_batch // (lay.dp * lay.micro_batch)
    moment_bytes = adam_moment_bytes(w.state_dtype)
    # Activations: per layer (loom.flops, the formula `loom memory` is tested against) x layers x in flight.
    act_bytes = 4 if w.precision == "fp32" else 2
    s = w.seq_len // lay.cp
    base = "selective" if lay.recompute == "selective" else "none"
    mega = priced_as_megatron(w, lay)
    fp8 = w.precision == "fp8"
    fused = (mega or w.elementwise_kernels == "fused") and cfg.attention != "math"
    # compiled blocks as measured: dense at any tp (fp8 at tp = 1), MoE at tp = 1 (bench/compiled_saved_bytes.py,
    # tests/test_plan_moe_memory.py)
    compiled = (not fused and w.runs_compiled(lay) and base == "none" and cfg.attention != "math"
                and cfg.dropout == 0 and cfg.attn_dropout == 0 and (lay.tp == 1 or not (fp8 or cfg.moe_layers)))
    if fused:
        # Megatron-Core + TE; its context parallelism (TE's ring) keeps only the local keys/values. A stack of
        # fused kernels on PyTorch (`elementwise_kernels="fused"`: NeMo AutoModel's TE RMSNorm and Linear, Meta's)
        # keeps the same per layer: a norm's 16-bit input and output, no fp32 copy of the input (loom's eager
        # RMSNorm upcasts and keeps one), and a fused SwiGLU's input alone.
        per_layer = megatron_layer_activation_bytes(cfg, s, lay.micro_batch, lay.tp, lay.sp, base, act_bytes, fp8)
    elif compiled:
        per_layer = compiled_layer_activation_bytes(cfg, s, lay.micro_batch, act_bytes, fp8, lay.tp, lay.sp)
    else:
        per_layer = layer_activation_bytes(cfg, s, lay.micro_batch, lay.tp, lay.sp, base, act_bytes)
    if lay.cp > 1 and not mega:  # attention keeps the gathered keys/values of the rest of the sequence for backward, and
        # one more h per token: eager, its output twice (each chunk's output, and their concatenation for the
        # out-projection); compiled, the residual after attention (tp = 1) or the concatenation (tp > 1)
        per_layer += 2 * lay.micro_batch * (w.seq_len - s) * max(1, cfg.kv_heads // lay.tp) * cfg.head_dim * act_bytes
        per_layer += lay.micro_batch * s * cfg.heads // lay.tp * cfg.head_dim * act_bytes
    full = (layer_activation_bytes(cfg, s, lay.micro_batch, lay.tp, lay.sp, "full", act_bytes)
            if lay.recompute == "full" else 0)
    if cfg.moe_layers:  # the average layer: MoE layers' MLP activations in place of dense ones
        delta = (compiled_moe_activation_delta(w, s, lay, act_bytes) if compiled
                 else moe_activation_delta(w, s, lay, base, act_bytes, mega))
        per_layer += cfg.moe_layers / cfg.layers * delta
    tokens = lay.micro_batch * s
    z = model_sizes(w)
    dense_layer, expert_layer = z["dense_layer"], z["expert_layer"]
    # Communication buffers: two layers' gathered 16-bit weights (FSDP prefetch), or DDP/optimizer buckets.
    pad = expert_row_padding(w, lay)[0]  # routed experts split by rows over more ranks than they have rows
    gathered_experts = expert_layer / lay.ep * (pad if lay.dp_style == "zero3" else 1)  # zero.py gathers padded rows
    buffers = 2 * 2 * (dense_layer / lay.tp + gathered_experts) + (4 * 40e6 if lay.dp > 1 else 0)
    if lay.dp_style == "zero3":  # loom/parallel/zero.py, as tests/test_zero.py measures it
        ffn = cfg.moe.ffn_hidden or cfg.ffn_hidden
        n = lay.dp * lay.cp
        dense = max(cfg.hidden * cfg.ffn_hidden if cfg.moe_layers < cfg.layers else 0,
                    cfg.heads * cfg.head_dim * cfg.hidden)
        expert = (cfg.moe.experts // lay.ep) * cfg.hidden * ffn * pad if cfg.moe_layers else 0
        # A routed expert's rows are split over its expert-data-parallel ranks (n / ep), so its reduce-scatter
        # output is 1/edp of it: priced with that spill where it holds the most (a bound when a dense weight is
        # larger).
        edp = max(1, n // lay.ep)
        by_experts = expert * (4 * (1 + 1 / edp) - act_bytes) >= dense * (4 * (1 + 1 / n) - act_bytes)
        buffers = (4 * 40e6 if lay.dp > 1 else 0) + zero3_buffer_bytes(
            dense_layer + gathered_experts, cfg.vocab_size * cfg.hidden, max(dense, expert), act_bytes, n,
            cfg.tie_embeddings, fused_head=bool(w.loss_chunk), largest_n=edp if by_experts else None)
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
        if style == "zero3":  # loom's sharded weights (loom/parallel/zero.py): fp32 master rows (cast to the compute
            # dtype per gather, no copy kept), fp32 gradient rows and moments, all split: FSDP's bytes; past 8
            # micro-batches a compute-dtype copy of the rows is kept (loom.rules.zero3_keeps_compute_rows)
            kept = act_bytes if act_bytes < 4 and zero3_keeps_compute_rows(m) else 0
            return (4 + kept) * local / group, 4 * local / group, moment_bytes * local / group
        if style == "distopt":  # 16-bit weights + fp32 grads replicated; master + moments split (Megatron, loom)
            return (2 if mega else act_bytes) * local, grad_bytes * local, (4 + moment_bytes) * local / group
        # fsdp (loom dp_shard): everything split; gradients sharded or whole between micro-batches
        out = 4 * local / group, 4 * local / (group if grads_sharded else 1), moment_bytes * local / group
        if lay.pp > 1:  # a stage keeps its gathered compute-dtype weights through the step (no reshard)
            out = out[0] + act_bytes * local, out[1], out[2]
        return out

    worst = None
    for shape in rank_shapes(w, lay):
        dense, experts = local_params(w, lay, shape)
        dp = lay.dp * lay.cp  # the cp ranks join the shard group (loom's dp_shard_cp, Megatron's dp x cp)
        d_state = states(dense, dp, lay.cp)
        # loom's replicate style still fully_shards routed experts over the edp ranks (loom_shard_groups);
        # routed experts are sharded over their expert-data-parallel ranks (tp x dp x cp / ep of them with
        # experts spread over tensor-parallel ranks, else dp x cp / ep)
        dense_group, expert_group = loom_shard_groups(lay)
        e_style = "fsdp" if lay.dp_style == "replicate" and not mega and lay.ep > 1 else lay.dp_style
        edp = expert_group if e_style == "fsdp" and not mega else expert_data_parallel(w, lay)
        e_state = (states(experts * pad, edp, max(1, lay.cp // lay.ep),
                          e_style, sharded and dense_group > 1) if experts else (0.0, 0.0, 0.0))
        if lay.dp_style == "distopt" and experts:  # whole weights are not padded, only the split buffers
            e_state = (e_state[0] / pad,) + e_state[1:]
        params, grads, optim = (a + b for a, b in zip(d_state, e_state))
        if w.lora_rank:  # LoRA (no tp: loom.rules.lora_problem): frozen base, adapters as any trained weight
            frozen_b, trained_b, _ = lora_bytes_per_param(w.precision, w.state_dtype)
            shard = dp if lay.dp_style == "fsdp" else 1
            adapters = lora_params(cfg, w.lora_rank, w.lora_targets) * shape.layers / cfg.layers  # this stage's
            params = ((dense + experts) * frozen_b + 4 * adapters) / shard
            grads, optim = 4 * adapters / shard, moment_bytes * adapters / shard
        activations = shape.held_layers * per_layer
        if lay.recompute == "full":  # k layers of every chunk keep only their input
            activations -= sum(held * recomputed_layers(lay, c) for c, held in zip(shape.chunks, shape.held)) * (per_layer - full)
        # On the rank with the LM head. loom: fp32 logits, their gradient and the 16-bit output. Megatron's
        # vocab-parallel cross-entropy: the fp32 copy it softmaxes in place and keeps, next to the 16-bit
        # logits at the end of forward and to the 16-bit input gradient in backward (6 bytes).
        logit_bytes = 4 + 2 if mega else 4 + 4 + act_bytes
        alive = min(tokens, w.loss_chunk) if w.loss_chunk else tokens  # one chunk's at a time (train.loss_chunk)
        logits = alive * (cfg.vocab_size / lay.tp) * logit_bytes if shape.head else 0.0
        if w.loss_chunk and not mega and shape.head:  # loom's chunked loss: one chunk's fp32 logits (softmax and
            # gradient in place on them) and its 16-bit gradient, then from forward to backward the hidden
            # states' gradient and an fp32 copy of the head weight's
            v = cfg.vocab_size / lay.tp
            logits = alive * v * (4 + (act_bytes if act_bytes < 4 else 0)) + tokens * cfg.hidden * act_bytes
            # ... unless the distributed optimizer takes the head's gradient straight into its fp32 buffer
            # (loom/parallel/headgrad.py), counted in `grads` (distopt) or `buffers` (zero3): zero3 every
            # micro-batch, tied or not; distopt untied only, a step's first (later ones keep the fp32 copy until
            # backward)
            into_buffer = lay.dp_style == "zero3" or (lay.dp_style == "distopt" and m == 1 and not cfg.tie_embeddings)
            if not into_buffer:
                logits += v * cfg.hidden * 4
        # Transformer Engine keeps each linear weight's fp8 cast and its transpose from the first
        # micro-batch to the last (its weight workspace cache): 2 bytes per linear weight on the rank.
        fp8_weights = (2 * shape.layers * (z["linear_layer"] / lay.tp + expert_layer / lay.ep)) if mega and fp8 else 0.0
        dynamic = params + grads + optim + activations + logits + buffers + fp8_weights
        total = dynamic * (1 + FRAGMENTATION) + CONTEXT_GIB * GIB
        if worst is None or total > worst["total"]:
            worst = {"params": params, "grads": grads, "optimizer": optim, "activations": activations,
                     "logits": logits, "buffers": buffers, "fp8_weights": fp8_weights, "reserve": CONTEXT_GIB * GIB + FRAGMENTATION * dynamic,
                     "total": total}
    if lay.dp_style == "distopt" and not mega:
        # loom's distributed optimizer materialises the model whole in fp32 on every rank before it keeps its
        # rows (distopt.py's set-up): the start-up peak, when it is the larger. zero3 draws each rank's rows from
        # the seed (loom/build.py's rows_later; only train.init_from, which the planner does not price, loads whole)
        startup = 4 * max(sum(local_params(w, lay, shape)) for shape in rank_shapes(w, lay)) + CONTEXT_GIB * GIB
        if startup > worst["total"]:
            worst = {**worst, "total": startup, "startup": startup}
    return worst
