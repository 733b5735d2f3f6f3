"""Seconds of one kernel on the hardware of `hardware.py`: a GEMM (2mnk over the peak x its efficiency x the
sustained clock, plus the expected half-wave tail of 128x128 tiles over the SMs, or the memory roofline if
that is slower; or a profile's measured table, less the latency its timed calls carried), bytes over HBM
bandwidth, elementwise ops at a profile's measured rate, ring
collectives over NVLink or the network, and pipeline point-to-point transfers."""

from __future__ import annotations

import math
from functools import lru_cache

from loom.planner.hardware import GPU

TILE = 128  # GEMM tile edge for the wave-tail model


def gemm_time(gpu: GPU, precision: str, m: int, n: int, k: int, batch: int = 1) -> float:
    """Seconds for `batch` independent (m x k) @ (k x n) products."""
    flops = 2.0 * m * n * k * batch
    table = gpu.gemm.get(precision)
    if table:
        rows = tuple(map(tuple, table))
        rate = _measured_rate(_without_call_latency(rows, gemm_call_latency_s(gpu, precision)), m, n, k) * 1e12
        compute = flops / rate
    else:
        # the preset's best-shape rate at its source's clock, times what a saturated chip keeps of it
        rate = gpu.peak(precision) * 1e12 * gpu.matmul_efficiency.get(precision, 0.7) * gpu.sustained_clock
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
    """TFLOP/s at (m, n, k) from a profile's table: on a full grid of measured m x n x k (what
    `--profile-hardware` writes), interpolated linearly in log m, log n and log k between the measured
    shapes either side (the end shapes' rates beyond them: a GEMM larger than the grid runs at the
    largest measured rate); otherwise the measured shape closest in log-space. Nearest-shape lookup put a
    shape half-way between two measured ones (2048 between 1024 and 4096) on whichever the table listed
    first, the smaller and slower one."""
    axes = [sorted({row[i] for row in table}) for i in range(3)]
    if len(axes[0]) * len(axes[1]) * len(axes[2]) == len(table) == len({tuple(r[:3]) for r in table}):
        rates = {tuple(row[:3]): row[3] for row in table}
        corners = [_bracket(axis, x) for axis, x in zip(axes, (m, n, k))]
        total = 0.0
        for lo_m, hi_m, wm in (corners[0],):
            for cm, fm in ((lo_m, 1 - wm), (hi_m, wm)):
                for cn, fn in ((corners[1][0], 1 - corners[1][2]), (corners[1][1], corners[1][2])):
                    for ck, fk in ((corners[2][0], 1 - corners[2][2]), (corners[2][1], corners[2][2])):
                        total += fm * fn * fk * rates[(cm, cn, ck)]
        return total
    best, rate = None, None
    for tm, tn, tk, tflops in table:
        dist = (math.log(m / tm)) ** 2 + (math.log(n / tn)) ** 2 + (math.log(k / tk)) ** 2
        if best is None or dist < best:
            best, rate = dist, tflops
    return rate


def gemm_call_latency_s(gpu: GPU, precision: str) -> float:
    """Seconds of host latency inside each time of a profile's GEMM table, which training does not pay.
    `--profile-hardware` times a GEMM call by call, synchronising the device after each one
    (`profile._timeit`), so every row holds one launch and one synchronisation round trip besides the
    kernel; a training step queues its kernels ahead of the device and waits for none of them (the gap
    between dependent kernels is `kernel_overhead_us`, added per GEMM here). A profile that measured the
    round trip says so (`gemm_call_latency_us`); a GPU profile from before that is estimated from its own
    table (`table_call_latency_s`); a CPU runs each product inline, so the call cost is the product's and
    nothing is removed, nor from a preset (no table) or a table built by hand (source "preset")."""
    if gpu.gemm_call_latency_us is not None:
        return gpu.gemm_call_latency_us * 1e-6
    if gpu.source == "preset" or gpu.is_cpu:
        return 0.0
    return table_call_latency_s(tuple(map(tuple, gpu.gemm.get(precision) or ())))


@lru_cache(maxsize=64)
def table_call_latency_s(table: tuple) -> float:
    """The fixed seconds per call in a GEMM table [[m, n, k, TFLOP/s], ...]: the least-squares fit of each
    row's time as t0 + 2mnk / R, each row weighted by its own time (relative residuals: the rows span three
    orders of magnitude), clamped to [0, the fastest row's time]. On the H200 profile of 2026-11-26 (27 bf16
    shapes, 1024-8192 per side) this gives t0 = 22.2 us and 711 TFLOP/s, and every row's time lies within
    11% of that line but the 1024^3 product's (64 tiles for 132 SMs: 23% slower than the line)."""
    if len(table) < 3:
        return 0.0
    times = [2.0 * m * n * k / (tflops * 1e12) for m, n, k, tflops in table]
    flops = [2.0 * m * n * k for m, n, k, _ in table]
    # Minimise sum((t0 + f x - t)^2 / t^2): the normal equations of a 2 x 2 system.
    a11 = sum(1 / t**2 for t in times)
    a12 = sum(f / t**2 for f, t in zip(flops, times))
    a22 = sum(f * f / t**2 for f, t in zip(flops, times))
    b1 = sum(1 / t for t in times)
    b2 = sum(f / t for f, t in zip(flops, times))
    det = a11 * a22 - a12 * a12
    if det <= 0:
        return 0.0
    t0 = (b1 * a22 - b2 * a12) / det
    return min(max(t0, 0.0), min(times))


@lru_cache(maxsize=64)
def _without_call_latency(table: tuple, latency: float) -> tuple:
    """The table's rows with `latency` seconds taken off each row's time, none faster than the table's best
    measured rate: the rate its largest products sustained back to back at the power cap. A short product
    timed between synchronised calls leaves the device idle in between, which lets a power-capped clock rise:
    with the latency off, the H200 profile's 4096-row products came out at up to 826 TFLOP/s, where its
    largest ones sustained 664-673, as products queued back to back in a training step would."""
    if latency <= 0:
        return table
    best = max(row[3] for row in table) * 1e12
    out = []
    for m, n, k, tflops in table:
        flops = 2.0 * m * n * k
        seconds = max(flops / (tflops * 1e12) - latency, flops / best)
        out.append((m, n, k, flops / seconds / 1e12))
    return tuple(out)


def _bracket(axis: list, x: float) -> tuple:
    """(lower, upper, weight of upper): where x falls between the measured values of one axis, in log x."""
    if x <= axis[0]:
        return axis[0], axis[0], 0.0
    for lo, hi in zip(axis, axis[1:]):
        if x <= hi:
            return lo, hi, math.log(x / lo) / math.log(hi / lo)
    return axis[-1], axis[-1], 0.0


def hbm_time(gpu: GPU, nbytes: float) -> float:
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


def elementwise_time(gpu: GPU, prec: str, nbytes: float) -> float:
    """Seconds for the elementwise ops of loom's own eager layer that move `nbytes` (as
    `elementwise_bytes_per_token` counts them): at the rate a profile measured for that layer at the
    nearest working-set size (on a CPU these ops are compute- and dispatch-bound, far below the memory
    bandwidth, and faster while the working set fits in cache), else at the preset's share of the memory
    bandwidth that eager layer was measured to reach (`GPU.eager_elementwise_fraction`). Fused kernels
    (a compiled block, Transformer Engine's): `compiled_elementwise_time`."""
    table = gpu.elementwise_gbps.get("bf16" if prec == "fp8" else prec)  # fp8 runs these ops in bf16
    if nbytes <= 0:
        return 0.0
    if not table:
        return hbm_time(gpu, nbytes) / log_interpolate(gpu.eager_elementwise_fraction, nbytes)
    return nbytes / (log_interpolate(table, nbytes) * 1e9)


def compiled_elementwise_time(gpu: GPU, prec: str, nbytes: float) -> float:
    """Seconds for fused kernels' elementwise bytes: a compiled block's (train.compile, the engine's
    compiled decode step), and a stack with fused norm / activation / rotary kernels (Transformer Engine's,
    `Workload.fused_elementwise`). Inductor fuses a block's norms,
    residual adds, activation function, rotary embedding and fp8 casts into a few Triton kernels that
    stream their operands once, so they run at the rate a profile measured for those kernels
    (`elementwise_compiled_gbps`), else at the memory bandwidth. An eager profile's `elementwise_gbps` is a
    chain of small separate kernels (on an H200 12-21% of the copy bandwidth) and does not apply."""
    table = gpu.elementwise_compiled_gbps.get("bf16" if prec == "fp8" else prec)
    if not table or nbytes <= 0:
        return hbm_time(gpu, nbytes)
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
