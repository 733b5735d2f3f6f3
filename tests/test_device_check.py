"""bench/device_check.sh --smoke: the device check's steps run on the CPU at tiny shapes into one folder (and a
tar of it); a step that fails or overruns leaves its record and the run goes on."""

import json
import os
import subprocess
import sys
import tarfile

import pytest

from conftest import ROOT

STEPS = ["setup_wheels", "versions", "gpu_tests", "train_1b", "packed_1b", "eager_1b", "train_3b", "moe", "train_7b", "fp8_7b",
         "train_7b_auto", "fp8_7b_auto", "fp8_7b_tw", "profile", "generate", "generate_paged", "rl", "serve"]


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
    for name in ("versions", "train_1b", "packed_1b", "train_3b", "moe", "train_7b", "fp8_7b", "generate", "rl"):
        assert status[name] == "ok", (name, (out / f"{name}.log").read_text()[-2000:])
    assert status["setup_wheels"] == status["gpu_tests"] == "skipped"  # the wheels and CUDA tests are the GPU's
    assert status["generate_paged"] == status["serve"] == "skipped"  # their smokes are other tests' (the notes say)
    assert status["train_7b_auto"] == status["fp8_7b_auto"] == status["fp8_7b_tw"] == status["eager_1b"] == "skipped"
    # the smoke's profile step is cut off by its 5 s timeout (no mode of loom plan --profile-hardware is that
    # short on 2 cores) or finishes; either way the generate step after it ran
    assert status["profile"] in ("timeout", "ok")
    if status["profile"] == "ok":
        assert json.loads((out / "profile.json").read_text())["peak_tflops"]
    assert "== " in stdout and "rl: ok" in (out / "log.txt").read_text()


def test_versions_and_smi_files(check):
    out, _, _ = check
    import torch

    versions = json.loads((out / "versions.json").read_text())
    assert versions["commit"] == "0123abc" and versions["torch"] == torch.__version__
    assert versions["python"] and "transformers" in versions and "torchao" in versions
    assert (out / "smi.csv").exists() and (out / "smi_static.csv").exists()


@pytest.mark.parametrize("name, recompute", [("gpu_train_1b", "none"), ("gpu_train_3b", "full")])
def test_training_rows_loom_with_both_losses_missing_torchtitan_is_an_error_row(check, name, recompute):
    out, _, _ = check
    report = json.loads((out / f"{name}.json").read_text())
    rows = report["runs"]
    assert [r["framework"] for r in rows] == ["loom", "loom", "transformers+liger", "torchtitan-0.3.0",
                                              "torchtitan-0.2.2", "transformers"]
    for row in rows:
        assert row["loss_kind"] in ("plain", "chunked", "fused_linear_ce") and row["loss_setting"]
        assert row["recompute"] == recompute
    plain, chunked = rows[0], rows[1]
    for row in (plain, chunked):
        assert "error" not in row, row.get("traceback")
        assert row["tokens_per_s"] > 0 and row["step_s"] > 0 and f"recompute.mode={recompute}" in row["settings"]
    assert "train.loss_chunk=0" in plain["settings"] and plain["loss_kind"] == "plain"
    assert "train.loss_chunk=16" in chunked["settings"] and chunked["loss_kind"] == "chunked"
    assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    # no torchtitan on this machine's path, no CUDA for Liger: error rows, and the row after them still ran
    titan = {r["framework"]: r for r in rows if r["framework"].startswith("torchtitan")}
    for version in ("0.3.0", "0.2.2"):
        assert f"torchtitan {version} is not installed" in titan[f"torchtitan-{version}"]["error"]
    assert "CUDA" in rows[2]["error"]
    assert "error" not in rows[-1] and rows[-1]["tokens_per_s"] > 0


def test_fp8_generate_and_rl_rows(check):
    out, _, _ = check
    (bf16,) = json.loads((out / "gpu_train_7b.json").read_text())["runs"]
    (fp8,) = json.loads((out / "gpu_train_fp8_7b.json").read_text())["runs"]
    for row in (bf16, fp8):
        assert "error" not in row, row.get("traceback")
        assert row["loss_kind"] == "chunked" and row["tokens_per_s"] > 0 and "recompute.mode=full" in row["settings"]
    assert "train.fp8=rowwise" in fp8["settings"] and "train.fp8=off" in bf16["settings"]
    (moe,) = json.loads((out / "gpu_train_moe.json").read_text())["runs"]
    assert "error" not in moe and "model.moe.experts=8" in moe["settings"] and moe["tokens_per_s"] > 0
    (packed,) = json.loads((out / "gpu_train_packed_1b.json").read_text())["runs"]
    assert "error" not in packed and packed["packing"].startswith("documents of 6-18 tokens") and packed["loss"] > 0
    generate = json.loads((out / "generate_gpu.json").read_text())
    assert generate["kv"] == "slab" and [r["batch"] for r in generate["rows"]] == [1, 4]
    assert all(r["decode_step_ms"] > 0 and r["prefill_s"] > 0 for r in generate["rows"])
    rl = json.loads((out / "rl_gpu.json").read_text())  # loom rl's steps, each split into its phases
    assert [r["step"] for r in rl["rows"]] == [1, 2, 3] and rl["summary"]["steps"] == 2
    for r in rl["rows"]:
        phases = ("generation_s", "reward_s", "logprobs_s", "training_s", "refit_s")
        assert r["generation_s"] > 0 and r["training_s"] > 0 and sum(r[k] for k in phases) <= r["step_s"] + 5e-4


def test_the_tar_holds_the_folder(check):
    out, tar, _ = check
    with tarfile.open(tar) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {p.name for p in out.iterdir()} <= names | {"log.txt"}  # log.txt's last line may follow the last tar
    assert {"versions.json", "gpu_train_1b.json", "gpu_train_3b.json", "gpu_train_7b.json", "gpu_train_fp8_7b.json",
            "gpu_train_packed_1b.json", "generate_gpu.json",
            "rl_gpu.json", "steps.jsonl", "smi.csv"} <= names


def test_only_runs_the_named_steps(tmp_path):
    """--only: setup and versions run, every measurement step not named is recorded as skipped."""
    out = tmp_path / "check"
    env = dict(os.environ, PYTHON=sys.executable, LOOM_COMMIT="0123abc")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device_check.sh"), str(out), "--smoke", "--only", "nothing"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == STEPS
    status = {s["step"]: (s["status"], s["note"]) for s in steps}
    assert status["versions"][0] == "ok"
    for name in STEPS[3:]:
        if name not in ("generate_paged", "serve", "train_7b_auto", "fp8_7b_auto", "fp8_7b_tw", "eager_1b"):  # --smoke skips
            assert status[name] == ("skipped", "not in --only"), name
