"""bench/generate_gpu.py keeps running: its --smoke mode (tiny model, fp32, CPU, eager engine) goes through
every measurement the GPU run makes except the CUDA-graph count, and its numbers follow from what it timed."""

import pytest

from conftest import ROOT, bench_smoke


def test_generate_gpu_bench_smoke(tmp_path):
    report = bench_smoke("generate_gpu.py", tmp_path, timeout=600)
    # The tiny shape (hidden 64, 2 layers, 4 heads of 16, 2 key/value heads, MLP 128, vocabulary 512, tied):
    # embedding 512*64; per layer q, o 64*64, k, v 64*32, MLP 3*64*128, two norms; the final norm.
    params = 512 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert report["parameters"] == params
    assert report["kv"] == "paged" and report["paged_read"] == "split" and report["paged_kernel"] is False  # CPU
    rows = {r["batch"]: r for r in report["rows"]}
    assert set(rows) == {1, 4}
    for batch, row in rows.items():
        # each step reads every weight once and the cache at the mean context (12 prompt + 8 new / 2)
        kv = 2 * 2 * 2 * 16 * (12 + 8 / 2) * batch
        assert row["step_bytes"] == (params + kv) * 4
        step_s = row["decode_step_ms"] / 1e3
        assert row["decode_tokens_per_s"] == pytest.approx(batch / step_s, rel=1e-3, abs=0.051)  # rounded to 0.1
        assert row["fraction_of_measured_read"] == pytest.approx(
            row["step_bytes"] / step_s / 1e9 / report["bandwidth_gbps"]["read_sum"], rel=2e-3, abs=1e-3)
        assert 0 < row["prefill_s"] and 0 < row["whole_call_tokens_per_s"]
        # fp32 on the CPU: the engine's greedy tokens are transformers', token for token
        assert row["agreement_with_transformers"] == {"sequences_equal": 1.0, "first_token_equal": 1.0,
                                                      "mean_common_prefix_tokens": 8.0}
    refit = report["refit"]
    assert refit["slab_addresses_unchanged"] is True and refit["median_s"] > 0
    assert refit["weight_bytes"] == params * 4
    assert report["machine"]["cpu"] and report["commit"]


def test_agreement_counts_equal_sequences_first_tokens_and_common_prefixes():
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_gpu", ROOT / "bench" / "generate_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    got = bench.agreement([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1, 2, 3], [4, 0, 6], [0, 8, 9]])
    assert got == {"sequences_equal": 1 / 3, "first_token_equal": 2 / 3, "mean_common_prefix_tokens": 1.33}
