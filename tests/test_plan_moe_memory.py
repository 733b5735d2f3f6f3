"""Issue 55, item 3: the held-out published MoE runs on H100 (`published_moe_heldout_runs`) and the memory terms
of Megatron-Core's MoE layers, each pinned by a hand computation with its source."""

import pytest

from loom.planner.validation import megatron_moe_seconds, published_moe_heldout_runs, published_moe_runs


@pytest.fixture(scope="module")
def heldout():
    return published_moe_heldout_runs()


def test_megatron_moe_flop_count_is_the_one_the_model_zoo_reports():
    # Megatron-LM's count for Qwen3-235B-A22B (94 layers, h 4096, 64 heads of 128 over 4 groups, 128 experts of
    # 1536, top-8, vocab 151,936), causal attention halved: the zoo's TP2 EP32 row reports 245 TFLOP/s at 19.7 s
    # on 256 H100 and its TP4 EP8 row 167 at 29.0 s.
    cfg = published_moe_runs()["zoo-qwen3-235b-tp2-ep32"][0].model
    B, s, L, h = 2048, 4096, 94, 4096
    flops = 12 * B * s * L * h * h * ((1 + 4 / 64 + s / (2 * h)) * 2 + 1.5 * 8 * 1536 / h + 151936 / (2 * L * h))
    assert megatron_moe_seconds(cfg, B, s, 245, 256) == pytest.approx(flops / (245e12 * 256), rel=1e-12)
    assert megatron_moe_seconds(cfg, B, s, 245, 256) == pytest.approx(19.7, rel=0.01)
    assert megatron_moe_seconds(cfg, B, s, 167, 256) == pytest.approx(29.0, rel=0.01)


def test_heldout_rows_carry_their_sources_and_published_step_times(heldout):
    from loom.planner.validation import tokens_seconds

    assert len(heldout) == 7
    for name, (w, fixed, seconds, source, routing) in heldout.items():
        assert "github.com" in source and routing and seconds > 0, name
        assert w.gpu.name == "h100" and w.framework == "megatron" and w.model.moe_layers, name
        assert fixed.get("tp", 1) * fixed.get("pp", 1) * fixed.get("cp", 1) * fixed["dp"] == w.gpus, name
    # Megatron-Bridge rows: GBS x 4096 tokens at the published tokens/s/GPU
    assert heldout["bridge-qwen3-30b-ep16-fp8"][2] == pytest.approx(1024 * 4096 / (8826 * 16), rel=1e-12)
    assert heldout["bridge-qwen3-235b-gbs8192-fp8"][2] == pytest.approx(tokens_seconds(8192, 4096, 1712, 256))
    # the zoo's 128k row: 256 sequences of 131,072 tokens at 389 TFLOP/s/GPU
    w, fixed, seconds, *_ = heldout["zoo-qwen3-235b-128k-cp8"]
    assert (w.seq_len, w.global_batch, fixed["cp"], fixed["dp"]) == (131072, 256, 8, 1)
    assert seconds == pytest.approx(megatron_moe_seconds(w.model, 256, 131072, 389, 256), rel=1e-12)
