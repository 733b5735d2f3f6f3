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


@pytest.mark.slow  # four processes and two spawned generation ranks beside a two-process synchronous run: minutes
def test_tensor_parallel_generation_k0_equals_sync_bit_for_bit(tmp_path):
    """`loom rl --nproc 4` async with two training ranks (parallel.tp=2) and one engine group of two generation
    ranks (rl.generation_tp=2) at K=0 computes what the synchronous loop over two tensor-parallel ranks computes
    (its engine sharded the same way): losses, rewards, importance weights, evaluations."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root / "tests")}
    out = {}
    async_tp = ["--rl.mode=async", "--rl.max_staleness=0", "--rl.generation_ranks=2", "--rl.generation_tp=2"]
    for name, nproc, extra in (("sync", 2, []), ("k0", 4, async_tp)):
        argv = ["rl", "--config", "tiny-grpo", "--run-dir", str(tmp_path / name), "--nproc", str(nproc),
                *[f"--{o}" for o in RL], *[a for a in ASYNC if not a.startswith("--train.threads")],
                "--parallel.tp=2", *extra]
        proc = subprocess.run([sys.executable, "-m", "loom.cli", *argv], capture_output=True, text=True, env=env,
                              cwd=root)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert len(out["sync"]) == len(out["k0"]) == 4  # the starting point, 2 steps, the final evaluation
    for a, b in zip(out["sync"], out["k0"]):
        for key, value in a.items():
            if key not in TIMING:
                assert b[key] == value, (a["step"], key, value, b[key])
    steps = [r for r in out["k0"] if "loss" in r]
    assert all(r["staleness_max"] == 0 and r["stale_dropped"] == 0 for r in steps)
    assert any(r["grad_norm"] > 0 for r in steps)  # it trained
