"""Inference layouts: TP x PP x batch, prefill and decode latency, throughput, KV cache, the Pareto front.

Prefill runs the prompt through the same forward-kernel model as training (compute-bound), its attention
at the rate a profile measured for the engine's packed prefill at that prompt length
(`prefill_attention_tflops`) when it has one. Decode is one
token per sequence per step: every stage reads its weights once and each sequence's KV cache, so a step
costs max(bytes / HBM bandwidth, FLOPs / matmul rate) plus two TP all-reduces per layer (latency-bound
at these message sizes) and the kernel gaps. A measured profile (`loom plan --profile-hardware`) refines
both ends: each weight streams at the rate its `decode_gbps` table measured for few-row products of that
shape at this batch (on a CPU far below the memory bandwidth: the GEMM library, not the memory, limits
them; dense models), the key/values at the rate the engine's decode attention measured for a read of
that size (`decode_attention_gbps`), the batch's elementwise ops at the rate measured for loom's layer
(`elementwise_gbps`, as in prefill), and the gaps are the generation engine's own measured cost per layer,
per step and per sequence (`engine_overhead_us`). One batch is in flight (latency-optimal); pipeline stages therefore add
capacity, not speed. Request latency = prefill + output_len x decode step at the mean
context length; throughput = output tokens per second per GPU over all replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from loom.planner.kernels import (collective_time, compiled_elementwise_time, elementwise_time, gemm_time,
                                  log_interpolate, members_per_node, p2p_time)
from loom.planner.layertime import elementwise_bytes_per_token, layer_times
from loom.planner.memory import CONTEXT_GIB
from loom.planner.params import embedding_params, head_params, layer_params
from loom.planner.search import tp_options
from loom.planner.stages import stage_layers
from loom.planner.workload import GIB, Workload


@dataclass
class InferenceEstimate:
    tp: int
    pp: int
    batch: int
    replicas: int
    prefill_s: float
    decode_step_s: float
    request_latency_s: float
    tokens_per_s_per_gpu: float
    weights_gib: float
    kv_cache_gib: float
    total_gib: float
    fits: bool
    pareto: bool = False

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "batch": self.batch, "replicas": self.replicas,
                "prefill_s": round(self.prefill_s, 6), "decode_ms_per_token": round(1e3 * self.decode_step_s, 4),
                "request_latency_s": round(self.request_latency_s, 5),
                "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 3),
                "memory_gib": {"weights": round(self.weights_gib, 4), "kv_cache": round(self.kv_cache_gib, 4),
                               "total": round(self.total_gib, 4)},
                "fits": self.fits, "pareto": self.pareto}


def evaluate_inference(w: Workload, tp: int, pp: int, batch: int, input_len: int, output_len: int) -> InferenceEstimate:
    cfg, gpu = w.model, w.gpu
    weight_bytes = {"fp8": 1, "fp32": 4}.get(w.precision, 2)
    kv_bytes = 4 if w.precision == "fp32" else 2  # the cache keeps the activation dtype (16-bit under fp8)
    n_layers = stage_layers(cfg, pp)
    # The fullest stage: the embedding on the first, the final norm and LM head on the last (a tied head is
    # the embedding itself when both are on one stage, its own copy otherwise).
    head = head_params(cfg) - (cfg.vocab_size * cfg.hidden if cfg.tie_embeddings and pp == 1 else 0)
    ends = embedding_params(cfg) + head if pp == 1 else max(embedding_params(cfg), head)
    stage_params = (n_layers * layer_params(cfg) + ends) / tp
    weights = stage_params * weight_bytes
    kv_heads_local = max(1, cfg.kv_heads // tp)  # heads are replicated when tp exceeds them
    kv_per_token_layer = 2 * kv_heads_local * cfg.head_dim * kv_bytes  # K and V
    context = input_len + output_len
    kv_cache = batch * context * n_layers * kv_per_token_layer
    # One layer's working set at a time, and fp32 logits for the last position only (all a prompt needs
    # to start decoding; the time model computes the head for that position alone too).
    prefill_act = batch * input_len * (cfg.hidden * 6 + 3 * cfg.ffn_hidden / tp) * 2 + batch * cfg.vocab_size / tp * 4
    total = weights + kv_cache + prefill_act + CONTEXT_GIB * GIB
    # Prefill: the forward of every stage, one after another, plus the LM head on the last stage's last token.
    # The engine runs loom's own modules, prefill eagerly (loom.infer.engine), whatever --compile and
    # --framework say of training.
    pw = replace(w, seq_len=input_len, compile="off", elementwise_kernels="loom")
    fwd = layer_times(pw, tp, 1, batch, tp > 1, "none").fwd
    if not cfg.moe_layers:
        # The engine runs the model's own linear layers, one product each (q, k and v apart, the MLP's gate
        # and up apart), not training's fused QKV and gate-up shapes: on a measured GEMM table a 128-token
        # prompt's 256-column k and v products run at their own rate.
        fwd = {**fwd, "gemm": sum(c * gemm_time(gpu, w.precision, batch * input_len, o, i)
                                  for c, o, i in linear_shapes(cfg, tp))}
    engine_attention = log_interpolate(gpu.prefill_attention_tflops.get("bf16" if w.precision == "fp8" else w.precision),
                                       input_len)
    if engine_attention:  # the engine's own packed prefill attention, measured at this prompt length
        fwd = {**fwd, "attention": 2 * 2 * batch * (cfg.heads // tp) * input_len ** 2 * cfg.head_dim / 2
               / (engine_attention * 1e12)}
    stage_fwd = n_layers * sum(fwd.values())
    act = batch * input_len * cfg.hidden * 2
    head = gemm_time(gpu, "bf16" if w.precision == "fp8" else w.precision, batch, cfg.vocab_size // tp, cfg.hidden)
    overhead = gpu.engine_overhead_us
    # The engine's own cost of a forward step (measured per layer and per step), when the profile has it.
    step_gaps = (n_layers * overhead["layer"] + overhead["step"]) * 1e-6 if overhead else 0.0
    prefill = pp * (stage_fwd + step_gaps) + head + (pp - 1) * p2p_time(gpu, act, tp * pp <= gpu.node_size)
    # Decode step at the mean context.
    mean_ctx = input_len + output_len / 2
    weights_read = (n_layers * layer_params(cfg) + cfg.vocab_size * cfg.hidden) / tp * weight_bytes  # + LM head
    kv_read = n_layers * batch * mean_ctx * kv_per_token_layer
    flops = 2 * batch * (n_layers * layer_params(cfg) / tp + cfg.vocab_size * cfg.hidden / tp) \
        + 4 * batch * n_layers * (cfg.heads / tp) * cfg.head_dim * mean_ctx
    rate = gpu.peak(w.precision) * 1e12 * gpu.matmul_efficiency.get(w.precision, 0.7)
    hbm = gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency
    kv_rate = attention_rate(gpu, w.precision, kv_read / n_layers) or hbm
    if gpu.decode_gbps.get(w.precision) and not cfg.moe_layers:
        # A profile measured how fast few-row products stream each weight shape at this batch, from memory.
        # A model small enough that part of it stays cached from step to step streams faster by
        # `decode_stream_scale` (measured at one row); that shortens a product's one-row (streaming) time only,
        # not what more rows add to it (the product's arithmetic, which a cache does not speed up).
        scale = log_interpolate(gpu.decode_stream_scale.get(w.precision), weights_read) or 1.0

        def weight_s(o: int, i: int) -> float:
            nbytes = o * i * weight_bytes
            t = nbytes / decode_rate(gpu, w.precision, batch, o, i)
            return t - min(t, nbytes / decode_rate(gpu, w.precision, 1, o, i)) * (1 - 1 / scale)

        per_layer = sum(c * weight_s(o, i) for c, o, i in linear_shapes(cfg, tp))
        head_s = weight_s(cfg.vocab_size // tp, cfg.hidden)
        compute = max(n_layers * per_layer + head_s + kv_read / kv_rate, flops / rate)
    else:
        compute = max((weights_read + kv_read) / hbm, flops / rate)
    comm = n_layers * 2 * collective_time(gpu, "all_reduce", batch * cfg.hidden * 2, tp, members_per_node(gpu, 1, tp)) if tp > 1 else 0.0
    gaps = step_gaps + batch * overhead.get("row", 0.0) * 1e-6 if overhead else n_layers * 16 * gpu.kernel_overhead_us * 1e-6
    # The batch's tokens through the elementwise ops (norms, adds, activation, rotary), as in prefill; on a GPU
    # the engine compiles its decode step (post.engine_compile "auto": loom.infer.step.resolve_compile), so
    # they run fused there, eagerly on a CPU.
    ew_time = elementwise_time if gpu.is_cpu else compiled_elementwise_time
    elementwise = n_layers * ew_time(gpu, w.precision, batch * elementwise_bytes_per_token(cfg, w.precision, tp))
    decode = pp * (compute + elementwise + comm + gaps) + (pp - 1) * p2p_time(gpu, batch * cfg.hidden * 2, tp * pp <= gpu.node_size)
    latency = prefill + output_len * decode
    replicas = w.gpus // (tp * pp)
    throughput = replicas * batch * output_len / latency / w.gpus
    return InferenceEstimate(tp=tp, pp=pp, batch=batch, replicas=replicas, prefill_s=prefill, decode_step_s=decode,
                             request_latency_s=latency, tokens_per_s_per_gpu=throughput, weights_gib=weights / GIB,
                             kv_cache_gib=kv_cache / GIB, total_gib=total / GIB, fits=total <= w.usable_bytes)


def attention_rate(gpu, precision: str, nbytes: float) -> float | None:
    """Bytes per second of the engine's decode attention reading `nbytes` of one layer's keys and values, from
    the profile's `decode_attention_gbps` (a [[bytes, GB/s], ...] table, log-interpolated; or one rate);
    None without a measurement."""
    rate = gpu.decode_attention_gbps.get(precision)
    if not rate:
        return None
    return (log_interpolate(rate, nbytes) if isinstance(rate, list) else rate) * 1e9


def decode_rate(gpu, precision: str, rows: int, n: int, k: int) -> float | None:
    """Bytes per second at which a product of `rows` rows streams an n x k weight, from the profile's measured
    `decode_gbps` table: the measured weight shape nearest in log space; between the measured row counts
    either side, the time per byte is interpolated linearly in rows (the nearest count beyond them). A
    few-row product costs the weight's streaming plus work that grows with each row (a CPU kernel's row tiles),
    so its time is about linear in rows where its rate is not."""
    table = gpu.decode_gbps.get(precision)
    if not table:
        return None
    shape = min({(tn, tk) for _, tn, tk, _ in table},
                key=lambda s: math.log(n / s[0]) ** 2 + math.log(k / s[1]) ** 2)
    curve = sorted((m, r) for m, tn, tk, r in table if (tn, tk) == shape)
    if rows <= curve[0][0]:
        return curve[0][1] * 1e9
    for (m0, r0), (m1, r1) in zip(curve, curve[1:]):
        if rows <= m1:
            t = (rows - m0) / (m1 - m0)
            return 1e9 / (1 / r0 + t * (1 / r1 - 1 / r0))
    return curve[-1][1] * 1e9


def linear_shapes(cfg, tp: int) -> list[tuple[int, int, int]]:
    """(count, out, in) of one dense layer's linear weights on a tensor-parallel rank."""
    q, kv = cfg.heads * cfg.head_dim // tp, max(1, cfg.kv_heads // tp) * cfg.head_dim
    mlp = [(2 if cfg.mlp == "swiglu" else 1, cfg.ffn_hidden // tp, cfg.hidden), (1, cfg.hidden, cfg.ffn_hidden // tp)]
    return [(1, q, cfg.hidden), (2, kv, cfg.hidden), (1, cfg.hidden, q), *mlp]


def search_inference(w: Workload, input_len: int, output_len: int, max_batch: int) -> list[InferenceEstimate]:
    """Every fitting (tp, pp, batch), the Pareto-optimal ones flagged, sorted by request latency."""
    cfg = w.model
    out = []
    batches = [b for b in (2**i for i in range(0, 20)) if b <= max_batch]
    for tp in tp_options(cfg, w.gpus, w.gpu.node_size, False):
        for pp in range(1, cfg.layers + 1):
            if w.gpus % (tp * pp) or (pp > 1 and stage_layers(cfg, pp) * (pp - 1) >= cfg.layers):
                continue
            for b in batches:
                est = evaluate_inference(w, tp, pp, b, input_len, output_len)
                if est.fits:
                    out.append(est)
    out.sort(key=lambda e: (e.request_latency_s, -e.tokens_per_s_per_gpu))
    best_throughput = -math.inf
    for est in out:  # sorted by latency: on the front when it beats every faster one's throughput
        if est.tokens_per_s_per_gpu > best_throughput:
            est.pareto = True
            best_throughput = est.tokens_per_s_per_gpu
    return out


def plot_inference(estimates: list[InferenceEstimate], path, title: str) -> None:
    """Request latency against output tokens/s per GPU for every fitting layout, the Pareto front joined
    and labelled tp/pp/batch."""
    from loom.planner.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.scatter([e.request_latency_s for e in estimates], [e.tokens_per_s_per_gpu for e in estimates], s=10,
               color="0.7", label="fits")
    front = sorted((e for e in estimates if e.pareto), key=lambda e: e.request_latency_s)
    ax.plot([e.request_latency_s for e in front], [e.tokens_per_s_per_gpu for e in front], "o-", color="C0",
            label="Pareto front")
    for e in front:
        ax.annotate(f"tp{e.tp} pp{e.pp} b{e.batch}", (e.request_latency_s, e.tokens_per_s_per_gpu), fontsize=7,
                    xytext=(4, -10), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("request latency (s)")
    ax.set_ylabel("output tokens/s per GPU")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)


def format_inference(estimates: list[InferenceEstimate], pareto_only: bool = True) -> str:
    rows = [e for e in estimates if e.pareto] if pareto_only else estimates
    head = f"{'tp':>3} {'pp':>3} {'batch':>5} {'replicas':>8} {'prefill s':>9} {'ms/token':>8} {'latency s':>9} " \
           f"{'tok/s/gpu':>10} {'weights':>8} {'KV GiB':>7} {'total':>7}"
    lines = [head, "-" * len(head)]
    for e in rows:
        lines.append(f"{e.tp:>3} {e.pp:>3} {e.batch:>5} {e.replicas:>8} {e.prefill_s:>9.3f} {1e3 * e.decode_step_s:>8.2f} "
                     f"{e.request_latency_s:>9.2f} {e.tokens_per_s_per_gpu:>10.1f} {e.weights_gib:>8.1f} "
                     f"{e.kv_cache_gib:>7.1f} {e.total_gib:>7.1f}")
    return "\n".join(lines)
