"""A mixture-of-experts model under data parallelism computes what one process computes (CPU, gloo, fp32,
dropless): per-step losses and grad norms, the final evaluation and the final parameters within 1e-5, for
top-2 of 8 experts (softmax) and Sinkhorn top-1; and the sigmoid_bias router's bias, whose loads are summed
over every micro-batch and data-parallel rank, moves exactly as in one process."""

import pytest

from test_parallel import MODEL, assert_same_run, final_weights, launch, metrics, single_runs

ROUTERS = {
    "top2of8": ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden=32",
                "model.moe.z_loss_coeff=0.001"],
    "sinkhorn_top1": ["model.moe.experts=8", "model.moe.top_k=1", "model.moe.ffn_hidden=32",
                      "model.moe.router=sinkhorn"],
    # A large rate so the bias steers the selection within six steps.
    "sigmoid_bias": ["model.moe.experts=8", "model.moe.top_k=2", "model.moe.ffn_hidden=32",
                     "model.moe.router=sigmoid_bias", "model.moe.bias_update_rate=0.02",
                     "model.moe.load_balance_coeff=0"],
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One single-process run per router, made on first use."""
    return single_runs(tmp_path_factory, {r: MODEL + ROUTERS[r] for r in ROUTERS})


CASES = [("top2of8", "parallel.dp_shard=2"), ("top2of8", "parallel.dp_replicate=2"),
         ("sinkhorn_top1", "parallel.dp_shard=2"), ("sinkhorn_top1", "parallel.dp_replicate=2"),
         ("sigmoid_bias", "parallel.dp_shard=2")]
# make test-all (the 20-minute budget): each router stays in make test under one data-parallel style (dp_shard under
# top2of8 and sigmoid_bias, dp_replicate under sinkhorn_top1); the router's statistics are reduced over the
# data-parallel group either way.
SLOW = {("top2of8", "parallel.dp_replicate=2"), ("sinkhorn_top1", "parallel.dp_shard=2")}


@pytest.mark.parametrize("router, layout", [pytest.param(*c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES],
                         ids=[f"{r}-{lay.split('.')[1]}" for r, lay in CASES])
def test_moe_data_parallel_matches_single_process(router, layout, references, tmp_path):
    launch(tmp_path / "run", 2, *ROUTERS[router], layout)
    reference = references(router)
    assert_same_run(tmp_path / "run", reference)
    assert_same_routing(tmp_path / "run", reference, router, moe_layers=3)


def assert_same_routing(run_dir, reference, router: str, moe_layers: int) -> None:
    """The routing statistics of every step (every layer's, every token's, counted once over the ranks) equal
    the single-process run's; for the sigmoid_bias router, the final selection bias of each of the `moe_layers`
    layers too, and it moved."""
    steps, _ = metrics(run_dir)
    ref_steps, _ = metrics(reference)
    for got, want in zip(steps, ref_steps):
        for key in ("moe_load_balance_loss", "moe_z_loss", "moe_imbalance", "moe_imbalance_max"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (got["step"], key)
    if router == "sigmoid_bias":
        got, want = final_weights(run_dir), final_weights(reference)
        bias = [k for k in want if k.endswith("router.expert_bias")]
        assert len(bias) == moe_layers
        for k in bias:
            assert (got[k] - want[k]).abs().max().item() < 1e-6, (k, got[k], want[k])
            assert want[k].abs().max().item() > 0.01  # it moved
