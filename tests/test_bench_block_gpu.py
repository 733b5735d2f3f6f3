"""bench/block_gpu.py (issue 52 item 5): a tensor-parallel rank's block eager and compiled, with the planner's
price of each written before it runs. On CPU, --smoke: the script's rows and their arithmetic."""

import json
import sys

from conftest import ROOT, bench_smoke


def test_block_bench_smoke_prices_then_measures_a_tp_rank_block(tmp_path):
    out = bench_smoke("block_gpu.py", tmp_path)
    (row,) = out["rows"]
    assert row["tp"] == 2 and row["eager_ms"] > 0 and row["compiled_ms"] > 0
    assert row["compiled_speedup"] == round(row["eager_ms"] / row["compiled_ms"], 3)
    pred = row["predicted_ms"]
    assert 0 < pred["compiled"] < pred["eager"]  # the planner prices compiled blocks faster
    assert row["compiled_error"] == round(pred["compiled"] / row["compiled_ms"] - 1, 3)


def test_rank_shape_divides_heads_and_mlp_but_not_the_hidden_size():
    sys.path.insert(0, str(ROOT / "bench"))
    from block_gpu import SHAPES, rank_config

    from loom.config import load_config

    full = load_config("llama3-70b").model
    local = rank_config(full, 8)
    assert (local.heads, local.kv_heads, local.ffn_hidden, local.hidden, local.head_dim) == (8, 1, 3584, 8192, 128)
    for config, tp, *_ in SHAPES.values():  # every shape the device check runs is valid
        rank_config(load_config(config).model, tp)
    assert json.dumps(SHAPES)
