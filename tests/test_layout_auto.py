"""`parallel.layout=auto` (loom/planner/auto.py): the planner's first row is the layout the run gets, the run
trains in it, and every step row carries the prediction."""

import json
import shutil

import pytest

from conftest import ROOT, SMALL, run_cli, run_main, small_config

PROFILE = ROOT / "bench" / "results" / "cpu_profile_train.json"  # a measured CPU profile (2 cores)
KEYS = ("tp", "pp", "vpp", "dp", "cp", "ep", "micro_batch", "sp", "recompute", "schedule")


def plan_first_row(cfg, world: int) -> dict:
    """`loom plan`'s best candidate loom runs, for the same model, batch, precision and accelerator."""
    toml = ROOT / "configs" / "tiny.toml"
    m = cfg.model
    args = ["plan", "--model", str(toml), "--gpus", str(world), "--gpu", str(PROFILE), "--precision", "fp32",
            "--seq", str(cfg.train.seq_len), "--global-batch", str(cfg.train.global_batch), "--json", "--top", "1",
            "--layers", str(m.layers), "--hidden", str(m.hidden), "--heads", str(m.heads), "--kv-heads", str(m.kv_heads),
            "--ffn", str(m.ffn_hidden), "--vocab", str(m.vocab_size)]
    out = run_main(*args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["candidates"][0]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_the_choice_is_the_plans_first_row_and_a_layout_loom_runs(world):
    from loom.planner.auto import apply, choose
    from loom.planner.hardware import load_gpu
    from loom.rules import layout_problem

    cfg = small_config("train.global_batch=16", "parallel.layout=auto")
    choice = choose(cfg, world, "train", gpu=load_gpu(str(PROFILE)))
    row = plan_first_row(cfg, world)
    chosen = apply(cfg, choice.values)
    assert chosen.parallel.world_size == world
    assert layout_problem(chosen, world, "train") is None
    p = chosen.parallel
    got = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "dp": p.dp, "cp": p.cp, "ep": p.ep,
           "micro_batch": chosen.train.micro_batch, "sp": p.sp, "recompute": chosen.recompute.mode,
           "schedule": p.schedule}
    assert got == {k: row[k] for k in KEYS}
    assert choice.predicted_step_s == pytest.approx(row["step_time_s"], rel=1e-3)
    assert choice.predicted_memory_gib == pytest.approx(row["memory_gib"]["total"], rel=1e-2)


def test_fixed_knobs_are_kept_and_the_rest_searched():
    from loom.planner.auto import apply, choose
    from loom.planner.hardware import load_gpu

    cfg = small_config("train.global_batch=16", "parallel.layout=auto", "parallel.auto_fix=tp=2,recompute=full")
    chosen = apply(cfg, choose(cfg, 4, "train", gpu=load_gpu(str(PROFILE))).values)
    assert (chosen.parallel.tp, chosen.recompute.mode) == (2, "full")
    assert chosen.parallel.world_size == 4  # dp (or pp, cp) fills the rest


def test_the_recipes_limits_count():
    """loom dpo runs data parallelism only: fixing tp=2 for it leaves nothing loom runs, said as such."""
    from loom.errors import UserError
    from loom.planner.auto import choose
    from loom.planner.hardware import load_gpu

    cfg = small_config("parallel.layout=auto", "parallel.auto_fix=tp=2")
    with pytest.raises(UserError, match="loom runs none of them for `loom dpo`"):
        choose(cfg, 2, "dpo", gpu=load_gpu(str(PROFILE)))


def test_a_cpu_is_measured_once_then_read_from_the_cache(monkeypatch, tmp_path):
    from loom.planner import auto

    monkeypatch.setenv("LOOM_CACHE", str(tmp_path))
    calls = []

    def measure(path):
        calls.append(path)
        data = json.loads(PROFILE.read_text())
        data["name"] = auto.cpu_name()
        path.write_text(json.dumps(data))

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    first = auto.launch_hardware("", 4, measure)
    second = auto.launch_hardware("", 1, measure)
    assert len(calls) == 1 and auto.cached_profile_path(auto.cpu_name()).is_file()
    assert first.memory_gib == pytest.approx(second.memory_gib / 4)  # four processes share the machine's memory


def test_summary_says_when_the_prediction_misses():
    from loom.planner.auto import summary

    pred = {"predicted_step_s": 1.0, "predicted_memory_gib": 2.0}
    close = summary(pred, [9.0, 1.1, 0.9, 1.2], 2.2)  # the first (warm-up) step is left out: median 1.1
    assert "1.1 s measured (median of 3)" in close and "+10%" in close and "MISSED" not in close
    far = summary(pred, [1.0, 1.3, 1.3], 1.0)
    assert "MISSED by more than 25% on step time and memory" in far


def test_bad_auto_settings_exit_2(tmp_path):
    base = ["train", "--config", "tiny", *[f"--{o}" for o in SMALL], "--run-dir", str(tmp_path / "r")]
    out = run_main(*base, "--parallel.auto_fix=tp=2")
    assert out.returncode == 2 and "only applies with parallel.layout=auto" in out.stderr
    out = run_main(*base, "--parallel.layout=auto", "--parallel.auto_fix=zz=2",
                   f"--parallel.auto_hardware={PROFILE}")
    assert out.returncode == 2 and "auto_fix key 'zz' is unknown" in out.stderr
    out = run_main(*base, "--parallel.layout=auto", "--parallel.auto_hardware=/nonexistent/p.json")
    assert out.returncode == 2 and "no such file" in out.stderr
    out = run_main(*base, "--parallel.layout=auto", "--parallel.auto_memory_margin_gib=-1")
    assert out.returncode == 2 and "auto_memory_margin_gib=-1" in out.stderr
    assert not (tmp_path / "r").exists()


def test_one_process_runs_the_choice_and_logs_the_prediction(tmp_path):
    """End to end in this process (`loom train` as the CLI runs it): the planner's choice is what the run's
    config.toml holds, every step row carries the prediction, and the run ends comparing it with the measurement."""
    from loom.config import load_config
    from loom.planner.auto import choose
    from loom.planner.hardware import load_gpu

    run = tmp_path / "run"
    overrides = [*SMALL, "train.steps=3", "train.global_batch=16", "parallel.layout=auto",
                 f"parallel.auto_hardware={PROFILE}"]
    out = run_main("train", "--config", "tiny", *[f"--{o}" for o in overrides], "--run-dir", str(run))
    assert out.returncode == 0, out.stderr[-3000:]
    expected = choose(small_config(*overrides[len(SMALL):]), 1, "train", gpu=load_gpu(str(PROFILE)))
    assert "parallel.layout=auto chose " + expected.layout in out.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "step_time_s" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all((r["predicted_step_s"], r["predicted_memory_gib"]) == tuple(expected.prediction().values())
               for r in steps)
    saved = load_config(str(run / "config.toml"), validate=False)
    assert saved.train.micro_batch == expected.values["train.micro_batch"] != 4  # SMALL's 4: the choice applied
    assert "layout=auto: step " in out.stdout and "predicted" in out.stdout


@pytest.mark.slow  # three interpreters on 2 cores (~15 s); make test runs the one-process test above
def test_two_processes_run_the_choice_and_log_the_prediction(tmp_path):
    """End to end: the launcher chooses (tp fixed at 2 so the workers run a layout that is not the default), the
    workers train in it, every step row carries the prediction and the end compares it with the measurement."""
    from loom.config import load_config
    from loom.planner.auto import choose
    from loom.planner.hardware import load_gpu

    run = tmp_path / "run"
    overrides = [*SMALL, "train.steps=3", "parallel.layout=auto", "parallel.auto_fix=tp=2",
                 f"parallel.auto_hardware={PROFILE}"]
    proc = run_cli("train", "--config", "tiny", *[f"--{o}" for o in overrides], "--nproc", "2", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = small_config(*overrides[len(SMALL):])
    gpu = load_gpu(str(PROFILE))
    import dataclasses

    expected = choose(cfg, 2, "train", gpu=dataclasses.replace(gpu, memory_gib=gpu.memory_gib / 2))
    assert "parallel.layout=auto chose " + expected.layout in proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "predicted_step_s" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["predicted_step_s"] == round(expected.predicted_step_s, 6) for r in steps)
    assert all(r["predicted_memory_gib"] == round(expected.predicted_memory_gib, 4) for r in steps)
    saved = load_config(str(run / "config.toml"), validate=False)
    assert (saved.parallel.tp, saved.parallel.world_size) == (2, 2)
    assert saved.train.micro_batch == expected.values["train.micro_batch"]
    assert "layout=auto: step " in proc.stdout and "predicted" in proc.stdout
