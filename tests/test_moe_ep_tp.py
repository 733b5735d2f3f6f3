"""Experts spread over tensor- and data-parallel ranks (expert tensor parallelism 1) compute what one process
computes.

Under sequence parallelism with parallel.ep > 1 (loom.rules.experts_span_tp) each tensor-parallel rank routes
its own sequence shard to experts placed over an EP group made of whole tp groups.

- One forward and backward, float64, tp=2 x ep=4 with sp over dp_shard=2 (FSDP), sigmoid_bias router forced to
  send every token to experts 0-1 (EP ranks 1-3 get none), shared experts with their gate, balance and z
  losses on: every parameter's gradient equals one process's (the starved experts' exactly 0).
- Counted on 4 ranks (tp=2 x dp_shard=2): rows through each rank's experts, their matmul FLOPs
  (FlopCounterMode) and the expert bytes a rank computes with and stores halve against tp=2 with ep=2 carved
  from dp (no sp) and against tp=2 with sp and ep=1 (the bytes quarter there).
- Slow: `loom train` (6 steps) equal to one process for softmax top-2, Sinkhorn top-1 and sigmoid_bias routers
  over FSDP, HSDP, pp=2 and cp=2 (CASES).
- The rule book's sizes and refusals.
"""

import pytest

from loom.config import load_config
from loom.errors import UserError
from test_moe_compose import ROUTERS, check_case
from test_parallel import PIPE, single_runs


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return single_runs(tmp_path_factory, {r: PIPE + ROUTERS[r] for r in ROUTERS})


CASES = {
    "top2of8-tp2-sp-ep2": ("top2of8", 2, ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2"]),
    "top2of8-tp2-sp-ep4": ("top2of8", 4, ["parallel.tp=2", "parallel.sp=true", "parallel.dp_shard=2",
                                          "parallel.ep=4"]),
    "sinkhorn_top1-tp2-sp-ep4": ("sinkhorn_top1", 4, ["parallel.tp=2", "parallel.sp=true", "parallel.dp_shard=2",
                                                      "parallel.ep=4"]),
    "sigmoid_bias-tp2-sp-ep4-hsdp": ("sigmoid_bias", 4, ["parallel.tp=2", "parallel.sp=true",
                                                         "parallel.dp_replicate=2", "parallel.ep=4"]),
    "top2of8-tp2-sp-ep2-pp2": ("top2of8", 4, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.ep=2"]),
    "sinkhorn_top1-tp2-sp-ep4-cp2": ("sinkhorn_top1", 4, ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2",
                                                          "parallel.ep=4"]),
    "top2of8-tp2-sp-ep2-dp_shard2": ("top2of8", 4, ["parallel.tp=2", "parallel.sp=true", "parallel.dp_shard=2",
                                                    "parallel.ep=2"]),
}
# make test: the one-step gradient test below (tp2 x ep4 with sp over dp_shard 2, FSDP) and the counting test;
# these 6-step training runs are in make test-all.


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_experts_over_tp_match_single_process(name, references, tmp_path):
    check_case(CASES[name], references, tmp_path)


# --- counted: expert FLOPs and expert bytes per rank halve against the layouts of before --------------

COUNT_MODEL = PIPE[:5] + ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden=32",
                          "train.seq_len=32", "train.global_batch=4", "train.micro_batch=2"]
COUNT_LAYOUTS = {  # 4 ranks each: tp=2 x dp_shard=2
    "tp2-ep2-over-dp": ["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2"],  # ep carved from dp (no sp)
    "tp2-sp-ep1": ["parallel.tp=2", "parallel.sp=true", "parallel.dp_shard=2"],  # experts replicated
    "tp2-sp-ep4": ["parallel.tp=2", "parallel.sp=true", "parallel.dp_shard=2", "parallel.ep=4"],  # new
}


def _count_worker(overrides):
    """One forward and backward of a 3-layer MoE model under `overrides` on this rank: rows through this
    rank's experts, their matmul FLOPs (counted by FlopCounterMode, a TorchDispatchMode), the expert
    parameter bytes the rank computes with (after FSDP's gather) and stores."""
    import torch
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    from loom.models.llama import build_model
    from loom.models.moe import GroupedExperts, moe_layers
    from loom.parallel import parallelize, place_in_mesh

    cfg = load_config("tiny", overrides)
    layout = place_in_mesh(cfg, "cpu")
    model = parallelize(build_model(cfg.model, seed=0), layout, cfg, None)
    counted = {"rows": 0, "flops": 0, "compute_bytes": 0}

    def counting(forward, experts):
        def run(x, counts, grouped=None, gate=None):
            with FlopCounterMode(display=False) as flops:
                y = forward(x, counts, grouped, gate=gate)
            counted["rows"] += x.shape[0]
            counted["flops"] += flops.get_total_flops()
            counted["compute_bytes"] += sum(w.numel() * w.element_size() for w in experts._weights() if w is not None)
            return y
        return run

    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.forward = counting(m.forward, m)
    dp_rank = layout.dp_rank
    g = torch.Generator().manual_seed(100 + dp_rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len), generator=g)
    out = model(tokens)
    out = out.to_local() if hasattr(out, "to_local") else out
    out.float().pow(2).mean().backward()
    stored = sum(p.to_local().numel() * p.element_size() for m in moe_layers(model)
                 for p in m.experts.parameters())
    token_mesh = [m.token_mesh is not None for m in moe_layers(model)]
    dist.barrier()
    return {**counted, "stored_bytes": stored, "token_mesh": token_mesh,
            "assignments": cfg.train.micro_batch * cfg.train.seq_len * cfg.model.moe.top_k * len(token_mesh)}


def test_expert_flops_and_bytes_per_rank_halve():
    from distributed import shared_pool

    got = {name: shared_pool(4).run(_count_worker, COUNT_MODEL + layout) for name, layout in COUNT_LAYOUTS.items()}
    new = got["tp2-sp-ep4"]
    assert all(all(r["token_mesh"]) for r in new) and not any(any(r["token_mesh"]) for r in got["tp2-sp-ep1"])
    # Each of the 2 data-parallel ranks' micro-batch routed once (dropless): 2 x assignments rows in all under the
    # new layout; every layout before computed each of them on both tensor-parallel ranks.
    assignments = new[0]["assignments"] * 2
    assert sum(r["rows"] for r in new) == assignments
    per_row = new[0]["flops"] / new[0]["rows"]  # 2 x 3 x hidden x ffn: SwiGLU's three matmuls
    assert per_row == 2 * 3 * 64 * 32
    for old in ("tp2-ep2-over-dp", "tp2-sp-ep1"):
        assert sum(r["rows"] for r in got[old]) == 2 * assignments, old
        assert sum(r["flops"] for r in got[old]) == 2 * sum(r["flops"] for r in new), old
    assert {r["stored_bytes"] for r in new} == {r["stored_bytes"] // 2 for r in got["tp2-ep2-over-dp"]}
    assert {r["compute_bytes"] for r in new} == {r["compute_bytes"] // 2 for r in got["tp2-ep2-over-dp"]}
    assert {r["compute_bytes"] for r in new} == {r["compute_bytes"] // 4 for r in got["tp2-sp-ep1"]}


# --- gradients equal one process's when three of the four EP ranks get no tokens --------------------

STARVE = PIPE[:5] + ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden=16",
                     "model.moe.shared_experts=1",
                     "model.moe.shared_gate=true",
                     "model.moe.router=sigmoid_bias", "model.moe.load_balance_coeff=0.01",
                     "model.moe.z_loss_coeff=0.001", "train.seq_len=16", "train.global_batch=4", "train.micro_batch=2"]
STARVE_LAYOUT = ["parallel.tp=2", "parallel.sp=true", "parallel.dp_shard=2", "parallel.ep=4"]


def _starved_model(cfg):
    """The float64 model, its selection bias sending every token of every layer to experts 0 and 1 (EP rank 0
    of 4); the two data-parallel ranks' tokens and the weights of their (linear) losses."""
    import torch

    from loom.models.llama import build_model

    model = build_model(cfg.model, dtype=torch.float64, seed=0)
    g = torch.Generator().manual_seed(7)
    shape = (2, cfg.train.micro_batch, cfg.train.seq_len)
    tokens = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
    weights = torch.randn(*shape, cfg.model.vocab_size, generator=g, dtype=torch.float64)
    return model, tokens, weights


def _force_routing(model):
    import torch

    from loom.models.moe import moe_layers

    for m in moe_layers(model):
        m.router.expert_bias = torch.tensor([50.0, 50.0] + [-50.0] * 6, dtype=torch.float32)


def _starved_worker():
    from loom.models.moe import moe_layers
    from loom.parallel import parallelize, place_in_mesh

    cfg = load_config("tiny", STARVE + STARVE_LAYOUT)
    layout = place_in_mesh(cfg, "cpu")
    model, tokens, weights = _starved_model(cfg)
    model = parallelize(model, layout, cfg, None)
    _force_routing(model)
    r = layout.dp_rank
    out = model(tokens[r])
    (out.full_tensor() * weights[r]).sum().backward()  # FSDP averages the 2 data-parallel ranks' gradients
    rows = [m.experts.w1.to_local().shape[0] for m in moe_layers(model)]
    grads = {n: p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
    return {"grads": grads, "local_experts": rows, "spans_tp": [m.token_mesh is not None for m in moe_layers(model)]}


def test_experts_over_tp_gradients_when_ranks_get_no_tokens():
    import torch

    from distributed import shared_pool
    from loom.models.moe import set_aux_grad_scale

    ranks = shared_pool(4).run(_starved_worker)
    cfg = load_config("tiny", STARVE)
    model, tokens, weights = _starved_model(cfg)
    _force_routing(model)
    set_aux_grad_scale(model, 0.5)  # two micro-batches, as the two data-parallel ranks' mean
    for r in range(2):
        ((model(tokens[r]) * weights[r]).sum() / 2).backward()
    assert all(ranks[0]["spans_tp"]) and set(ranks[0]["local_experts"]) == {2}
    got = ranks[0]["grads"]
    assert got.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        g = torch.from_numpy(got[name])
        # The router computes in fp32 (its gradient and what flows back from it); the rest is float64.
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6 * p.grad.abs().max().item(), msg=name)
        if name.endswith("experts.w1"):
            assert p.grad[:2].abs().min() > 0 and p.grad[2:].abs().max() == 0, name  # EP ranks 1-3: no tokens


# --- rules ----------------------------------------------------------------------------------------


def test_rules_for_experts_over_tp():
    from loom.rules import experts_span_tp, valid_ep_sizes

    moe = PIPE + ROUTERS["top2of8"]
    tp_sp = ["parallel.tp=2", "parallel.sp=true"]
    cfg = load_config("tiny", moe + tp_sp + ["parallel.dp_shard=2", "parallel.ep=4"])
    assert cfg.parallel.world_size == 4 and experts_span_tp(2, True, 4)  # ep does not multiply the world
    assert experts_span_tp(2, True, 2) and not experts_span_tp(2, False, 2) and not experts_span_tp(2, True, 1)
    assert not experts_span_tp(4, True, 2)  # ep not a multiple of tp: carved from dp x cp, as without sp
    assert valid_ep_sizes(8, 2, 2, True) == [1, 2, 4] and valid_ep_sizes(8, 2) == [1, 2]
    assert valid_ep_sizes(8, 8, 2, True) == [1, 2, 4, 8] and valid_ep_sizes(6, 3, 2, True) == [1, 2, 3, 6]
    with pytest.raises(UserError, match=r"parallel.ep=8 with parallel.tp=2 and parallel.sp=true spreads the experts "
                                        r".* must divide tp x dp_replicate x dp_shard x cp = 2 x 1 x 2 x 1 = 4 .* "
                                        r"valid ep sizes for this layout: 1, 2, 4$"):
        load_config("tiny", moe + tp_sp + ["parallel.dp_shard=2", "parallel.ep=8"])
    with pytest.raises(UserError, match=r"parallel.ep=3 with parallel.tp=2 and parallel.sp=true must be a multiple of "
                                        r"tp dividing .* = 8 .* or divide dp_replicate x dp_shard x cp = 4 .* "
                                        r"valid ep sizes for this layout: 1, 2, 4, 8$"):
        load_config("tiny", moe + tp_sp + ["parallel.dp_shard=4", "parallel.ep=3"])
    with pytest.raises(UserError, match=r"parallel.ep=4 spread over tensor-parallel ranks .* "
                                        r"model.moe.capacity_factor=1.25 .* set model.moe.capacity_factor=0"):
        load_config("tiny", moe + tp_sp + ["parallel.dp_shard=2", "parallel.ep=4", "model.moe.capacity_factor=1.25"])
    # Without sp every tp rank computes the whole layer: ep is carved from dp x cp, and the message says sp helps.
    with pytest.raises(UserError, match=r"parallel.ep=4 must divide dp_replicate x dp_shard x cp = 1 x 2 x 1 = 2 .* "
                                        r"valid ep sizes for this layout: 1, 2, .* or set parallel.sp=true"):
        load_config("tiny", moe + ["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=4"])
    # ep not a multiple of tp under sp: carved from dp x cp as before (every tp rank computes the whole layer).
    load_config("tiny", moe + tp_sp + ["model.moe.experts=6", "parallel.dp_shard=3", "train.global_batch=12",
                                       "parallel.ep=3"])
    load_config("tiny", moe + tp_sp + ["model.moe.capacity_factor=1.25"])  # ep=1: whole sequences, as before
