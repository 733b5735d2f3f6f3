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


def test_megatron_moe_layer_keeps_the_gate_weight_not_the_expert_output():
    # Megatron-Core's grouped experts fold each routed row's gate weight into the fused SwiGLU
    # (experts.py bias_act_func -> weighted_bias_swiglu_impl), which keeps that fp32 weight; the combine keeps
    # nothing. loom's combine multiplies the expert output by the weight and keeps the output (e*h per row).
    from dataclasses import replace

    from loom.planner.memory import moe_activation_delta
    from loom.planner.workload import Layout

    w = published_moe_heldout_runs()["bridge-qwen3-30b-ep16-fp8"][0]
    cfg = w.model
    h, f, fe, k, E = cfg.hidden, cfg.ffn_hidden, cfg.moe.ffn_hidden, cfg.moe.top_k, cfg.moe.experts
    s, b, e = 4096, 1, 2
    lay = Layout(dp=16, ep=16, micro_batch=b, dp_style="distopt")
    rows = s * b * k
    for precision, lin in (("bf16", 2), ("fp8", 1)):
        mw = replace(w, precision=precision)
        # Megatron + TE: per row the dispatched input (its fp8 cast under fp8), fc1's output (2 fe, 16-bit), fc2's
        # input (fe; fp8 cast under fp8) and the fp32 gate weight; per token the router's fp32 logits and
        # probabilities; less the dense MLP's (2e f + lin f per token) the layer does not have.
        mega = rows * (lin * h + (2 * e + lin) * fe + 4) + s * b * 2 * 4 * E - s * b * (2 * e + lin) * f
        assert moe_activation_delta(mw, s, lay, "none", e, True) == pytest.approx(mega, rel=1e-12), precision
    # loom's own layer (bf16): the dispatched input, the SwiGLU MLP's 4 e fe, the expert output e h per row;
    # the router's fp32 input copy too.
    loom = rows * (e * h + 4 * e * fe + e * h) + s * b * (4 * h + 2 * 4 * E) - s * b * 4 * e * f
    assert moe_activation_delta(replace(w, precision="bf16", framework="loom"), s, lay, "none", e, False) == (
        pytest.approx(loom, rel=1e-12))
