"""A profile's GEMM table as training runs the products: each timed call's launch and synchronisation
latency taken off, no product faster than the rate the largest shapes sustained back to back (the
power-capped clock); and the clock analysis of a device run's nvidia-smi log."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loom.errors import UserError
from loom.planner.hardware import PRESETS, load_gpu
from loom.planner.kernels import gemm_call_latency_s, gemm_time, table_call_latency_s

ROOT = Path(__file__).resolve().parents[1]
H200 = ROOT / "bench/results/h200-2026-11-26/profile.json"
DIMS = (1024, 4096, 8192)


def _table(t0: float, rate) -> list[list[float]]:
    """Rows [m, n, k, TFLOP/s] whose times are exactly t0 + 2mnk / rate(m, n, k)."""
    rows = []
    for m in DIMS:
        for n in DIMS:
            for k in DIMS:
                f = 2.0 * m * n * k
                rows.append([m, n, k, f / (t0 + f / rate(m, n, k)) / 1e12])
    return rows


def _gpu(table, **kw):
    base = dataclasses.replace(PRESETS["h100"], name="test gpu", source="measured by hand", gemm={"bf16": table},
                               peak_tflops={"bf16": max(r[3] for r in table)}, matmul_efficiency={"bf16": 1.0},
                               hbm_gbps=1e9, kernel_overhead_us=3.0)
    return dataclasses.replace(base, **kw)


def test_the_call_latency_of_a_table_is_its_least_squares_intercept():
    t0, r = 20e-6, 700e12
    assert table_call_latency_s(tuple(map(tuple, _table(t0, lambda *s: r)))) == pytest.approx(t0, rel=1e-9)
    # On the committed H200 profile: the same weighted fit done independently (numpy, float64).
    table = np.array(load_gpu(str(H200)).gemm["bf16"], dtype=np.float64)
    f = 2 * table[:, 0] * table[:, 1] * table[:, 2]
    t = f / (table[:, 3] * 1e12)
    (want, _), *_ = np.linalg.lstsq(np.stack([1 / t, f / t], 1), np.ones_like(t), rcond=None)
    got = table_call_latency_s(tuple(map(tuple, table.tolist())))
    assert got == pytest.approx(want, rel=1e-9) and 15e-6 < got < 30e-6


def test_gemm_time_takes_the_latency_off_and_caps_at_the_sustained_rate():
    """Every row carries 20 us of call latency over its product's own rate: 500 TFLOP/s at 1024 rows, 800 at
    4096 (a short product between synchronised calls: the idle gaps keep a power-capped clock higher) and
    650 at 8192. Taken off, a product runs at its own rate, but never above the best rate the table measured
    (latency included)."""
    t0 = 20e-6
    own = {1024: 500e12, 4096: 800e12, 8192: 650e12}
    rate = lambda m, n, k: own[m]  # noqa: E731
    table = _table(t0, rate)
    best = max(r[3] for r in table) * 1e12
    f = 2.0 * 4096 * 8192 * 8192
    assert best == pytest.approx(f / (t0 + f / 800e12), rel=1e-12)  # the 4096 x 8192 x 8192 row
    gap = 3e-6
    for latency in (20.0, None):  # measured by the profile, or fitted from the table (a GPU profile's)
        gpu = _gpu(table, gemm_call_latency_us=latency)
        if latency is not None:
            assert gemm_call_latency_s(gpu, "bf16") == pytest.approx(t0, rel=1e-12)
        else:  # the rates differ by shape, so the fitted intercept is the line's, not exactly 20 us
            assert 0 < gemm_call_latency_s(gpu, "bf16") < 1e-3
    gpu = _gpu(table, gemm_call_latency_us=20.0)
    for m, n, k in ((8192, 8192, 8192), (8192, 1024, 4096), (4096, 4096, 4096), (1024, 1024, 1024)):
        f = 2.0 * m * n * k
        assert gemm_time(gpu, "bf16", m, n, k) == pytest.approx(f / min(rate(m, n, k), best) + gap, rel=1e-9)
    # Between measured shapes, the corrected rates interpolated in log m: 2048 rows halfway between 1024
    # (500) and 4096 (800, capped at the best measured rate).
    f = 2.0 * 2048 * 8192 * 8192
    assert gemm_time(gpu, "bf16", 2048, 8192, 8192) == pytest.approx(
        f / (0.5 * 500e12 + 0.5 * min(800e12, best)) + gap, rel=1e-9)
    # Without the correction the same product is priced at the rates as timed.
    plain = _gpu(table, gemm_call_latency_us=0.0)
    slow = {m: next(r[3] for r in table if r[:3] == [m, 8192, 8192]) * 1e12 for m in (1024, 4096)}
    assert gemm_time(plain, "bf16", 2048, 8192, 8192) == pytest.approx(
        f / (0.5 * slow[1024] + 0.5 * slow[4096]) + gap, rel=1e-9)


def test_no_latency_is_taken_off_a_cpu_profile_a_preset_or_a_profile_that_measured_none():
    table = _table(20e-6, lambda *s: 700e12)
    f = 2.0 * 4096**3
    row = next(r for r in table if r[:3] == [4096, 4096, 4096])
    as_timed = f / (row[3] * 1e12) + 3e-6
    for gpu in (_gpu(table, name="cpu: x86_64 x2"), _gpu(table, source="preset"), _gpu(table, gemm_call_latency_us=0.0)):
        assert gemm_call_latency_s(gpu, "bf16") == 0.0
        assert gemm_time(gpu, "bf16", 4096, 4096, 4096) == pytest.approx(as_timed, rel=1e-12)
    # The presets have no table: the wave-tail curve, untouched.
    assert gemm_call_latency_s(PRESETS["h100"], "bf16") == 0.0


def test_a_profile_gemm_call_latency_must_be_a_non_negative_number(tmp_path):
    data = json.loads(H200.read_text())
    for bad in (-1.0, "fast", True):
        path = tmp_path / "p.json"
        path.write_text(json.dumps({**data, "gemm_call_latency_us": bad}))
        with pytest.raises(UserError, match="gemm_call_latency_us"):
            load_gpu(str(path))
    path.write_text(json.dumps({**data, "gemm_call_latency_us": 5.5}))
    assert load_gpu(str(path)).gemm_call_latency_us == 5.5


def test_a_cpu_profile_measures_no_call_latency():
    from loom.planner.profile import gemm_call_latency_us

    assert gemm_call_latency_us("cpu") == 0.0


def test_smi_clocks_by_phase_counts_only_samples_at_the_power_cap(tmp_path):
    smi = tmp_path / "smi.csv"
    rows = ["timestamp, clocks.current.sm [MHz], power.draw [W], temperature.gpu, utilization.gpu [%]"]
    samples = [("10:00:01", 1980, 120.0, 0), ("10:00:02", 1700, 690.0, 100), ("10:00:03", 1800, 650.0, 99),
               ("10:00:04", 1900, 400.0, 60),  # below 0.85 x 700 W: not counted
               ("10:00:06", 1500, 680.0, 95), ("10:00:07", 1600, 700.0, 97), ("10:00:08", 1550, 670.0, 90)]
    rows += [f"2026/11/26 {t}.100, {c} MHz, {p} W, 50, {u} %" for t, c, p, u in samples]
    smi.write_text("\n".join(rows) + "\n")
    log = tmp_path / "log.txt"
    log.write_text("== 10:00:00 [+0s] 1. training throughput\nnoise\n== 10:00:05 [+5s] 2. hardware profile\n")
    out = tmp_path / "clocks.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench/smi_clocks.py"), str(smi), str(log), "--phase",
                        "training=training", "--phase", "gemm_table=profile", "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    phases = json.loads(out.read_text())["phases"]
    assert phases["training"]["samples"] == 2 and phases["training"]["clock_mhz"]["median"] == 1750
    assert phases["gemm_table"]["clock_mhz"] == {"min": 1500, "median": 1550, "max": 1600}
    assert phases["gemm_table"]["median_over_first_phase"] == pytest.approx(1550 / 1750, abs=1e-4)


def test_hopper_presets_price_matmuls_at_the_sustained_clock():
    """A preset's GEMM ceiling is the burst rate its source measured (Bekman's MAMF, at the 1980 MHz boost
    clock) times what a chip saturated at its power cap keeps of it (his H200 MSMF over MAMF): 2mnk plus
    the half-wave tail over peak x efficiency x sustained clock, by hand."""
    h100, h200, a100 = PRESETS["h100"], PRESETS["h200"], PRESETS["a100-80gb"]
    # The constants are the published measurements: MAMF / theory and MSMF / MAMF.
    assert h100.matmul_efficiency["bf16"] == pytest.approx(795 / 989, abs=5e-4)
    assert h100.matmul_efficiency["fp8"] == pytest.approx(1403 / 1979, abs=5e-4)
    assert h200.matmul_efficiency["bf16"] == pytest.approx(850 / 989, abs=5e-4)
    assert h200.matmul_efficiency["fp8"] == pytest.approx(1525 / 1979, abs=5e-4)
    assert h100.sustained_clock == h200.sustained_clock == pytest.approx(755 / 850, abs=5e-4)
    assert 755 / 850 == pytest.approx(1354 / 1525, abs=1e-3)  # the same ratio in fp8
    assert a100.sustained_clock == 1.0
    m = n = k = 8192
    tail = 0.5 * 2 * 128 * 128 * k * 132  # 4096 tiles > 132 SMs: half a wave lost
    rate = 989e12 * 0.804 * 0.888
    assert gemm_time(h100, "bf16", m, n, k) == pytest.approx((2 * m * n * k + tail) / rate + 2e-6, rel=1e-12)


def test_the_step_breakdown_shows_the_sustained_clock_as_its_own_term():
    from loom.config import load_config
    from loom.planner.steptime import evaluate
    from loom.planner.workload import Layout, Workload

    cfg = load_config("llama3-8b").model
    lay = Layout(dp=8, micro_batch=1, recompute="none", dp_style="fsdp")
    w = Workload(cfg, 8192, 64, 8, PRESETS["h100"])
    burst = Workload(cfg, 8192, 64, 8, dataclasses.replace(PRESETS["h100"], sustained_clock=1.0))
    got, ref = evaluate(w, lay).time_terms, evaluate(burst, lay).time_terms
    assert "clock" not in ref and got["clock"] > 0
    # The matmuls' own terms stay at the burst clock; the difference is the clock term.
    assert got["gemm"] == pytest.approx(ref["gemm"], rel=1e-12)
    assert got["head"] == pytest.approx(ref["head"], rel=1e-12)
    # Compute-bound products scale by 1 / 0.888 (each product's 2 us launch gap does not): by hand, the
    # 32 layers' 4 products forward, 8 backward, and the head's 3, per micro-batch, 8 micro-batches.
    gaps = 8 * (32 * 12 + 3) * 2e-6
    assert got["clock"] == pytest.approx((ref["gemm"] + ref["head"] - gaps) * (1 / 0.888 - 1), rel=0.02)
    # A profile's tables were timed at the power cap: no clock term.
    prof = load_gpu(str(H200))
    assert prof.sustained_clock == 1.0
    assert "clock" not in evaluate(Workload(cfg, 8192, 8, 1, prof), Layout(micro_batch=1, dp_style="replicate")).time_terms


def test_a_profile_sustained_clock_must_be_a_fraction(tmp_path):
    data = json.loads(H200.read_text())
    path = tmp_path / "p.json"
    for bad in (0, 1.5, "x"):
        path.write_text(json.dumps({**data, "sustained_clock": bad}))
        with pytest.raises(UserError, match="sustained_clock"):
            load_gpu(str(path))


def test_a_profile_eager_elementwise_share_must_be_rows_of_fractions(tmp_path):
    """`eager_elementwise_fraction` (issue 38): rows [[bytes, share in (0, 1]], ...]; anything else exits 2
    naming the key, and a valid table loads as given (a profile written before the key gets the default)."""
    data = json.loads(H200.read_text())
    path = tmp_path / "p.json"
    for bad in (0.09, [[1e8, 1.5]], [[0, 0.1]], [[1e8]], [], [[1e8, True]]):
        path.write_text(json.dumps({**data, "eager_elementwise_fraction": bad}))
        with pytest.raises(UserError, match="eager_elementwise_fraction"):
            load_gpu(str(path))
    path.write_text(json.dumps({**data, "eager_elementwise_fraction": [[1e8, 0.5]]}))
    assert load_gpu(str(path)).eager_elementwise_fraction == ((1e8, 0.5),)
    path.write_text(json.dumps({k: v for k, v in data.items() if k != "eager_elementwise_fraction"}))
    assert load_gpu(str(path)).eager_elementwise_fraction == PRESETS["h100"].eager_elementwise_fraction
