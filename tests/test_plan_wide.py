"""The planner against a wider set of published dense runs (issue 38: the model must generalise):
loom/planner/published.py published_wide_runs, `loom plan --validate`'s table after the MoE runs."""

from __future__ import annotations

import pytest

from loom.planner.validation import predict, published_wide_runs

WIDE = published_wide_runs()


@pytest.fixture(scope="module")
def priced():
    """name -> the planner's best estimate at the published layout (None where nothing fits)."""
    return {name: predict(w, fixed) for name, (w, fixed, _, _) in WIDE.items()}


def test_wide_table_rows_all_fit_and_mean_error_is_bounded(priced):
    # 24 rows: the table may grow, but not shrink silently; every published layout must fit, and the mean
    # |step-time error| (7.7% when the table was built, 7.0% with Megatron's cross-entropy traffic) must not
    # regress past 8.0%.
    assert len(WIDE) == 24
    unfit = [name for name, best in priced.items() if best is None or not best.fits]
    assert not unfit, unfit
    errors = {name: abs(best.step_time_s / WIDE[name][2] - 1) for name, best in priced.items()}
    assert sum(errors.values()) / len(errors) <= 0.080, errors
    # Narayanan et al.'s A100 weak-scaling rows (Megatron-LM 2021) stay within 5% each.
    assert all(errors[n] <= 0.05 for n in WIDE if n.startswith("narayanan-")), errors


def test_wide_step_times_are_what_the_sources_say():
    """Independent arithmetic on the sources' own columns, so the targets cannot drift."""
    seconds = {name: run[2] for name, run in WIDE.items()}
    # Narayanan et al. 2021, Table 1: the aggregate PFLOP/s column is TFLOP/s/GPU x GPUs; Eq. 3's FLOPs per
    # step over it is the step (3.6B: 8.8 PFLOP/s on 64 GPUs, batch 512, 30 layers of hidden 3072).
    eq3 = 96 * 512 * 2048 * 30 * 3072**2 * (1 + 2048 / (6 * 3072) + 51200 / (16 * 30 * 3072))
    assert seconds["narayanan-3.6b"] == pytest.approx(eq3 / 8.8e15, rel=0.01)
    # Megatron-LM README (2024): 1.7B at 19.6 aggregate PFLOP/s, with Megatron's FLOP count of a step
    # (batch 192, seq 4096, 24 layers, hidden 2048, ffn 8192, vocab 131072).
    flops = 12 * 192 * 4096 * 24 * 2048**2 * ((1 + 1 + 4096 / 2048) + 4 + 131072 / (2 * 24 * 2048))
    assert seconds["mcore-1.7b-48gpu"] == pytest.approx(flops / 19.6e15, rel=0.01)
    # NeMo 24.07: GPT3-5B at 22,521 tokens/s/GPU on 64 GPUs, 2048 x 2048 tokens per step.
    assert seconds["nemo-gpt3-5b-fp8"] == pytest.approx(2048 * 2048 / (22521 * 64), rel=1e-9)
    # Megatron-Bridge 26.06: Llama-3.1 405B at 326 tokens/s/GPU on 1024 GPUs, 1536 x 8192 tokens per step.
    assert seconds["bridge-405b-gbs1536-fp8"] == pytest.approx(1536 * 8192 / (326 * 1024), rel=1e-9)


def test_megatron_cross_entropy_traffic_is_counted_op_by_op():
    """Megatron-Core's unfused vocab-parallel cross-entropy moves 38 bytes a logit forward and 14 backward, its
    fused one 26 and 14 (their ops counted in loom.planner.layertime), loom's 12 and 12; the head's matmuls are
    the same for all."""
    from dataclasses import replace

    from loom.config import load_config
    from loom.planner.hardware import PRESETS
    from loom.planner.layertime import head_times
    from loom.planner.workload import Workload

    gpu = PRESETS["h100"]
    m = load_config("llama3-8b").model
    loom_w = Workload(m, 8192, 128, 8, gpu, framework="loom", loss_chunk=0)
    mega_w = replace(loom_w, framework="megatron")
    for tp in (1, 2):
        tokens, v = 2 * 8192, m.vocab_size // tp
        per_byte = 1 / (gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency)  # seconds a byte at the HBM rate
        (lf, lb), (mf, mb) = head_times(loom_w, tp, 1, 2), head_times(mega_w, tp, 1, 2)
        assert mf - lf == pytest.approx((38 - 12) * tokens * v * per_byte, rel=1e-9)
        assert mb - lb == pytest.approx((14 - 12) * tokens * v * per_byte, rel=1e-9)
        # --cross-entropy-loss-fusion: the fp32 cast and the max in one kernel, subtract and exp in another
        ff, fb = head_times(replace(mega_w, ce_fusion=True), tp, 1, 2)
        assert mf - ff == pytest.approx((38 - 26) * tokens * v * per_byte, rel=1e-9) and fb == pytest.approx(mb)
