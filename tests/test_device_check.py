"""bench/device_check.sh --smoke: the device check's steps run on the CPU at tiny shapes into one folder (and a
tar of it); a step that fails or overruns leaves its record and the run goes on."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

from conftest import ROOT

STEPS = ["setup_wheels", "versions", "predict", "train_1b", "titan_1b", "train_7b_auto", "generate_paged", "generate",
         "rl", "rl_async", "profile", "train_3b", "titan_3b", "moe", "block_tp", "serve", "host_syncs", "gpu_tests", "train_7b",
         "liger_1b"]
SMOKE_SKIPS = ("setup_wheels", "generate_paged", "rl_async", "titan_3b", "block_tp", "serve", "host_syncs", "gpu_tests",
               "liger_1b")  # other tests' smokes


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device-check")
    out, tar = tmp / "check", tmp / "check.tar.gz"
    env = dict(os.environ, PYTHON=sys.executable, LOOM_COMMIT="0123abc")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh"), str(out), "--smoke", "--tar", str(tar)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, tar, proc.stdout


def test_every_step_is_recorded_and_a_cut_off_step_does_not_stop_the_run(check):
    out, _, stdout = check
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == STEPS
    status = {s["step"]: s["status"] for s in steps}
    for name in STEPS:
        if name in SMOKE_SKIPS:
            assert status[name] == "skipped", name
        elif name != "profile":
            assert status[name] == "ok", (name, (out / f"{name}.log").read_text()[-2000:])
    # the smoke's profile step is cut off by its 2 s timeout (no mode of loom plan --profile-hardware is that
    # short on 2 cores) or finishes; either way the steps after it ran
    assert status["profile"] in ("timeout", "ok")
    if status["profile"] == "ok":
        assert json.loads((out / "profile.json").read_text())["peak_tflops"]
    assert "== " in stdout and "rl: ok" in (out / "log.txt").read_text()
    spec = json.loads((out / "generate_gpu.json").read_text())["speculative"]  # issue 57's batch-1 row, lossless
    assert spec["identical_greedy"] is True and spec["speculative_tokens_per_s"] > 0 and spec["draft_tokens"] == 4
    call = json.loads((out / "call.json").read_text())  # the call's summary: what the ledger's call row reads
    assert call["steps"] == status and call["budget_s"] == 0 and call["ok"] == sum(v == "ok" for v in status.values())
    assert call["complete"] is (status["profile"] == "ok") and call["cache"].startswith("cold")


def test_predictions_are_made_before_the_rows_and_reach_the_ledger(check, tmp_path):
    """predict runs loom plan for the loom rows before they run; the ledger keys every figure by its row name and
    attaches the prediction the plan made for that row."""
    out, _, _ = check
    sys.path.insert(0, str(ROOT / "bench"))
    import ledger

    preds = {r["row"]: r for r in json.loads((out / "predictions.json").read_text())["rows"]}
    steps = [json.loads(line)["step"] for line in (out / "steps.jsonl").read_text().splitlines()]
    assert steps.index("predict") < steps.index("train_1b")
    rows = ledger.ingest(out, gpu="cpu-smoke", ledger=tmp_path / "l.jsonl", adopt_cache=False)
    got = {(r["key"], r["figure"]): r for r in rows}
    plain = got[("train_1b/loom/plain", "tokens_per_s")]
    assert plain["predicted"] == preds["train_1b loom plain"]["predicted_tokens_per_s"]
    assert plain["commit"] == "0123abc" and plain["gpu"] == "cpu-smoke" and plain["source"].endswith("gpu_train_1b.json")
    assert got[("eager_1b/loom/plain", "step_s")]["predicted"] == preds["eager_1b loom"]["predicted_step_s"]
    for key in ("packed_1b/loom/plain", "train_7b_auto/loom/chunked16", "fp8_7b_auto/loom/chunked16", "moe/loom/chunked16",
                "train_3b/loom/chunked16", "train_1b/transformers/plain"):
        assert got[(key, "tokens_per_s")]["value"] > 0, key
    assert got[("decode/slab/b1", "decode_step_ms")]["value"] > 0 and got[("rl/grpo_1b", "step_s")]["value"] > 0
    assert got[("device_check/call", "seconds")]["value"] > 0
    again = ledger.ingest(out, gpu="cpu-smoke", ledger=tmp_path / "l.jsonl", adopt_cache=False)  # replaces, not adds
    assert len(ledger.read(tmp_path / "l.jsonl")) == len(again) == len(rows)


def test_versions_and_smi_files(check):
    out, _, _ = check
    import torch

    versions = json.loads((out / "versions.json").read_text())
    assert versions["commit"] == "0123abc" and versions["torch"] == torch.__version__
    assert versions["python"] and "transformers" in versions and "torchao" in versions
    assert (out / "smi.csv").exists() and (out / "smi_static.csv").exists()


def test_training_rows_loom_with_both_losses_and_every_peer(check):
    out, _, _ = check
    rows = json.loads((out / "gpu_train_1b.json").read_text())["runs"]  # loom's 1B rows: one process
    assert [(r["row"], r["loss_kind"]) for r in rows] == [("train_1b", "plain"), ("train_1b", "chunked"),
                                                         ("eager_1b", "plain"), ("packed_1b", "plain")]
    for row in rows:
        assert "error" not in row, row.get("traceback")
        assert row["tokens_per_s"] > 0 and row["timing_started_s"] > 0 and set(row["compile_cache"]) >= {"fxgraph_hit"}
    plain, chunked, eager, packed = rows
    assert "train.loss_chunk=0" in plain["settings"] and "train.loss_chunk=16" in chunked["settings"]
    assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-5) and eager["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert "train.compile=false" in eager["settings"]
    assert packed["packing"].startswith("documents of 6-18 tokens") and packed["loss"] != pytest.approx(plain["loss"])
    assert plain["timing_started_s"] < chunked["timing_started_s"] < eager["timing_started_s"]  # one process, in order
    peers = {r["framework"]: r for r in json.loads((out / "gpu_train_titan_1b.json").read_text())["runs"]}
    assert list(peers) == ["torchtitan-0.3.0", "torchtitan-0.2.2", "transformers+liger", "transformers"]
    for version in ("0.3.0", "0.2.2"):  # no torchtitan on this machine's path: error rows, the next row still ran
        assert f"torchtitan {version} is not installed" in peers[f"torchtitan-{version}"]["error"]
    assert "CUDA" in peers["transformers+liger"]["error"]
    assert "error" not in peers["transformers"] and peers["transformers"]["row"] == "train_1b"
    three = json.loads((out / "gpu_train_3b.json").read_text())["runs"]
    assert [r["loss_kind"] for r in three] == ["plain", "chunked"]
    assert all("recompute.mode=full" in r["settings"] and "error" not in r for r in three)


def test_fp8_generate_and_rl_rows(check):
    out, _, _ = check
    bf16, fp8 = json.loads((out / "gpu_train_7b.json").read_text())["runs"]
    auto, fp8_auto = json.loads((out / "gpu_train_7b_auto.json").read_text())["runs"]
    for row in (bf16, fp8, auto, fp8_auto):
        assert "error" not in row, row.get("traceback")
        assert row["loss_kind"] == "chunked" and row["tokens_per_s"] > 0
    assert "recompute.mode=full" in bf16["settings"] and "recompute.mode=auto" in auto["settings"]
    assert auto["micro_batch"] == 1 and auto["recompute_plan"]
    assert "train.fp8=rowwise" in fp8["settings"] and "train.fp8=off" in bf16["settings"]
    assert "train.fp8=rowwise" in fp8_auto["settings"] and (fp8["row"], fp8_auto["row"]) == ("fp8_7b", "fp8_7b_auto")
    (moe,) = json.loads((out / "gpu_train_moe.json").read_text())["runs"]
    assert "error" not in moe and "model.moe.experts=8" in moe["settings"] and moe["tokens_per_s"] > 0
    generate = json.loads((out / "generate_gpu.json").read_text())
    assert generate["kv"] == "slab" and [r["batch"] for r in generate["rows"]] == [1, 4]
    assert all(r["decode_step_ms"] > 0 and r["prefill_s"] > 0 for r in generate["rows"])
    rl = json.loads((out / "rl_gpu.json").read_text())  # loom rl's steps, each split into its phases
    assert [r["step"] for r in rl["rows"]] == [1, 2, 3] and rl["summary"]["steps"] == 2
    for r in rl["rows"]:
        phases = ("generation_s", "reward_s", "logprobs_s", "training_s", "refit_s")
        assert r["generation_s"] > 0 and r["training_s"] > 0 and sum(r[k] for k in phases) <= r["step_s"] + 5e-4


def test_rl_step_is_the_rl_bench_smoke(check):
    """The rl step runs `bench/rl_gpu.py --smoke`: its report passes every check of test_bench_rl_gpu.py's smoke
    (which runs the same command on its own in make test-all)."""
    from test_bench_rl_gpu import check_smoke

    out, _, _ = check
    check_smoke(json.loads((out / "rl_gpu.json").read_text()), out)


def test_the_tar_holds_the_folder(check):
    out, tar, _ = check
    with tarfile.open(tar) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {p.name for p in out.iterdir()} <= names | {"log.txt"}  # log.txt's last line may follow the last tar
    assert {"versions.json", "predictions.json", "gpu_train_1b.json", "gpu_train_titan_1b.json", "gpu_train_3b.json",
            "gpu_train_7b.json", "gpu_train_7b_auto.json", "gpu_train_moe.json", "generate_gpu.json",
            "rl_gpu.json", "steps.jsonl", "smi.csv", "call.json"} <= names


def test_only_runs_the_named_steps_and_the_budget_skips_what_it_cannot_hold(tmp_path):
    """--only: setup, versions and predict run, every measurement step not named is recorded as skipped; --budget:
    a step that would start with under 20 s of the call's budget left is skipped, and the call is not complete."""
    out = tmp_path / "check"
    env = dict(os.environ, PYTHON=sys.executable, LOOM_COMMIT="0123abc")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh"), str(out), "--smoke", "--only", "train_1b",
                           "--budget", "25"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == STEPS
    status = {s["step"]: (s["status"], s["note"]) for s in steps}
    assert status["versions"][0] == status["predict"][0] == "ok"
    assert status["train_1b"][0] == "skipped" and status["train_1b"][1].startswith("budget: ")
    for name in STEPS[4:]:
        if name not in SMOKE_SKIPS:
            assert status[name] == ("skipped", "not in --only"), name
    call = json.loads((out / "call.json").read_text())
    assert call["complete"] is False and call["budget_s"] == 25
    bad = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh"), str(tmp_path / "x"), "--budget", "soon"],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert bad.returncode == 2 and "--budget takes whole seconds" in bad.stderr
