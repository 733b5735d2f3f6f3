"""The rule book (loom/rules.py): one set of layout rules that config validation, the launcher, the
runtime and the planner share — so the planner never offers, and `loom plan --config` never writes, a
layout `loom train` refuses."""

import subprocess
import sys

import pytest

from conftest import ROOT
from loom.config import ModelConfig, load_config
from loom.errors import UserError
from loom.planner.workload import Workload
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
    """Every candidate of a search that the planner calls runnable, converted to a loom config, passes loom's
    own checks with the planner's world size (one in 20 also written as a TOML file and loaded back, the
    round trip `loom plan --config` makes); every candidate it calls not runnable is refused by those same
    checks (or has no loom setting at all)."""
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
            if runnable % 20 == 1:
                path = tmp_path / f"c{i}.toml"
                write_config(e, w, None, path)
                cfg = load_config(str(path))
            else:
                cfg = to_loom_config(e, w)
            check_layout(cfg, e.layout.world)
            assert cfg.parallel.world_size == e.layout.world == w.gpus
        else:
            try:
                cfg = to_loom_config(e, w)
            except UserError:
                continue  # no loom setting for it (a separate distributed optimizer)
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


@pytest.fixture
def fake_torchrun(monkeypatch):
    """torchrun replaced by a recorder (and the data preparation by nothing): the launcher's decisions are
    checked without starting a worker."""
    import torch.distributed.run

    import loom.data.token_datasets
    import loom.data.tokenizer
    import loom.train.trainer  # noqa: F401  imported before the patch, so it keeps the real functions

    calls = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda args: calls.append(args))
    monkeypatch.setattr(loom.data.tokenizer, "load_tokenizer", lambda cfg: None)
    monkeypatch.setattr(loom.data.token_datasets, "build_datasets", lambda cfg, tok: None)
    return calls


def test_nproc_inference_reaches_the_workers(fake_torchrun, capsys, tmp_path):
    """`loom train --nproc 4 --parallel.tp=2` (no data-parallel size) launches 4 workers with
    parallel.dp_shard=2 and says so; before, it was refused ("multiply to 2 ... 4 processes")."""
    from loom.cli import main

    assert main(["train", "--config", "tiny", "--run-dir", str(tmp_path / "r"), "--nproc", "4",
                 "--parallel.tp=2", "--train.micro_batch=4"]) == 0
    (args,) = fake_torchrun
    assert args.nproc_per_node == "4" and args.training_script == "loom.cli"
    assert args.training_script_args[0] == "train"
    assert "--parallel.tp=2" in args.training_script_args and "--parallel.dp_shard=2" in args.training_script_args
    err = capsys.readouterr().err
    assert "loom train: parallel.dp_shard=2 inferred from --nproc 4 / (tp=2 x cp=1 x pp=1)" in err, err
    # A data-parallel size the user gave is kept, and checked against the process count.
    fake_torchrun.clear()
    assert main(["train", "--config", "tiny", "--run-dir", str(tmp_path / "r"), "--nproc", "4",
                 "--parallel.tp=2", "--parallel.dp_replicate=2", "--train.micro_batch=4"]) == 0
    (args,) = fake_torchrun
    assert not any(a.startswith("--parallel.dp_shard") for a in args.training_script_args)
    assert "inferred" not in capsys.readouterr().err
    # loom memory launches through the same launcher.
    fake_torchrun.clear()
    assert main(["memory", "--config", "tiny", "--nproc", "4", "--parallel.tp=2", "--train.micro_batch=4"]) == 0
    (args,) = fake_torchrun
    assert "--parallel.dp_shard=2" in args.training_script_args


def test_an_inferred_size_is_checked_like_a_given_one(fake_torchrun, capsys):
    """dp_shard=8 inferred from --nproc 8 does not divide the global batch of 16 sequences of 4: refused
    before launch, after the line that says where 8 came from."""
    from loom.cli import main

    assert main(["train", "--config", "tiny", "--nproc", "8", "--train.micro_batch=4"]) == 2
    err = capsys.readouterr().err
    assert "parallel.dp_shard=8 inferred from --nproc 8" in err and "train.global_batch=16" in err, err
    assert not fake_torchrun


def test_nproc_without_a_fitting_layout_is_refused_before_launch(capsys):
    from loom.cli import main

    assert main(["train", "--config", "tiny", "--nproc", "3", "--parallel.tp=2"]) == 2
    assert "--nproc 3 is not a multiple of tp=2" in capsys.readouterr().err


def test_uneven_split_fields_need_pipeline_parallelism():
    with pytest.raises(UserError, match="need parallel.pp > 1"):
        load_config("tiny", ["parallel.first_stage_layers=1"])


def test_search_offers_sequence_parallelism_only_where_tp_divides_the_sequence():
    """The search paired sp=true with every tp > 1, also tp sizes that do not divide the sequence, which
    loom refuses (and `--config` would then write): 2050 tokens split over 2 ranks, not over 4 or 8."""
    from loom.planner.search import candidates

    w = Workload(_workload().model, 2050, 64, 16, PRESETS["h100"])
    seen = {}
    for lay in candidates(w, recompute_modes=("none",), dp_styles=("fsdp",)):
        seen.setdefault(lay.tp, set()).add(lay.sp)
        assert not tp_problems(lay.tp, w.model, w.seq_len, lay.sp), lay
    assert seen == {1: {False}, 2: {False, True}, 4: {False}, 8: {False}}


def test_config_schedules_are_the_rule_books():
    import typing

    from loom.config import ParallelConfig
    from loom.rules import SCHEDULES

    assert typing.get_args(typing.get_type_hints(ParallelConfig)["schedule"]) == SCHEDULES


def test_expert_parallel_sizes():
    """parallel.ep is carved from dp_replicate x dp_shard x cp (it does not multiply the world size) and
    must divide model.moe.experts; a dense model takes ep=1 only; MoE runs under tp, pp and cp, but not cp with
    capacity dropping (a cp rank's capacity would count only its part of the sequences)."""
    from loom.rules import ep_problem, moe_problem, valid_ep_sizes

    assert valid_ep_sizes(8, 4) == [1, 2, 4] and valid_ep_sizes(6, 8) == [1, 2] and valid_ep_sizes(0, 8) == [1]
    assert ep_problem(1, 0, 1, 1, 1) is None
    assert ep_problem(2, 8, 1, 2, 1) is None and ep_problem(4, 8, 2, 2, 1) is None and ep_problem(2, 8, 1, 1, 2) is None
    assert "model.moe.experts=0" in ep_problem(2, 0, 1, 2, 1)
    assert ep_problem(4, 8, 1, 2, 1).endswith("valid ep sizes for this layout: 1, 2, or raise parallel.dp_shard "
                                              "(e.g. parallel.dp_shard=4)")
    assert ep_problem(4, 6, 1, 4, 1).endswith("valid ep sizes for this layout: 1, 2")
    assert moe_problem(8, 2, "interleaved", 2, 0.0) is None and moe_problem(8, 1, "1f1b", 1, 1.25) is None
    assert moe_problem(0, 2, "zero_bubble", 2, 1.25) is None  # a dense model
    assert moe_problem(8, 1, "1f1b", 2, 1.25).startswith("parallel.cp=2 with model.moe.capacity_factor=1.25 "
                                                         "is not supported")
    assert "set parallel.schedule=1f1b or interleaved" in moe_problem(8, 2, "zero_bubble", 1, 0.0)
    cfg = load_config("tiny", ["model.moe.experts=4", "model.moe.top_k=2", "parallel.dp_shard=2", "parallel.ep=2",
                                "train.micro_batch=4"])
    check_layout(cfg, 2)  # two processes: ep=2 adds none
    with pytest.raises(UserError, match="processes were started"):
        check_layout(cfg, 4)
