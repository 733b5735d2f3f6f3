"""Megatron-Core's pipeline split in the planner (issue 55): the embedding and the loss counted as a layer each
(`--account-for-embedding/loss-in-pipeline-split`, loom's `parallel.embedding_in_split` / `loss_in_split`), so
pp x vpp may reach layers + 2 and a chunk may hold only the embedding or only the head and loss."""

import json

import pytest
from conftest import run_main

from loom.config import load_config
from loom.errors import UserError
from loom.planner.hardware import PRESETS
from loom.planner.layertime import head_times, layer_times
from loom.planner.search import evaluate_layout, split_options
from loom.planner.stages import rank_shapes
from loom.planner.workload import Layout, Workload


def _workload():
    """Llama-3-8B-shaped with 30 layers: 30 + the embedding + the loss = 32 units = pp 4 x vpp 8 chunks of one."""
    cfg = load_config("llama3-8b").model
    cfg.layers, cfg.tie_embeddings = 30, False
    return Workload(cfg, 8192, 64, 32, PRESETS["h100"], framework="megatron")  # Megatron's split, as it runs it


FIELDS = dict(tp=2, pp=4, vpp=8, dp=4, sp=True, dp_style="distopt", schedule="interleaved")


def test_layers_plus_two_chunks_priced_by_the_slowest_rank():
    from dataclasses import replace

    w = _workload()
    with pytest.raises(UserError, match="32 pipeline stages but model.layers=30"):
        evaluate_layout(w, FIELDS)  # without Megatron's split: more chunks than layers
    e = evaluate_layout(w, {**FIELDS, "embedding_in_split": True, "loss_in_split": True})
    # Chunks [0, 1 x 30, 0]; rank r runs chunks r, r+4, ..., r+28: rank 0 seven layers and the embedding,
    # ranks 1 and 2 eight layers, rank 3 seven layers and the head (the loss's unit: chunk 31 holds no layer).
    shapes = {(s.embedding, s.head): s for s in rank_shapes(w, e.layout)}
    assert shapes[(True, False)].chunks == (0,) + (1,) * 7 and shapes[(False, True)].chunks == (1,) * 7 + (0,)
    assert shapes[(False, False)].chunks == (1,) * 8
    # Interleaved warm-up, by hand: rank r runs 2(p-r-1) + (v-1)p + 1 forwards before its first backward, four at
    # a time per chunk: rank 0 35 = 4 of each of its 8 chunks + 3 more of chunk 0 (the embedding's: no layer)
    # -> 28 layer-micro-batches; rank 1 33 (5 of its first chunk) -> 33; rank 2 31 (3 of its last) -> 31; rank 3
    # 29 = 4 of each of its first 7 chunks + 1 of its last (the loss's: no layer) -> 28. Without the split
    # counted (the embedding's and the loss's chunks holding a layer) rank 0 would hold 35 and rank 3 29.
    assert sorted(s.held_layers for s in rank_shapes(w, e.layout)) == [28, 28, 31, 33]
    # Step time: the slowest rank's layers (and head) times the 16 micro-batches; the head weighs about two
    # layers at a 128k vocabulary, so rank 3 (7 layers + head) sets the pace over ranks 1-2 (8 layers).
    lt = layer_times(replace(w, attention_kernel="fused", elementwise_kernels="fused"), 2, 1, 1, True, "none")
    layer = sum(lt.fwd.values()) + sum(lt.bwd.values())
    head = sum(head_times(w, 2, 1, 1))
    assert 1.5 < head / layer < 3
    core = lt.fwd["gemm"] + lt.bwd["gemm"] + lt.fwd["attention"] + lt.bwd["attention"]
    t = e.time_terms
    assert t["gemm"] + t["attention"] + t["head"] + t.get("clock", 0.0) == pytest.approx(16 * (7 * core + head),
                                                                                          rel=1e-9)
    # The search proposes that split for pp=4 x vpp=8, where no other split exists.
    assert split_options(30, 4, 8, "interleaved", round(head / layer, 1)) == ((0, 0, True, True),)


def test_plan_layout_searches_and_checks_megatrons_split():
    base = ["plan", "--model", "llama3-8b", "--layers", "30", "--gpus", "32", "--gpu", "h100", "--global-batch", "64"]
    r = run_main(*base, "--layout", "tp=2,pp=4,vpp=8,sp=true", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "embedding_in_split" in out["search"]["searched"]
    assert out["candidates"] and all(c["embedding_in_split"] and c["loss_in_split"] for c in out["candidates"])
    r = run_main(*base, "--layout", "tp=2,pp=4,vpp=8,sp=true,embedding_in_split=true,loss_in_split=false", "--json")
    assert r.returncode == 2 and "31 units do not split evenly" in r.stderr and "valid pp x vpp: 31" in r.stderr, r.stderr
    r = run_main(*base, "--layout", "tp=2,pp=4,vpp=8,loss_in_split=maybe")
    assert r.returncode == 2 and "loss_in_split='maybe' must be true or false" in r.stderr, r.stderr


def test_published_96_chunks_for_94_layers_is_priced():
    """The model zoo's Qwen3-235B-A22B at TP2 PP32 VPP3 EP8 (96 virtual stages, 94 layers), refused before."""
    from loom.planner.validation import predict, published_moe_heldout_runs

    w, fixed, *_ = published_moe_heldout_runs()["zoo-qwen3-235b-a2a-pp32"]
    best = predict(w, fixed)
    assert best is not None and best.fits
    assert (best.layout.pp, best.layout.vpp, best.layout.embedding_in_split, best.layout.loss_in_split) == (32, 3, True, True)


def test_rule_book_splits_the_units_evenly():
    """loom.rules.split_layers, by hand: L + 2 units over pp x vpp chunks, one transformer layer fewer at each
    counted end; refusals name what is wrong and what is valid."""
    from loom.rules import split_layers, split_problem

    assert split_layers(94, 96, embedding=True, loss=True) == [0] + [1] * 94 + [0]  # the model zoo's PP32 x VPP3
    assert split_layers(94, 32, embedding=True, loss=True) == [2] + [3] * 30 + [2]  # 96 units, 3 a chunk
    assert split_layers(5, 2, embedding=True) == [2, 3] and split_layers(5, 3, loss=True) == [2, 2, 1]
    assert split_problem(4, 2, 3) is not None and split_problem(4, 2, 3, embedding=True, loss=True) is None
    assert "valid pp x vpp: 2, 3, 6" in split_problem(4, 4, 1, embedding=True, loss=True)
    assert "need parallel.pp > 1" in split_problem(4, 1, 1, embedding=True)
    both = split_problem(8, 2, 1, first=3, embedding=True)
    assert "parallel.first_stage_layers=3" in both and "parallel.embedding_in_split=true" in both
