"""CPU kernels for decode steps: a small-batch fp32 matrix product (y = x W^T + b for a few rows of x) and
the attention of one new token per sequence to its cached keys.

Why. A decode step multiplies a handful of rows (one per sequence) by every weight of the model, a shape at
which MKL's sgemm and inductor's CPU GEMM template run well below their large-product rate; the weight
products are most of a decode step. bench/generate_cpu.py measures both kernels (`decode_step_ms`,
`packed_products`) against ATen's; its results/ hold the numbers.

`packed_linear` packs each weight once into panels of 16 output columns, [ceil(N/16), K, 16] (zero-padded),
and multiplies by panels: a 6 x 16 register tile (12 AVX2 accumulators) walks K once per 6 rows with fused
multiply-adds, every tile prefetches the panel four on, and the panels are split over ATen's threads. On a
CPU with AVX-512F (checked at run time with `__builtin_cpu_supports`; that code is compiled for AVX-512 per
function, so the library still builds and runs on an AVX2-only CPU) the tile is 8 rows x 2 panels (16 zmm
accumulators: one panel row is one zmm register) over pairs of panels, the output's tail columns written with
masked stores. Both tiles sum each output in the same order, so the two paths give the same bits.
`LOOM_CPU_AVX512=0` keeps the AVX2 tile on such a CPU; `product_isa()` says which path runs and switches it
(for an A/B in one process). At hundreds of rows (a prefill) neither is faster than MKL, so the engine uses
the kernel for decode steps only.

`decode_attention` takes q [B, H, R, d] (the R query heads that share a key/value head, one token each),
the slab's keys and values as strided views and the boolean mask, and computes masked softmax attention in
fp32 with one task per (row, key/value head), reading each key and value row once for all R queries and
only the rows some query may attend to. `decode_attention_paged` does the same over paged keys and values (the
pool, a block table per row and each row's position), reading each row's visible keys from its blocks only.

What they are not: general kernels. fp32 only, CPU with AVX2 and FMA only. Everything else (bf16, a GPU, a
tensor-parallel shard) keeps `F.linear` and SDPA; `available()` says whether this process can use them.

Built from kernels.cpp (beside this file) with the system's C++ compiler the first time a process asks for
it, into a cache directory keyed by the source, torch's and Python's versions and the compiler (`cache_dir`:
loom.files.cache_dir: $LOOM_CACHE, else ~/.cache/loom, else the temporary directory), written whole or not at all, then loaded with
`torch.ops.load_library`: the ops are `torch.ops.loom_cpu.packed_linear`, `.decode_attention` and
`.decode_attention_paged` (and `.packed_linear_isa`, behind `product_isa`), with fake
(meta) implementations so that `torch.compile` keeps each as one opaque call inside a compiled decode step.
They have no backward (the engine runs under no_grad). No compiler, no AVX2, `LOOM_CPU_KERNELS=0` or a
failed build: `available()` is False (the reason logged once) and nothing else changes.

Rounding: each product output is a sum over K in order with fused multiply-adds, so it differs from MKL's
in the last bits (relative 1e-6 at K = 1024), like any two fp32 GEMMs."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loom.files import cache_dir

log = logging.getLogger(__name__)

PANEL = 16  # output columns per packed panel: two AVX2 registers

SOURCE = (Path(__file__).parent / "kernels.cpp").read_text()  # the kernels, in C++

FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-DNDEBUG"]

_state: dict = {}  # "ok": bool once decided; "why": the reason when not


def _build_command(out: Path, src: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()]
    rpath = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
    compiler = os.environ.get("CXX", "c++")
    return [compiler, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(src), "-o", str(out),
            *libs, *rpath, "-lc10", "-ltorch_cpu"]


def _library() -> Path:
    """The built library's path, building it first if this machine has not (one builder at a time)."""
    key = hashlib.sha256("\n".join([SOURCE, torch.__version__, sys.version, *FLAGS,
                                    os.environ.get("CXX", "c++")]).encode()).hexdigest()[:16]
    root = cache_dir() / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    lib = root / f"loom_cpu_kernels_{key}.so"
    if lib.exists():
        return lib
    with open(root / f"loom_cpu_kernels_{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same library
        if lib.exists():
            return lib
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            src, out = Path(tmp) / "loom_cpu_kernels.cpp", Path(tmp) / lib.name
            src.write_text(SOURCE)
            done = subprocess.run(_build_command(out, src), capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building the CPU decode kernels failed:\n{done.stderr[-2000:]}")
            os.replace(out, lib)  # whole or absent: a killed build leaves no half-written library
    return lib


def available() -> bool:
    """Whether the kernels can run in this process: AVX2 CPU, a C++ compiler, LOOM_CPU_KERNELS not 0.
    Builds (once per machine) and loads the library on the first call; the answer is kept."""
    if "ok" in _state:
        return _state["ok"]
    why = None
    if os.environ.get("LOOM_CPU_KERNELS", "1") == "0":
        why = "LOOM_CPU_KERNELS=0"
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        why = f"the CPU's vector capability is {torch.backends.cpu.get_cpu_capability()}, the kernel needs AVX2"
    else:
        try:
            lib = str(_library())
            if lib not in torch.ops.loaded_libraries:
                torch.ops.load_library(lib)
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            why = f"{type(err).__name__}: {err}"
    if why is None:
        _register_fake()
        if os.environ.get("LOOM_CPU_AVX512", "1") == "0":
            torch.ops.loom_cpu.packed_linear_isa(256)
    else:
        log.info("CPU decode kernels not used (F.linear and SDPA instead): %s", why)
    _state.update(ok=why is None, why=why)
    return _state["ok"]


def product_isa(use: str | None = None) -> str:
    """The vector path `packed_linear` takes in this process, "avx512" or "avx2" (`available()` first). `use`:
    switch to that path first ("avx512" only where the CPU has AVX-512F; else "avx2")."""
    widths = {"avx2": 256, "avx512": 512}
    width = torch.ops.loom_cpu.packed_linear_isa(0 if use is None else widths[use])
    return {256: "avx2", 512: "avx512"}[width]


def _register_fake() -> None:
    if _state.get("fake"):
        return

    @torch.library.register_fake("loom_cpu::packed_linear")
    def _(x, packed, out_features, bias):
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("loom_cpu::decode_attention")
    def _(q, keys, values, mask):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("loom_cpu::decode_attention_paged")
    def _(q, keys, values, table, positions):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    _state["fake"] = True


def pack(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] (nn.Linear's layout) -> [ceil(N/16), K, 16]: panel p, row k holds W[16p:16p+16, k] (zero
    past N). `out`: write into this tensor in place (its address kept) instead of a new one."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = F.pad(weight.detach().float(), (0, 0, 0, panels * PANEL - n))
    view = padded.view(panels, PANEL, k).transpose(1, 2)
    if out is None:
        return view.contiguous()
    return out.copy_(view)


class PackedLinear(nn.Module):
    """Stands in for an `nn.Linear` in a decode step: its weight packed (`pack`), its bias shared. `repack()`
    after the source's weight changed (a refit) rewrites the packed copy in place."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.source = [source]  # a list: not a submodule (its weight is not this module's state)
        self.out_features = source.out_features
        self.register_buffer("packed", pack(source.weight), persistent=False)

    def repack(self) -> None:
        pack(self.source[0].weight, out=self.packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.loom_cpu.packed_linear(x, self.packed, self.out_features, self.source[0].bias)


def runs_on(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels take tensors of `dtype` on `device` in this process: fp32 on a CPU, `available()`."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and available()


def packable(module: nn.Module) -> bool:
    """An nn.Linear whose product this kernel can take: plain parameters (no DTensor shard) that `runs_on`."""
    return (type(module) is nn.Linear and type(module.weight) is nn.Parameter
            and runs_on(module.weight.device, module.weight.dtype))
