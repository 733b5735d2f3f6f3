"""The rule book (loom/rules.py): one set of layout rules that config validation, the launcher, the
runtime and the planner share — so the planner never offers, and `loom plan --config` never writes, a
layout `loom train` refuses."""

import subprocess
import sys

import pytest

from conftest import ROOT
from loom.config import ModelConfig, load_config
from loom.errors import UserError
from loom.planner.costmodel import Workload
from loom.planner.hardware import PRESETS
from loom.rules import check_layout, infer_dp_shard, tp_problems


def test_rule_book_and_config_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import loom.rules, loom.config, loom.planner.search, loom.planner.report\n"
            "cfg = loom.config.load_config('tiny', ['parallel.tp=2'])\n"
            "loom.rules.check_layout(cfg, 2)\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def _workload(**model):
    base = dict(layers=8, hidden=512, heads=8, kv_heads=8, ffn_hidden=1024, vocab_size=32000, max_seq_len=4096)
    return Workload(ModelConfig(**{**base, **model}), 2048, 64, 16, PRESETS["h100"])


@pytest.mark.parametrize("model, layout, needle", [
    ({"ffn_hidden": 1004}, "tp=8", "model.ffn_hidden=1004"),        # 1004 = 4 x 251
    ({"vocab_size": 32001}, "tp=2", "model.vocab_size=32001"),
    ({}, "tp=2,sp=true", None),                                     # valid: control
])
def test_plan_layout_applies_every_tensor_parallel_rule(model, layout, needle):
    """`loom plan --layout` priced tp sizes that split heads and key/value heads but not the MLP or the
    vocabulary; now the rule book's full set applies (the same messages as `loom train`)."""
    from loom.planner.search import evaluate_layout, parse_layout

    w = _workload(**model)
    if needle is None:
        assert evaluate_layout(w, parse_layout(layout, w.gpus)).step_time_s > 0
        return
    with pytest.raises(UserError, match=needle.replace(".", r"\.")):
        evaluate_layout(w, parse_layout(layout, w.gpus))


def test_plan_layout_refuses_sequence_parallel_when_tp_does_not_divide_the_sequence():
    from loom.planner.search import evaluate_layout, parse_layout

    w = Workload(_workload().model, 2050, 64, 16, PRESETS["h100"])  # 2050 = 2 x 1025
    assert evaluate_layout(w, parse_layout("tp=2,sp=true", w.gpus)).step_time_s > 0
    with pytest.raises(UserError, match="train.seq_len=2050"):
        evaluate_layout(w, parse_layout("tp=4,sp=true", w.gpus))


def test_every_search_candidate_agrees_with_the_rule_book(tmp_path):
    """Write every candidate of a search that the planner calls runnable as a loom config: loading it
    passes loom's own checks with the planner's world size; every candidate it calls not runnable is
    refused by those same checks (or has no loom setting at all)."""
    from loom.planner.report import loom_runnable, to_loom_config, write_config
    from loom.planner.search import search

    w = _workload(layers=6, vocab_size=32000)
    results, info = search(w, top=0)
    assert len(results) > 100
    runnable = 0
    for i, e in enumerate(results):
        assert not tp_problems(e.layout.tp, w.model, w.seq_len, e.layout.sp)
        verdict = loom_runnable(e, w)
        if verdict is None:
            runnable += 1
            path = tmp_path / f"c{i}.toml"
            write_config(e, w, None, path)
            cfg = load_config(str(path), measuring=True)
            check_layout(cfg, e.layout.world)
            assert cfg.parallel.world_size == e.layout.world == w.gpus
        else:
            try:
                cfg = to_loom_config(e, w)
            except UserError:
                continue  # no loom setting for it (distributed optimizer, fp8)
            with pytest.raises(UserError):
                check_layout(cfg, e.layout.world)
            with pytest.raises(UserError, match="loom cannot run"):
                write_config(e, w, None, tmp_path / "refused.toml")
    assert runnable > 10
    assert not (tmp_path / "refused.toml").exists()


def test_nproc_infers_the_data_parallel_size():
    cfg = load_config("tiny", ["parallel.tp=2"])
    assert infer_dp_shard(cfg.parallel, 8) == (4, "parallel.dp_shard=4 inferred from --nproc 8 / (tp=2 x cp=1 x pp=1); "
                                                   "set parallel.dp_shard or parallel.dp_replicate to choose otherwise")
    assert infer_dp_shard(cfg.parallel, 2) is None  # tp fills it: nothing to infer
    assert infer_dp_shard(load_config("tiny", ["parallel.dp_replicate=2", "train.micro_batch=4"]).parallel, 4) is None  # given by the user
    with pytest.raises(UserError, match="--nproc 3 is not a multiple of tp=2"):
        infer_dp_shard(cfg.parallel, 3)


def test_nproc_without_a_fitting_layout_is_refused_before_launch(capsys):
    from loom.cli import main

    assert main(["train", "--config", "tiny", "--nproc", "3", "--parallel.tp=2"]) == 2
    assert "--nproc 3 is not a multiple of tp=2" in capsys.readouterr().err


def test_uneven_split_fields_need_pipeline_parallelism():
    with pytest.raises(UserError, match="need parallel.pp > 1"):
        load_config("tiny", ["parallel.first_stage_layers=1"])
