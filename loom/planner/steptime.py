"""Step time of one training layout, and its estimate. Everything derives from the architecture
(`ModelConfig`), the layout, and the hardware numbers in `hardware.py`; nothing is fitted to a particular
published run. A micro-batch's forward and backward on the slowest pipeline rank (`layertime`) times the
micro-batches, then
  pipeline     (m + bubble) micro-batch slots of the slowest stage, bubble = (p-1)/v for 1F1B and
               interleaved, (p-1)/3 for zero-bubble; plus P2P transfers;
  dp_comm      the part of gradient reduction / parameter gathering not hidden behind backward;
  fsdp_copy    FSDP2's copies into and out of its flat collective buffers, on the compute stream;
  distopt_copy loom's distributed optimizer's gradient copies and adds into its fp32 buffer, and the
               gathered weights' copy into the parameters;
  optimizer    the AdamW update, bytes over HBM bandwidth;
  clock        the matmuls' (layers' and head's) extra time at the sustained clock of a saturated GPU over
               the burst clock their preset efficiency was measured at (`GPU.sustained_clock`; 0 for a
               profile, whose tables were timed at the power cap).
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from loom.flops import train_flops_per_token
from loom.rules import adam_moment_bytes, grads_stay_sharded, zero3_keeps_compute_rows
from loom.planner.hardware import GPU
from loom.planner.kernels import collective_time, hbm_time, members_per_node, p2p_time
from loom.planner.layertime import head_times, layer_times
from loom.planner.memory import memory
from loom.planner.params import lora_params, model_sizes
from loom.planner.stages import (expert_data_parallel, expert_rank_stride, expert_row_padding, local_params,
                                 loom_shard_groups, priced_as_megatron, rank_shapes, recomputed_layers)
from loom.planner.workload import Estimate, Layout, Workload


def _intra(gpu: GPU, stride: int, size: int) -> bool:
    return stride * size <= gpu.node_size


@lru_cache(maxsize=1024)
def with_te_kernels(w: Workload) -> Workload:
    """`w` with Transformer Engine's kernels where it left them to the framework: fused attention and fused
    elementwise ops (one object per workload, so the caches keyed on it hold)."""
    return replace(w, attention_kernel="fused" if w.attention_kernel == "auto" else w.attention_kernel,
                   elementwise_kernels="fused" if w.elementwise_kernels == "auto" else w.elementwise_kernels)


@lru_cache(maxsize=1024)
def compiled_workload(w: Workload, on: bool) -> Workload:
    """`w` with its blocks' compilation resolved for one layout (`Workload.runs_compiled`), one object per
    workload and answer so the caches keyed on it hold."""
    return w if w.compile == ("on" if on else "off") else replace(w, compile="on" if on else "off")


@lru_cache(maxsize=1024)
def at_burst_clock(w: Workload) -> Workload:
    """`w` on its GPU as if it kept its burst clock (`sustained_clock` 1): the baseline the step's "clock"
    term is measured from (one object per workload, so the caches keyed on it hold)."""
    return replace(w, gpu=replace(w.gpu, sustained_clock=1.0))


def kernels_workload(w: Workload, lay: Layout) -> Workload:
    """`w` with the kernels layout `lay` runs: Transformer Engine's under Megatron's distributed optimizer, and
    its blocks compiled or not (`Workload.runs_compiled`)."""
    megatron_distopt = lay.dp_style == "distopt" and w.framework == "megatron"
    kw = with_te_kernels(w) if megatron_distopt else w  # Megatron's runtime runs Megatron's kernels
    return compiled_workload(kw, w.runs_compiled(lay))


def step_time(w: Workload, lay: Layout) -> dict:
    """Seconds of one training step, term by term (the terms of this module's docstring and `layertime`'s)."""
    w = w.at_layout(lay)
    cfg, gpu = w.model, w.gpu
    m = w.global_batch // (lay.dp * lay.micro_batch)
    base = "selective" if lay.recompute == "selective" else "none"
    kw = kernels_workload(w, lay)
    lt = layer_times(kw, lay.tp, lay.cp, lay.micro_batch, lay.sp, base, lay.ep)
    ft = layer_times(kw, lay.tp, lay.cp, lay.micro_batch, lay.sp, "full", lay.ep) if lay.recompute == "full" else None
    hf, hb = head_times(kw, lay.tp, lay.cp, lay.micro_batch)
    # The sustained clock's share of the matmuls (the layers' and the head's), split out of them as its own
    # term: the same products priced at the burst clock, and the difference.
    clock = w.gpu.sustained_clock != 1.0
    if clock:
        bw = at_burst_clock(kw)
        blt = layer_times(bw, lay.tp, lay.cp, lay.micro_batch, lay.sp, base, lay.ep)
        bft = layer_times(bw, lay.tp, lay.cp, lay.micro_batch, lay.sp, "full", lay.ep) if ft else None
        bhead = sum(head_times(bw, lay.tp, lay.cp, lay.micro_batch))
    # A micro-batch's forward + backward on each pipeline rank; the slowest rank sets the pace.
    shapes = rank_shapes(w, lay)
    terms, per_mb, n_layers, n_full = {}, -1.0, 0, 0
    for shape in shapes:
        t = dict.fromkeys(("gemm", "attention", "elementwise", "tp_comm", "cp_comm", "ep_comm", "overhead"), 0.0)
        full_layers = sum(recomputed_layers(lay, c) for c in shape.chunks) if ft else 0
        for key in t:
            t[key] = shape.layers * (lt.fwd[key] + lt.bwd[key])
            if full_layers:
                t[key] += full_layers * ((ft.fwd[key] + ft.bwd[key]) - (lt.fwd[key] + lt.bwd[key]))
        t["head"] = hf + hb if shape.head else 0.0
        if clock:
            burst = shape.layers * (blt.fwd["gemm"] + blt.bwd["gemm"])
            if full_layers:
                burst += full_layers * ((bft.fwd["gemm"] + bft.bwd["gemm"]) - (blt.fwd["gemm"] + blt.bwd["gemm"]))
            t["clock"] = t["gemm"] - burst
            t["gemm"] = burst
            if shape.head:
                t["clock"] += t["head"] - bhead
                t["head"] = bhead
        if sum(t.values()) > per_mb:
            terms, per_mb, n_layers, n_full = t, sum(t.values()), shape.layers, full_layers
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
    # experts (E/ep per rank) are reduced over the expert-data-parallel ranks (`expert_data_parallel`: dp x cp
    # / ep of them, or tp x dp x cp / ep with experts spread over tensor-parallel ranks).
    dense, experts = max((local_params(w, lay, shape) for shape in shapes), key=sum)  # the largest rank's
    pad, experts_off_rows = expert_row_padding(w, lay)  # routed experts split by rows over more ranks than rows
    experts *= pad
    dp_comm = 0.0
    group = lay.dp * lay.cp  # gradients are reduced over the data-parallel ranks and their cp ranks
    egroup = expert_data_parallel(w, lay)
    estride = expert_rank_stride(w, lay) * lay.ep  # expert-dp members are a whole EP group apart
    # Gradient element size on the wire: Megatron's buffer dtype (bf16 in NeMo's performance recipes), else fp32.
    gb = 2 if priced_as_megatron(w, lay) and w.grad_dtype == "bfloat16" else 4

    def coll(kind: str, per_param: float) -> float:
        """One collective over the dense parameters and one over the routed experts' expert-dp group."""
        return (collective_time(gpu, kind, per_param * dense, group, members_per_node(gpu, lay.tp, group))
                + collective_time(gpu, kind, per_param * experts, egroup, members_per_node(gpu, estride, egroup)))

    if group > 1 or egroup > 1:
        # The backward that reductions (and FSDP's backward gathers) hide behind: the slowest rank's, with the
        # forward that full recomputation reruns inside it.
        bwd_mb = sum(lt.bwd.values()) * n_layers
        if n_full:
            bwd_mb += n_full * (sum(ft.bwd.values()) - sum(lt.bwd.values()))
        fwd_mb = sum(lt.fwd.values()) * n_layers
        if lay.dp_style == "replicate":
            grad = coll("all_reduce", gb)
            dp_comm = max(grad - bwd_mb, grad / max(n_layers, 1)) if w.overlap_grad_reduce else grad
        elif lay.dp_style == "distopt" and not priced_as_megatron(w, lay):
            # loom's distributed optimizer (loom/parallel/distopt.py): buckets reduce-scattered as the last
            # micro-batch's backward completes them (a pipeline stage counts each parameter's gradients to know
            # its last micro-batch), the new 16-bit weights all-gathered after the optimizer step, exposed.
            grad = coll("reduce_scatter", 4)
            gather = coll("all_gather", 2 if w.precision != "fp32" else 4)
            hidden_grad = max(grad - bwd_mb, grad / max(n_layers, 1))
            dp_comm = hidden_grad + gather
            layers = max(shape.layers for shape in shapes)
            step["distopt_copy"] = hbm_time(gpu, distopt_copy_bytes(w, dense + experts, m,
                                                                    fused_linear_params(w, lay, layers)))
        elif lay.dp_style == "distopt":
            grad = coll("reduce_scatter", gb)
            gather = coll("all_gather", 2)
            hidden_grad = max(grad - bwd_mb, grad / max(n_layers, 1)) if w.overlap_grad_reduce else grad
            dp_comm = hidden_grad + max(gather - fwd_mb, gather / max(n_layers, 1))
        else:
            gather = coll("all_gather", 2)
            grad = coll("reduce_scatter", 4)
            hidden_gather = max(gather - fwd_mb, gather / max(n_layers, 1))
            hidden_grad = max(grad - bwd_mb, grad / max(n_layers, 1))
            if lay.pp > 1:
                # Pipeline stages gather their weights once per step and keep them; the schedule reduces
                # gradients after the stage's last backward, with no backward left to hide behind.
                dp_comm = hidden_gather + grad
            else:
                # 16-bit weights gathered before each layer's forward and backward of every micro-batch
                # (prefetched, overlapping the previous layer); gradients reduce-scattered every
                # micro-batch (sharded accumulation) or after the last one.
                sharded = grads_stay_sharded(w.grad_accum, lay.pp, m) or lay.dp_style == "zero3"
                dp_comm = m * (hidden_gather + max(gather - bwd_mb, gather / max(n_layers, 1))) + (m if sharded else 1) * hidden_grad
        if lay.dp_style == "zero3":  # loom's sharded weights: no FSDP2 copies; its own adds and casts
            layers = max(shape.layers for shape in shapes)
            fused = fused_linear_params(w, lay, layers)
            if w.loss_chunk and not cfg.tie_embeddings and not w.gpu.is_cpu:  # the chunked loss writes the untied
                fused += cfg.vocab_size * cfg.hidden  # head's gradient into its buffer (loom/parallel/headgrad.py)
            step["distopt_copy"] = hbm_time(gpu, zero3_copy_bytes(w, dense + experts, m, group, fused,
                                                                 rows=dense / group + experts / egroup))
        if w.fsdp2 and lay.dp_style in ("fsdp", "replicate") and not priced_as_megatron(w, lay):
            step["fsdp_copy"] = hbm_time(gpu, fsdp2_copy_bytes(w, lay, dense, experts, m, experts_off_rows))
    step["dp_comm"] = dp_comm
    # AdamW: read param, grad, two moments; write param, moments (and a 16-bit copy); over the local shard.
    if lay.dp_style == "replicate":  # loom's replicate still shards the routed experts over the edp ranks
        shard = dense / lay.cp + experts / (max(1, lay.cp // lay.ep) if priced_as_megatron(w, lay)
                                            else loom_shard_groups(lay)[1])
    else:
        shard = dense / group + experts / egroup
    moments = adam_moment_bytes(w.state_dtype)
    if w.lora_rank:  # LoRA: AdamW updates the adapters only (the frozen base has no gradient)
        shard = lora_params(w.model, w.lora_rank, w.lora_targets) / lay.pp / (group if lay.dp_style == "fsdp" else 1)
    step["optimizer"] = hbm_time(gpu, shard * (4 + 4 + moments + 4 + moments + 2))
    return step


def distopt_copy_bytes(w: Workload, local: float, m: int, fused: float = 0.0) -> float:
    """Bytes loom's distributed optimizer moves on the compute stream in one step for `local` parameters
    (loom/parallel/distopt.py): each micro-batch's gradient (e bytes, the compute dtype's) copied into the fp32
    buffer (4 written) on the first micro-batch and added to it later (8: read and write), then the gathered
    weights copied into the parameters once (2e). The `fused` of them (the blocks' bias-free linear layers on a
    GPU, `fused_linear_params`) have their weight gradient written into the buffer by the backward's GEMM
    (`LinearIntoBuffer`, as Megatron's gradient-accumulation fusion): none of the first term, like Megatron."""
    e = 4 if w.precision == "fp32" else 2
    return (local - fused) * ((e + 4) + (m - 1) * (e + 8)) + local * 2 * e


def zero3_copy_bytes(w: Workload, local: float, m: int, group: int, fused: float = 0.0,
                     rows: float | None = None) -> float:
    """Bytes loom's sharded weights (loom/parallel/zero.py) move on the compute stream in one step for `local`
    parameters split over `group` ranks: the all-gathers write straight into the parameters and the fused linear
    layers' GEMMs write their fp32 gradients straight into the reduce-scatter's input (nothing for either); each
    micro-batch the `local - fused` others' 16-bit gradients are copied into it (e read, 4 written) and every
    reduced row is added into the rank's fp32 gradient rows (the first micro-batch copies: 8; later ones add: 12);
    each gather casts the master rows it sends to the compute dtype (4 + e; none in fp32): every unit twice per
    micro-batch, forward and backward (the embedding and head once: counted twice here); past 8 micro-batches the
    rows are cast once after the step and kept (`loom.rules.zero3_keeps_compute_rows`)."""
    e = 4 if w.precision == "fp32" else 2
    rows = local / group if rows is None else rows  # (`rows`: routed experts split over their edp ranks)
    cast = 0 if e == 4 else rows * (4 + e) * (1 if zero3_keeps_compute_rows(m) else 2 * m)
    return m * (local - fused) * (e + 4) + rows * (8 + (m - 1) * 12) + cast


def fused_linear_params(w: Workload, lay: Layout, layers: int) -> float:
    """Weights of the linear layers loom's distributed optimizer fuses on a rank holding `layers` layers: each
    block's attention projections and dense MLP (not the routed or shared experts), split by tp; under tp only
    the bias-free ones (loom/parallel/distopt.py's `_fuse_linears`); none on a CPU (its backward computes the
    product, then adds it)."""
    cfg = w.model
    if w.gpu.is_cpu or (cfg.bias and lay.tp > 1):
        return 0.0
    h, d, a, g = cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads
    qkv = h * (a + 2 * g) * d
    attn = a * d * h + (0 if cfg.qkv_bias and lay.tp > 1 else qkv)  # Qwen2's biased q/k/v unfused under tp
    mlp = (3 if cfg.mlp == "swiglu" else 2) * h * cfg.ffn_hidden
    dense_share = 1 - cfg.moe_layers / cfg.layers
    return layers * (attn + dense_share * mlp) / lay.tp


def fsdp2_copy_bytes(w: Workload, lay: Layout, dense: float, experts: float, m: int,
                     experts_off_rows: bool = False) -> float:
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
    in autograd, so only the chunk_cat (8) per reduction is FSDP's. Shard groups: `loom_shard_groups`.
    `experts_off_rows` (`expert_row_padding`): the routed experts are split along a dimension other than their
    rows, which FSDP2 copies once more each way (a temporary, then torch.cat into the parameter after each
    gather; torch.cat of the gradient's chunks before each reduction): 2e more per element each."""
    cfg = w.model
    e = 4 if w.precision == "fp32" else 2
    shard_dense, shard_experts = loom_shard_groups(lay)

    def unshard(n: int) -> float:
        return 2 * e if n > 1 or e == 4 else 4 + 3 * e

    off = 2 * e if experts_off_rows else 0.0
    once = dense * unshard(shard_dense) + experts * (unshard(shard_experts) + off)
    if lay.pp > 1:
        gathers = once
    else:
        z = model_sizes(w)
        root = (z["total"] - z["experts"] - cfg.layers * z["dense_layer"]) / lay.tp
        single = ((root + z["dense_layer"] / lay.tp) * unshard(shard_dense)
                  + z["expert_layer"] / lay.ep * (unshard(shard_experts) + off))
        gathers = m * (2 * once - single)
    local = dense + experts
    reduced = m if shard_dense > 1 and grads_stay_sharded(w.grad_accum, lay.pp, m) else 1
    gathers += reduced * experts * off  # (the gradients' extra copy, with the reductions)
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
