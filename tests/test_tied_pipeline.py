"""Tied embeddings under pipeline parallelism: the first stage's embedding and the last stage's head copy
start equal, their gradients are summed over the two ranks, and every schedule computes what one process
computes with the shared weight (configs/tiny.toml ties them, as Llama-3.2-1B/3B and Qwen do). Under tensor
parallelism too: tensor-parallel rank r of the first stage and rank r of the last exchange the same vocabulary rows,
whatever placement DTensor's embedding backward gave the embedding's gradient (issue 34)."""

import pytest
import torch

from loom.cli import main
from test_moe_compose import ROUTERS as MOE_ROUTERS
from test_moe_parallel import assert_same_routing
from test_parallel import MODEL, assert_same_run, final_weights, launch

TIED = MODEL + ["model.layers=4"]  # tiny.toml's tie_embeddings=true is kept


@pytest.fixture(scope="module")
def tied_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single-tied") / "run"
    assert main(["train", "--config", "tiny", "--run-dir", str(run_dir), *[f"--{o}" for o in TIED]]) == 0
    return run_dir


LAYOUTS = {
    "pp2-1f1b": (2, ["parallel.pp=2"]),
    "pp2-interleaved": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"]),
    "pp2-zero_bubble": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zero_bubble"]),
    "pp2-dp_shard2": (4, ["parallel.pp=2", "parallel.dp_shard=2"]),
    # Tensor x pipeline: the embedding and the head are vocabulary shards on every tensor-parallel rank, and
    # tensor-parallel rank r of the first stage sums gradients with rank r of the last. Without SP the
    # embedding's gradient comes back replicated, with SP as a partial sum (loom/parallel/pipeline.py).
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "tp2-sp-pp2": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2"]),
    "tp2-pp2-cp2": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2"]),
    # The embedding and the loss counted as a layer each: chunk 0 (rank 0) holds only the embedding, chunk 5
    # (rank 1) only the tied head and the loss; the pair exchanges gradients across the two ranks.
    "pp2-vpp3-ends": (2, ["parallel.pp=2", "parallel.vpp=3", "parallel.schedule=interleaved",
                          "parallel.embedding_in_split=true", "parallel.loss_in_split=true"]),
}


# make test-all (the 20-minute budget): pp2-dp_shard2 (4 processes), and pp2-interleaved, covered piecewise by
# pp2-1f1b (embedding and head on different ranks), pp2-zero_bubble (two chunks per rank, the tied pair on one rank)
# and test_parallel's pp2-vpp2-interleaved (the interleaved schedule). tp2-pp2-cp2 (8 processes, ~32 s) stays in
# make test: issue 34 asks for it there. tests/test_layout_matrix.py keeps the account of which layouts run where.
SLOW = {"pp2-dp_shard2", "pp2-interleaved"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_tied_pipeline_matches_single_process(name, tied_reference, tmp_path):
    nproc, layout = LAYOUTS[name]
    launch(tmp_path / "run", nproc, *layout, base=TIED)
    assert_same_run(tmp_path / "run", tied_reference)
    weights = final_weights(tmp_path / "run")
    # After six updates the two copies are still one weight.
    assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])


# A tied mixture-of-experts model under tensor x pipeline x expert parallelism (ep carved from dp_shard=2). Top-2 of 8
# experts, seed 1: test_moe_compose.py says why (no near-tie between a token's second and third experts).
MOE = MOE_ROUTERS["top2of8"]
MOE_LAYOUTS = {
    "tp2-pp2-dp_shard2-ep2": (8, ["parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=2", "parallel.ep=2"]),
}


# 8 processes (~40 s), in make test: the one proof there of MoE layers under tensor parallelism (issue 34)
@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_tied_moe_pipeline_matches_single_process(name, tmp_path):
    single = tmp_path / "single"
    assert main(["train", "--config", "tiny", "--run-dir", str(single), *[f"--{o}" for o in TIED + MOE]]) == 0
    nproc, layout = MOE_LAYOUTS[name]
    launch(tmp_path / "run", nproc, *MOE, *layout, base=TIED)
    assert_same_run(tmp_path / "run", single)
    assert_same_routing(tmp_path / "run", single, "top2of8", moe_layers=4)
    weights = final_weights(tmp_path / "run")
    assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])


@pytest.mark.slow  # 2 x (one process + 2 ranks), ~30 s; make test keeps pp2-vpp3-ends (interleaved) above
@pytest.mark.parametrize("tied", ["true", "false"])
def test_zbv_with_embedding_and_loss_chunks_matches_single_process(tied, tmp_path):
    """ZB-V on 2 layers with the embedding and the loss counted: chunks [0, 1, 1, 0], and the V puts chunks 0 and 3
    on rank 0, which then runs only the embedding and only the head and loss (the tied pair on one rank)."""
    base = MODEL + ["model.layers=2", f"model.tie_embeddings={tied}"]
    single = tmp_path / "single"
    assert main(["train", "--config", "tiny", "--run-dir", str(single), *[f"--{o}" for o in base]]) == 0
    launch(tmp_path / "run", 2, "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zero_bubble",
           "parallel.embedding_in_split=true", "parallel.loss_in_split=true", base=base)
    assert_same_run(tmp_path / "run", single)
