"""`loom plan --profile-hardware OUT.json`: measure this machine and write a profile for `--gpu OUT.json`.

Measured: GEMM throughput over a grid of shapes for each 16-bit dtype (fp32 too on a CPU), fused
attention forward+backward, memory bandwidth (a large device copy), all-reduce bus bandwidth between
local processes (gloo on CPU, nccl between GPUs), the weight-streaming rate of few-row (decode) products
per weight shape, and, through `loom.infer.probe`, the generation engine's decode attention rate and its
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


def gemm_table(device: str, dtype: torch.dtype, shapes) -> list[list[float]]:
    rows = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = _timeit(lambda: a @ b, device)
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


def attention_rate(device: str, dtype: torch.dtype) -> float:
    import torch.nn.functional as F

    b, h, s, d = (4, 16, 2048, 128) if device == "cuda" else (1, 4, 512, 64)
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    t = _timeit(step, device)
    flops = 3.5 * 4 * b * h * s * s * d / 2  # causal half; backward 2.5x forward
    return flops / t / 1e12


def kernel_overhead_us(device: str) -> float:
    """Time per small dependent op (launch and dispatch cost, which bounds many short kernels)."""
    x = torch.zeros(256, device=device)

    def ops():
        for _ in range(100):
            x.add_(1.0)

    return _timeit(ops, device) / 100 * 1e6


def decode_rates(device: str, dtype: torch.dtype, quick: bool = False) -> list[list[float]]:
    """[[rows, n, k, GB/s], ...]: the weight bytes per second that a linear layer with an n x k weight streams
    through a product with a few rows, outside autograd, as the generation engine runs it. Each shape is timed
    over enough copies of its weight to exceed any last-level cache, so every weight comes from memory, as a
    model's do in every decode step."""
    import torch.nn.functional as F

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

                    def step():
                        for w in weights:
                            F.linear(x, w)

                    out.append([m, n, k, round(len(weights) * nbytes / _timeit(step, device, min_time=0.1) / 1e9, 3)])
                del weights
    return out


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
    (the CLI passes `loom.infer.probe.measure`), adds the generation engine's own measured costs."""
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
        # a CPU's rate differs from the 1024-row one by 5-35% (2-core EPYC); nearest-shape lookup needs them.
        shapes += [(4096, n, k) for n in dims for k in dims]
    gemm = {key: gemm_table(device, dt, shapes) for key, dt in dtypes.items()}
    if cuda and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(0) >= (8, 9):
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
    profile = {
        "name": name, "memory_gib": round(memory_gib, 2), "peak_tflops": peak,
        "matmul_efficiency": {k: 1.0 for k in peak}, "attention_efficiency": round(attn / peak[attn_key], 4),
        "hbm_gbps": round(bw, 2), "hbm_efficiency": 1.0,
        "nvlink_gbps": round(coll if coll else bw / 4, 2), "collective_efficiency": 1.0,
        "internode_gbps": internode_gbps, "sms": sms, "node_size": max(1, local),
        "kernel_overhead_us": round(kernel_overhead_us(device), 3),
        "decode_gbps": {attn_key: decode_rates(device, dtypes[attn_key], quick=quick)},
        **(engine_probe(device, dtypes[attn_key], quick) if engine_probe is not None else {}),
        "gemm": gemm, "source": f"measured by loom plan --profile-hardware (torch {torch.__version__})",
    }
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    tmp.replace(out)
    return profile
