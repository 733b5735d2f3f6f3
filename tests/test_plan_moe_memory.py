"""Issue 55, item 3: the held-out published MoE runs on H100 (`published_moe_heldout_runs`) and the memory terms
of Megatron-Core's MoE layers, each pinned by a hand computation with its source."""

import pytest
from conftest import saved_bytes

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

    assert len(heldout) == 9
    for name, (w, fixed, seconds, source, routing) in heldout.items():
        assert "github.com" in source and routing and seconds > 0, name
        # Megatron-Core's runs priced as Megatron; NeMo AutoModel's (PyTorch FSDP2) as loom's runtime with fused kernels
        assert w.framework == ("loom" if name.startswith("automodel-") else "megatron"), name
        assert w.gpu.name == "h100" and w.model.moe_layers, name
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
    # nothing. loom's SwiGLU experts do the same (loom/models/swiglu.py's weighted_swiglu), under expert
    # parallelism too (its exchange carries the gates: loom/parallel/expert.py); GELU experts are weighted in the
    # combine, which keeps the expert output (e*h per row).
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
    # loom's own layer (bf16): the dispatched input, the routed SwiGLU MLP's 3 e fe (w1's and w3's outputs and
    # their product: loom/models/swiglu.py), the fp32 gate per row; the router's fp32 input copy too; less the
    # dense MLP's eager 4 e f. GELU experts: 2 e fe and the expert output e h a row, less the dense 2 e f.
    loom = rows * (e * h + 3 * e * fe + 4) + s * b * (4 * h + 2 * 4 * E) - s * b * 4 * e * f
    assert moe_activation_delta(replace(w, precision="bf16", framework="loom"), s, lay, "none", e, False) == (
        pytest.approx(loom, rel=1e-12))
    gelu = replace(w, precision="bf16", framework="loom", model=replace(cfg, mlp="gelu"))
    loom_gelu = rows * (e * h + 2 * e * fe + e * h) + s * b * (4 * h + 2 * 4 * E) - s * b * 2 * e * f
    assert moe_activation_delta(gelu, s, lay, "none", e, False) == pytest.approx(loom_gelu, rel=1e-12)


def test_megatron_attention_keeps_q_and_out_at_heads_times_head_dim():
    # Qwen3-235B-A22B: 64 query heads of 128 (8192 wide) over hidden 4096, 4 groups (k, v 512 wide each). TE's
    # attention keeps q, k, v and out at their widths; the rest of the layer as before (norm inputs and their
    # normalised outputs, fc1's output and fc2's input of a 12288 MLP, fp32 log-sum-exp).
    from loom.planner.memory import megatron_layer_activation_bytes

    cfg = published_moe_runs()["zoo-qwen3-235b-tp2-ep32"][0].model
    s, b, e, tp = 4096, 1, 2, 2
    h, f = 4096, 12288
    want = (2 * (e + e) * s * b * h / tp + (e * s * b * (2 * 8192 + 2 * 512) + (2 * e + e) * s * b * f + 4 * 64 * s * b) / tp)
    assert megatron_layer_activation_bytes(cfg, s, b, tp, True, "none", e, False) == pytest.approx(want, rel=1e-12)
    # fp8: the normalised inputs and fc2's input as 1-byte casts, plus the out-projection's fp8 copy of its input
    want8 = (2 * (e + 1) * s * b * h / tp + (e * s * b * (2 * 8192 + 2 * 512) + 1 * s * b * 8192
                                              + (2 * e + 1) * s * b * f + 4 * 64 * s * b) / tp)
    assert megatron_layer_activation_bytes(cfg, s, b, tp, True, "none", e, True) == pytest.approx(want8, rel=1e-12)
    # head_dim = hidden / heads (Llama): the old hidden x (2 + 2g/a) is the same count
    llama = published_moe_runs()["dgxc-grok1-314b-bf16"][0].model
    a, g = llama.heads, llama.kv_heads
    assert llama.heads * llama.head_dim == llama.hidden
    got = megatron_layer_activation_bytes(llama, s, b, 1, False, "selective", e, False)
    hh, ff = llama.hidden, llama.ffn_hidden
    assert got == pytest.approx(2 * 2 * e * s * hh + e * s * hh * (2 + 2 * g / a) + 3 * e * s * ff, rel=1e-12)


def test_automodel_deepep_experts_keep_what_their_weighted_swiglu_keeps(heldout):
    # NeMo AutoModel's DeepEP experts (GPT-OSS-20B: 32 experts of 2880, top-4, hidden 2880; bf16, MBS 2):
    # per routed row the dispatched input (e h), fc1's gated output (2 e fe), the weighted SwiGLU's output
    # (e fe) and the row's fp32 gate weight; per token the router's fp32 input copy, logits and probabilities;
    # less the dense SwiGLU MLP loom's layer formula counts (4 e f).
    from dataclasses import replace

    from loom.planner.memory import gate_in_activation, moe_activation_delta
    from loom.planner.workload import Layout

    w, fixed, *_ = heldout["automodel-gpt-oss-20b"]
    assert gate_in_activation(w, False) and not gate_in_activation(replace(w, moe_dispatcher="alltoall"), False)
    assert not gate_in_activation(replace(w, elementwise_kernels="auto"), False)
    lay = Layout(dp=8, ep=8, micro_batch=2)
    s, b, e, h, fe, k, E = 4096, 2, 2, 2880, 2880, 4, 32
    rows = s * b * k
    want = rows * (e * h + 3 * e * fe + 4) + s * b * (4 * h + 2 * 4 * E) - s * b * 4 * e * 2880
    assert moe_activation_delta(w, s, lay, "none", e, False) == pytest.approx(want, rel=1e-12)
    # loom's own kernels keep the same: its SwiGLU experts fold the gate in too, behind the exchange (swiglu.py)
    loom = rows * (e * h + 3 * e * fe + 4) + s * b * (4 * h + 2 * 4 * E) - s * b * 4 * e * 2880
    assert moe_activation_delta(replace(w, elementwise_kernels="loom"), s, lay, "none", e, False) == pytest.approx(
        loom, rel=1e-12)


def test_fused_kernel_stacks_keep_what_transformer_engine_layers_keep():
    # A PyTorch stack of fused kernels (TE's RMSNorm and Linear, a fused SwiGLU: elementwise_kernels="fused")
    # keeps per layer what Megatron + TE keeps (megatron_layer_activation_bytes), not loom's eager layer with its
    # fp32 norm-input copies and four SwiGLU tensors (loom.flops.layer_activation_bytes).
    from dataclasses import replace

    from loom.config import ModelConfig
    from loom.flops import layer_activation_bytes
    from loom.planner.hardware import PRESETS
    from loom.planner.memory import memory
    from loom.planner.workload import Layout, Workload

    cfg = ModelConfig(layers=4, hidden=1024, heads=8, kv_heads=2, ffn_hidden=2816, vocab_size=32000, max_seq_len=2048)
    w = Workload(cfg, 2048, 1, 1, PRESETS["h100"], elementwise_kernels="fused", compile="off")
    lay = Layout(dp_style="replicate")
    s, h, f, a, g, e = 2048, 1024, 2816, 8, 2, 2
    te = 2 * (e + e) * s * h + e * s * (2 * h + 2 * h * g / a) + 3 * e * s * f + 4 * a * s
    assert memory(w, lay)["activations"] == pytest.approx(4 * te, rel=1e-12)
    eager = layer_activation_bytes(cfg, s, 1, 1, False, "none", e)
    assert eager > te
    assert memory(replace(w, elementwise_kernels="loom"), lay)["activations"] == pytest.approx(4 * eager, rel=1e-12)


def test_heldout_fsdp_and_expert_layouts_fit(heldout):
    # The layouts that ran: NeMo AutoModel's GPT-OSS on 8 GPUs (FSDP8 + EP8, MBS 2) and 64 (FSDP64 + EP64), and
    # Megatron-Bridge's Qwen3-30B-A3B with EP16 over 16 GPUs. Before issue 55's terms the two GPT-OSS rows
    # were priced at 98.9 and 106.7 GiB (fp32 Adam moments, loom's eager layer, the expert output kept).
    from loom.planner.validation import predict

    for name in ("automodel-gpt-oss-20b", "automodel-gpt-oss-120b", "bridge-qwen3-30b-ep16-fp8"):
        w, fixed, seconds, *_ = heldout[name]
        best = predict(w, fixed)
        assert best is not None and best.fits and best.layout.recompute == "none", name
        assert best.memory["total"] <= w.usable_bytes, name


def test_context_parallel_without_data_parallelism_shards_the_states_over_cp(heldout):
    """The zoo's 128k row: CP 8 leaves dp = 1, and Megatron's distributed optimizer (like loom's FSDP over
    dp_shard x cp) still shards over the 8 cp ranks, so the search offers the sharded styles there; priced
    replicated, no layout of it fit."""
    from dataclasses import replace as dc_replace

    from loom.planner.memory import memory
    from loom.planner.validation import predict

    w, fixed, *_ = heldout["zoo-qwen3-235b-128k-cp8"]
    best = predict(w, fixed)
    assert best is not None and best.fits and best.layout.dp == 1 and best.layout.cp == 8
    assert best.layout.dp_style == "distopt"
    replicated = memory(w, dc_replace(best.layout, dp_style="replicate"))
    assert replicated["optimizer"] > 4 * best.memory["optimizer"]  # the states over 8 cp ranks, not whole


# --- compiled MoE blocks (issue 52, item 4): what inductor's partitioner keeps, by expert path ------------------

def test_compiled_moe_layers_are_priced_by_their_expert_path():
    """`memory()` prices a compiled MoE model at tp = 1 as a compiled dense layer plus the MoE layer's compiled
    delta, by the path loom's experts take: traced grouped GEMMs without expert parallelism (Hopper, bf16), eager
    grouped GEMMs between the all-to-alls (ep > 1), the eager loop (no grouped kernel: Ampere). Worked by hand
    for Mixtral-8x7B (every layer MoE, 8 experts of 14,336, top-2) from the per-token, per-row and per-padded-row
    bytes the measurement below reads off; with compile off, the eager formulas."""
    from loom.config import load_config
    from loom.flops import layer_activation_bytes
    from loom.planner.hardware import PRESETS
    from loom.planner.memory import memory, moe_activation_delta
    from loom.planner.workload import Layout, Workload

    m = load_config("mixtral-8x7b").model
    h, a, g, f, fe, E, k, s, e = m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.moe.ffn_hidden or m.ffn_hidden, \
        m.moe.experts, m.moe.top_k, 4096, 2
    assert (h, f, fe, E, k, m.moe.shared_experts) == (4096, 14336, 14336, 8, 2, 0) and m.moe_layers == m.layers
    T, rows = s, s * k  # micro-batch 1
    dense = T * (e * (6 * h + 2 * h * g / a + 3 * f) + 4 * a + 8)  # compiled dense layer
    common = T * (4 * h + 8 * E + 8 * k - e * 3 * f) + 4 * E * h + 8 * E  # router; the dense MLP goes
    # traced: the padded input (not its zero buffer) per padded row, no zero combine buffer or one-hot per token
    # (SwiGLU experts without the exchange fold the fp32 gate into their activation: 4 bytes a padded row kept, no
    # expert output or 16-bit gate)
    traced = common - T * e * h + T * (12 - 4 * E) + rows * 24 + (rows + 16 * E) * (4 + e * (h + 3 * fe))
    # eager experts keep SwiGLU's two inputs and the product (loom/models/swiglu.py): 3 fe a row; behind the
    # exchange too they fold the fp32 gate in (4 bytes a padded row) and the combine keeps no expert output
    grouped_ep8 = common - T * e * h + rows * (24 + 16) + (rows + 16 * E // 8) * (4 + e * (h + 3 * fe))
    looped = common - T * e * h + rows * (e * h + 4 + 16 + e * 3 * fe)
    cases = [(PRESETS["h100"], 1, traced), (PRESETS["h100"], 8, grouped_ep8), (PRESETS["a100-80gb"], 1, looped)]
    for gpu, ep, delta in cases:
        lay = Layout(dp=64, ep=ep, micro_batch=1, dp_style="fsdp")
        on = memory(Workload(m, s, 256, 64, gpu), lay)["activations"]
        assert on == pytest.approx(m.layers * (dense + delta), rel=1e-12), (gpu.name, ep)
        off_w = Workload(m, s, 256, 64, gpu, compile="off")
        eager = m.layers * (layer_activation_bytes(m, s, 1, 1, False, "none", e)
                            + moe_activation_delta(off_w.at_layout(lay), s, lay, "none", e, False))
        assert memory(off_w, lay)["activations"] == pytest.approx(eager, rel=1e-12)
        assert on < 0.97 * eager  # compiled: no fp32 norm copies, the dense attention's compiled set
    # fp8 (attention's linears in fp8, the experts 16-bit): the fp8 dense layer kept e*(2f), not e*(3f + h), of its MLP
    dense8 = T * (e * (4 * h + 2 * h * g / a + 2 * f) + 4 * a + 8)
    lay = Layout(dp=64, micro_batch=1, dp_style="fsdp")
    on = memory(Workload(m, s, 256, 64, PRESETS["h100"], precision="fp8"), lay)["activations"]
    assert on == pytest.approx(m.layers * (dense8 + traced + T * e * (f + h)), rel=1e-12)


def _compiled_moe_block_saved_bytes(cfg, s: int, b: int, experts: str, exchange: bool, fp8: str = "off") -> float:
    """What a compiled one-layer MoE model in bf16 saves for backward on CPU, counted as
    tests/test_plan.py::test_compiled_block_activations_match_inductors_saved_tensors counts a dense one (each saved
    storage once, parameters and the same outside-the-block tensors excluded). `experts`: "traced" forces loom's
    grouped path (one graph), "looped" the per-expert loop; `exchange`: expert parallelism's real all-to-all over a
    one-rank gloo group (a graph break, the experts eager behind it); `fp8`: torchao's recipe, as train.fp8."""
    import torch
    import torch.distributed as dist

    from loom.models import moe
    from loom.models.llama import build_model

    h, a = cfg.hidden, cfg.heads
    torch.manual_seed(0)
    torch._dynamo.reset()
    started = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "use_grouped_mm", lambda x: experts != "looped")
        model = build_model(cfg).to(torch.bfloat16)
        if fp8 != "off":
            from loom.parallel.float8 import apply_float8

            apply_float8(model, fp8)
        block = model.layers["0"]
        try:
            if exchange:
                from torch.distributed.device_mesh import init_device_mesh

                from loom.parallel.expert import ExpertParallel

                if not dist.is_initialized():
                    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
                    started = True
                block.feed_forward.expert_parallel = ExpertParallel(init_device_mesh("cpu", (1,)))
            block.compile()
            ids = torch.randint(0, cfg.vocab_size, (b, s))
            model(ids).float().sum().backward()  # compile forward and backward
            total = saved_bytes(model, ids)
        finally:
            if started:
                dist.destroy_process_group()
    outside = b * s * (4 * h + 4 + 2 * h + 2 * h + 8) + 2 * s * (h // a) * 2  # as the dense test
    return total - outside


def test_compiled_grouped_moe_layer_keeps_no_zero_buffer():
    """The traced grouped path (loom/models/moe.py) allocates its padded input buffer, the combine's output and the
    balance loss's one-hot flat: as [rows, h] and [tokens, E] zeros, the compiler merged them with the zeros of the
    same shape that the backward of the row gathers and of the router's top-k creates, and saved them for backward
    (e*h bytes a padded row and a token, 4E a token). Compiled with inductor's decompositions and partitioner
    (`aot_eager_decomp_partition`; the slow test below measures inductor itself), no all-zero tensor is saved, and
    the padded input is (so the grouped path ran)."""
    import torch

    from loom.config import ModelConfig
    from loom.config.model import MoEConfig
    from loom.models import moe

    h, E, k, T = 32, 4, 2, 64
    cfg = ModelConfig(layers=1, hidden=h, heads=4, kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=T,
                      moe=MoEConfig(experts=E, top_k=k, ffn_hidden=16))
    torch.manual_seed(0)
    layer = moe.MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    layer = layer.to(torch.bfloat16)
    x = torch.randn(T, h, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    saved = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "use_grouped_mm", lambda x: True)
        compiled = torch.compile(layer, backend="aot_eager_decomp_partition", fullgraph=True)
        compiled(x).float().sum().backward()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            compiled(x)
    torch._dynamo.reset()
    wide = [tuple(t.shape) for t in saved if t.is_floating_point() and t.dim() == 2 and h in t.shape and t.any()]
    assert (h, T * k + 16 * E) in wide  # the padded input (transposed, for the experts' weight gradients)
    zero = [tuple(t.shape) for t in saved if t.is_floating_point() and not t.any()]
    assert zero == []  # before: [(T * k + 16 * E, h), (T, h), (T, E)]


@pytest.mark.slow
@pytest.mark.parametrize("experts,exchange,mlp,shared,gate,fp8", [
    ("traced", False, "swiglu", 0, False, "off"),  # the Hopper path without expert parallelism
    ("traced", False, "gelu", 1, True, "off"),
    ("grouped", True, "swiglu", 2, False, "off"),  # Hopper with expert parallelism: eager behind the exchange
    ("looped", False, "swiglu", 1, False, "off"),  # no grouped kernel
    ("traced", False, "swiglu", 2, False, "rowwise"),
    ("grouped", True, "swiglu", 1, False, "tensorwise"),
])
def test_compiled_moe_block_matches_inductors_saved_tensors(experts, exchange, mlp, shared, gate, fp8):
    """`compiled_layer_activation_bytes` + `compiled_moe_activation_bytes` against what a compiled one-layer MoE
    block saves (softmax router, balance loss, 8 experts of 128, top-2; 1024 routed rows, so the grouped path's
    16-row padding per expert, 128 rows, is 12% of them and counted). Matches to the byte on the traced and bf16
    grouped paths, within 32 bytes (looped) and 460 (fp8 grouped) elsewhere; fails if a path's terms were another's
    (the nearest differ by 0.28%) or if the traced path kept its zero buffers again (21% more, 0.4% the one-hot)."""
    from loom.config import ModelConfig
    from loom.config.model import MoEConfig
    from loom.planner.memory import compiled_layer_activation_bytes, compiled_moe_activation_bytes

    h, f, a, g, s, b, E, k = 256, 1024, 8, 2, 256, 2, 8, 2
    cfg = ModelConfig(layers=1, hidden=h, heads=a, kv_heads=g, ffn_hidden=f, vocab_size=512, max_seq_len=s, mlp=mlp,
                      moe=MoEConfig(experts=E, top_k=k, ffn_hidden=128, shared_experts=shared, shared_gate=gate))
    if fp8 != "off":
        pytest.importorskip("torchao")
    got = _compiled_moe_block_saved_bytes(cfg, s, b, experts, exchange, fp8)
    expected = (compiled_layer_activation_bytes(cfg, s, b, 2, fp8 != "off")
                + compiled_moe_activation_bytes(cfg, s * b, s * b * k, 2, E, experts, exchange, fp8 != "off"))
    assert got == pytest.approx(expected, rel=2e-3)  # the nearest paths differ by 0.28%


def test_experts_split_over_more_ranks_than_they_have_rows_are_priced_as_loom_splits_them():
    """Mixtral's 8 experts: under ep 8 a rank holds one, split over its 8 edp ranks; without ep the 8 are split over
    all 64. loom's FSDP splits them along their hidden dimension (loom/parallel/data.py's `shard_dim`, tested in
    test_moe_ep.py): no padding, one more copy per gather and reduction (2e bytes per element each). loom's
    distributed optimizer and sharded weights split by rows (torch.chunk): a rank holds ceil(8/64) = 1 expert's rows
    where 1/8 is its share, so the experts' state and buffers are 8 x. Megatron's flat buffers: neither."""
    from loom.config import load_config
    from loom.planner.hardware import load_gpu
    from loom.planner.memory import memory
    from loom.planner.stages import expert_row_padding, local_params, rank_shapes
    from loom.planner.steptime import fsdp2_copy_bytes
    from loom.planner.workload import Layout, Workload

    w = Workload(model=load_config("mixtral-8x7b").model, seq_len=4096, global_batch=256, gpus=64,
                 gpu=load_gpu("h100"))
    fsdp_ep8 = Layout(dp=64, ep=8, micro_batch=2, recompute="full")
    assert expert_row_padding(w, fsdp_ep8) == (1.0, True)
    dense, experts = local_params(w, fsdp_ep8, rank_shapes(w, fsdp_ep8)[0])
    extra = fsdp2_copy_bytes(w, fsdp_ep8, dense, experts, 2, True) - fsdp2_copy_bytes(w, fsdp_ep8, dense, experts, 2)
    # per micro-batch (2): the experts gathered for forward and again for backward (the last layer's once) and
    # their gradients reduced, each one more copy of 2e = 4 bytes per element (bf16)
    z_layer, off = experts / w.model.layers, 4
    assert extra == pytest.approx(2 * ((2 * experts - z_layer) * off + experts * off), rel=1e-9)

    zero3 = Layout(dp=64, micro_batch=2, recompute="full", dp_style="zero3")
    assert expert_row_padding(w, zero3) == (8.0, False)
    # a rank's one expert (ep 8) is split along its second dimension by distopt and zero3 too: no padding
    assert expert_row_padding(w, Layout(dp=64, ep=8, micro_batch=2, dp_style="zero3")) == (1.0, False)
    fsdp = Layout(dp=64, micro_batch=2, recompute="full", dp_style="fsdp")
    assert expert_row_padding(w, fsdp) == (1.0, True)
    dense, experts = local_params(w, zero3, rank_shapes(w, zero3)[0])
    # zero3's moments per rank: 8 bytes per element of its rows (the master rows count as its weights), experts 8 x
    assert memory(w, zero3)["optimizer"] == pytest.approx(8 * (dense + 8 * experts) / 64, rel=1e-9)
    mega = Workload(model=w.model, seq_len=4096, global_batch=256, gpus=64, gpu=w.gpu, framework="megatron")
    assert expert_row_padding(mega, fsdp_ep8) == (1.0, False)


def test_experts_split_off_rows_where_either_dimension_divides():
    """loom/parallel/data.py's `shard_dim` splits each stacked expert tensor along the first of its dimensions the
    ranks divide (w1, w3 [E, hidden, ffn]: hidden, else ffn; w2 [E, ffn, hidden]: ffn, else hidden), so either
    dividing is enough for no padding: Mixtral over 4096 ranks, where 4096 divides hidden (4096) but not ffn
    (14336), is split off its rows, not priced as 512 padded copies."""
    from loom.config import load_config
    from loom.parallel.data import shard_dim
    from loom.planner.hardware import load_gpu
    from loom.planner.stages import expert_row_padding
    from loom.planner.workload import Layout, Workload

    cfg = load_config("mixtral-8x7b").model
    w = Workload(model=cfg, seq_len=4096, global_batch=4096, gpus=4096, gpu=load_gpu("h100"))
    e, h, f = cfg.moe.experts, cfg.hidden, cfg.moe.ffn_hidden or cfg.ffn_hidden
    assert shard_dim((e, h, f), 4096) and shard_dim((e, f, h), 4096)  # what loom's FSDP does: no padding
    assert expert_row_padding(w, Layout(dp=4096, dp_style="fsdp")) == (1.0, True)
