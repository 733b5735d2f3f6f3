"""bench/rl_gpu.py keeps running: its --smoke mode (tiny model, fp32, CPU) runs `loom rl` end to end and turns
each step of its metrics.jsonl into a row whose phases add up to no more than the step; a run that fails, runs
past --timeout or is terminated keeps the rows it finished and ends with an error row."""

import importlib.util
import json
import os
import signal
import statistics
import sys

import pytest

from conftest import ROOT

PHASES = ("generation_s", "reward_s", "logprobs_s", "training_s", "refit_s")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("rl_gpu", ROOT / "bench" / "rl_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_smoke(report, folder):
    """What `rl_gpu.py --smoke --out FOLDER/F.json` wrote: also checked on the device check's smoke run
    (tests/test_device_check.py runs the same command as its rl step)."""
    rows = report["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["warmup"] for r in rows] == [True, False, False]
    settings = report["settings"]
    assert {"rl.group_size=4", "rl.max_new_tokens=8", "train.global_batch=8", "rl.kl_coef=0.001"} <= set(settings)
    for r in rows:
        assert "error" not in r
        # every phase ran and was timed: generation, the old and reference log-probs, the update, the refit
        assert all(r[k] > 0 for k in ("generation_s", "logprobs_s", "training_s", "refit_s")) and r["reward_s"] >= 0
        parts = sum(r[k] for k in PHASES)
        assert parts <= r["step_s"] + 5e-4  # the split adds up to no more than the step (values rounded to 1e-4)
        assert r["other_s"] == pytest.approx(r["step_s"] - parts, abs=6e-4)
        # 2 prompts x 4 completions of up to 8 tokens (a completion may stop early at <|endoftext|>)
        assert 0 < r["generated_tokens"] <= 64 and r["generated_tokens"] == round(8 * r["response_tokens_mean"])
        assert r["generation_tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["generation_s"], rel=0.02)
        assert r["generation_share"] == pytest.approx(r["generation_s"] / r["step_s"], rel=0.01)
        assert 0 <= r["reward"] <= 1
    measured = rows[1:]
    s = report["summary"]
    assert s["steps"] == 2
    assert s["step_s_median"] == pytest.approx(statistics.median(r["step_s"] for r in measured), abs=1e-4)
    gen, step = sum(r["generation_s"] for r in measured), sum(r["step_s"] for r in measured)
    assert s["generation_share"] == pytest.approx(gen / step, abs=1e-3)
    assert s["generation_tokens_per_s"] == pytest.approx(sum(r["generated_tokens"] for r in measured) / gen, rel=1e-3)
    assert s["generation_share"] + sum(s[k.replace("_s", "_share")] for k in PHASES[1:]) <= 1.001
    assert report["machine"]["cpu"] and report["torch"] and report["commit"] and "--smoke" in report["command"]
    assert report["startup_s"] > 0 and report["model"]["layers"] == 2
    assert (folder / report["loom_rl_log"]).is_file()  # loom rl's own output, beside the JSON


# make test-all: test_device_check.py's test_rl_step_is_the_rl_bench_smoke checks the same command's report
@pytest.mark.slow
def test_rl_gpu_bench_smoke(bench, tmp_path):
    out = tmp_path / "smoke.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    check_smoke(json.loads(out.read_text()), tmp_path)


@pytest.mark.slow
def test_rl_gpu_bench_async_smoke(bench, tmp_path):
    """--mode async: loom rl --nproc 2 with rl.mode=async (one generation process), the same rows plus the
    staleness and the trainer's wait for its rollouts (K=1: the policy one step behind after the first)."""
    out = tmp_path / "smoke.json"
    assert bench.main(["--smoke", "--mode", "async", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert report["mode"] == "async" and "rl.mode=async" in report["settings"]
    assert [r["step"] for r in rows] == [1, 2, 3] and report["summary"]["steps"] == 2
    for r in rows:
        assert "error" not in r and 0 < r["generated_tokens"] <= 64 and r["training_s"] > 0
        assert r["generation_tokens_per_s"] is None  # generation_s is the trainer's wait: no rate from it
        assert r["generation_s"] == pytest.approx(r["rollout_wait_s"], abs=2e-3)
    assert [r["staleness_mean"] for r in rows] == [0.0, 1.0, 1.0]  # step 1 from the start's weights


FAKE = """import json, sys, time
row = {{"step_time_s": 1.0, "generation_s": 0.6, "reward_s": 0.01, "logprobs_s": 0.1, "training_s": 0.2,
       "refit_s": 0.01, "generated_tokens": 100, "response_length": 12.5}}
with open(sys.argv[1], "a") as f:
    for step in (1, 2):
        f.write(json.dumps({{"step": step, **row}}) + "\\n")
    f.write(json.dumps({{"step": 2, "val_reward": 0.5}}) + "\\n")  # an evaluation row: not a step
    f.write('{{"step": 3, "gen')  # a line still being written
    f.flush()
print("loom rl's last words")
{end}
"""


@pytest.mark.parametrize("end, error", [
    ("sys.exit(3)", "loom rl exited with 3: loom rl's last words"),
    ("time.sleep(60)", "cut off: loom rl still running after --timeout 1.5 s"),
    ("import os, signal; os.kill(os.getppid(), signal.SIGTERM); time.sleep(60)", "cut off: this script was terminated"),
])
def test_a_failed_or_cut_off_run_keeps_its_finished_rows(bench, tmp_path, end, error):
    metrics, out = tmp_path / "metrics.jsonl", tmp_path / "out.json"
    cmd = [sys.executable, "-S", "-c", FAKE.format(end=end), str(metrics)]  # -S: a quick start
    result = {"benchmark": "rl_gpu"}
    terms = []
    previous = signal.signal(signal.SIGTERM, lambda *_: terms.append(1))  # if the bench caught none: no kill
    try:
        code = bench.run_and_collect(cmd, dict(os.environ), metrics, tmp_path / "log.txt", out, result, warmup=1,
                                     timeout=1.5, poll=0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not terms  # the bench's own handler took the signal, and gave the previous one back
    assert signal.getsignal(signal.SIGTERM) is previous
    report = json.loads(out.read_text())
    assert report == result
    steps, last = report["rows"][:-1], report["rows"][-1]
    assert [(r["step"], r["warmup"], r["other_s"], r["generation_tokens_per_s"]) for r in steps] == [
        (1, True, 0.08, 166.7), (2, False, 0.08, 166.7)]
    assert last["error"].startswith(error) and code != 0
    assert report["summary"]["steps"] == 1 and report["summary"]["generation_share"] == 0.6


def test_the_run_is_ended_once_its_last_step_is_in(bench, tmp_path):
    """What loom does after the last step (its final evaluation) is not waited for: no error row, exit 0."""
    metrics, out = tmp_path / "metrics.jsonl", tmp_path / "out.json"
    cmd = [sys.executable, "-S", "-c", FAKE.format(end="time.sleep(60)"), str(metrics)]
    result = {}
    code = bench.run_and_collect(cmd, dict(os.environ), metrics, tmp_path / "log.txt", out, result, warmup=1,
                                 timeout=30.0, poll=0.05, steps=2)
    assert code == 0 and [r["step"] for r in result["rows"]] == [1, 2] and result["summary"]["steps"] == 1
