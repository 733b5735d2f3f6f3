"""`loom plan --profile-hardware OUT.json`: measure this machine and write a profile for `--gpu OUT.json`.

Measured: GEMM throughput over a grid of shapes for each 16-bit dtype (fp32 too on a CPU), fused
attention forward+backward, memory bandwidth (a large device copy), all-reduce bus bandwidth between
local processes (gloo on CPU, nccl between GPUs), the weight-streaming rate of few-row (decode) products
per weight shape, the rate of loom's own layer's elementwise ops at a few working-set sizes, and, through
`loom.infer.probe`, the generation engine's decode attention rate and its
own cost per layer and per step. Datasheet-only numbers that one machine cannot show
(network bandwidth between nodes) come from `--internode-gbps`. Measured rates are stored as peaks with
efficiency 1, and the GEMM table replaces the default efficiency curve.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from loom.errors import UserError


def _timeit(fn, device: str, min_time: float = 0.2, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    reps, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < min_time:
        fn()
        reps += 1
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    return elapsed / reps


def _linear_pass(x: torch.Tensor, weights: list, device: str, min_time: float = 0.2, product=None) -> float:
    """Seconds for F.linear(x, w) over every w in `weights`, one after another (copies that together
    outgrow the caches make each product read its weight from memory). `product(w)`, when given, returns
    the function that multiplies by w instead (prepared before the clock starts: the generation engine's
    packed CPU kernel packs each weight once)."""
    import torch.nn.functional as F

    fns = [product(w) for w in weights] if product is not None else [lambda x, w=w: F.linear(x, w) for w in weights]

    def run():
        for fn in fns:
            fn(x)

    return _timeit(run, device, min_time=min_time)


def gemm_table(device: str, dtype: torch.dtype, shapes) -> list[list[float]]:
    """[[m, n, k, TFLOP/s], ...] of x @ W^T with x [m, k] and W [n, k], as a linear layer computes it. On a
    CPU in fp32 the product cycles over copies of W that together outgrow the last-level cache, so each W comes
    from memory as a model's weights do (each is read once per forward); a hot cache would overstate the rate."""
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        cold = device == "cpu" and dtype == torch.float32  # (a CPU's bf16 products are too slow to repeat)
        copies = max(1, (1 << 26) // (n * k * 4)) if cold else 1
        weights = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(copies)]
        t = _linear_pass(a, weights, device) / copies
        rows.append([m, n, k, round(2 * m * n * k / t / 1e12, 4)])
    return rows


def fp8_table(shapes) -> list[list[float]]:
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        t = _timeit(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), "cuda")
        rows.append([m, n, k, round(2 * m * n * k / t / 1e12, 4)])
    return rows


def memory_bandwidth(device: str) -> float:
    n = (1 << 28) if device == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of fp32
    x = torch.empty(n, device=device)
    y = torch.empty_like(x)
    t = _timeit(lambda: y.copy_(x), device)
    return 2 * x.numel() * 4 / t / 1e9  # read + write


ATTENTION_SEQS = (1024, 2048, 4096, 8192, 16384)  # sequence lengths of the `attention_tflops` table on a GPU
ATTENTION_HEAD_DIMS = (128, 64)  # its head dims: 128 (Llama 2/3 7B-70B, Llama-3.2-3B), 64 (Llama-3.2-1B)
ATTENTION_TOKENS, ATTENTION_WIDTH = 16384, 2048  # a timed batch's tokens; heads x head dim


def attention_rate(device: str, dtype: torch.dtype, backend=None, seq: int = 0, head_dim: int = 0,
                   passes: int = 0) -> float:
    """TFLOP/s of causal SDPA forward + backward as a training step runs them. `backend`: a torch SDPBackend
    that restricts SDPA to that kernel (cuDNN's fused attention), or a list of them in order of priority
    (loom's order); `seq`: the sequence length, the batch keeping ATTENTION_TOKENS tokens (default: 4 x 2048
    on a GPU); `head_dim`: the head size, heads x head_dim = ATTENTION_WIDTH (default: 16 heads of 128).
    As in loom's attention, q, k, v and the output's gradient are [b, s, h, d] tensors seen as [b, h, s, d],
    and backward starts from a prepared output gradient (`torch.autograd.grad`): no loss reduction, no
    gradient accumulated into leaves, which a training step runs neither of. `passes` forward-and-backward
    pairs run between two synchronisations (default 4 on a GPU, 1 on a CPU), spreading the synchronisation
    after each timed call over them. FLOPs: the causal half of the score and context products, backward
    2.5x the forward (3.5x in all), as `layertime` prices them."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    b, h, s, d = (4, 16, 2048, 128) if device == "cuda" else (1, 4, 512, 64)
    if seq:
        b, s = max(1, ATTENTION_TOKENS // seq), seq
    if head_dim:
        h, d = max(1, ATTENTION_WIDTH // head_dim), head_dim
    passes = passes or (4 if device == "cuda" else 1)
    q, k, v, grad = (torch.randn(b, s, h, d, device=device, dtype=dtype).transpose(1, 2) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    if backend is None:
        kernels = contextlib.nullcontext
    elif isinstance(backend, list):
        kernels = lambda: sdpa_kernel(backend, set_priority=True)  # noqa: E731
    else:
        kernels = lambda: sdpa_kernel([backend])  # noqa: E731

    def step():
        for _ in range(passes):
            with kernels():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)

    t = _timeit(step, device) / passes
    flops = 3.5 * 4 * b * h * s * s * d / 2  # causal half; backward 2.5x forward
    return flops / t / 1e12


def attention_table(device: str, dtype: torch.dtype, backend, key: str, quick: bool = False) -> dict:
    """`attention_tflops` of a profile: {key: [[seq, TFLOP/s], ...]} at head dim 128, and at each other head
    dim D of ATTENTION_HEAD_DIMS {f"{key}:d{D}": ...} (`Workload.loom_attention_tflops` takes the nearest),
    each from `attention_rate` with `backend` (loom's kernel order) over ATTENTION_SEQS (quick: 4096 only)."""
    seqs = ATTENTION_SEQS if not quick else (4096,)
    dims = ATTENTION_HEAD_DIMS if not quick else ATTENTION_HEAD_DIMS[:1]
    return {key if dim == 128 else f"{key}:d{dim}":
            [[seq, round(attention_rate(device, dtype, backend, seq, dim), 3)] for seq in seqs] for dim in dims}


def kernel_overhead_us(device: str) -> float:
    """Time per small dependent op (launch and dispatch cost, which bounds many short kernels)."""
    x = torch.zeros(256, device=device)

    def ops():
        for _ in range(100):
            x.add_(1.0)

    return _timeit(ops, device) / 100 * 1e6


def gemm_call_latency_us(device: str) -> float:
    """Microseconds of launch and synchronisation in each call `gemm_table` times: the per-call time of a
    one-element kernel timed the same way (a device synchronisation after every call). The planner takes it
    off every GEMM table row, since a training step queues its kernels without waiting (`kernels.
    gemm_call_latency_s`). 0 on a CPU, whose products run inline: their call cost is paid in training too."""
    if device != "cuda":
        return 0.0
    x = torch.zeros(1, device=device)
    return _timeit(lambda: x.add_(1.0), device) * 1e6


def decode_rates(device: str, dtype: torch.dtype, quick: bool = False, product=None) -> list[list[float]]:
    """[[rows, n, k, GB/s], ...]: the weight bytes per second that a linear layer with an n x k weight streams
    through a product with a few rows, outside autograd, as the generation engine runs it (F.linear, or the
    engine's own `product`, see `_linear_pass`). Each shape is timed over enough copies of its weight to exceed
    any last-level cache, so every weight comes from memory, as a model's do in every decode step."""
    if device == "cuda":
        dims, rows, stream = (1024, 4096, 16384), (1, 16, 64, 256), 1 << 30
    else:
        dims, rows, stream = (256, 512, 1024, 2048, 4096), (1, 4, 16, 64), 1 << 27
    if quick:
        dims, rows = dims[1::2], rows[::3]
    out = []
    with torch.no_grad():
        for n in dims:
            for k in dims:
                nbytes = n * k * torch.finfo(dtype).bits // 8
                weights = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(-(-stream // nbytes))]
                for m in rows:
                    x = torch.randn(m, k, device=device, dtype=dtype)
                    seconds = _linear_pass(x, weights, device, min_time=0.1, product=product)
                    out.append([m, n, k, round(len(weights) * nbytes / seconds / 1e9, 3)])
                del weights
    return out


def decode_stream_scale(device: str, dtype: torch.dtype, quick: bool = False, product=None) -> list[list[float]]:
    """[[bytes, factor], ...]: how much faster few-row products stream their weights when a decode step's
    weights total only `bytes` (cycled over, as step after step reads the same model) than at the size
    `decode_rates` streams (larger than any last-level cache). A model smaller than a few times the
    cache keeps part of its weights cached from one step to the next; a large one gets factor 1."""
    sizes = (1 << 24, 1 << 26, 1 << 28, 1 << 30) if device == "cuda" else (1 << 23, 1 << 24, 1 << 25, 1 << 26, 1 << 27)
    reference = sizes[-1]
    n = k = 1024
    nbytes = n * k * torch.finfo(dtype).bits // 8
    rates = {}
    with torch.no_grad():
        x = torch.randn(1, k, device=device, dtype=dtype)
        for size in (sizes[::2] if quick else sizes):
            weights = [torch.randn(n, k, device=device, dtype=dtype) for _ in range(max(1, size // nbytes))]
            rates[size] = len(weights) * nbytes / _linear_pass(x, weights, device, min_time=0.1, product=product)
            del weights
    return [[float(size), round(rate / rates[reference], 3)] for size, rate in sorted(rates.items())]


def _allreduce_worker(rank: int, world: int, port: int, backend: str, nbytes: int, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    x = torch.ones(nbytes // 4, device=device)
    t = _timeit(lambda: dist.all_reduce(x), "cuda" if backend == "nccl" else "cpu", min_time=0.5)
    if rank == 0:
        out.put(2 * (world - 1) / world * nbytes / t / 1e9)  # bus bandwidth
    dist.destroy_process_group()


def collective_bandwidth(world: int, backend: str) -> float | None:
    if world < 2:
        return None
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    nbytes = (256 << 20) if backend == "nccl" else (16 << 20)
    procs = [ctx.Process(target=_allreduce_worker, args=(r, world, port, backend, nbytes, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    return queue.get(timeout=5) if not queue.empty() else None


def profile_hardware(out: Path, internode_gbps: float = 25.0, quick: bool = False, engine_probe=None) -> dict:
    """Measure this machine and write the profile to `out`. `engine_probe(device, dtype, quick)`, when given
    (the CLI passes `loom.infer.probe.measure`), adds the generation engine's own measured costs; its
    "decode_product" entry, if not None, is how the engine multiplies a decode step's rows by a weight on
    this machine, and the decode tables are measured through it instead of F.linear."""
    if out.suffix != ".json":
        raise UserError(f"--profile-hardware {out}: the profile is JSON; give a path ending in .json")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        name, memory_gib, sms = props.name, props.total_memory / 2**30, props.multi_processor_count
        dims = (1024, 4096, 8192) if not quick else (1024, 4096)
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
        local = torch.cuda.device_count()
    else:
        name = f"cpu: {platform.processor() or platform.machine()} x{os.cpu_count()}"
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        sms = os.cpu_count() or 1
        dims = (128, 512, 1024) if not quick else (128, 512)
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        local = 2
    shapes = [(m, n, k) for m in dims for n in dims for k in dims]
    if not cuda and not quick:
        # Prefill-sized row counts (batch x prompt tokens): at 4096 rows the operands outgrow the caches and
        # a CPU's rate differs from the 1024-row one; nearest-shape lookup needs them.
        shapes += [(4096, n, k) for n in dims for k in dims]
    gemm = {key: gemm_table(device, dt, shapes) for key, dt in dtypes.items()}
    if cuda and torch.cuda.get_device_capability(0) >= (8, 9):
        try:
            gemm["fp8"] = fp8_table(shapes)
        except RuntimeError:
            pass
    peak = {key: max(r[3] for r in rows) for key, rows in gemm.items()}
    attn_key = "bf16" if cuda else "fp32"
    attn = attention_rate(device, dtypes[attn_key])
    bw = memory_bandwidth(device)
    coll = collective_bandwidth(min(local, 8) if cuda else 2, "nccl" if cuda and local > 1 else "gloo") \
        if (cuda and local > 1) or not cuda else None
    errors = {}
    fused_attention = 0.0
    if cuda and torch.cuda.get_device_capability(0) >= (9, 0):
        from torch.nn.attention import SDPBackend

        try:  # the kernel loom's attention runs first on Hopper and newer
            fused_attention = attention_rate(device, dtypes[attn_key], SDPBackend.CUDNN_ATTENTION)
        except RuntimeError as exc:
            errors["fused_attention"] = f"{type(exc).__name__}: {exc}"[:500]
    attention_by_seq = {}
    if cuda:
        from torch.nn.attention import SDPBackend

        # loom's kernel order (loom.train.steps.attention_kernels): cuDNN first on Hopper and newer, else flash
        order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        if torch.cuda.get_device_capability(0) >= (9, 0):
            order.reverse()
        order.append(SDPBackend.EFFICIENT_ATTENTION)
        try:
            attention_by_seq = attention_table(device, dtypes[attn_key], order, attn_key, quick=quick)
        except RuntimeError as exc:
            errors["attention_tflops"] = f"{type(exc).__name__}: {exc}"[:500]
    try:  # on a GPU, forward and backward (what training's eager blocks run); a failure keeps the forward
        eager = elementwise_rates(device, dtypes[attn_key], quick=quick)
    except Exception as exc:  # noqa: BLE001 - the forward-only rate still stands
        if not cuda:
            raise
        errors["elementwise_train"] = f"{type(exc).__name__}: {exc}"[:500]
        eager = elementwise_rates(device, dtypes[attn_key], quick=quick, train=False)
    compiled = {}
    if cuda:  # inductor on a CPU needs a C++ toolchain and is not what loom's CPU path runs
        try:
            compiled = {attn_key: compiled_elementwise_rates(device, dtypes[attn_key], quick=quick)}
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not lose the rest of the profile
            errors["elementwise_compiled"] = f"{type(exc).__name__}: {exc}"[:500]
    engine = {}
    if engine_probe is not None:
        try:  # the generation engine's probe must not abort the whole profile: its failure is recorded
            engine = engine_probe(device, dtypes[attn_key], quick)
        except Exception as exc:  # noqa: BLE001
            errors["engine"] = f"{type(exc).__name__}: {exc}"[:500]
    product = engine.pop("decode_product", None)
    profile = {
        "name": name, "memory_gib": round(memory_gib, 2), "peak_tflops": peak,
        "matmul_efficiency": {k: 1.0 for k in peak}, "attention_efficiency": round(attn / peak[attn_key], 4),
        "hbm_gbps": round(bw, 2), "hbm_efficiency": 1.0,
        "nvlink_gbps": round(coll if coll else bw / 4, 2), "collective_efficiency": 1.0,
        "internode_gbps": internode_gbps, "sms": sms, "node_size": max(1, local),
        "kernel_overhead_us": round(kernel_overhead_us(device), 3),
        "gemm_call_latency_us": round(gemm_call_latency_us(device), 3),
        "decode_gbps": {attn_key: decode_rates(device, dtypes[attn_key], quick=quick, product=product)},
        "decode_stream_scale": {attn_key: decode_stream_scale(device, dtypes[attn_key], quick=quick, product=product)},
        "elementwise_gbps": {attn_key: eager},
        **({"elementwise_compiled_gbps": compiled} if compiled else {}),
        **({"fused_attention_efficiency": round(fused_attention / peak[attn_key], 4)} if fused_attention else {}),
        **({"attention_tflops": attention_by_seq} if attention_by_seq else {}),
        **engine,
        "gemm": gemm, "source": f"measured by loom plan --profile-hardware (torch {torch.__version__})",
        **({"errors": errors} if errors else {}),
    }
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    tmp.replace(out)
    return profile


# Products, attention and the embedding, by aten op (a CPU's profile) or by GPU kernel name: cuBLAS names its
# Hopper GEMMs nvjet_sm90_* (torch 2.11+cu130 on an H200; bench/eager_share.py) or *gemm*/*xmma*, CUTLASS
# cutlass*, cuDNN's fused attention cudnn_generated_*sdpa*, FlashAttention flash_*, the embedding's gather
# indexSelect*.
NOT_ELEMENTWISE_OPS = {"mm", "bmm", "addmm", "linear", "matmul", "embedding", "index_select"}
NOT_ELEMENTWISE_KERNELS = ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas", "splitkreduce", "attention", "flash",
                           "sdpa", "fmha", "cudnn", "indexselect", "embedding")


def is_elementwise_kernel(name: str) -> bool:
    """Whether a profiler event (an aten op on a CPU, a kernel on a GPU) counts as loom's elementwise work: not
    a matrix product, attention or the embedding's gather."""
    op = name.removeprefix("aten::")
    return op not in NOT_ELEMENTWISE_OPS and not any(k in op.lower() for k in NOT_ELEMENTWISE_KERNELS)


# The one-layer Llama whose eager elementwise ops `elementwise_rates` times (bench/eager_share.py reads it too)
ELEMENTWISE_PROBE = dict(layers=1, hidden=1024, heads=16, kv_heads=8, ffn_hidden=2816, vocab_size=256)


def elementwise_rates(device: str, dtype: torch.dtype, quick: bool = False,
                      train: bool | None = None) -> list[list[float]]:
    """[[bytes, GB/s], ...]: how fast loom's own layer gets through its elementwise ops (norms, residual adds,
    SwiGLU's activation, rotary embedding and what else runs between its products), at a few working-set
    sizes (the bytes of one forward). A one-layer Llama runs under torch's profiler; the self time of every
    op or kernel that is not a matrix product, attention or the embedding (`is_elementwise_kernel`) is the
    elementwise time, and the bytes are what the cost model counts for those ops
    (`layertime.elementwise_bytes_per_token`, plus the final norm). `train` (default: on a GPU) times a
    forward and backward, which the cost model prices as three forwards' bytes, so the rate is what
    training's eager blocks reach; otherwise a forward only (a CPU profile, whose rate also prices its
    inference engine, keeps what it measured before)."""
    from loom.config import ModelConfig
    from loom.models.llama import build_model
    from loom.planner.layertime import elementwise_bytes_per_token

    train = device == "cuda" if train is None else train
    tokens = (2048, 16384) if device == "cuda" else (128, 1024, 4096)
    if quick:
        tokens = tokens[:1]
    prec = "fp32" if dtype == torch.float32 else "bf16"
    out = []
    for n in tokens:
        cfg = ModelConfig(**ELEMENTWISE_PROBE, max_seq_len=n)
        torch.manual_seed(0)
        model = build_model(cfg).to(device=device, dtype=dtype).train(train)
        ids = torch.randint(0, cfg.vocab_size, (1, n), device=device)
        nbytes = n * (elementwise_bytes_per_token(cfg, prec) + 2 * cfg.hidden * (4 if prec == "fp32" else 2))
        timed = nbytes * (3 if train else 1)  # backward priced as twice the forward's bytes

        def run():
            if not train:
                with torch.no_grad():
                    return model(ids)
            model.zero_grad(set_to_none=True)
            model(ids).float().square().mean().backward()

        best = None
        for _ in range(2):
            run()  # warm-up
        for _ in range(1 if quick else 3):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if device == "cuda"
                                                    else torch.profiler.ProfilerActivity.CPU]) as prof:
                run()
                if device == "cuda":
                    torch.cuda.synchronize()
            seconds = 0.0
            for e in prof.key_averages():
                if is_elementwise_kernel(e.key):
                    seconds += (e.self_device_time_total if device == "cuda" else e.self_cpu_time_total) * 1e-6
            best = seconds if best is None else min(best, seconds)
        out.append([float(nbytes), round(timed / max(best, 1e-9) / 1e9, 3)])
    return out


def triton_seconds(events) -> float:
    """Seconds of the Triton kernels among a profile's (name, device microseconds) pairs: the elementwise
    work of a compiled block (inductor names its generated kernels triton_poi_/triton_red_/triton_per_...;
    products and attention stay cuBLAS / SDPA kernels)."""
    return sum(us for name, us in events if name.startswith("triton")) * 1e-6


def compiled_elementwise_rates(device: str, dtype: torch.dtype, quick: bool = False) -> list[list[float]]:
    """[[bytes, GB/s], ...]: the rate of a compiled block's elementwise work (loom's train.compile), as
    `elementwise_rates` measures an eager one: a one-layer Llama's block compiled as loom compiles it
    (`nn.Module.compile`), forward and backward under torch's profiler; the Triton kernels' device time
    (`triton_seconds`) against the bytes the cost model counts for a block's forward and backward (three
    times `layertime.elementwise_bytes_per_token`)."""
    from loom.config import ModelConfig
    from loom.models.llama import build_model
    from loom.planner.layertime import elementwise_bytes_per_token

    prec = "fp32" if dtype == torch.float32 else "bf16"
    out = []
    for n in (16384,) if not quick else (4096,):  # one size: each compiles the block anew (tens of seconds)
        cfg = ModelConfig(**ELEMENTWISE_PROBE, max_seq_len=n)
        torch.manual_seed(0)
        model = build_model(cfg).to(device=device, dtype=dtype)
        for block in model.layers.values():
            block.compile()
        ids = torch.randint(0, cfg.vocab_size, (1, n), device=device)
        nbytes = 3 * n * elementwise_bytes_per_token(cfg, prec)
        best = None
        for _ in range(2):
            model(ids).float().sum().backward()  # warm-up: compiles forward and backward
        for _ in range(1 if quick else 3):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                model(ids).float().sum().backward()
                torch.cuda.synchronize()
            seconds = triton_seconds((e.key, e.self_device_time_total) for e in prof.key_averages())
            best = seconds if best is None else min(best, seconds)
        if best:
            out.append([float(nbytes), round(nbytes / best / 1e9, 3)])
    return out
