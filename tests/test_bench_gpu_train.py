"""bench/gpu_train.py keeps running: its --smoke mode (tiny shape, CPU) trains loom with both loss settings, each
row in its own process, and reports numbers that follow from the FLOP formula; a framework that is missing or
overruns gets an error row and the others go on. With LOOM_TORCHTITAN_SITES set (folders holding torchtitan
0.3.0 / 0.2.2 and their needs, see bench/DEVICE.md) the torchtitan rows are checked too."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT, bench_smoke
from loom.config import ModelConfig
from loom.flops import train_flops_per_token

BENCH = ROOT / "bench" / "gpu_train.py"


def run_bench(tmp_path, *args, env=None):
    return bench_smoke("gpu_train.py", tmp_path, *args, env=env)


def check_flops(row):
    assert row["tokens_per_step"] == 64 and row["step_s"] == sorted(row["step_times_s"])[1]  # median of 2
    tps = 64 / row["step_s"]
    assert row["tokens_per_s"] == pytest.approx(tps, abs=0.051)
    cfg = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=512, max_seq_len=32)
    noncausal = tps * train_flops_per_token(cfg, 32) / 1e12
    assert row["tflops_noncausal"] == pytest.approx(noncausal, rel=1e-3)
    # causal attention: half of the scores and values (4 s h FLOPs per layer forward, x3 for training)
    causal = noncausal - tps * 3 * 2 * 4 * 32 * 64 / 2 / 1e12
    assert row["tflops_causal"] == pytest.approx(causal, rel=1e-3)
    assert row["mfu_causal"] == pytest.approx(row["tflops_causal"] / 989.0, rel=1e-3)


def test_gpu_train_bench_smoke_runs_loom_with_both_losses_and_keeps_going(tmp_path):
    # torchtitan-0.2.2 is pointed at an empty folder: it is not installed there, its row says so
    report = run_bench(tmp_path, "--frameworks", "loom,torchtitan-0.2.2", "--pythonpath",
                       f"torchtitan-0.2.2={tmp_path}")
    assert report["machine"]["torch"] and report["machine"]["device"] == "cpu"
    rows = report["runs"]
    assert [r["framework"] for r in rows] == ["loom", "loom", "torchtitan-0.2.2"]
    plain, chunked, titan = rows
    for row in (plain, chunked):
        assert "error" not in row, row.get("traceback")
        check_flops(row)
    assert "train.loss_chunk=0" in plain["settings"] and "train.loss_chunk=16" in chunked["settings"]
    assert (plain["loss_kind"], chunked["loss_kind"]) == ("plain", "chunked")
    assert "train.loss_chunk=0" in plain["loss_setting"] and "computed in forward" in chunked["loss_setting"]
    # the same model and tokens: the chunked loss is the same mean cross-entropy, near ln(vocab) at random init
    assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert plain["loss"] == pytest.approx(math.log(512), rel=0.1)
    assert "torchtitan 0.2.2 is not installed" in titan["error"]
    assert titan["loss_kind"] == "plain" and "tokens_per_s" not in titan


def test_gpu_train_bench_row_past_its_timeout_is_an_error_row(tmp_path):
    report = run_bench(tmp_path, "--frameworks", "transformers", "--row-timeout", "0.5")
    (row,) = report["runs"]
    assert row["error"] == "timed out after --row-timeout 0.5 s" and "tokens_per_s" not in row


def titan_sites() -> dict[str, str]:
    """LOOM_TORCHTITAN_SITES="torchtitan-0.3.0=DIR,torchtitan-0.2.2=DIR" (each torchtitan in its own folder),
    LOOM_TORCHTITAN_COMMON=DIR (their needs: bench/device_wheels.txt's common group)."""
    spec = os.environ.get("LOOM_TORCHTITAN_SITES", "")
    return dict(item.split("=", 1) for item in spec.split(",") if "=" in item)


@pytest.mark.parametrize("framework", ["torchtitan-0.3.0", "torchtitan-0.2.2"])
def test_torchtitan_rows_on_cpu(tmp_path, framework):
    site = titan_sites().get(framework)
    if not site:
        pytest.skip(f"LOOM_TORCHTITAN_SITES names no folder for {framework} (bench/DEVICE.md: checking the wheels)")
    env = dict(os.environ)
    common = (os.environ.get("LOOM_TORCHTITAN_COMMON"), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in common if p)
    for recompute in ("none", "full"):
        report = run_bench(tmp_path, "--frameworks", framework, "--recompute", recompute,
                           "--pythonpath", f"{framework}={site}", env=env)
        (row,) = report["runs"]
        assert "error" not in row, row.get("traceback")
        check_flops(row)
        assert row["framework_version"] == framework.split("-")[1] and row["recompute"] == recompute
        assert math.isfinite(row["loss"]) and row["settings"] and row["notes"]
        assert row["loss_kind"] == ("chunked" if framework == "torchtitan-0.3.0" else "plain")
    # its model at the real shapes, built on the meta device, holds exactly the Llama-3.2 parameters
    probe = ("import json, sys, torch; sys.path.insert(0, 'bench'); import gpu_train as g; "
             f"v = {framework.split('-')[1]!r}; g.torchtitan_version(v); "
             "v == '0.3.0' and g.torch_compat_for_torchtitan_030(); "
             "build = (lambda s: g.build_titan_030(s, 4096, torch.device('cuda'))[1]) if v == '0.3.0' "
             "else (lambda s: g.build_titan_022(s, 4096)[1]); "
             "print(json.dumps({s: sum(p.numel() for p in build(s).parameters()) "
             "for s in ('llama3.2-1b', 'llama3.2-3b')}))")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    # Llama-3.2-1B and -3B (tied embeddings): 1,235,814,400 and 3,212,749,824 parameters
    assert counts == {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824}


def test_llama2_7b_shape_is_the_published_model():
    """The 7B row's shape (issue 39) holds Llama-2-7b-hf's 6,738,415,616 parameters (its config.json: untied
    head, 32 heads of 128, MLP 11008, vocabulary 32000), counted by the bench and by loom's model on meta."""
    import importlib.util

    import torch

    from loom.models.llama import build_model

    spec = importlib.util.spec_from_file_location("gpu_train", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["gpu_train"] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    assert bench.llama_params("llama2-7b") == 6_738_415_616
    assert bench.llama_params("llama3.2-1b") == 1_235_814_400  # tied head: Llama-3.2-1B's count
    cfg = bench.model_config("llama2-7b", 4096)
    assert not cfg.tie_embeddings and cfg.rope_theta == 10000.0
    model = build_model(cfg, device=torch.device("meta"))
    assert bench.check_params(model, "llama2-7b", "loom") == 6_738_415_616
    # the MoE row's shape: Qwen3-30B-A3B's layer (128 experts of 768, heads of 128, q/k norm) x 4, untied head
    moe = bench.model_config("qwen3-30b-a3b-4l", 4096)
    assert moe.moe.experts == 128 and moe.moe.top_k == 8 and moe.head_dim == 128 and moe.qk_norm
    layer = 2048 * 4096 * 2 + 2048 * 512 * 2 + 128 * 3 * 2048 * 768 + 2048 * 128 + 2 * 2048 + 2 * 128
    n = sum(p.numel() for p in build_model(moe, device=torch.device("meta")).parameters())
    assert n == 2 * 151936 * 2048 + 4 * layer + 2048 == 3_114_814_464


def test_gpu_train_auto_recompute_row_plans_layers_and_accumulates_micro_batches(tmp_path):
    """The 7B item-5 rows' settings on the tiny shape: `--recompute auto` plans per layer for the memory given
    (here one that holds the states and one layer's activations kept whole, not two), `--micro-batch 1` runs the
    step's two sequences as two micro-batches; the row says both."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_train", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["gpu_train"] = bench
    spec.loader.exec_module(bench)
    out = tmp_path / "auto.json"
    assert bench.main(["--smoke", "--in-process", "--frameworks", "loom", "--recompute", "auto",
                       "--recompute-memory-gib", "0.0021", "--loss-chunk", "0", "--micro-batch", "1",
                       "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["runs"]
    assert "error" not in row and row["micro_batch"] == 1 and row["batch"] == 2
    assert row["recompute_plan"].startswith("recompute.mode=auto: 1 none, 1 full")
    assert "train.micro_batch=1" in row["settings"] and "recompute.mode=auto" in row["settings"]
    with pytest.raises(SystemExit, match="give --frameworks loom"):
        bench.main(["--smoke", "--in-process", "--frameworks", "loom,transformers", "--recompute", "auto"])
