"""The planner on MoE layouts with the routed experts spread over tensor- as well as data-parallel ranks
(loom under sequence parallelism with ep a multiple of tp, Megatron-Core's expert tensor parallelism 1): each
rank routes its own sequence shard, the all-to-all stays inside a node while the EP group does, expert states
are sharded over tp x dp / ep ranks; checked against hand arithmetic and against the old layout's terms."""

from __future__ import annotations

import json
from dataclasses import replace
from math import comb

import pytest
from conftest import run_main

from loom.config import load_config
from loom.planner.hardware import PRESETS
from loom.planner.layertime import _moe_forward, layer_times
from loom.planner.memory import memory, moe_activation_delta
from loom.planner.params import expert_params, total_params
from loom.planner.search import search
from loom.planner.workload import Layout, Workload

H100 = PRESETS["h100"]


def _w(name="mixtral-8x7b", gpus=64, **kw):
    return Workload(load_config(name).model, 4096, 256, gpus, H100, **kw)


def test_which_layout_is_priced():
    loom, mega = _w(), _w(framework="megatron")
    assert loom.experts_over_tp(2, True, 8) and loom.experts_over_tp(4, True, 8)
    assert not loom.experts_over_tp(2, False, 8)  # no SP: every tp rank computes the whole MoE layer
    assert not loom.experts_over_tp(2, True, 1) and not loom.experts_over_tp(4, True, 2)  # ep not a multiple of tp
    assert not loom.experts_over_tp(1, False, 8)
    # Megatron (expert tensor parallelism 1) routes each rank's own shard whenever tp > 1 with SP.
    assert mega.experts_over_tp(2, True, 1) and mega.experts_over_tp(4, True, 2) and not mega.experts_over_tp(2, False, 8)
    dense = load_config("llama2-7b").model
    assert not Workload(dense, 4096, 256, 64, H100).experts_over_tp(2, True, 2)


def test_rows_per_rank_halve_and_the_all_to_all_stays_in_the_node():
    w = _w()
    cfg, gpu = w.model, w.gpu
    h, k = cfg.hidden, cfg.moe.top_k
    old = _moe_forward(w, 4096, 2, False, 8)  # every tp rank routes all 4096 tokens
    new = _moe_forward(w, 4096, 2, True, 8)  # each routes its 2048
    # A rank of the new layout at tp 2 does what a tp 1 rank does with half the tokens; the old one what a
    # tp 1 rank does with all of them.
    assert new["gemm"] == pytest.approx(_moe_forward(w, 2048, 1, False, 8)["gemm"], rel=1e-12)
    assert old["gemm"] == pytest.approx(_moe_forward(w, 4096, 1, False, 8)["gemm"], rel=1e-12)
    assert new["gemm"] < 0.6 * old["gemm"]
    assert new["elementwise"] == pytest.approx(old["elementwise"] / 2, rel=1e-12)
    # All-to-all: 2048 x top_k rows of h bf16 per rank, 7/8 of them sent, all 8 EP peers (whole tp groups side
    # by side) in one 8-GPU node: NVLink. The old layout's EP group takes one rank per tp group: 4 per node, the
    # 4/7 of the sent rows that leave the node at the network's bandwidth, for twice the rows.
    # (And one more latency: the rows' gates, which the SwiGLU experts fold in, exchanged after the dispatch.)
    eff = gpu.collective_efficiency
    lat = gpu.collective_latency_us * 1e-6
    sent = 2048 * k * h * 2 * 7 / 8
    assert new["ep_comm"] == pytest.approx(2 * (lat + sent / (gpu.nvlink_gbps * 1e9 * eff)) + lat, rel=1e-12)
    assert old["ep_comm"] == pytest.approx(2 * (lat + 2 * sent * 4 / 7 / (gpu.internode_gbps * 1e9 * eff)) + lat,
                                           rel=1e-12)
    # ep 16 over tp 2 x dp 8: 8 of the 16 peers in the node, 8/15 of the sent rows leave it.
    q = _w("qwen3-30b-a3b")
    kq, hq = q.model.moe.top_k, q.model.hidden
    sent16 = 2048 * kq * hq * 2 * 15 / 16
    assert _moe_forward(q, 4096, 2, True, 16)["ep_comm"] == pytest.approx(
        2 * (lat + max(sent16 * 7 / 15 / (gpu.nvlink_gbps * 1e9 * eff), sent16 * 8 / 15 / (gpu.internode_gbps * 1e9 * eff)))
        + lat, rel=1e-12)


def test_moe_layers_drop_the_mlp_tp_collectives_and_the_gathered_input():
    w = _w()  # every Mixtral layer is an MoE layer
    old = layer_times(w, 2, 1, 1, True, "none", 1)  # SP, experts not over tp (ep=1): gathers the MoE input
    new = layer_times(w, 2, 1, 1, True, "none", 8)
    assert new.fwd["tp_comm"] == pytest.approx(old.fwd["tp_comm"] / 2, rel=1e-12)  # attention's AG + RS only
    # Activations of the MoE MLP from the rank's own 2048 tokens, nothing gathered (loom's layer: fp32 router
    # input copy and fp32 logits + probabilities per token; per routed row the dispatched input, the gated
    # MLP's three fe-wide tensors (loom/models/swiglu.py) and the fp32 gate folded into it, which the exchange
    # carries), less the dense MLP's share (4f per token over tp).
    cfg = w.model
    h, f, fe, k, E, e = cfg.hidden, cfg.ffn_hidden, cfg.moe.ffn_hidden, cfg.moe.top_k, cfg.moe.experts, 2
    lay = Layout(tp=2, dp=32, ep=8, sp=True)
    rows = 2048 * k
    hand = rows * (e * h + 3 * e * fe + 4) + 2048 * (4 * h + 2 * 4 * E) - 4096 * 4 * e * f / 2
    assert moe_activation_delta(w, 4096, lay, "none", e, False) == pytest.approx(hand, rel=1e-12)
    old_lay = Layout(tp=2, dp=32, ep=1, sp=True)  # every tp rank routes 4096 tokens and keeps the gathered input
    # (without ep the SwiGLU experts fold the fp32 gate into their activation: 4 bytes a row, no expert output)
    hand_old = 2 * rows * (e * h + 3 * e * fe + 4) + 4096 * (4 * h + 2 * 4 * E) + e * 4096 * h - 4096 * 4 * e * f / 2
    assert moe_activation_delta(w, 4096, old_lay, "none", e, False) == pytest.approx(hand_old, rel=1e-12)


def test_expert_states_are_sharded_over_tp_x_dp_over_ep():
    w = _w("qwen3-30b-a3b", framework="megatron", grad_dtype="bfloat16")
    cfg = w.model
    experts = cfg.layers * expert_params(cfg)
    dense = total_params(cfg) - experts
    # ep 64 = tp 2 x dp 32 (only with experts over tp ranks): 2 of the 128 experts per rank, each on one rank.
    mem = memory(w, Layout(tp=2, dp=32, ep=64, sp=True, dp_style="distopt"))
    assert mem["params"] == pytest.approx(2 * (dense / 2 + experts / 64), rel=1e-9)
    assert mem["grads"] == pytest.approx(2 * (dense / 2 + experts / 64), rel=1e-9)
    assert mem["optimizer"] == pytest.approx(12 * (dense / 2 / 32 + experts / 64 / 1), rel=1e-9)
    # ep 8 with experts over tp: expert-data-parallel group tp x dp / ep = 8; without SP (old layout) dp / ep = 4.
    new = memory(w, Layout(tp=2, dp=32, ep=8, sp=True, dp_style="distopt"))
    assert new["optimizer"] == pytest.approx(12 * (dense / 2 / 32 + experts / 8 / 8), rel=1e-9)
    lw = _w("qwen3-30b-a3b")  # loom: the old layout without SP
    old = memory(lw, Layout(tp=2, dp=32, ep=8, sp=False, dp_style="distopt"))
    assert old["optimizer"] == pytest.approx(12 * (dense / 2 / 32 + experts / 8 / 4), rel=1e-9)
    # loom's fsdp style: weights, gradients and moments of the experts over their tp x dp / ep ranks.
    fsdp = memory(lw, Layout(tp=2, dp=32, ep=16, sp=True, dp_style="fsdp"))
    assert fsdp["params"] == pytest.approx(4 * (dense / 2 / 32 + experts / 16 / 4), rel=1e-9)


def test_search_proposes_ep_over_tp_and_dp_with_sp():
    w = Workload(load_config("qwen3-30b-a3b").model, 4096, 64, 16, H100)
    found, _ = search(w, top=0, fixed={"tp": 2, "pp": 1, "cp": 1}, dp_styles=("fsdp",), recompute_modes=("full",))
    over = [e.layout for e in found if (e.layout.dp * e.layout.cp) % e.layout.ep]
    assert {lay.ep for lay in over} == {16}  # ep = tp x dp = 16 (8 divides dp and is offered either way)
    assert all(lay.sp and lay.ep % lay.tp == 0 for lay in over)
    assert {e.layout.ep for e in found} == {1, 2, 4, 8, 16}


def test_cli_layout_accepts_ep_over_tp_with_sp_and_names_valid_sizes():
    base = ("plan", "--model", "qwen3-30b-a3b", "--gpus", "32", "--global-batch", "64", "--runtime", "any")
    r = run_main(*base, "--layout", "tp=2,pp=1,ep=32,sp=true", "--json")
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)["candidates"][0]
    assert best["ep"] == 32 and best["tp"] == 2 and best["sp"] and best["time_s"]["ep_comm"] > 0
    r = run_main(*base, "--layout", "tp=2,pp=1,ep=32,sp=true", "--json", "--moe-dispatcher", "deepep")
    assert r.returncode == 0, r.stderr
    # ep 32 spans 4 nodes: DeepEP sends a token once per remote node instead of once per remote expert row
    assert json.loads(r.stdout)["candidates"][0]["time_s"]["ep_comm"] < 0.7 * best["time_s"]["ep_comm"]
    r = run_main(*base, "--layout", "tp=2,pp=1,ep=32")  # sp left to the search: priced with sp=true
    assert r.returncode == 0, r.stderr
    r = run_main(*base, "--layout", "tp=2,pp=1,ep=32,sp=false")
    assert r.returncode == 2 and "valid: 1, 2, 4, 8, 16" in r.stderr and "sp=true" in r.stderr, r.stderr
    r = run_main(*base, "--layout", "tp=2,pp=1,ep=6,sp=true")
    assert r.returncode == 2 and "valid: 1, 2, 4, 8, 16, 32" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_deepep_sends_a_token_once_per_remote_node():
    # Qwen3-235B-A22B's MoE (128 experts, top-8) over ep 32 = 4 nodes of 8: a remote node holds 32 of the 128
    # experts, so it gets none of a token's 8 with probability C(96, 8) / C(128, 8); DeepEP sends the token
    # once to each of the other 3 nodes that gets any, instead of one row per expert on a remote rank (6 of 8).
    from loom.planner.validation import published_moe_runs

    w = published_moe_runs()["zoo-qwen3-235b-tp2-ep32"][0]
    gpu, h = w.gpu, w.model.hidden
    missed = comb(96, 8) / comb(128, 8)
    leaving = 2048 * 3 * (1 - missed) * h * 2  # 2048 tokens per rank at tp 2
    expected = 2 * (gpu.collective_latency_us * 1e-6 + leaving / (gpu.internode_gbps * 1e9 * gpu.collective_efficiency))
    assert _moe_forward(w, 4096, 2, True, 32)["ep_comm"] == pytest.approx(expected, rel=1e-12)
    rows_out = 2048 * 8 * 24 / 32 * h * 2  # every row bound for another node's rank
    assert _moe_forward(replace(w, moe_dispatcher="alltoall"), 4096, 2, True, 32)["ep_comm"] == pytest.approx(
        2 * (gpu.collective_latency_us * 1e-6 + rows_out / (gpu.internode_gbps * 1e9 * gpu.collective_efficiency))
        + gpu.collective_latency_us * 1e-6, rel=1e-12)  # (and the probabilities' all-to-all: DeepEP carries them)


def test_published_moe_runs_with_tensor_parallelism_fit_and_their_error():
    from loom.planner.validation import PUBLISHED_MOE_ROUTING, published_moe_runs, published_runs, predict

    runs = published_moe_runs()
    # The published step times, from the sources' own numbers.
    assert runs["bridge-qwen3-235b-a22b-fp8"][2] == pytest.approx(2048 * 4096 / (1575 * 256), rel=1e-12)
    assert runs["dgxc-grok1-314b-bf16"][2] == pytest.approx(8192 * 1024 / 526493, rel=1e-4)  # its tokens/s
    old = published_runs()
    errors = {}
    for name, (w, fixed, seconds, source, routing) in runs.items():
        assert w.experts_over_tp(fixed["tp"], fixed["sp"], fixed["ep"]) and "github.com" in source and routing
        best = predict(w, fixed)
        assert best is not None and best.fits, name
        errors[name] = best.step_time_s / seconds - 1
    for name in PUBLISHED_MOE_ROUTING:
        w, fixed, seconds, _ = old[name]
        errors[name] = predict(w, fixed).step_time_s / seconds - 1
    # The model zoo's Megatron-LM runs pass no --grad-reduce-in-bf16 (fp32 gradients, Megatron-LM's bf16
    # default); NeMo's and Megatron-Bridge's recipes reduce in bf16.
    assert {n: w.grad_dtype for n, (w, *_) in runs.items()} == {
        n: "float32" if n.startswith("zoo-") else "bfloat16" for n in runs}
    # Every row but the model zoo's TP4 x EP8 (its 29.0 s is half the speed of its TP2 rows; -43% here)
    # within 25%; mean |error| over the 8 MoE rows 13.2% when written (16.8% with the zoo's gradients priced
    # bf16, reductions hidden behind a backward without its recomputed forward, and the experts' weight
    # gradients not accumulated into the gradient buffer; issue 40's target 15%).
    assert all(abs(e) <= 0.25 for n, e in errors.items() if n != "zoo-qwen3-235b-tp4-ep8"), errors
    assert errors["zoo-qwen3-235b-tp2-ep32"] == pytest.approx(-0.052, abs=0.005), errors
    assert errors["zoo-qwen3-235b-tp4-ep8"] == pytest.approx(-0.414, abs=0.005), errors
    assert errors["zoo-qwen3-235b-fsdp-ep8"] == pytest.approx(-0.000, abs=0.005), errors
    assert sum(abs(e) for e in errors.values()) / len(errors) <= 0.15, errors


def test_reductions_hide_behind_the_backward_with_its_recomputed_forward():
    # The model zoo's Megatron-FSDP row (full recompute, 4 micro-batches, no pipeline): each micro-batch's
    # fp32 reduce-scatter hides behind that micro-batch's backward, which reruns every layer's forward.
    from loom.planner.kernels import collective_time, members_per_node
    from loom.planner.layertime import layer_times
    from loom.planner.stages import expert_data_parallel, expert_rank_stride, local_params, rank_shapes
    from loom.planner.steptime import step_time
    from loom.planner.validation import published_moe_runs, predict

    w, fixed, *_ = published_moe_runs()["zoo-qwen3-235b-fsdp-ep8"]
    lay = predict(w, fixed).layout
    assert (lay.recompute, lay.recompute_layers, lay.pp, lay.dp_style) == ("full", 0, 1, "fsdp")
    gpu, L = w.gpu, w.model.layers
    m = w.global_batch // (lay.dp * lay.micro_batch)
    dense, experts = local_params(w, lay, rank_shapes(w, lay)[0])
    eg, es = expert_data_parallel(w, lay), expert_rank_stride(w, lay) * lay.ep

    def coll(kind, per_param):
        return (collective_time(gpu, kind, per_param * dense, lay.dp, members_per_node(gpu, lay.tp, lay.dp))
                + collective_time(gpu, kind, per_param * experts, eg, members_per_node(gpu, es, eg)))

    lt = layer_times(w, lay.tp, lay.cp, lay.micro_batch, lay.sp, "none", lay.ep)
    fwd = sum(lt.fwd.values()) * L
    bwd = sum(lt.bwd.values()) * L + fwd  # the recomputed forward runs inside backward
    gather, grad = coll("all_gather", 2), coll("reduce_scatter", 4)
    assert sum(lt.bwd.values()) * L < grad < bwd  # exposed without the recompute window, hidden with it
    expected = m * (max(gather - fwd, gather / L) + max(gather - bwd, gather / L) + max(grad - bwd, grad / L))
    assert step_time(w, lay)["dp_comm"] == pytest.approx(expected, rel=1e-9)


def test_expert_weight_gradients_accumulate_into_megatrons_gradient_buffer():
    # The model zoo's TP4 x EP8 row: 1024 tokens per rank x top-8 over 16 local experts, 512 rows each. Each
    # expert's fc1 (3072 x 4096) and fc2 (4096 x 1536) weight gradient is C += A^T B with k = 512 and C the
    # fp32 main_grad, read and written: memory-bound on H100 (3350 GB/s x 0.8), where the same product
    # writing a 16-bit C once (gemm_time) is compute-bound.
    from loom.planner.kernels import gemm_time
    from loom.planner.layertime import _expert_wgrad_extra
    from loom.planner.validation import published_moe_runs

    w = published_moe_runs()["zoo-qwen3-235b-tp4-ep8"][0]
    gpu, bw = w.gpu, w.gpu.hbm_gbps * 1e9 * w.gpu.hbm_efficiency
    expected = 0.0
    for out, inp in ((3072, 4096), (4096, 1536)):
        traffic = 16 * ((out + inp) * 512 * 2 + 2 * out * inp * 4)
        expected += traffic / bw + gpu.kernel_overhead_us * 1e-6 - gemm_time(gpu, "bf16", out, inp, 512, 16)
    assert traffic / bw > gemm_time(gpu, "bf16", out, inp, 512, 16)  # memory-bound
    assert _expert_wgrad_extra(w, 512, 16) == pytest.approx(expected, rel=1e-12) and expected > 0
    assert _moe_forward(w, 4096, 4, True, 8)["wgrad_extra"] == pytest.approx(expected, rel=1e-12)
    # A bf16 gradient buffer moves half the C bytes; loom's runtime writes each gradient once (gemm_time's).
    assert 0 < _expert_wgrad_extra(replace(w, grad_dtype="bfloat16"), 512, 16) < expected
    assert _expert_wgrad_extra(replace(w, framework="loom"), 512, 16) == 0.0
    # 4096 rows per expert (the TP2 x EP32 row): compute-bound, nothing added.
    assert _expert_wgrad_extra(w, 4096, 4) == 0.0
