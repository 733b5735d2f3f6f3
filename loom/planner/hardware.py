"""Accelerator and cluster descriptions for the planner: presets from datasheets, or a measured profile.

Every number here is a property of the hardware, never of a particular training run:

- `memory_gib`: memory a process can use (what `nvidia-smi` reports as total).
- `peak_tflops`: dense tensor-core peak per precision from the vendor datasheet (SXM parts, no sparsity).
- `matmul_efficiency`: the fraction of that peak the best-shaped cuBLAS GEMM reaches at the clock its
  source measured it. Hopper: Bekman's Maximum Achievable Matmul FLOPS (MAMF; ml-engineering,
  compute/accelerator/README.md, the MAMF/MSMF table), a short burst at the 1980 MHz boost clock: H100 SXM
  bf16 795 of 989 TFLOP/s (0.804), fp8 1403 of 1979 (0.709); H200 SXM bf16 850 (0.859), fp8 1525 (0.771).
  A100: 0.80, under the SXM's MAMF (271 of 312, 0.869) by about what sustaining costs (next item).
  Smaller GEMMs are slower than this ceiling through the wave-tail model in `kernels.py`.
- `sustained_clock`: what a training run keeps of that rate once the chip is saturated at its power cap,
  the ratio of sustained to burst matmul throughput on the same GPU (named term "clock" in a step's
  breakdown). Hopper: 0.888, Bekman's H200 Maximum Sustainable Matmul FLOPS over its MAMF on one 700 W
  HGX node with all eight GPUs computing (bf16 755 / 850, fp8 1354 / 1525; the MSMF runs held 1767-1918
  MHz at 683-689 W against the bursts' 1980 MHz at about 160 W), the same die and power cap as the H100's;
  loom's own H200 runs agree: the median SM clock of the training samples at the power cap was 1770 of
  1980 MHz (0.894; `bench/smi_clocks.py`, `bench/results/smi_clocks_h200_2026-11-26*.json`). A100: 1.0,
  no sustained figure for the SXM (the 300 W A100 PCIe keeps 258 / 285 = 0.905), its efficiency set
  below its MAMF as above. A measured profile's GEMM table was timed at the power cap itself (the same
  logs: the profile's GEMM phase held 1583-1635 MHz), so a profile keeps 1.0.
- `attention_efficiency`: fraction of the 16-bit peak that the attention loom runs sustains, forward and
  backward together: torch's scaled_dot_product_attention, whose default backend order puts its flash
  backend (FlashAttention-2 kernels) first (`torch._C._get_sdp_priority_order()`: flash, efficient, math,
  cuDNN). FlashAttention-2 reports 50-70% on A100 forward and ~45% backward, and its forward reaches only
  35% of an H100's peak (Shah et al. 2024, FlashAttention-3, abstract); the presets apply that forward
  figure to both passes, so loom's attention on Hopper is if anything priced fast.
- `fused_attention_efficiency`: the same for cuDNN's fused attention, which Transformer Engine runs for
  Megatron-Core and torch's SDPA for loom on Hopper (loom.train.steps.attention_kernels puts it first there),
  using Hopper's asynchronous tensor cores as FlashAttention-3 does (FA3: up to 75% forward on H100; cuDNN/FA3
  forward and backward together ~40-60%); 0 means `attention_efficiency`. The Hopper presets' 0.45 is what
  loom's own H200 training run measured for it: Llama 2 7B's shape, seq 4096, batch 2, causal, compiled,
  cuDNN's `sdpa_sm90_flash_fprop` at 552.9 us a call and `flash_bprop` at 1614.6 us (2.5x the forward's
  FLOPs): 3.5 x 274.9 GFLOP over 2167.5 us = 444 TFLOP/s, 0.449 of the 989.4 dense bf16 peak
  (bench/results/device_check_h200_2026-11-26_e/gpu_train_7b.json's kernel table; H100 and H200 share the
  compute die and clocks). Under `framework="loom"` a preset prices loom's attention with it; a measured
  profile uses its own table or rates.
- `hbm_gbps` and `hbm_efficiency`: datasheet memory bandwidth and the fraction elementwise kernels reach.
- `eager_elementwise_fraction`: the share of that rate (hbm_gbps x hbm_efficiency) at which loom's own eager
  layer gets through the elementwise bytes the cost model counts (`layertime.elementwise_bytes_per_token`:
  what fused kernels move, each operand read and written once), by working-set size ([[bytes, share],
  ...], log-interpolated as a profile's `elementwise_gbps`). Eager PyTorch runs each op as its own kernel,
  and loom's norm alone (fp32 upcast, square, mean, rsqrt, scale, downcast, weight) moves about ten times
  the bytes a fused norm does. From one measurement: the H200 profile of 2026-11-26
  (`bench/results/h200-2026-11-26/profile.json`) timed the eager layer's non-product kernels at 371.3 GB/s of
  counted bytes at a 97.5 MB working set and 336.6 at 780 MB, where its copy reached 3919.5 GB/s; but its
  kernel filter then knew GEMMs by "gemm" and "cutlass" only, and that machine's cuBLAS names them nvjet_sm90_*
  (`profile.is_elementwise_kernel` now knows them), so those times include the layer's products.
  `bench/eager_share.py` takes out the products' time by the same profile's GEMM table (0.147 of 0.263 ms and
  0.658 of 2.318 ms): 842 and 470 GB/s, shares 0.2149 and 0.1199 (`bench/results/eager_share_h200.json`),
  the values here; as measured, with the products in, 0.0947 and 0.0859 bound them from below. A forward at
  hidden 1024; backward is assumed to run at the same share (a GPU profile now times forward and backward,
  `profile.elementwise_rates`). Taken as a property of loom's code more than of
  the chip (the same kernels move the same bytes on any GPU), every preset carries it, the H100 and A100
  ones unmeasured; a profile measures the rate itself (`elementwise_gbps`) and ignores this. Compiled
  blocks, Megatron-Core/Transformer Engine and other fused stacks run at the full rate
  (`Workload.fused_elementwise`).
- `nvlink_gbps`: NVLink bandwidth per GPU per direction inside the node (`node_size` GPUs);
  `internode_gbps`: network bandwidth per GPU per direction (one NIC per GPU);
  `collective_efficiency`: the fraction of link bandwidth NCCL ring collectives reach (bus bandwidth).
- `sms`: streaming multiprocessors, for the GEMM wave-tail model.

A profile measured with `loom plan --profile-hardware OUT.json` has the same keys plus an optional
`gemm` table (`{"bf16": [[m, n, k, tflops], ...]}`) that replaces the default efficiency curve, and for
`loom plan --inference` the `decode_gbps` curve and `engine_overhead_us` (see `GPU`); on a GPU also the
compiled block's elementwise rate (`elementwise_compiled_gbps`), cuDNN's fused attention on Hopper
(`fused_attention_efficiency`) and `errors`, what it failed to measure.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from loom.errors import UserError
from loom.flops import PEAK_TFLOPS


# loom's eager layer's elementwise rate over the copy rate on the H200 of 2026-11-26, by working set: its
# profile's elementwise_gbps with the layer's products taken out, over its measured hbm_gbps (module
# docstring; bench/eager_share.py, bench/results/eager_share_h200.json).
EAGER_ELEMENTWISE_FRACTION = ((97517568.0, 0.2149), (780140544.0, 0.1199))


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    peak_tflops: dict  # precision -> dense TFLOP/s
    hbm_gbps: float
    nvlink_gbps: float
    internode_gbps: float
    sms: int
    node_size: int = 8
    # (major, minor): what loom's code paths choose by (`loom.models.moe.grouped_mm_wanted`: the routed experts run
    # torch._grouped_mm from 9.0 on, a loop of matmuls before); a profile's file may name it, else Hopper's
    compute_capability: tuple = (9, 0)
    matmul_efficiency: dict = field(default_factory=dict)  # precision -> fraction of peak (at its source's clock)
    sustained_clock: float = 1.0  # the fraction of matmul_efficiency kept at the power cap (module docstring)
    attention_efficiency: float = 0.5
    fused_attention_efficiency: float = 0.0
    hbm_efficiency: float = 0.8
    # [[bytes, share of the copy rate], ...] (module docstring); unused where a profile measured elementwise_gbps
    eager_elementwise_fraction: tuple = EAGER_ELEMENTWISE_FRACTION
    collective_efficiency: float = 0.8
    collective_latency_us: float = 10.0  # fixed cost of one collective (launch + NCCL protocol)
    kernel_overhead_us: float = 2.0  # GPU idle time between two dependent kernels
    gemm: dict = field(default_factory=dict)  # measured table: precision -> [[m, n, k, tflops], ...]
    # Measured by a profile: precision -> [[rows, n, k, GB/s], ...], the weight bytes per second an n x k
    # weight streams through a few-row (decode) product; {"layer": us, "step": us, "row": us}, the generation
    # engine's own cost of a decode step beyond its kernels' work (dispatch per layer; embedding, head,
    # sampling per step; per sequence in the batch); precision -> [[bytes, GB/s], ...] (or one GB/s), the
    # key/value bytes per second of the engine's decode attention by the bytes of one layer's cache read.
    decode_gbps: dict = field(default_factory=dict)
    engine_overhead_us: dict = field(default_factory=dict)
    decode_attention_gbps: dict = field(default_factory=dict)
    # Measured by a profile: precision -> [[bytes, GB/s], ...], the rate of loom's own layer's elementwise
    # ops (norms, residual adds, activation, rotary) at working sets of `bytes`, as
    # `layertime.elementwise_bytes_per_token` counts them.
    elementwise_gbps: dict = field(default_factory=dict)
    # precision -> [[bytes, factor], ...]: few-row products stream a model whose weights total `bytes`
    # this many times faster than `decode_gbps` (part of a small model stays cached between steps).
    decode_stream_scale: dict = field(default_factory=dict)
    # precision -> [[prompt tokens, TFLOP/s], ...]: the generation engine's packed prefill attention.
    prefill_attention_tflops: dict = field(default_factory=dict)
    # Measured by a profile on a GPU: precision -> [[bytes, GB/s], ...], the rate of the same elementwise
    # bytes when the block runs compiled (train.compile: inductor fuses them into Triton kernels), timed as
    # the Triton kernels of a compiled one-layer forward and backward. Without it compiled blocks run their
    # elementwise bytes at the memory bandwidth (hbm_gbps x hbm_efficiency).
    elementwise_compiled_gbps: dict = field(default_factory=dict)
    # Measured by a profile on a GPU: precision -> [[sequence, TFLOP/s], ...], causal attention forward and
    # backward through SDPA with loom's kernel order (cuDNN first on Hopper and newer), by sequence length
    # (efficiency grows with the sequence); it prices loom's attention in place of attention_efficiency.
    attention_tflops: dict = field(default_factory=dict)
    # Microseconds of launch and synchronisation inside each call the profile's GEMM table timed (it
    # synchronises after every call; training does not), measured by a profile as the per-call time of a
    # trivial kernel timed the same way; None: not measured (a GPU profile before it: estimated from the
    # table, `kernels.gemm_call_latency_s`).
    gemm_call_latency_us: float | None = None
    # What a profile failed to measure: {"engine": "RuntimeError: ..."}; the rest of the profile stands.
    errors: dict = field(default_factory=dict)
    source: str = "preset"

    @property
    def is_cpu(self) -> bool:
        """A CPU's profile (`--profile-hardware` names it "cpu: ...")."""
        return self.name.lower().startswith("cpu")

    def peak(self, precision: str) -> float:
        if precision not in self.peak_tflops:
            raise UserError(
                f"--precision {precision} is not supported by {self.name}; it has "
                f"{', '.join(sorted(self.peak_tflops))}"
            )
        return self.peak_tflops[precision]

    def to_json(self) -> dict:
        return asdict(self)


_AMPERE = dict(peak_tflops=dict(PEAK_TFLOPS["a100"]), matmul_efficiency={"bf16": 0.80, "fp16": 0.80},
               nvlink_gbps=300.0, internode_gbps=25.0, sms=108, attention_efficiency=0.5,
               compute_capability=(8, 0))
_HOPPER = dict(peak_tflops=dict(PEAK_TFLOPS["h100"]), sustained_clock=0.888,
               nvlink_gbps=450.0, internode_gbps=50.0, sms=132, attention_efficiency=0.35,
               fused_attention_efficiency=0.45)

PRESETS: dict[str, GPU] = {
    "a100-40gb": GPU(name="a100-40gb", memory_gib=39.6, hbm_gbps=1555.0, **_AMPERE),
    "a100-80gb": GPU(name="a100-80gb", memory_gib=79.3, hbm_gbps=2039.0, **_AMPERE),
    "h100": GPU(name="h100", memory_gib=79.6, hbm_gbps=3350.0,
                matmul_efficiency={"bf16": 0.804, "fp16": 0.804, "fp8": 0.709}, **_HOPPER),
    "h200": GPU(name="h200", memory_gib=140.4, hbm_gbps=4800.0,
                matmul_efficiency={"bf16": 0.859, "fp16": 0.859, "fp8": 0.771}, **_HOPPER),
}


def load_gpu(spec: str) -> GPU:
    """A preset name (a100-40gb, a100-80gb, h100, h200) or a path to a JSON profile."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if not (spec.endswith(".json") or path.exists()):
        raise UserError(f"--gpu {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON profile file")
    if not path.is_file():
        raise UserError(f"--gpu {spec}: no such file (write one with `loom plan --profile-hardware {spec}`)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--gpu {spec}: not a readable JSON profile ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"--gpu {spec}: the profile must be a JSON object with keys such as memory_gib, peak_tflops")
    known = {f.name for f in fields(GPU)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"--gpu {spec}: unknown keys {unknown}; valid keys: {', '.join(sorted(known))}")
    required = ["name", "memory_gib", "peak_tflops", "hbm_gbps", "nvlink_gbps", "internode_gbps", "sms"]
    missing = [k for k in required if k not in data]
    if missing:
        raise UserError(f"--gpu {spec}: missing keys {missing} (required: {', '.join(required)})")
    for key in ("memory_gib", "hbm_gbps", "nvlink_gbps", "internode_gbps", "sms"):
        if not isinstance(data[key], (int, float)) or data[key] <= 0:
            raise UserError(f"--gpu {spec}: {key}={data[key]!r} must be a positive number")
    if not isinstance(data["peak_tflops"], dict) or not data["peak_tflops"] or not all(
            isinstance(v, (int, float)) and v > 0 for v in data["peak_tflops"].values()):
        raise UserError(f"--gpu {spec}: peak_tflops must map precisions to positive TFLOP/s, e.g. {{\"bf16\": 312}}")
    clock = data.get("sustained_clock", 1.0)
    if isinstance(clock, bool) or not isinstance(clock, (int, float)) or not 0 < clock <= 1:
        raise UserError(f"--gpu {spec}: sustained_clock={clock!r} must be a fraction in (0, 1] (1: the profile's "
                        "rates were measured at the power cap, as --profile-hardware measures them)")
    eager = data.get("eager_elementwise_fraction", EAGER_ELEMENTWISE_FRACTION)
    if not (isinstance(eager, (list, tuple)) and eager and all(
            isinstance(r, (list, tuple)) and len(r) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                                 for x in r) and r[0] > 0 and 0 < r[1] <= 1 for r in eager)):
        raise UserError(f"--gpu {spec}: eager_elementwise_fraction={eager!r} must be rows [[bytes, share], ...] with "
                        "bytes > 0 and each share in (0, 1]: the share of the copy rate loom's eager elementwise ops "
                        "reach by working set, used where the profile has no elementwise_gbps table")
    data["eager_elementwise_fraction"] = tuple(tuple(r) for r in eager)
    latency = data.get("gemm_call_latency_us")
    if latency is not None and (isinstance(latency, bool) or not isinstance(latency, (int, float)) or latency < 0):
        raise UserError(f"--gpu {spec}: gemm_call_latency_us={latency!r} must be a number >= 0 (microseconds) or null")
    _check_decode_keys(spec, data)
    data.setdefault("source", str(path))
    return GPU(**data)


def _check_decode_keys(spec: str, data: dict) -> None:
    """The optional decode measurements of a profile, in the shapes `loom plan --profile-hardware` writes."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0

    table = data.get("decode_gbps", {})
    if not (isinstance(table, dict) and all(isinstance(rows, list) and all(
            isinstance(r, list) and len(r) == 4 and all(map(number, r)) for r in rows) for rows in table.values())):
        raise UserError(f"--gpu {spec}: decode_gbps must map precisions to rows [rows, n, k, GB/s] of positive "
                        "numbers, e.g. {\"fp32\": [[1, 512, 512, 12.5]]}")
    for key, example in (("elementwise_gbps", "[[bytes, GB/s], ...], e.g. {\"fp32\": [[5e6, 9.4], [2e8, 3.7]]}"),
                         ("elementwise_compiled_gbps", "[[bytes, GB/s], ...], e.g. {\"bf16\": [[1e8, 2900.0]]}"),
                         ("attention_tflops", "[[sequence, TFLOP/s], ...], e.g. {\"bf16\": [[1024, 250.0], [16384, 450]]}"),
                         ("decode_stream_scale", "[[bytes, factor], ...], e.g. {\"fp32\": [[8e6, 2.1], [1.3e8, 1.0]]}"),
                         ("prefill_attention_tflops", "[[tokens, TFLOP/s], ...], e.g. {\"fp32\": [[128, 0.021], [512, 0.031]]}")):
        table = data.get(key, {})
        if not (isinstance(table, dict) and all(isinstance(rows, list) and rows and all(
                isinstance(r, list) and len(r) == 2 and all(map(number, r)) for r in rows) for rows in table.values())):
            raise UserError(f"--gpu {spec}: {key} must map precisions to rows of positive numbers {example}")
    rates = data.get("decode_attention_gbps", {})
    if not (isinstance(rates, dict) and all(number(r) or (isinstance(r, list) and r and all(
            isinstance(row, list) and len(row) == 2 and all(map(number, row)) for row in r)) for r in rates.values())):
        raise UserError(f"--gpu {spec}: decode_attention_gbps must map precisions to positive GB/s or to rows "
                        "[[bytes, GB/s], ...] of positive numbers, e.g. {\"fp32\": [[3e5, 3.0], [9e6, 11.3]]}")
    overhead = data.get("engine_overhead_us", {})
    if overhead and not (isinstance(overhead, dict) and {"layer", "step"} <= set(overhead) <= {"layer", "step", "row"}
                         and all(isinstance(v, (int, float)) for v in overhead.values())):
        raise UserError(f"--gpu {spec}: engine_overhead_us must be {{\"layer\": us, \"step\": us}} and optionally "
                        "\"row\" (per sequence in the batch), e.g. "
                        "{\"layer\": 450.0, \"step\": 300.0, \"row\": 7.0}")
