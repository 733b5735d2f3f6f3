"""Time of one layer and of the LM head for one micro-batch on one rank, term by term:
  gemm         linear-layer matmuls (`kernels.gemm_time`);
  attention    the s x s part: fused kernel FLOPs (causal half) over the efficiency of the kernel that runs
               it (torch SDPA's FlashAttention-2 for loom, Transformer Engine's cuDNN attention for
               Megatron), or with "math" attention two batched GEMMs plus the softmax/mask/dropout traffic;
  elementwise  norms, residual adds, activation functions, RoPE, dropout: bytes over HBM bandwidth, or
               over the rate a profile measured for loom's own layer at that working set (a CPU's
               are compute-bound) (backward moves twice the forward bytes);
  tp_comm      tensor-parallel all-reduces (or all-gather + reduce-scatter with SP) that are not
               overlapped, over NVLink when the group fits in a node, else the network (every collective
               across nodes moves one network port per group rank in a node: rail-optimised clusters);
  cp_comm      context parallelism's key/value all-gather; ep_comm: expert parallelism's all-to-alls;
  overhead     the gap between dependent kernels;
forward and backward (with recomputation's extra forward work).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from loom.config import ModelConfig
from loom.planner.kernels import (collective_time, compiled_elementwise_time, elementwise_time, gemm_time, hbm_time,
                                  members_per_node)
from loom.planner.workload import Layout, Workload


@dataclass(frozen=True)
class LayerTimes:
    fwd: dict
    bwd: dict  # including recomputation


def torchao_fp8_cast_bytes_per_token(cfg: ModelConfig, tp: int = 1) -> float:
    """Bytes torchao's Float8Linear (loom's train.fp8) moves per token of one layer, forward and backward
    together, casting activations to fp8: each linear casts its input in forward and, in backward, its
    output gradient (for the input gradient) and both again with the other axis's scales (for the weight
    gradient); each cast reads the 16-bit tensor for its amax, then reads it again and writes one byte
    (2 + 2 + 1 = 5 bytes per element). loom's linears: wq, wk, wv, wo, w1, w3, w2, each casting its own
    input (wq/wk/wv and w1/w3 read the same normed input separately). The weights' casts are per
    micro-batch, not per token (`_layer_forward`)."""
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    gated = cfg.mlp == "swiglu"
    inputs = 3 * h + a * d / tp + (2 if gated else 1) * h + f / tp
    outputs = (a + 2 * g) * d / tp + h + (2 if gated else 1) * f / tp + h
    return 5 * 2 * (inputs + outputs)


def elementwise_bytes_per_token(cfg: ModelConfig, prec: str, tp: int = 1, sp: bool = False, moe: bool = False,
                                fp8_recipe: str = "te") -> float:
    """Bytes the elementwise ops of one layer's forward move per token on a rank: two norms, two residual
    adds (replicated over tp unless SP splits the sequence), the MLP's activation function and rotary
    embedding (split over tp), dropout and fp8 casts when present (`fp8_recipe`: "te", Transformer
    Engine's casts fused into its norm+linear modules, or "torchao", loom's Float8Linear casts,
    `torchao_fp8_cast_bytes_per_token`; backward is priced at twice the forward, so a third of those
    forward-and-backward bytes is counted here)."""
    h, d, a, g, f = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
    half = 4 if prec == "fp32" else 2  # bytes of an activation element
    per_token_hidden = 2 * (2 * h * half) + 2 * (3 * h * half)  # two norms, two residual adds
    if cfg.dropout > 0:
        per_token_hidden += 2 * (2 * h * half + h)
    per_token_split = (3 if cfg.mlp == "swiglu" else 2) * f * half if not moe else 0.0  # activation function
    if cfg.position == "rope":
        per_token_split += 2 * (a + g) * d * half
    fp8_cast = 0.0
    if prec == "fp8" and fp8_recipe == "torchao":
        fp8_cast = torchao_fp8_cast_bytes_per_token(cfg, tp) / 3
    elif prec == "fp8":
        # Every linear input (forward) and output gradient (backward) is scaled and cast to fp8, plus a
        # transposed fp8 copy for the weight gradient: 4 bytes moved per input element over forward and
        # backward together. Half is counted here, in the forward's bytes; backward's 2x gives the rest.
        inputs_per_token = h + a * d / tp + h + f / tp  # QKV, out-proj, fc1, fc2 inputs on this rank
        fp8_cast = 4 * inputs_per_token / 2
    return per_token_hidden / (tp if sp else 1) + per_token_split / tp + fp8_cast


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
    span = moe and w.experts_over_tp(tp, sp, ep)  # each rank routes its own sequence shard (no MoE tp collectives)
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
        core = {"attention": score + ctx, "elementwise": hbm_time(gpu, traffic)}
    else:
        # Fused attention computes only the causal half of the score matrix.
        flops = 2 * 2 * mbs * heads * s * w.seq_len * d / 2
        peak16 = gpu.peak("bf16" if prec == "fp8" else prec)
        measured = w.loom_attention_tflops("bf16" if prec == "fp8" else prec)
        # A profile's rate counts forward and backward (3.5x the forward FLOPs); backward is 2.5x forward below.
        rate = measured * 1e12 if measured else peak16 * 1e12 * w.attention_efficiency
        core = {"attention": flops / rate, "elementwise": 0.0}
    # torchao's fp8 casts for loom's own runtime, Transformer Engine's for Megatron; a compiled block's
    # elementwise bytes (or a fused stack's) run as fused kernels (`compiled_elementwise_time`), loom's eager
    # ones at the profile's eager rate, or the preset's share of the bandwidth (`elementwise_time`).
    recipe = "torchao" if w.framework == "loom" else "te"
    ew_time = compiled_elementwise_time if w.fused_elementwise() else elementwise_time
    ew_bytes = tokens * elementwise_bytes_per_token(cfg, prec, tp, sp, moe, recipe)
    if prec == "fp8" and recipe == "torchao" and not moe:
        # Each weight cast to fp8 once per micro-batch in forward and once (other axis) in backward;
        # counted in the forward's bytes as a third of both passes, as the activation casts are.
        weights = (h * (a + 2 * g) * d + a * d * h + (3 if cfg.mlp == "swiglu" else 2) * f * h) / tp
        ew_bytes += 5 * 2 * weights / 3
    elementwise = ew_time(gpu, prec, ew_bytes)
    if moe_terms:
        elementwise += moe_terms["elementwise"]
    tp_comm = 0.0
    if tp > 1:
        act = tokens * h * half
        per_node = members_per_node(gpu, 1, tp)
        if sp:  # attention's and the MLP's; an MoE layer whose ranks route their own shards has only attention's
            tp_comm = (1 if span else 2) * (collective_time(gpu, "all_gather", act, tp, per_node)
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
    core["moe_wgrad"] = moe_terms["wgrad_extra"] if moe_terms else 0.0  # MoE only: `_moe_forward`
    return fwd, core


def _moe_forward(w: Workload, tokens: int, tp: int, sp: bool, ep: int) -> dict:
    """An MoE layer's MLP forward on one rank, in place of the dense MLP, for `tokens` tokens of the tensor-
    parallel group (a micro-batch's share of the sequence). Two layouts (`Workload.experts_over_tp`):

    - experts spread over tensor- and data-parallel ranks (loom under SP with ep a multiple of tp, Megatron-Core
      with expert tensor parallelism 1): each rank routes only its own sequence shard, tokens / tp, and the
      router and shared experts run on those rows; an EP group is whole tp groups side by side (tp innermost),
      so its members are consecutive ranks.
    - otherwise MoE layers are not split over tp (loom/parallel/tensor.py): every tensor-parallel rank routes
      all the group's tokens (under SP it all-gathers them first and keeps its own shard of the output), the
      shared experts run whole on every tp rank, and an EP group takes one rank of each tp group (stride tp).

    The routed rows, tokens x top_k (x the imbalance on the busiest rank), are spread over the rank's E/ep
    experts as one grouped GEMM per weight (`batch` = local experts); the router is a small GEMM. Dispatch
    and combine are one all-to-all each over the ep ranks (each rank sends (ep-1)/ep of its rows away),
    inside a node when the ep group fits in one, else at the network's bandwidth for the part that leaves
    the node (`Workload.moe_dispatcher` "deepep": each token crosses the network once per node it goes
    to). Permuting the rows in and out and the experts' activation function are HBM traffic."""
    cfg, gpu, prec = w.model, w.gpu, w.precision
    h, k, E = cfg.hidden, cfg.moe.top_k, cfg.moe.experts
    fe = cfg.moe.ffn_hidden or cfg.ffn_hidden
    gated = cfg.mlp == "swiglu"
    half = 4 if prec == "fp32" else 2
    span = w.experts_over_tp(tp, sp, ep)
    routed_tokens = tokens // tp if span else tokens  # this rank's tokens through the router and shared experts
    rows = routed_tokens * k * w.moe_imbalance
    local = E // ep
    per_expert = max(1, math.ceil(rows / local))
    gemm = (gemm_time(gpu, prec, per_expert, (2 if gated else 1) * fe, h, local)
            + gemm_time(gpu, prec, per_expert, h, fe, local)
            + gemm_time(gpu, "bf16" if prec == "fp8" else prec, routed_tokens, E, h))  # the router (fp32 in
    # loom; priced at the 16-bit rate: E x h per token is small next to the experts')
    if cfg.moe.shared_experts:
        fs = cfg.moe.shared_experts * fe
        gemm += (gemm_time(gpu, prec, routed_tokens, (2 if gated else 1) * fs, h)
                 + gemm_time(gpu, prec, routed_tokens, h, fs))
    # Bytes: rows gathered in and scattered back (read + write each), the activation function over the rows,
    # the router's softmax / top-k over E scores per token (fp32).
    traffic = rows * (2 * 2 * h * half + (3 if gated else 2) * fe * half) + routed_tokens * E * 4 * 3
    if cfg.moe.shared_experts:
        traffic += routed_tokens * (3 if gated else 2) * cfg.moe.shared_experts * fe * half
    ep_comm = 0.0
    if ep > 1:
        row = h * half  # bytes of one dispatched row
        in_node = members_per_node(gpu, 1 if span else tp, ep)  # ep peers sharing this rank's node
        inside = rows * row * (in_node - 1) / ep  # bytes each rank sends to its node's peers per exchange
        leaving = rows * row * (ep - in_node) / ep  # and to the other nodes' ranks
        if w.moe_dispatcher == "deepep" and ep > in_node:
            # DeepEP's internode kernels send a token over the network once per node holding any of its
            # top_k experts, and that node's receiving GPU forwards it over NVLink to the others: with the
            # experts spread evenly (balanced routing), a remote node holds none of a token's k experts
            # with probability C(E - E/nodes, k) / C(E, k).
            nodes = ep // in_node
            per_node = E // nodes
            missed = math.prod((E - per_node - i) / (E - i) for i in range(k)) if E - per_node >= k else 0.0
            inside += leaving  # forwarded inside the receiving node (each rank forwards as much as it gets)
            leaving = routed_tokens * w.moe_imbalance * (nodes - 1) * (1 - missed) * row
        seconds = max(inside / (gpu.nvlink_gbps * 1e9 * gpu.collective_efficiency),
                      leaving / (gpu.internode_gbps * 1e9 * gpu.collective_efficiency))
        chunks = w.ep_overlap_chunks
        # Each row's gate weight travels with it to the experts that fold it into their activation: one more
        # all-to-all (4 bytes a row) after the dispatch, and its gradient back in backward: loom's SwiGLU experts
        # (loom/parallel/expert.py), Megatron-Core's alltoall dispatcher (its permuted probs, always); DeepEP
        # carries them in the token's message.
        gates = w.moe_dispatcher != "deepep" and (gated or w.framework == "megatron")
        lat = gpu.collective_latency_us * 1e-6
        ep_comm = 2 * (chunks * lat + seconds) + (chunks * lat if gates else 0.0)
        if chunks > 1:  # loom's pipelined exchange (parallel.ep_overlap_chunks, loom/parallel/expert.py): the
            # first chunk's dispatch and the last one's combine stay exposed; the other exchanges run while
            # other chunks' experts compute, and only what the experts' products cannot cover shows
            experts = gemm_time(gpu, prec, per_expert, (2 if gated else 1) * fe, h, local) + gemm_time(
                gpu, prec, per_expert, h, fe, local)
            ep_comm = ep_comm / chunks + (chunks - 1) / chunks * max(0.0, ep_comm - experts)
    return {"gemm": gemm, "elementwise": hbm_time(gpu, traffic), "ep_comm": ep_comm, "kernels": 12,
            "wgrad_extra": _expert_wgrad_extra(w, per_expert, local)}


def _expert_wgrad_extra(w: Workload, per_expert: int, local: int) -> float:
    """Seconds the routed experts' weight-gradient GEMMs (`local` experts, `per_expert` rows each) take in
    backward beyond the same products writing a 16-bit C (`gemm_time`; the backward is priced at twice the
    forward GEMM time). Megatron-Core fuses the weight-gradient accumulation into the GEMM
    (gradient_accumulation_fusion, on unless --no-gradient-accumulation-fusion; Transformer Engine's
    GroupedLinear with fuse_wgrad_accumulation): each expert's product is C += A^T B with C the fp32 (with
    --grad-reduce-in-bf16, bf16) main_grad of its weight, read and written every micro-batch. With few rows
    per expert (short k = per_expert) that C traffic, 2 x weight elements x the buffer's element size,
    outweighs the FLOPs and the product is memory-bound. loom's runtime writes each gradient once at the
    compute dtype, what `gemm_time` already counts: 0 there."""
    if w.framework != "megatron":
        return 0.0
    cfg, gpu, prec = w.model, w.gpu, w.precision
    h, fe = cfg.hidden, cfg.moe.ffn_hidden or cfg.ffn_hidden
    elem = {"fp8": 1, "fp32": 4}.get(prec, 2)
    gb = 2 if w.grad_dtype == "bfloat16" else 4
    extra = 0.0
    for out, inp in (((2 if cfg.mlp == "swiglu" else 1) * fe, h), (h, fe)):  # fc1, fc2
        plain = gemm_time(gpu, prec, out, inp, per_expert, local)  # the product with a written 16-bit C
        traffic = local * ((out + inp) * per_expert * elem + 2 * out * inp * gb)
        extra += max(0.0, hbm_time(gpu, traffic) + gpu.kernel_overhead_us * 1e-6 - plain)
    return extra


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
    bwd["gemm"] += core["moe_wgrad"]  # the routed experts' weight gradients into the gradient buffer
    if recompute == "full":
        for key in bwd:
            bwd[key] += fwd[key]
    elif recompute == "selective":
        bwd["attention"] += core["attention"]
        bwd["elementwise"] += core["elementwise"]
    return LayerTimes(fwd, bwd)


# Bytes each logit moves through the cross-entropy, forward and backward, beyond the head's matmuls:
# - loom (and torch's F.cross_entropy on fp32 logits): the cast to fp32, log-softmax and gather forward, the
#   softmax gradient backward, three fp32 passes each way (checked against loom's measured runs);
# - Megatron-Core's vocab-parallel cross-entropy (megatron/core/tensor_parallel/cross_entropy.py, unfused: the
#   default without --cross-entropy-loss-fusion), counted op by op. Forward: `.float()` (2 read + 4 written),
#   max (4), in-place subtract of the max (4 + 4), exp in place (4 + 4), sum (4), in-place divide into the
#   softmax kept for backward (4 + 4): 38. Backward: the target's entry (one element a row), in-place multiply
#   by the output gradient (4 + 4), the cast back to the head's 16-bit dtype (4 + 2): 14.
# - the same with --cross-entropy-loss-fusion (megatron/core/fusions/fused_cross_entropy.py, `Workload.ce_fusion`):
#   the cast and the max in one kernel (2 + 4), subtract and exp in place in one (4 + 4), the sum (4), the divide
#   (4 + 4): 26 forward; the same 14 backward.
CE_BYTES_PER_LOGIT = {"loom": (12, 12), "megatron": (38, 14), "megatron_fused": (26, 14)}


@lru_cache(maxsize=4096)
def head_times(w: Workload, tp: int, cp: int, mbs: int) -> tuple[float, float]:
    """Forward and backward seconds of the LM head and cross-entropy (fp32 logits) per micro-batch."""
    if w.loss_chunk == "auto":  # a caller without the layout: as one of pp = 1 at this tp
        w = w.at_layout(Layout(tp=tp))
    cfg, gpu = w.model, w.gpu
    tokens = mbs * w.seq_len // cp
    v = cfg.vocab_size // tp
    gemm = gemm_time(gpu, "bf16" if w.precision == "fp8" else w.precision, tokens, v, cfg.hidden)
    loss = "loom" if w.framework != "megatron" else "megatron_fused" if w.ce_fusion else "megatron"
    ce_fwd, ce_bwd = CE_BYTES_PER_LOGIT[loss]
    fwd = gemm + hbm_time(gpu, ce_fwd * tokens * v)
    bwd = 2 * gemm + hbm_time(gpu, ce_bwd * tokens * v)  # the input's and the weight's gradient products
    if w.loss_chunk:  # loom's chunked loss: forward computes the head's gradients too (the same three matmuls
        # and passes over the logits), adding each chunk's weight gradient into an fp32 buffer (read and
        # written once per chunk after the first); backward only scales the kept gradients
        chunks = -(-tokens // w.loss_chunk)
        fwd += bwd + hbm_time(gpu, 8 * (chunks - 1) * v * cfg.hidden)
        bwd = hbm_time(gpu, 8 * v * cfg.hidden + 4 * tokens * cfg.hidden)
    if tp > 1:  # loss-parallel: max and sum-exp all-reduces of tokens floats
        fwd += 2 * collective_time(gpu, "all_reduce", tokens * 4, tp, members_per_node(gpu, 1, tp))
    return fwd, bwd
