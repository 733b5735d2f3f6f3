"""Tied embeddings under pipeline parallelism: the first stage's embedding and the last stage's head copy
start equal, their gradients are summed over the two ranks, and every schedule computes what one process
computes with the shared weight (configs/tiny.toml ties them, as Llama-3.2-1B/3B and Qwen do)."""

import pytest
import torch

from loom.cli import main
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
}


# make test-all (the 20-minute budget): pp2-dp_shard2 (4 processes), and pp2-interleaved, covered piecewise by
# pp2-1f1b (embedding and head on different ranks), pp2-zero_bubble (two chunks per rank, the tied pair on one rank)
# and test_parallel's pp2-vpp2-interleaved (the interleaved schedule)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("pp2-dp_shard2", "pp2-interleaved")
                                  else n for n in LAYOUTS])
def test_tied_pipeline_matches_single_process(name, tied_reference, tmp_path):
    nproc, layout = LAYOUTS[name]
    launch(tmp_path / "run", nproc, *layout, base=TIED)
    assert_same_run(tmp_path / "run", tied_reference)
    weights = final_weights(tmp_path / "run")
    # After six updates the two copies are still one weight.
    assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])
