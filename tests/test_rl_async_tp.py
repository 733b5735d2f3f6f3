"""Tensor-parallel generation ranks (rl.generation_tp, loom/post/rl/async_loop.py): each group of generation_tp
generation ranks runs one engine sharded as `loom serve --nproc` shards it, keeping only its shard of the weights
broadcast to it; K=0 is the synchronous loop (whose engine is sharded over parallel.tp) bit for bit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loom.cli import main
from loom.post.rl import async_loop
from test_rl import RL
from test_rl_async import ASYNC, TIMING


def _stage(full: torch.Tensor, chunks, box_offset, box_shape) -> torch.Tensor:
    """What a generation rank keeps of `full`, sent as `chunks` ((offset, shape) each), for its box."""
    staged = torch.full(box_shape, float("nan"))
    for offset, shape in chunks:
        part = full
        for dim, (o, n) in enumerate(zip(offset, shape)):
            part = part.narrow(dim, o, n)
        part = part.contiguous().reshape(-1)  # as it arrives: flat
        where = async_loop._overlap(offset, shape, box_offset, box_shape)
        if where is not None:
            async_loop._narrow(staged, where[1]).copy_(async_loop._narrow(part.view(shape), where[0]))
    return staged


@pytest.mark.parametrize("shard_dim", [0, 1])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_tensor_parallel_rank_keeps_its_shard_of_the_broadcast_chunks(shard_dim, tp):
    """Chunks cut as training layouts cut them (FSDP rows of uneven size, tensor-parallel columns, both) land in
    each rank's shard exactly as torch.chunk cuts the whole tensor (DTensor's Shard for sizes tp divides)."""
    full = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    layouts = {
        "whole": [((0, 0), (8, 12))],
        "rows": [((0, 0), (3, 12)), ((3, 0), (5, 12))],
        "columns": [((0, 0), (8, 5)), ((0, 5), (8, 7))],
        "both": [((r, c), (n, m)) for r, n in ((0, 5), (5, 3)) for c, m in ((0, 6), (6, 6))],
    }
    for name, chunks in layouts.items():
        for rank in range(tp):
            want = full.chunk(tp, shard_dim)[rank]
            offset = [0, 0]
            offset[shard_dim] = rank * want.shape[shard_dim]
            got = _stage(full, chunks, tuple(offset), tuple(want.shape))
            assert torch.equal(got, want), (name, rank)


@pytest.mark.parametrize("extra, message", [
    (["--nproc=4", "--rl.generation_ranks=2", "--rl.generation_tp=3"],
     "rl.generation_tp=3 must divide rl.generation_ranks=2"),
    (["--nproc=5", "--rl.generation_ranks=4", "--rl.generation_tp=4"],
     "rl.generation_tp=4 cannot shard the model: it does not divide model.kv_heads=2"),
    (["--nproc=3", "--rl.generation_ranks=2", "--rl.generation_tp=0"], "rl.generation_tp"),
    (["--nproc=2", "--rl.mode=sync", "--rl.generation_tp=2"], "only rl.mode=async has"),
])
def test_bad_generation_tp_exits_2(tmp_path, capsys, extra, message):
    argv = ["rl", "--config", "tiny-grpo", "--run-dir", str(tmp_path / "run"), *[f"--{o}" for o in RL],
            "--rl.mode=async", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def _run(tmp_path, name: str, nproc: int, *extra: str) -> list[dict]:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root / "tests")}
    argv = ["rl", "--config", "tiny-grpo", "--run-dir", str(tmp_path / name), "--nproc", str(nproc),
            *[f"--{o}" for o in RL], *[a for a in ASYNC if not a.startswith("--train.threads")], *extra]
    proc = subprocess.run([sys.executable, "-m", "loom.cli", *argv], capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _same(want: list[dict], got: list[dict]) -> None:
    assert len(want) == len(got) == 4  # the starting point, 2 steps, the final evaluation
    for a, b in zip(want, got):
        for key, value in a.items():
            if key not in TIMING:
                assert b[key] == value, (a["step"], key, value, b[key])


@pytest.mark.slow  # a two-process synchronous run and a four-process async one: ~25 s idle, minutes when loaded
def test_tensor_parallel_generation_k0_equals_sync_bit_for_bit(tmp_path):
    """`loom rl --nproc 4` async with two training ranks (parallel.tp=2) and one engine group of two generation
    ranks (rl.generation_tp=2) at K=0 computes what the synchronous loop over two tensor-parallel ranks computes
    (its engine sharded the same way): losses, rewards, importance weights, evaluations. (The same async run with
    rl.generation_tp=1, whole engines, differs from it in the last bits of 12 metrics.)"""
    sync = _run(tmp_path, "sync", 2, "--parallel.tp=2")
    k0 = _run(tmp_path, "k0", 4, "--parallel.tp=2", "--rl.mode=async", "--rl.max_staleness=0",
              "--rl.generation_ranks=2", "--rl.generation_tp=2")
    _same(sync, k0)
    steps = [r for r in k0 if "loss" in r]
    assert all(r["staleness_max"] == 0 and r["stale_dropped"] == 0 for r in steps)
    assert any(r["grad_norm"] > 0 for r in steps)  # it trained


@pytest.mark.slow  # a four- and a six-process run: ~25 s idle
def test_data_parallel_ranks_dealt_to_two_engine_groups_compute_the_same(tmp_path):
    """Two FSDP training ranks: their rollouts made by one tensor-parallel engine group (generation_ranks=2) or
    dealt to two (generation_ranks=4, each group one data-parallel rank) give the same run bit for bit."""
    common = ("--parallel.dp_shard=2", "--train.micro_batch=8", "--rl.mode=async", "--rl.max_staleness=0",
              "--rl.generation_tp=2")
    one = _run(tmp_path, "one", 4, *common, "--rl.generation_ranks=2")
    two = _run(tmp_path, "two", 6, *common, "--rl.generation_ranks=4")
    _same(one, two)
    assert any(r.get("grad_norm", 0) > 0 for r in two)
