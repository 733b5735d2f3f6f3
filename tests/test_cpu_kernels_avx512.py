"""The AVX-512 path of the packed product (loom/infer/cpu/kernels.py): chosen on a CPU with AVX-512F, within
fp32 rounding of float64 `F.linear` on ragged shapes (rows, K and N not multiples of its 8 x 32 tile), the
same bits as the AVX2 tile, and switched off by LOOM_CPU_AVX512=0."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loom.infer.cpu import kernels as cpu_kernels


def cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return set()
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


CAN_BUILD = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and shutil.which("c++") is not None
HAS_AVX512 = "avx512f" in cpu_flags()
needs_avx512 = pytest.mark.skipif(not (CAN_BUILD and HAS_AVX512), reason="needs an AVX-512F CPU and a C++ compiler")


@pytest.fixture
def isa():
    """The process's product path, put back as it was after the test."""
    assert cpu_kernels.available(), cpu_kernels._state.get("why")
    before = cpu_kernels.product_isa()
    yield
    cpu_kernels.product_isa(before)


@needs_avx512
def test_dispatch_picks_avx512_here(isa):
    assert cpu_kernels.product_isa() == "avx512"
    assert cpu_kernels.product_isa("avx2") == "avx2"
    assert cpu_kernels.product_isa() == "avx2"
    assert cpu_kernels.product_isa("avx512") == "avx512"


@pytest.mark.skipif(not CAN_BUILD or HAS_AVX512, reason="needs an AVX2 CPU without AVX-512F")
def test_dispatch_keeps_avx2_without_avx512(isa):
    assert cpu_kernels.product_isa() == "avx2"
    assert cpu_kernels.product_isa("avx512") == "avx2"


@needs_avx512
@pytest.mark.parametrize("k", [1, 13, 384, 1031])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 48, 100])
def test_avx512_equals_float64_linear_and_the_avx2_tile(isa, n, k):
    """Rows 1..17 and 40 (8-row tiles and every remainder), N filling a pair of panels partly, one panel alone
    (odd panel counts) or whole pairs, with and without bias, 2-D and 3-D: within fp32 rounding of the
    float64 product (the tolerance of test_cpu_kernels.py), and bit for bit the AVX2 tile's output."""
    g = torch.Generator().manual_seed(n * 10000 + k)
    weight = torch.randn(n, k, generator=g)
    packed = cpu_kernels.pack(weight)
    for bias in (None, torch.randn(n, generator=g)):
        for shape in [(1, k), (3, k), (7, k), (8, k), (9, k), (15, k), (16, k), (17, k), (40, k), (2, 5, k)]:
            x = torch.randn(shape, generator=g)
            cpu_kernels.product_isa("avx512")
            got = torch.ops.loom_cpu.packed_linear(x, packed, n, bias)
            cpu_kernels.product_isa("avx2")
            avx2 = torch.ops.loom_cpu.packed_linear(x, packed, n, bias)
            want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
            assert got.shape == want.shape and got.dtype == torch.float32
            scale = (x.double().abs() @ weight.double().abs().t()).max().item() + 1
            err = (got.double() - want).abs().max().item()
            aten = (F.linear(x, weight, bias).double() - want).abs().max().item()
            assert err <= 1e-6 * scale + 2 * aten, (shape, err, aten)
            assert torch.equal(got, avx2), shape


@needs_avx512
def test_switched_off_by_the_environment(isa, monkeypatch):
    """LOOM_CPU_AVX512=0: `available()` (deciding afresh) keeps the AVX2 tile; the kernels stay available."""
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("LOOM_CPU_AVX512", "0")
    assert cpu_kernels.available()
    assert cpu_kernels.product_isa() == "avx2"
