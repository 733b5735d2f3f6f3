"""Compiled transformer blocks (`train.compile`, loom/parallel/__init__.py `compile_blocks`) in every layout
family the rule book accepts, each equal to one eager process (CPU, gloo, fp32).

Each family runs one training step (its micro-batches, forward and backward) on two rank processes with the
blocks compiled by `counting`: torch's `aot_eager` backend (the graph capture and AOTAutograd's traced forward
and backward, as inductor gets them, without code generation) that counts the graphs it compiles and the
times a compiled forward runs. The step's loss and every parameter's gradient must equal one eager process's,
and the compiled path must really be taken: every block of the rank compiled, compiled forwards run at least
once per block and micro-batch, and the graph breaks bounded by the family's `max_breaks` (where a block is
cut on purpose: sequence parallelism's gather hooks, ...). A silent fallback to eager (no compile, or a block
falling apart into eager pieces) fails the count.
"""

from __future__ import annotations

import os

import pytest
import torch

from distributed import shared_pool

BASE = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn_hidden=128",
        "model.vocab_size=512", "model.max_seq_len=64", "train.seq_len=32", "train.micro_batch=2",
        "train.global_batch=4", "model.tie_embeddings=false"]
ROWS, SEQ = 4, 32

# family -> (overrides, the most graph breaks one step may record on a rank, the reason for them)
FAMILIES = {
    "tp2": (["parallel.tp=2"], 0, "none: the block is one graph"),
    "tp2-sp": (["parallel.tp=2", "parallel.sp=true"], 4,
               "sequence parallelism's gather enters each tensor-parallel region eagerly (its saved-tensor hooks "
               "keep only the sequence shard): 2 regions x entry and exit"),
}

COUNTS = {"graphs": 0, "calls": 0}
BACKEND = "loom_counting_test"


def _counting_backend(gm, example_inputs):
    from torch._dynamo.backends.debugging import aot_eager

    COUNTS["graphs"] += 1
    compiled = aot_eager(gm, example_inputs)

    def run(*args):
        COUNTS["calls"] += 1
        return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)
    return run


def _step(overrides: list[str], compiled: bool):
    """One step of the family on this rank: (loss over the whole batch, {name: full gradient}, counts)."""
    import torch.distributed as dist
    from torch._dynamo import list_backends, register_backend
    from torch._dynamo.utils import counters

    from loom.config import load_config
    from loom.models.llama import build_model
    from loom.models.losses import TokenCrossEntropy, run_loss_chunk
    from loom.parallel import place_in_mesh
    from loom.parallel.distributed import all_reduce_sum, full_tensor
    from loom.train.steps import build_runner

    torch.set_num_threads(1)
    if compiled and BACKEND not in list_backends(exclude_tags=()):
        register_backend(name=BACKEND)(_counting_backend)
    torch._dynamo.reset()
    counters.clear()
    COUNTS.update(graphs=0, calls=0)
    cfg = load_config("tiny", BASE + overrides + [f"train.compile={str(compiled).lower()}"])
    layout = place_in_mesh(cfg, "cpu")
    model = build_model(cfg.model, seed=3)
    os.environ["LOOM_COMPILE_BACKEND"] = BACKEND
    try:
        runner = build_runner(model, cfg, layout, TokenCrossEntropy(run_loss_chunk(cfg)), torch.device("cpu"), None)
    finally:
        del os.environ["LOOM_COMPILE_BACKEND"]
    ids = torch.randint(0, 512, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(5))
    per = ROWS // layout.dp_size
    rows = slice(layout.dp_rank * per, (layout.dp_rank + 1) * per)
    batch = {"input_ids": ids[rows, :-1], "labels": ids[rows, 1:]}
    loss = runner.forward_backward(batch, layout.dp_size / (ROWS * SEQ))
    if dist.is_initialized():  # the ranks' token sums (tensor-parallel ranks hold the same one)
        loss = all_reduce_sum(loss.clone()) / layout.tp
    grads = {n: full_tensor(p.grad).detach().clone() for n, p in runner.model.named_parameters()
             if p.grad is not None}
    blocks = list(runner.model.layers.values())
    count = {"blocks": len(blocks), "compiled_blocks": sum(getattr(b, "_compiled_call_impl", None) is not None
                                                           for b in blocks),
             "micro_batches": cfg.train.global_batch // (layout.dp_size * cfg.train.micro_batch),
             "graph_breaks": sum(counters["graph_break"].values()), **COUNTS}
    return float(loss) / (ROWS * SEQ), grads, count


@pytest.fixture(scope="module")
def reference():
    """One eager process, made once per model."""
    cache = {}

    def get(extra=()):
        key = tuple(extra)
        if key not in cache:
            cache[key] = _step(list(extra), compiled=False)
        return cache[key]

    return get


def assert_same_step(ranks, ref, family):
    loss, grads, _ = ref
    merged: dict = {}
    for rank_loss, rank_grads, _ in ranks:
        assert rank_loss == pytest.approx(loss, rel=1e-5), family
        for name, g in rank_grads.items():
            merged.setdefault(name, g)
    assert set(merged) == set(grads), (family, set(merged) ^ set(grads))
    for name, g in grads.items():
        scale = g.abs().max().item() + 1e-12
        err = (merged[name] - g).abs().max().item()
        assert err <= 1e-4 * scale, f"{family}: {name} differs by {err:.3g} (max |g| {scale:.3g})"


def assert_compiled(ranks, family, max_breaks):
    for _, _, c in ranks:
        assert c["blocks"] > 0 and c["compiled_blocks"] == c["blocks"], (family, c)
        assert c["graphs"] >= 1 and c["calls"] >= c["blocks"] * c["micro_batches"], (family, c)
        assert c["graph_breaks"] <= max_breaks, (family, c)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_family_matches_one_eager_process(family, reference):
    overrides, max_breaks, _ = FAMILIES[family]
    ranks = shared_pool(2).run(_step, overrides, True)
    assert_same_step(ranks, reference(), family)
    assert_compiled(ranks, family, max_breaks)
