"""The planner on mixture-of-experts models: parameter counts against the built model and the published
sizes, expert memory sharded by expert parallelism, the all-to-all and expert-GEMM terms against hand
arithmetic, the ep search, the imbalance assumption and bad input."""

from __future__ import annotations

import json
import math

import pytest
from conftest import run_main

from loom.config import load_config
from loom.planner.layertime import layer_times
from loom.planner.memory import memory
from loom.planner.params import expert_params, total_params
from loom.planner.steptime import evaluate
from loom.planner.workload import GIB, Layout, Workload
from loom.planner.hardware import PRESETS
from loom.planner.search import search

H100 = PRESETS["h100"]


def test_moe_parameter_count_equals_the_built_model_and_published_sizes():
    from loom.models.llama import build_model

    cfg = load_config("tiny-moe").model
    cfg.moe.shared_experts, cfg.moe.shared_gate, cfg.moe.interval = 1, True, 2  # dense and MoE layers mixed
    model = build_model(cfg, device="meta")
    assert total_params(cfg) == sum(p.numel() for p in model.parameters())
    # Mixtral 8x7B: 46.7B parameters (Jiang et al. 2024); Qwen3-30B-A3B: 30.5B (its model card).
    assert total_params(load_config("mixtral-8x7b").model) / 1e9 == pytest.approx(46.70, abs=0.01)
    assert total_params(load_config("qwen3-30b-a3b").model) / 1e9 == pytest.approx(30.53, abs=0.01)


def _w(name="mixtral-8x7b", gpus=64, **kw):
    cfg = load_config(name).model
    return Workload(cfg, 4096, 256, gpus, H100, **kw)


def test_experts_are_sharded_by_ep_and_their_states_by_the_expert_data_parallel_ranks():
    w = _w()
    cfg = w.model
    experts = cfg.layers * expert_params(cfg)
    dense = total_params(cfg) - experts
    for ep in (1, 2, 8):
        # Megatron's distributed optimizer: 16-bit weights of the rank's dense part and E/ep experts.
        mem = memory(w, Layout(dp=64, ep=ep, dp_style="distopt"))
        assert mem["params"] == pytest.approx(2 * (dense + experts / ep), rel=1e-9), ep
        # Its fp32 master + moments: dense over 64 ranks, experts over the 64 / ep expert-data-parallel ranks,
        # by rows (loom/parallel/distopt.py): 8 / ep experts over 64 / ep ranks, a rank holds one expert's rows
        # where 1/8 of one is its share (`expert_row_padding`, test_plan_moe_memory.py); at ep 8 a rank's one
        # expert is split along its second dimension, unpadded
        pad = 1 if ep == 8 else 8
        assert mem["optimizer"] == pytest.approx(12 * (dense / 64 + pad * experts / ep / (64 // ep)), rel=1e-9), ep
        # FSDP: everything sharded the same way, so the expert states do not depend on ep.
        fsdp = memory(w, Layout(dp=64, ep=ep, dp_style="fsdp"))
        assert fsdp["params"] == pytest.approx(4 * (dense / 64 + experts / ep / (64 // ep)), rel=1e-9)
        # loom's replicate style replicates the dense part but fully_shards the routed experts over the
        # expert-data-parallel ranks all the same (loom/parallel/data.py): fp32 weights, gradients, moments.
        # Without expert parallelism the experts are part of their blocks: replicated too.
        rep = memory(w, Layout(dp=64, ep=ep, dp_style="replicate"))
        expert_shard = experts / ep / (64 // ep) if ep > 1 else experts
        assert rep["params"] == pytest.approx(4 * (dense + expert_shard), rel=1e-9), ep
        assert rep["optimizer"] == pytest.approx(8 * (dense + expert_shard), rel=1e-9), ep


def test_all_to_all_and_expert_gemms_follow_the_token_arithmetic():
    w = _w()
    cfg, gpu = w.model, w.gpu
    one = layer_times(w, 1, 1, 1, False, "none", 8)
    tokens, k, h = 4096, cfg.moe.top_k, cfg.hidden
    # Two all-to-alls of rows forward (dispatch, combine): each rank sends 7/8 of its tokens x top_k rows of h
    # bf16, inside the node (ep=8 fits), at NVLink bandwidth x efficiency, plus a latency each; and the latency of
    # a third, the rows' gates, which the SwiGLU experts fold into their activation (loom/parallel/expert.py).
    volume = tokens * k * h * 2 * 7 / 8
    lat = gpu.collective_latency_us * 1e-6
    expected = 2 * (lat + volume / (gpu.nvlink_gbps * 1e9 * gpu.collective_efficiency)) + lat
    assert one.fwd["ep_comm"] == pytest.approx(expected, rel=1e-9)
    assert one.bwd["ep_comm"] == pytest.approx(expected, rel=1e-9)
    # Across nodes (tp=2 puts 4 ep peers in a node): the half that leaves the node goes at network speed.
    # Without SP the MoE layer is not split over tp, so each tp rank routes every token of the micro-batch
    # (with SP and ep a multiple of tp the experts spread over the tp ranks: test_experts_over_tp_...).
    two = layer_times(w, 2, 1, 1, False, "none", 8)
    rows = tokens * k
    out = rows * h * 2 * (4 / 7) * 7 / 8
    assert two.fwd["ep_comm"] == pytest.approx(
        2 * (lat + out / (gpu.internode_gbps * 1e9 * gpu.collective_efficiency)) + lat, rel=1e-9)
    # A dense model has no all-to-all; the MoE model's matmuls count top_k experts per token: with 2 of 8
    # experts of the dense MLP's width, the MLP GEMM work doubles, whatever ep.
    dense_cfg = load_config("mixtral-8x7b").model
    dense_cfg.moe.experts = 0
    dense = layer_times(Workload(dense_cfg, 4096, 256, 64, H100), 1, 1, 1, False, "none")
    assert dense.fwd["ep_comm"] == 0.0
    mlp_flops = 2 * 3 * h * cfg.ffn_hidden * tokens
    assert one.fwd["gemm"] - dense.fwd["gemm"] == pytest.approx(
        mlp_flops / (gpu.peak("bf16") * 1e12 * gpu.matmul_efficiency["bf16"] * gpu.sustained_clock), rel=0.1)


def test_pipelined_exchange_prices_only_what_the_experts_cannot_cover():
    """parallel.ep_overlap_chunks = C (loom/parallel/expert.py): C exchanges each way, each with its latency; the
    first dispatch and the last combine (1/C of the volume) stay exposed, the rest only beyond the routed experts'
    products (the chunks' products run while the other chunks' exchanges are in flight)."""
    from loom.planner.kernels import gemm_time

    w = _w()
    cfg, gpu = w.model, w.gpu
    tokens, k, h, local = 4096, cfg.moe.top_k, cfg.hidden, cfg.moe.experts // 8
    fe = cfg.moe.ffn_hidden or cfg.ffn_hidden
    seconds = tokens * k * h * 2 * 7 / 8 / (gpu.nvlink_gbps * 1e9 * gpu.collective_efficiency)
    rows = tokens * k // local
    experts = gemm_time(gpu, "bf16", rows, 2 * fe, h, local) + gemm_time(gpu, "bf16", rows, h, fe, local)
    for chunks in (2, 4):
        full = 2 * (chunks * gpu.collective_latency_us * 1e-6 + seconds) + chunks * gpu.collective_latency_us * 1e-6
        expected = full / chunks + (chunks - 1) / chunks * max(0.0, full - experts)
        got = layer_times(_w(ep_overlap_chunks=chunks), 1, 1, 1, False, "none", 8)
        assert got.fwd["ep_comm"] == pytest.approx(expected, rel=1e-9) and got.bwd["ep_comm"] == got.fwd["ep_comm"]
        assert got.fwd["gemm"] == layer_times(w, 1, 1, 1, False, "none", 8).fwd["gemm"]  # the work is unchanged
    assert layer_times(_w(ep_overlap_chunks=4), 1, 1, 1, False, "none", 8).fwd["ep_comm"] < \
        0.6 * layer_times(w, 1, 1, 1, False, "none", 8).fwd["ep_comm"]


def test_imbalance_slows_the_busiest_rank_and_grows_its_activations():
    balanced, skewed = _w(), _w(moe_imbalance=1.5)
    # (distopt: with FSDP over 64 GPUs this step is bound by the weight gathers, which hide the experts' time)
    lay = Layout(dp=64, ep=8, dp_style="distopt", recompute="none")
    a, b = evaluate(balanced, lay), evaluate(skewed, lay)
    # the exchanged bytes grow 1.5 x, the latencies do not: three all-to-alls (dispatch, gates, combine) forward
    # and three backward per MoE layer and micro-batch
    cfg = balanced.model
    fixed = cfg.moe_layers * (256 // 64) * 6 * balanced.gpu.collective_latency_us * 1e-6
    assert b.time_terms["ep_comm"] - fixed == pytest.approx(1.5 * (a.time_terms["ep_comm"] - fixed), rel=1e-9)
    assert b.time_terms["gemm"] > a.time_terms["gemm"] * 1.2
    assert b.memory["activations"] > a.memory["activations"]
    assert b.step_time_s > a.step_time_s


def test_search_offers_expert_parallel_sizes_that_divide_experts_and_dp():
    found, _ = search(_w(gpus=16), top=0, dp_styles=("fsdp",), recompute_modes=("full",))
    eps = {e.layout.ep for e in found}
    assert eps and eps <= {1, 2, 4, 8} and max(eps) > 1
    for e in found:
        lay = e.layout
        over_tp = lay.sp and lay.tp > 1 and lay.ep % lay.tp == 0 and (lay.tp * lay.dp * lay.cp) % lay.ep == 0
        assert ((lay.dp * lay.cp) % lay.ep == 0 or over_tp) and 8 % lay.ep == 0
    dense = load_config("llama2-7b").model
    found, _ = search(Workload(dense, 4096, 64, 16, H100), top=0, recompute_modes=("full",))
    assert {e.layout.ep for e in found} == {1}


def test_cli_moe_sizes_layout_and_refusals():
    r = run_main("plan", "--layers", "8", "--hidden", "1024", "--heads", "8", "--vocab", "32000", "--mlp", "swiglu",
                "--norm", "rmsnorm", "--experts", "16", "--top-k", "2", "--moe-ffn", "512", "--gpus", "16",
                "--seq", "2048", "--global-batch", "64", "--layout", "ep=8", "--runtime", "any", "--json")
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)["candidates"][0]
    assert best["ep"] == 8 and best["time_s"]["ep_comm"] > 0
    for args, needle in ((("--model", "llama2-7b", "--gpus", "16", "--layout", "ep=2"), "mixture-of-experts"),
                         (("--model", "mixtral-8x7b", "--gpus", "16", "--layout", "ep=3"), "valid: 1, 2, 4, 8"),
                         (("--model", "mixtral-8x7b", "--gpus", "16", "--top-k", "9"), "model.moe.top_k"),
                         (("--model", "mixtral-8x7b", "--gpus", "16", "--moe-imbalance", "0.5"), "--moe-imbalance"),
                         (("--model", "mixtral-8x7b", "--gpus", "8", "--inference"), "mixture-of-experts")):
        r = run_main("plan", *args)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_loss_chunk_auto_prices_what_loom_runs_by_default(tmp_path):
    """`loss_chunk="auto"` (the planner's default, as train.loss_chunk's): loom's runtime on a GPU with tp = pp
    = 1 is priced with 8192-token chunks (with FSDP or loom's distributed optimizer), tp or pp > 1 and a CPU
    profile with whole logits, each exactly as the explicit setting prices it; `loom plan`'s layout config keeps "auto"."""
    import dataclasses

    cfg = load_config("llama3-8b").model
    auto, chunked, whole = (Workload(cfg, 4096, 64, 8, H100, loss_chunk=c) for c in ("auto", 8192, 0))
    for lay, like in ((Layout(dp=8, micro_batch=2, dp_style="fsdp"), chunked),
                      (Layout(tp=2, sp=True, dp=4, micro_batch=2, dp_style="fsdp"), whole),
                      (Layout(pp=2, dp=4, micro_batch=2, dp_style="fsdp"), whole),
                      (Layout(dp=8, micro_batch=2, dp_style="distopt"), chunked)):
        a, b = evaluate(auto, lay), evaluate(like, lay)
        assert a.step_time_s == b.step_time_s and a.memory == b.memory, lay
    assert evaluate(auto, Layout(dp=8, micro_batch=2)).memory["logits"] < evaluate(whole, Layout(
        dp=8, micro_batch=2)).memory["logits"]
    cpu = dataclasses.replace(H100, name="cpu-test")
    assert Workload(cfg, 4096, 64, 8, cpu, loss_chunk="auto").at_layout(Layout(dp=8)).loss_chunk == 0
    for recipe in ("rl", "dpo", "rm"):  # their losses read whole logits
        assert Workload(cfg, 4096, 64, 8, H100, loss_chunk="auto", recipe=recipe).at_layout(Layout(dp=8)).loss_chunk == 0
    assert Workload(cfg, 4096, 64, 8, H100, loss_chunk="auto", recipe="sft").at_layout(Layout(dp=8)).loss_chunk == 8192
    done = run_main("plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--seq", "4096",
                    "--global-batch", "64", "--top", "1", "--config", str(tmp_path / "best.toml"))
    assert done.returncode == 0 and 'loss_chunk = "auto"' in (tmp_path / "best.toml").read_text()
    bad = run_main("plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--loss-chunk", "-5")
    assert bad.returncode == 2 and "--loss-chunk=-5 must be an integer >= 0" in bad.stderr


def test_loss_chunk_head_gradient_in_the_distributed_optimizers_buffer_is_not_counted_twice():
    """loom/parallel/headgrad.py: with an untied head the distributed optimizer takes the chunked loss's head-weight
    gradient straight into its fp32 buffer (already in `grads` for distopt, `buffers` for zero3), so the logits
    term holds no fp32 copy of it: every micro-batch under zero3, a step's only one under distopt (later ones keep
    the copy). A tied head's too under zero3 (its rows wait there for the embedding's part); distopt keeps the copy."""
    import dataclasses

    cfg = load_config("llama3-8b").model
    assert not cfg.tie_embeddings
    head = 4 * cfg.vocab_size * cfg.hidden

    def logits(model, style, global_batch):
        w = Workload(model, 4096, global_batch, 8, H100, loss_chunk=1024)
        return memory(w, Layout(dp=8, micro_batch=1, dp_style=style, recompute="full"))["logits"]

    for batch, micro in ((8, 1), (32, 4)):
        fsdp = logits(cfg, "fsdp", batch)
        assert fsdp - logits(cfg, "zero3", batch) == pytest.approx(head, rel=1e-9), micro
        assert fsdp - logits(cfg, "distopt", batch) == pytest.approx(head if micro == 1 else 0, abs=1), micro
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    assert logits(tied, "fsdp", 8) - logits(tied, "zero3", 8) == pytest.approx(head, rel=1e-9)
    assert logits(tied, "distopt", 8) == pytest.approx(logits(tied, "fsdp", 8), rel=1e-9)


def test_loss_chunk_keeps_one_chunk_of_logits_and_no_extra_head_forward():
    """loom's chunked loss computes the head's gradients in forward: one chunk's fp32 logits and their bf16
    gradient alive, the hidden states' gradient and an fp32 head-weight gradient kept until backward; the
    same three head matmuls as the plain loss, plus adding each chunk's weight gradient into the fp32 one."""
    from loom.planner.layertime import head_times
    from loom.planner.kernels import hbm_time

    cfg = load_config("qwen3-30b-a3b").model
    whole, chunked = (Workload(cfg, 4096, 512, 8, H100, loss_chunk=c) for c in (0, 1024))
    lay = Layout(dp=8, ep=8, micro_batch=4, dp_style="fsdp", recompute="full")
    a, b = evaluate(whole, lay), evaluate(chunked, lay)
    tokens, v, h = 4 * 4096, cfg.vocab_size, cfg.hidden
    assert a.memory["logits"] == pytest.approx(tokens * v * 10, rel=1e-9)  # fp32 x2 + bf16
    assert b.memory["logits"] == pytest.approx(1024 * v * 6 + tokens * h * 2 + v * h * 4, rel=1e-9)
    (af, ab), (bf, bb) = head_times(whole, 1, 1, 4), head_times(chunked, 1, 1, 4)
    accumulate = hbm_time(H100, 8 * 15 * v * h)  # 16 chunks: 15 read-and-write passes over the fp32 buffer
    assert bf == pytest.approx(af + ab + accumulate, rel=1e-9)
    assert bb == pytest.approx(hbm_time(H100, 8 * v * h + 4 * tokens * h), rel=1e-9)
    assert bf + bb < af + ab + af  # not one more head forward
    assert math.isclose(a.memory["params"], b.memory["params"])
    assert b.memory["total"] < a.memory["total"] - 20 * GIB
