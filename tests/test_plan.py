"""The planner: validation against published runs, the speed bar, the contract, bad input."""

from __future__ import annotations

import json
import time

import pytest
from conftest import run_cli

from loom.config import load_config
from loom.planner.costmodel import GIB, Layout, Workload, evaluate, memory, total_params
from loom.planner.hardware import PRESETS
from loom.planner.search import search
from loom.planner.validation import predict as predict_run
from loom.planner.validation import published_runs

A100 = PRESETS["a100-80gb"]


PUBLISHED = {name: run[:3] for name, run in published_runs().items()}


def predict(name):
    w, fixed, _ = PUBLISHED[name]
    found = predict_run(w, fixed)
    assert found is not None, f"{name}: the published layout is predicted not to fit"
    return found


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_runs_within_15_percent(name):
    best = predict(name)
    published = PUBLISHED[name][2]
    assert best.fits
    assert best.step_time_s == pytest.approx(published, rel=0.15), (name, best.step_time_s, published)


def test_published_step_times_are_what_the_papers_say():
    # Independent arithmetic on the papers' numbers, so the targets above cannot drift.
    assert PUBLISHED["narayanan-1.7b"][2] == pytest.approx(3.528, rel=1e-3)
    assert PUBLISHED["narayanan-145.6b"][2] == pytest.approx(24.82, rel=1e-3)
    assert PUBLISHED["nemo-llama2-7b-fp8"][2] == pytest.approx(3.870, rel=1e-3)


def test_recompute_costs_what_the_paper_says():
    # Full recomputation repeats the forward: about 4/3 of the matmul time of no recomputation (Table 4's
    # 18.13 / 13.75 also includes fixed costs); selective adds only the attention core.
    w, fixed, _ = PUBLISHED["korthikanti-175b-selective"]
    base = dict(fixed, schedule="1f1b")
    none = evaluate(w, Layout(**dict(base, recompute="none")))
    sel = evaluate(w, Layout(**base))
    full = evaluate(w, Layout(**dict(base, recompute="full")))
    assert full.time_terms["gemm"] / none.time_terms["gemm"] == pytest.approx(4 / 3, rel=1e-6)
    assert sel.time_terms["gemm"] == none.time_terms["gemm"]
    assert none.step_time_s < sel.step_time_s < full.step_time_s
    # Activation memory: selective drops the 5as/h term of sbh(34 + 5as/h); full keeps only the layer input.
    s, h, a, t = 2048, 12288, 96, 8
    per_layer = {"none": 34 + 5 * a * s / h, "selective": 34, "full": 2}
    for lay, key in ((none, "none"), (sel, "selective"), (full, "full")):
        expected = s * h * per_layer[key] / t * (96 // 8) * 8  # 12 layers per stage, 8 micro-batches in flight
        assert lay.memory["activations"] == pytest.approx(expected, rel=0.01), key


def test_speed_gpt3_175b_on_1024_a100():
    w = Workload(load_config("gpt3-175b").model, 2048, 1536, 1024, A100)
    start = time.perf_counter()
    found, info = search(w, top=5)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, elapsed
    assert info["considered"] > 10000 and found
    assert all(a.step_time_s <= b.step_time_s for a, b in zip(found, found[1:]))
    assert all(e.fits and e.memory["total"] <= A100.memory_gib * GIB for e in found)


def test_memory_model_matches_loom_measurements():
    from loom.memory import measure_activations

    cfg = load_config("tiny", ["train.dtype=bfloat16", "model.layers=2", "model.hidden=256", "model.heads=8",
                               "model.ffn_hidden=688", "model.vocab_size=1024", "train.seq_len=128",
                               "train.micro_batch=2", "train.global_batch=2"])
    measured = measure_activations(cfg, device="cpu")
    w = Workload(cfg.model, 128, 2, 1, A100)
    mem = memory(w, Layout(micro_batch=2, dp_style="replicate"))
    assert mem["activations"] == pytest.approx(2 * measured["layer_activation_bytes"], rel=0.01)
    # Parameters counted exactly (the live module), 4 bytes each for fp32 master weights.
    from loom.models.llama import build_model

    live = sum(p.numel() for p in build_model(cfg.model, "cpu").parameters())
    assert total_params(cfg.model) == live
    assert mem["params"] == 4 * live and mem["grads"] == 4 * live and mem["optimizer"] == 8 * live


def test_sharding_styles_divide_what_they_should():
    w = Workload(load_config("llama2-7b").model, 4096, 128, 8, PRESETS["h100"])
    p = total_params(w.model)
    rep = memory(w, Layout(dp=8, dp_style="replicate"))
    dist = memory(w, Layout(dp=8, dp_style="distopt"))
    fsdp = memory(w, Layout(dp=8, micro_batch=16, dp_style="fsdp"))  # one micro-batch: sharded gradients
    assert rep["params"] + rep["grads"] + rep["optimizer"] == pytest.approx(16 * p)
    assert dist["params"] + dist["grads"] + dist["optimizer"] == pytest.approx((2 + 4 + 12 / 8) * p)
    assert fsdp["params"] + fsdp["grads"] + fsdp["optimizer"] == pytest.approx(16 * p / 8)
    bf16 = memory(Workload(w.model, 4096, 128, 8, PRESETS["h100"], state_dtype="bfloat16"), Layout(dp=8, dp_style="replicate"))
    assert bf16["optimizer"] == pytest.approx(4 * p)


def test_cli_json_contract_and_layout():
    r = run_cli("plan", "--model", "gpt3-175b", "--gpus", "64", "--gpu", "a100-80gb", "--global-batch", "64",
                "--json", "--top", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["candidates"]) == 3
    keys = {"tp", "pp", "vpp", "dp", "cp", "ep", "micro_batch", "sp", "recompute", "step_time_s",
            "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "memory_gib", "fits"}
    for c in out["candidates"]:
        assert keys <= set(c)
        assert {"params", "grads", "optimizer", "activations", "total"} <= set(c["memory_gib"])
        assert c["tp"] * c["pp"] * c["dp"] * c["cp"] == 64
        assert c["fits"] and c["memory_gib"]["total"] <= A100.memory_gib
        # Consistency of the reported rates with the step time.
        assert c["tokens_per_s_per_gpu"] == pytest.approx(64 * 2048 / c["step_time_s"] / 64, rel=1e-3)
    steps = [c["step_time_s"] for c in out["candidates"]]
    assert steps == sorted(steps)
    r = run_cli("plan", "--model", "gpt3-175b", "--gpus", "64", "--gpu", "a100-80gb", "--global-batch", "64",
                "--layout", "tp=8,pp=8,dp=1,mbs=1,sp=true,recompute=selective", "--json")
    assert r.returncode == 0, r.stderr
    (one,) = json.loads(r.stdout)["candidates"]
    assert (one["tp"], one["pp"], one["dp"], one["micro_batch"], one["sp"], one["recompute"]) == (8, 8, 1, 1, True, "selective")
    assert one["fits"]


@pytest.mark.parametrize("args, needle", [
    (["--model", "gpt3-175b", "--gpus", "64", "--gpu", "b300"], "neither a preset"),
    (["--model", "gpt3-175b", "--gpus", "64", "--layout", "tp=8,pp=4,dp=1"], "must equal the GPU count"),
    (["--model", "gpt3-175b", "--gpus", "60", "--global-batch", "60", "--layout", "tp=5,pp=1"], "tp=5 must divide heads"),
    (["--model", "gpt3-175b", "--gpus", "64", "--layout", "tp=8,zz=1"], "unknown"),
    (["--model", "gpt3-175b", "--gpus", "8", "--gpu", "a100-40gb", "--global-batch", "8"], "no layout"),
    (["--model", "gpt3-175b", "--gpus", "8", "--precision", "fp8", "--gpu", "a100-80gb"], "not supported by a100"),
    (["--layers", "4", "--gpus", "8"], "missing"),
    (["--model", "gpt3-175b", "--gpus", "0"], "must be >= 1"),
    (["--model", "gpt3-175b", "--gpus", "8", "--gpu", "missing.json"], "no such file"),
])
def test_bad_input_exits_2(args, needle):
    r = run_cli("plan", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_config_written_for_the_winner_trains(tmp_path):
    out = tmp_path / "plan.toml"
    r = run_cli("plan", "--model", "tiny", "--gpus", "2", "--gpu", "a100-80gb", "--global-batch", "4", "--seq", "64",
                "--config", str(out))
    assert r.returncode == 0, r.stderr
    cfg = load_config(str(out))
    assert cfg.parallel.world_size == 2 and cfg.train.global_batch == 4 and cfg.train.seq_len == 64
    r = run_cli("train", "--config", str(out), "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                "--train.steps=2", "--train.dtype=float32", "--train.device=cpu", "--train.eval_samples=2",
                "--checkpoint.save_final=false", "--data.corpus_max_bytes=300000")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len([json.loads(x) for x in lines if '"loss"' in x]) >= 2


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    r = run_cli("plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch", "64", "--top", "4", "--plot", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_inference_pareto_front_and_decode_physics():
    from loom.planner.inference import evaluate_inference, search_inference

    w = Workload(load_config("llama2-7b").model, 4096, 1, 8, PRESETS["h100"])
    results = search_inference(w, 1024, 256, 64)
    front = [e for e in results if e.pareto]
    assert len(front) >= 2
    assert all(a.request_latency_s <= b.request_latency_s and a.tokens_per_s_per_gpu < b.tokens_per_s_per_gpu
               for a, b in zip(front, front[1:]))
    def dominates(a, b):
        return (a.request_latency_s <= b.request_latency_s and a.tokens_per_s_per_gpu >= b.tokens_per_s_per_gpu
                and (a.request_latency_s, a.tokens_per_s_per_gpu) != (b.request_latency_s, b.tokens_per_s_per_gpu))

    for e in results:  # the front is exactly the set of undominated layouts
        if e.pareto:
            assert not any(dominates(o, e) for o in results)
        else:
            assert any(dominates(f, e) or (f.request_latency_s, f.tokens_per_s_per_gpu)
                       == (e.request_latency_s, e.tokens_per_s_per_gpu) for f in front)
    # Decode at batch 1 is bandwidth-bound: about the weights over the HBM bandwidth.
    one = evaluate_inference(w, 1, 1, 1, 1024, 256)
    weights = 2 * total_params(w.model)
    bound = weights / (PRESETS["h100"].hbm_gbps * 1e9)
    assert bound < one.decode_step_s < 1.6 * bound
    # KV cache: 2 (K, V) x layers x kv heads x head dim x 2 bytes x tokens.
    m = w.model
    assert one.kv_cache_gib * GIB == pytest.approx(2 * m.layers * m.kv_heads * m.head_dim * 2 * (1024 + 256))
    r = run_cli("plan", "--model", "llama2-7b", "--gpus", "8", "--inference", "--input-len", "1024",
                "--output-len", "256", "--batch", "64", "--json")
    assert r.returncode == 0, r.stderr
    assert all(c["pareto"] for c in json.loads(r.stdout)["candidates"])


def test_profile_hardware_round_trip(tmp_path):
    out = tmp_path / "cpu.json"
    r = run_cli("plan", "--profile-hardware", str(out), "--quick")
    assert r.returncode == 0, r.stderr
    prof = json.loads(out.read_text())
    assert prof["gemm"]["fp32"] and prof["hbm_gbps"] > 0 and prof["peak_tflops"]["fp32"] > 0
    r = run_cli("plan", "--model", "tiny", "--gpus", "1", "--gpu", str(out), "--precision", "fp32",
                "--global-batch", "16", "--json", "--top", "1")
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)["candidates"][0]
    assert best["step_time_s"] > 0 and best["fits"]
