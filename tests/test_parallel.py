"""Every parallel layout computes what one process computes (CPU, gloo, through `loom train --nproc`)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from loom.cli import main
from loom.config import load_config

# Several layers, GQA (8 query heads sharing 4 key/value heads), sizes divisible by tp=4.
MODEL = [
    "model.layers=3", "model.hidden=64", "model.heads=8", "model.kv_heads=4", "model.ffn_hidden=160",
    "model.vocab_size=512", "model.max_seq_len=64", "train.seq_len=32", "train.micro_batch=2",
    "train.global_batch=16", "train.steps=6", "train.eval_samples=8", "optim.warmup_steps=2", "optim.lr=3e-3",
    "data.corpus_max_bytes=300000", "log.progress=none", "log.tensorboard=false",
]


# Pipeline cases: 4 layers (so pp x vpp = 4 works) and untied embeddings (they live on different stages).
PIPE = MODEL + ["model.layers=4", "model.tie_embeddings=false"]


def single_runs(tmp_path_factory, overrides: dict):
    """`get(name)`: the single-process reference run of `overrides[name]` (tiny config), made on first use."""
    runs = {}

    def get(name):
        if name not in runs:
            run_dir = tmp_path_factory.mktemp(f"single-{name}") / "run"
            assert main(["train", "--config", "tiny", "--run-dir", str(run_dir),
                         *[f"--{o}" for o in overrides[name]]]) == 0
            runs[name] = run_dir
        return runs[name]

    return get


def _train_rank(run_dir: str, overrides: list[str], world: int) -> None:
    """One rank of `loom train --nproc world`: the trainer its workers run, with their thread count."""
    from loom.train.trainer import Trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # loom.launch's OMP_NUM_THREADS
    Trainer(load_config("tiny", overrides), run_dir, quiet=True).fit()


def launch(run_dir, nproc, *extra, base=MODEL):
    """Train the tiny config with `base + extra` in `nproc` ranks as `loom train --nproc` does (the data-parallel
    size inferred from the process count the same way), in the session's kept rank processes
    (tests/distributed.py `shared_pool`): starting torch and joining a group once, not once per run. The
    launcher itself (torchrun workers, restarts, signals) is tested through the command in test_run_control.py,
    test_faults.py and test_checkpoint.py."""
    from distributed import shared_pool
    from loom.rules import check_layout, infer_dp_shard

    overrides = list(base) + list(extra)
    cfg = load_config("tiny", overrides)
    inferred = infer_dp_shard(cfg.parallel, nproc)
    if inferred:
        overrides.append(f"parallel.dp_shard={inferred[0]}")
        cfg.parallel.dp_shard = inferred[0]
    check_layout(cfg, nproc)
    shared_pool(nproc).run(_train_rank, str(run_dir), overrides, nproc)


def metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def final_weights(run_dir):
    """The full weights, assembled in this process from the sharded step-6 checkpoint."""
    from loom.models.io import load_model_dir

    model, _, _ = load_model_dir(run_dir / "checkpoints" / "step-6")
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    assert main(["train", "--config", "tiny", "--run-dir", str(run_dir), *[f"--{o}" for o in MODEL]]) == 0
    return run_dir


@pytest.fixture(scope="module")
def pipe_reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single-pipe") / "run"
    assert main(["train", "--config", "tiny", "--run-dir", str(run_dir), *[f"--{o}" for o in PIPE]]) == 0
    return run_dir


def assert_same_run(run_dir, reference, rtol=1e-5):
    steps, evals = metrics(run_dir)
    ref_steps, ref_evals = metrics(reference)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for got, want in zip(steps, ref_steps):
        assert math.isclose(got["loss"], want["loss"], rel_tol=rtol), (got["step"], got["loss"], want["loss"])
        assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=rtol), (got["step"], got["grad_norm"], want["grad_norm"])
    assert math.isclose(evals[-1]["val_loss"], ref_evals[-1]["val_loss"], rel_tol=rtol)
    got_w, want_w = final_weights(run_dir), final_weights(reference)
    assert got_w.keys() == want_w.keys()
    for name in want_w:
        if name.endswith("attention.wk.bias"):
            # A key bias shifts every score of a query equally, so softmax ignores it: its gradient is
            # exactly 0 in theory and rounding noise in practice, which Adam scales up to full steps.
            continue
        # Adam normalises each element's step, so an element whose gradient is ~0 moves by ~lr in a
        # direction float rounding decides: parameters agree to ~1e-5 of their norm (losses and grad
        # norms to 1e-5 relative, above). Elementwise, allow 5% of one step's lr.
        rel = ((got_w[name] - want_w[name]).norm() / want_w[name].norm()).item()
        assert rel < 5e-5, (name, rel)
        assert (got_w[name] - want_w[name]).abs().max().item() < 1.5e-4, name


LAYOUTS = {
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "tp4-sp": (4, ["parallel.tp=4", "parallel.sp=true"]),  # slow: tp2-sp-dp_shard2 covers tp with SP
    "dp_replicate2": (2, ["parallel.dp_replicate=2"]),
    "dp_shard2": (2, ["parallel.dp_shard=2"]),
    "dp_shard4": (4, ["parallel.dp_shard=4"]),
    "hsdp2x2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "tp2-sp-dp_shard2": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.dp_shard=2"]),
    "tp2-dp_replicate2": (4, ["parallel.tp=2", "parallel.dp_replicate=2"]),
    # Context parallelism: each rank holds 2 of the 4 (cp=2) chunks of every sequence.
    "cp2": (2, ["parallel.cp=2", "recompute.mode=selective"]),  # only the local attention is recomputed
    "cp2-tp2-sp": (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
    "cp2-dp_shard2": (4, ["parallel.cp=2", "parallel.dp_shard=2"]),
}


# In `make test-all` only (the suite's 20-minute budget on 2 cores): compositions that the cases left in `make test`
# cover piecewise — tp2-sp-dp_shard2 covers tp with data parallelism; cp2 and pp2-cp2 cover cp and cp with
# another dimension; dp_shard2 and hsdp2x2 cover sharding (and hsdp2x2 replication); tp2-sp-dp_shard2 covers tp
# with SP, and test_resume_across_layouts (tp2 x pp2, final weights against one process) tp without it.
SLOW_LAYOUTS = {"tp4-sp", "tp2-dp_replicate2", "cp2-tp2-sp", "dp_shard4", "cp2-dp_shard2", "tp2-sp", "dp_replicate2",
                "tp2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_LAYOUTS else n for n in LAYOUTS])
def test_layout_matches_single_process(name, reference, tmp_path):
    nproc, layout = LAYOUTS[name]
    launch(tmp_path / "run", nproc, *layout)
    assert_same_run(tmp_path / "run", reference)


PIPE_LAYOUTS = {
    "pp2-1f1b": (2, ["parallel.pp=2"]),
    "pp2-interleaved": (2, ["parallel.pp=2", "parallel.schedule=interleaved"]),
    "pp2-zero_bubble": (2, ["parallel.pp=2", "parallel.schedule=zero_bubble"]),
    "pp2-uneven": (2, ["parallel.pp=2", "parallel.first_stage_layers=1"]),
    "pp4-1f1b": (4, ["parallel.pp=4"]),
    "pp2-vpp2-interleaved": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"]),
    "pp2-vpp2-zbv": (2, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zero_bubble"]),
    "pp2-tp2-sp": (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true"]),
    "pp2-dp_shard2": (4, ["parallel.pp=2", "parallel.dp_shard=2"]),
    "pp2-cp2": (4, ["parallel.pp=2", "parallel.cp=2"]),
    "tp2-pp2-dp_shard2": (8, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.dp_shard=2"]),
    # The embedding and the loss counted as a layer each (Megatron-Core's account_for_*_in_pipeline_split):
    # 4 layers + 2 = 6 chunks of one unit, so chunk 0 (rank 0) holds only the embedding and chunk 5 (rank 1)
    # only the final norm, head and loss. Without the flags pp x vpp = 6 > 4 layers is refused.
    "pp2-vpp3-ends": (2, ["parallel.pp=2", "parallel.vpp=3", "parallel.schedule=interleaved",
                          "parallel.embedding_in_split=true", "parallel.loss_in_split=true"]),
}


def least_bubble(layout: list[str]) -> float:
    """The smallest mean `pipeline_bubble` (wait over compute, mean over ranks) a working measurement
    can report for a layout of PIPE.

    1F1B and interleaved: theory is (p-1)/(v*m) idle per unit of compute; transfers and uneven stages only
    add waiting, but time a rank spends in TP/FSDP collectives, or sharing 2 cores with up to 7 other
    processes, counts as compute and lowers the ratio (tp2-pp2-dp_shard2 measured 0.25 at theory 0.25),
    so half of theory. Zero-bubble fills the steady state, but the last stage still waits for the first
    micro-batch's forward through the p-1 stages before it: p-1 chunk forwards against the v*m chunk
    forwards and backwards (3 forwards' worth) it computes, averaged over p ranks; halved again for a
    backward costing more than two forwards.
    """
    cfg = load_config("tiny", PIPE + layout)
    p, v = cfg.parallel.pp, cfg.parallel.vpp
    m = cfg.train.global_batch // (cfg.parallel.dp * cfg.train.micro_batch)
    if cfg.parallel.schedule == "zero_bubble":
        return (p - 1) / (6 * p * v * m)
    return (p - 1) / (v * m) / 2


# make test-all (the 20-minute budget): tp2-pp2-dp_shard2 (8 processes, ~55 s) and pp2-tp2-sp (4 processes) are
# covered piecewise by test_resume_across_layouts (tp2 x pp2, its final weights against one process), tp2-sp-dp_shard2
# (SP) and pp2-cp2 (pp with a sharded-gradient dimension); pp2-dp_shard2 by pp2-cp2 and dp_shard2; pp4-1f1b by the
# pp2 1F1B cases; pp2-interleaved (one chunk per rank) by pp2-vpp2-interleaved, the interleaving itself.
SLOW_PIPE_LAYOUTS = {"tp2-pp2-dp_shard2", "pp2-tp2-sp", "pp2-dp_shard2", "pp4-1f1b", "pp2-interleaved"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_PIPE_LAYOUTS else n
                                  for n in PIPE_LAYOUTS])
def test_pipeline_layout_matches_single_process(name, pipe_reference, tmp_path):
    nproc, layout = PIPE_LAYOUTS[name]
    launch(tmp_path / "run", nproc, *layout, base=PIPE)
    assert_same_run(tmp_path / "run", pipe_reference)
    steps, _ = metrics(tmp_path / "run")
    bubbles = [r["pipeline_bubble"] for r in steps]
    # Measured on 2 cores: 0.2-0.3 for pp=2 (theory 0.125), about 1 for pp=4 (0.375) and for the uneven split.
    assert sum(bubbles) / len(bubbles) > least_bubble(layout), bubbles


@pytest.mark.slow  # 4 processes for 60 s; tp=2 with SP (tp2-sp-dp_shard2) and without (the resume test) stay in make test
def test_tp4_without_sp_and_gpt_architecture(tmp_path):
    """GPT-3 style (LayerNorm with bias, GELU, learned positions, biases) under tp=4 and tp=2+SP."""
    gpt = ["model.norm=layernorm", "model.mlp=gelu", "model.position=learned", "model.bias=true"]
    single = tmp_path / "single"
    assert main(["train", "--config", "tiny", "--run-dir", str(single), *[f"--{o}" for o in MODEL + gpt]]) == 0
    launch(tmp_path / "tp4", 4, *gpt, "parallel.tp=4")
    assert_same_run(tmp_path / "tp4", single)
    launch(tmp_path / "tp2sp", 2, *gpt, "parallel.tp=2", "parallel.sp=true")
    assert_same_run(tmp_path / "tp2sp", single)


def _train_counting_linear_dtypes(run_dir, overrides):
    """Train on this rank; the dtypes of every nn.Linear output it computed, with their counts."""
    from collections import Counter

    from loom.train.trainer import Trainer

    seen = Counter()

    def hook(module, args, output):
        if isinstance(module, torch.nn.Linear):
            seen[str(output.dtype)] += 1

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        Trainer(load_config("tiny", MODEL + overrides), run_dir, quiet=True).fit()
    finally:
        handle.remove()
    return dict(seen)


@pytest.mark.slow  # 2 x 50 steps on 5 processes; bf16 in one process stays in make test (tests/test_train.py)
def test_bf16_tp2_dp_shard2_tracks_fp32(tmp_path):
    """bf16 under TP + SP + FSDP (FSDP's mixed precision, not autocast) runs the matmuls in bf16 and
    tracks the fp32 single-process curve."""
    from distributed import run_ranks

    steps = ["train.steps=50", "optim.warmup_steps=5"]
    single = tmp_path / "single"
    assert main(["train", "--config", "tiny", "--run-dir", str(single), *[f"--{o}" for o in MODEL + steps]]) == 0
    layout = ["parallel.tp=2", "parallel.sp=true", "parallel.dp_shard=2", "train.dtype=bfloat16", "train.threads=1"]
    dtypes = run_ranks(4, _train_counting_linear_dtypes, tmp_path / "bf16", steps + layout)
    # Every matmul of every rank ran in bf16: 50 steps x 4 micro-batches x 22 Linear layers (3 layers x 7
    # and the head), plus evaluation.
    for rank_dtypes in dtypes:
        assert set(rank_dtypes) == {"torch.bfloat16"} and rank_dtypes["torch.bfloat16"] >= 50 * 4 * 22, dtypes
    ref, _ = metrics(single)
    got, _ = metrics(tmp_path / "bf16")
    assert len(got) == 50
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, ref))
    worst_norm = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(got, ref))
    # Close to fp32, yet not fp32: in fp32 this layout matches one process to 1e-5 (losses and grad
    # norms); in bf16 losses moved by up to 4e-3 and grad norms by up to 0.4 (measured).
    assert 1e-4 < worst < 0.02, worst
    assert worst_norm > 1e-2, worst_norm
    assert ref[-1]["loss"] < ref[0]["loss"] - 1.0  # it learned, so tracking the curve means something


@pytest.mark.slow  # 2 x 4 processes for 60 s (make test-all); make test keeps the tp2-sp-dp_shard2 layout it compares with
def test_two_nodes_on_localhost_match_four_local_processes(tmp_path):
    layout = ["parallel.tp=2", "parallel.sp=true", "parallel.dp_shard=2"]
    launch(tmp_path / "local", 4, *layout)
    from distributed import free_port

    port = free_port()
    run_dir = tmp_path / "nodes"
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "loom.cli", "train", "--config", "tiny", "--run-dir", str(run_dir),
               "--nproc", "2", "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
               *[f"--{o}" for o in MODEL + layout]]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    a, _ = metrics(tmp_path / "local")
    b, _ = metrics(run_dir)
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)


@pytest.mark.parametrize(
    "base, nproc, extra, fragments",
    [
        (MODEL, 4, ["parallel.tp=2", "parallel.dp_shard=4"], ["multiply to 8", "4 processes"]),
        (MODEL, 3, ["parallel.tp=3"], ["parallel.tp=3", "valid tp sizes for this model: 1, 2, 4"]),
        (MODEL, 8, ["parallel.tp=8"], ["model.kv_heads=4", "valid tp sizes"]),
        (MODEL, 4, ["parallel.dp_shard=4", "train.global_batch=12"], ["global_batch=12", "valid global batches: 8, 16"]),
        (PIPE, 2, ["parallel.pp=2", "train.loss_chunk=64"], ["train.loss_chunk=64", "parallel.pp=2"]),
        (PIPE, 4, ["parallel.pp=4", "parallel.vpp=2"], ["= 8 pipeline stages", "model.layers=4"]),
        (PIPE, 2, ["parallel.pp=2", "model.layers=5"], ["does not split evenly", "first_stage_layers"]),
        (PIPE, 2, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "parallel.embedding_in_split=true"],
         ["+ the embedding = 5 units", "valid pp x vpp: 5"]),
        (PIPE, 2, ["parallel.pp=2", "train.global_batch=2"], ["micro-batch count", "= 1"]),
        (PIPE, 2, ["parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "train.global_batch=6"],
         ["multiple of pp=2"]),
        (PIPE, 2, ["parallel.pp=2", "parallel.vpp=2"], ["schedule=1f1b", "interleaved"]),
    ],
)
def test_bad_layouts_refused_before_workers_start(capsys, tmp_path, base, nproc, extra, fragments):
    argv = ["train", "--config", "tiny", "--run-dir", str(tmp_path / "r"), "--nproc", str(nproc),
            *[f"--{o}" for o in base + extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    for f in fragments:
        assert f in err, err
    assert not (tmp_path / "r").exists()


def test_bf16_moments_fully_sharded_match_one_process(tmp_path):
    """The bf16-moment optimizer on sharded parameters, including its checkpoint, matches one process."""
    single = tmp_path / "single"
    assert main(["train", "--config", "tiny", "--run-dir", str(single),
                 *[f"--{o}" for o in MODEL + ["optim.state_dtype=bfloat16"]]]) == 0
    launch(tmp_path / "fsdp", 2, "parallel.dp_shard=2", "optim.state_dtype=bfloat16")
    a, _ = metrics(single)
    b, _ = metrics(tmp_path / "fsdp")
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-5)
    # The saved moments are bf16: read the checkpoint's own metadata (what DCP wrote, per entry).
    import pickle

    meta = pickle.loads((tmp_path / "fsdp" / "checkpoints" / "step-6" / ".metadata").read_bytes())
    moments = {k: v.properties.dtype for k, v in meta.state_dict_metadata.items() if k.endswith(".exp_avg")}
    assert len(moments) == len(final_weights(single)) - 1  # every parameter (the tied output shares one)
    assert set(moments.values()) == {torch.bfloat16}


def test_resume_across_layouts(tmp_path, pipe_reference):
    """A sharded checkpoint saved under tp=2 x pp=2 resumes under cp=2 x dp_shard=2 (FSDP over the four
    dp x cp ranks): the losses after the resume match the undisturbed single-process run within 1e-4."""
    launch(tmp_path / "run", 4, "parallel.tp=2", "parallel.pp=2", "checkpoint.interval=3", base=PIPE)
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in (ckpts / "step-3").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    # Read in one process, and exported to Hugging Face, the tp x pp checkpoint holds the reference weights.
    from loom import load_model
    from loom.interop import convert

    want = final_weights(pipe_reference)
    exported = load_model(convert(ckpts / "step-6", tmp_path / "hf", to="hf")).state_dict()
    for got in (final_weights(tmp_path / "run"), exported):
        assert got.keys() == want.keys()
        for name in want:
            assert ((got[name] - want[name]).norm() / want[name].norm()).item() < 5e-5, name
    import shutil

    shutil.rmtree(ckpts / "step-6")
    (ckpts / "latest").write_text("step-3\n")
    launch(tmp_path / "run", 4, "parallel.cp=2", "parallel.dp_shard=2", "checkpoint.resume=true", base=PIPE)
    assert_same_run(tmp_path / "run", pipe_reference, rtol=1e-4)


# Six layers + the embedding + the loss = 8 units: pp=4 1F1B splits them [1, 2, 2, 1] (the first and last stage one
# transformer layer short), and pp=4 x vpp=2 interleaved [0, 1, 1, 1, 1, 1, 1, 0] (rank 0's first chunk only the
# embedding, rank 3's second only the head and loss).
ENDS_PP4 = {
    "pp4-1f1b": ["parallel.pp=4"],
    "pp4-vpp2-interleaved": ["parallel.pp=4", "parallel.vpp=2", "parallel.schedule=interleaved"],
}


@pytest.mark.slow  # 2 x 4 processes (~40 s); make test keeps pp2-vpp3-ends (and its tied twin in test_tied_pipeline)
def test_pipeline_counting_embedding_and_loss_pp4_matches_single_process(tmp_path):
    from loom.rules import chunk_layer_counts

    base = PIPE + ["model.layers=6"]
    single = tmp_path / "single"
    assert main(["train", "--config", "tiny", "--run-dir", str(single), *[f"--{o}" for o in base]]) == 0
    ends = ["parallel.embedding_in_split=true", "parallel.loss_in_split=true"]
    want = {"pp4-1f1b": [1, 2, 2, 1], "pp4-vpp2-interleaved": [0, 1, 1, 1, 1, 1, 1, 0]}
    for name, layout in ENDS_PP4.items():
        assert chunk_layer_counts(load_config("tiny", base + layout + ends)) == want[name]
        launch(tmp_path / name, 4, *layout, *ends, base=base)
        assert_same_run(tmp_path / name, single)
