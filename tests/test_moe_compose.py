"""Mixture of experts composed with pipeline, tensor(+sequence) and context parallelism, with and without
expert parallelism, computes what one process computes (CPU, gloo, fp32, 6 steps, dropless, 4 layers, all
MoE): per-step losses and grad norms, the final evaluation and the final parameters within 1e-5, and the
routing statistics of metrics.jsonl (balance and z losses, load imbalance) within 1e-5.

- pp: each stage records its own layers' statistics (one row per MoE layer of the whole model, summed over
  the ranks), the schedule's metadata-inference forward records none, and the auxiliary losses are
  averaged over the rank's micro-batches; the sigmoid_bias router's bias moves as in one process.
- tp (with and without SP): every rank computes the whole MoE layer on the whole sequence.
- cp: the balance loss's per-expert sums and Sinkhorn's balancing run over the cp group's tokens.
- ep composed with each: ep=2 over pp=2 x dp_shard=2, over tp=2 + SP x dp_shard=2 (the experts spread over
  the tp ranks, each routing its own sequence shard: tests/test_moe_ep_tp.py), and over cp=2 (ep spans the
  cp ranks).
"""

import pytest

from loom.config import load_config
from loom.errors import UserError
from test_moe_parallel import assert_same_routing
from test_parallel import PIPE, assert_same_run, launch, single_runs

MOE = ["model.moe.experts=8", "model.moe.ffn_hidden=32"]
ROUTERS = {
    # Routing is discrete: a token whose second and third best experts are within float rounding of each
    # other may go either way, and tensor- and context-parallel attention round differently from one process.
    # With seed 0 one of ~10^5 top-2 choices here is that close (tp=2 and cp=2 agree to 1e-7 for two steps,
    # then one token switches experts 2 and 4 of layer 1, moving those router rows by 2% of a step). Since the
    # samples are shuffled per pass (issue 53) seed 1 has one too (pp=2, step 6: 7.8e-5); seed 2 has none in any
    # top2of8 case here or in test_moe_ep*.py, so the comparison stays at 1e-5.
    "top2of8": MOE + ["model.moe.top_k=2", "model.moe.z_loss_coeff=0.001", "train.seed=2"],
    "sinkhorn_top1": MOE + ["model.moe.top_k=1", "model.moe.router=sinkhorn"],
    # A large rate so the bias steers the selection within six steps.
    "sigmoid_bias": MOE + ["model.moe.top_k=2", "model.moe.router=sigmoid_bias", "model.moe.bias_update_rate=0.02",
                           "model.moe.load_balance_coeff=0"],
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One single-process run per router, made on first use."""
    return single_runs(tmp_path_factory, {r: PIPE + ROUTERS[r] for r in ROUTERS})


CASES = {
    "top2of8-pp2": ("top2of8", 2, ["parallel.pp=2"]),
    "top2of8-pp2-interleaved": ("top2of8", 2, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"]),
    "sigmoid_bias-pp2": ("sigmoid_bias", 2, ["parallel.pp=2"]),
    "top2of8-ep2-pp2": ("top2of8", 4, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2"]),
    "sinkhorn_top1-ep2-pp2": ("sinkhorn_top1", 4, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2"]),
    "top2of8-tp2": ("top2of8", 2, ["parallel.tp=2"]),
    "top2of8-tp2-sp": ("top2of8", 2, ["parallel.tp=2", "parallel.sp=true"]),
    "sinkhorn_top1-tp2-sp": ("sinkhorn_top1", 2, ["parallel.tp=2", "parallel.sp=true"]),
    "top2of8-ep2-tp2-sp": ("top2of8", 4, ["parallel.tp=2", "parallel.sp=true", "parallel.dp_shard=2",
                                          "parallel.ep=2"]),
    "top2of8-cp2": ("top2of8", 2, ["parallel.cp=2"]),
    "sinkhorn_top1-cp2": ("sinkhorn_top1", 2, ["parallel.cp=2"]),
    "top2of8-ep2-cp2": ("top2of8", 2, ["parallel.cp=2", "parallel.ep=2"]),
    "sinkhorn_top1-ep2-cp2": ("sinkhorn_top1", 2, ["parallel.cp=2", "parallel.ep=2"]),
}
FAST = {"top2of8-pp2", "sinkhorn_top1-cp2"}  # the rest run in `make test-all`


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_moe_layout_matches_single_process(name, references, tmp_path):
    check_case(CASES[name], references, tmp_path)


def check_case(case, references, tmp_path) -> None:
    """(router, processes, overrides): a 6-step run in that layout equals the router's one-process run, losses,
    gradient norms and routing."""
    router, nproc, layout = case
    launch(tmp_path / "run", nproc, *ROUTERS[router], *layout, base=PIPE)
    reference = references(router)
    assert_same_run(tmp_path / "run", reference)
    assert_same_routing(tmp_path / "run", reference, router, moe_layers=4)


def test_refusals_name_the_field():
    moe = PIPE + ROUTERS["top2of8"]
    with pytest.raises(UserError, match=r"parallel.cp=2 with model.moe.capacity_factor=1.25 .* set "
                                        r"model.moe.capacity_factor=0 \(dropless\) or parallel.cp=1$"):
        load_config("tiny", moe + ["parallel.cp=2", "model.moe.capacity_factor=1.25"])
    with pytest.raises(UserError, match=r"parallel.schedule=zero_bubble with model.moe.experts=8 .* set "
                                        r"parallel.schedule=1f1b or interleaved$"):
        load_config("tiny", moe + ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zero_bubble"])
    for layout in (["parallel.pp=2"], ["parallel.tp=2", "parallel.sp=true"], ["parallel.cp=2", "parallel.ep=2"]):
        load_config("tiny", moe + layout)  # accepted
    load_config("tiny", moe + ["parallel.tp=2", "model.moe.capacity_factor=1.25"])  # tp sees whole sequences
