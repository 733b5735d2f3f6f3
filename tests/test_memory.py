"""Activation memory and FLOPs measured against the published formulas (Korthikanti et al. 2022)."""

import json

import pytest
import torch

from conftest import small_config
from loom.cli import main
from loom.config import load_config
from loom.memory import measure_activations, plan_budget, step_flops


def korthikanti(t, *extra):
    return load_config("korthikanti", [f"parallel.tp={t}", *extra])


def paper(cfg, case, t):
    """Bytes per layer per rank, Table 2 of the paper (16-bit activations, 1-byte dropout masks)."""
    s, b, h, a = cfg.train.seq_len, cfg.train.micro_batch, cfg.model.hidden, cfg.model.heads
    sbh = s * b * h
    return {
        "none": sbh * (34 + 5 * a * s / h),
        "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": sbh * (34 / t + 5 * a * s / (h * t)),
        "tp+selective": sbh * (10 + 24 / t),
        "tp+sp+selective": 34 * sbh / t,
        "full": 2 * sbh,
    }[case]


CASES = {
    "tp": [],
    "tp+sp": ["parallel.sp=true"],
    "tp+selective": ["recompute.mode=selective"],
    "tp+sp+selective": ["parallel.sp=true", "recompute.mode=selective"],
    "full": ["recompute.mode=full"],
}


def _measure_all(t):
    from loom.parallel.dims import place_in_mesh

    out = {}
    for case, extra in CASES.items():
        cfg = korthikanti(t, *extra)
        out[case] = measure_activations(cfg, place_in_mesh(cfg, "cpu"), device="cpu")["layer_activation_bytes"]
    return out


def test_single_process_matches_paper():
    for case, extra in {"none": [], "tp+selective": ["recompute.mode=selective"], "full": ["recompute.mode=full"]}.items():
        cfg = korthikanti(1, *extra)
        got = measure_activations(cfg, device="meta")["layer_activation_bytes"]
        assert got == pytest.approx(paper(cfg, case, 1), rel=0.03), case


@pytest.mark.parametrize("t", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 processes: slow
def test_tensor_and_sequence_parallel_match_paper(t):
    from distributed import shared_pool

    results = shared_pool(t).run(_measure_all, t)
    for case in CASES:
        got = results[0][case]
        assert all(r[case] == got for r in results)  # every rank holds the same
        assert got == pytest.approx(paper(korthikanti(t), case, t), rel=0.03), case


def test_flops_match_paper():
    cfg = korthikanti(1)
    m, t = cfg.model, cfg.train
    B, L, s, h, V = t.global_batch, m.layers, t.seq_len, m.hidden, m.vocab_size
    base = 72 * B * L * s * h * h
    none = step_flops(cfg)
    assert none["model_flops_per_step"] == pytest.approx(base * (1 + s / (6 * h) + V / (12 * h * L)), rel=0.01)
    assert none["hardware_flops_per_step"] == none["model_flops_per_step"]
    full = step_flops(korthikanti(1, "recompute.mode=full"))
    assert full["hardware_flops_per_step"] == pytest.approx(96 * B * L * s * h * h * (1 + s / (6 * h) + V / (16 * h * L)), rel=0.01)
    # Selective, recomputing the whole attention core once (QK^T and PV: 4Bs^2h per layer): 2s/9h.
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        sel = step_flops(korthikanti(1, "recompute.mode=selective"))
    assert sel["hardware_flops_per_step"] == pytest.approx(base * (1 + 2 * s / (9 * h) + V / (12 * h * L)), rel=0.01)
    # loom's default stops recomputing once backward has what it needs: PV's output is not needed,
    # so only QK^T is redone (2Bs^2h per layer): 1 + s/6h + s/36h.
    sel = step_flops(korthikanti(1, "recompute.mode=selective"))
    assert sel["hardware_flops_per_step"] == pytest.approx(base * (1 + 7 * s / (36 * h) + V / (12 * h * L)), rel=0.01)


def llama_formula(cfg, t=1, sp=False):
    """loom's Llama layer (RMSNorm, SDPA, SwiGLU, GQA, no dropout, 16-bit), bytes per rank.

    RMSNorm keeps an fp32 copy of its input (4sbh) and its bf16 normalised output (2sbh) plus fp32
    1/rms (4bs); attention keeps its input (2sbh), q (2sbh), k and v (2sbh*g/a each), and SDPA's
    output (2sbh, shared with the output projection's input) and fp32 log-sum-exp (4abs); the MLP
    keeps its input (2sbh) and four [s,b,f] tensors: w1 and w3 outputs, SiLU output, their product
    (8sbf). No s^2 term: SDPA never stores the score matrix.
        t = 1:  sbh(20 + 4g/a + 8f/h) + 4bs(a + 2)
        TP:     sbh(16 + (4 + 4g/a + 8f/h)/t) + 4bs(2 + a/t)
        TP+SP:  [sbh(20 + 4g/a + 8f/h) + 4bs(a + 2)] / t
    """
    s, b, h = cfg.train.seq_len, cfg.train.micro_batch, cfg.model.hidden
    a, g, f = cfg.model.heads, cfg.model.kv_heads, cfg.model.ffn_hidden
    sbh = s * b * h
    if t == 1 or sp:
        return (sbh * (20 + 4 * g / a + 8 * f / h) + 4 * b * s * (a + 2)) / t
    return sbh * (16 + (4 + 4 * g / a + 8 * f / h) / t) + 4 * b * s * (2 + a / t)


LLAMA = ["train.dtype=bfloat16", "model.layers=2", "model.hidden=256", "model.heads=8", "model.ffn_hidden=688",
         "model.vocab_size=1024", "train.seq_len=128", "train.micro_batch=2", "data.corpus_max_bytes=300000"]


@pytest.mark.parametrize("kv", [8, 2])
def test_llama_layer_matches_derived_formula(kv):
    cfg = load_config("tiny", LLAMA + [f"model.kv_heads={kv}"])
    got = measure_activations(cfg, device="cpu")["layer_activation_bytes"]
    assert got == pytest.approx(llama_formula(cfg), rel=0.03)


def _llama_tp(t):
    from loom.parallel.dims import place_in_mesh

    out = {}
    for sp in (False, True):
        cfg = load_config("tiny", LLAMA + ["model.kv_heads=4", f"parallel.tp={t}", f"parallel.sp={str(sp).lower()}"])
        out[sp] = measure_activations(cfg, place_in_mesh(cfg, "cpu"), device="cpu")["layer_activation_bytes"]
    return out


def test_llama_tensor_parallel_matches_derived_formula():
    from distributed import shared_pool

    got = shared_pool(2).run(_llama_tp, 2)[0]
    cfg = load_config("tiny", LLAMA + ["model.kv_heads=4"])
    assert got[False] == pytest.approx(llama_formula(cfg, 2, sp=False), rel=0.03)
    assert got[True] == pytest.approx(llama_formula(cfg, 2, sp=True), rel=0.03)


def auto_memory_for(extra, activation_bytes: float) -> float:
    """The memory (bytes) at which recompute.mode=auto leaves `activation_bytes` for activations, by hand: fp32
    parameters, gradients and two AdamW moments (16 bytes a parameter), one layer's whole activations and 5% of
    the memory kept as the reserve."""
    from loom.memory import state_bytes

    params = state_bytes(small_config(*extra))["params_trained"]
    layer = measure_activations(small_config(*extra))["layer_activation_bytes"]
    return (16 * params + layer + activation_bytes) / 0.95


@pytest.mark.parametrize("mode", ["selective", "full", "budget", "auto"])
def test_every_recompute_mode_trains_like_none(tmp_path, mode):
    from loom.train.trainer import Trainer

    extra = ["model.attention=math", "model.dropout=0.1", "model.attn_dropout=0.1"]
    ref = Trainer(small_config(*extra), tmp_path / "none", quiet=True)
    ref.fit()
    budget = []
    if mode == "budget":  # between the selective and none footprints of this model
        totals = [measure_activations(small_config(*extra, f"recompute.mode={m}"))["total_activation_bytes"]
                  for m in ("none", "selective")]
        budget = [f"recompute.budget_gib={sum(totals) / 2 / 2**30}"]
    if mode == "auto":  # memory that leaves activations between the selective and none footprints
        totals = [measure_activations(small_config(*extra, f"recompute.mode={m}"))["total_activation_bytes"]
                  for m in ("none", "selective")]
        budget = [f"recompute.memory_gib={auto_memory_for(extra, sum(totals) / 2) / 2**30}"]
    run = Trainer(small_config(*extra, f"recompute.mode={mode}", *budget), tmp_path / mode, quiet=True)
    run.fit()
    if mode == "auto":  # it planned for that memory and recomputes something
        assert run.recompute_note.startswith("recompute.mode=auto: ") and "selective" in run.recompute_note
    rows = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]  # noqa: E731
    for a, b in zip(rows(tmp_path / "none"), rows(tmp_path / mode)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)


def test_budget_between_selective_and_none_fits_and_costs_no_more_than_selective():
    base = korthikanti(1)
    none = measure_activations(base, device="meta")
    sel = measure_activations(korthikanti(1, "recompute.mode=selective"), device="meta")
    total_none, total_sel = none["total_activation_bytes"], sel["total_activation_bytes"]
    budget = (total_sel + total_none) / 2
    cfg = korthikanti(1, "recompute.mode=budget", f"recompute.budget_gib={budget / 2**30}")
    plan = plan_budget(cfg)
    measured = measure_activations(cfg, device="meta", layer_plan=plan["plan"])["total_activation_bytes"]
    assert measured <= budget
    assert measured == plan["activation_bytes"]
    sel_flops = step_flops(korthikanti(1, "recompute.mode=selective"))["hardware_flops_per_step"]
    assert step_flops(cfg, plan["plan"])["hardware_flops_per_step"] <= sel_flops
    assert "selective" in plan["plan"].values() and "full" not in plan["plan"].values()
    # A budget below everything-selective needs full recomputation of some layers.
    tight = korthikanti(1, "recompute.mode=budget", f"recompute.budget_gib={(total_sel - 1) / 2**30}")
    plan = plan_budget(tight)
    assert "full" in plan["plan"].values()
    assert measure_activations(tight, device="meta", layer_plan=plan["plan"])["total_activation_bytes"] < total_sel


def test_loom_memory_cli(capsys):
    assert main(["memory", "--config", "korthikanti", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ["layer_activation_bytes", "model_flops_per_step", "hardware_flops_per_step", "breakdown",
                "params_bytes", "grads_bytes", "optimizer_bytes"]:
        assert key in out
    cfg = korthikanti(1)
    assert out["layer_activation_bytes"] == pytest.approx(paper(cfg, "none", 1), rel=0.03)
    assert main(["memory", "--config", "korthikanti"]) == 0
    assert "one transformer layer" in capsys.readouterr().out
    assert main(["memory", "--config", "korthikanti", "--parallel.tp=2"]) == 2
    assert "--nproc 2" in capsys.readouterr().err


def test_analytic_formula_in_flops_module_matches_measurement():
    """loom.flops.layer_activation_bytes (what the planner will use) agrees with the ledger."""
    from loom.flops import layer_activation_bytes

    for extra, sp, mode in [([], False, "none"), (["recompute.mode=selective"], False, "selective"),
                            (["recompute.mode=full"], False, "full")]:
        cfg = korthikanti(1, *extra)
        got = measure_activations(cfg, device="meta")["layer_activation_bytes"]
        want = layer_activation_bytes(cfg.model, cfg.train.seq_len, cfg.train.micro_batch, recompute=mode)
        assert got == pytest.approx(want, rel=0.01), mode
    for kv in (8, 2):
        cfg = load_config("tiny", LLAMA + [f"model.kv_heads={kv}"])
        got = measure_activations(cfg, device="cpu")["layer_activation_bytes"]
        want = layer_activation_bytes(cfg.model, cfg.train.seq_len, cfg.train.micro_batch)
        assert got == pytest.approx(want, rel=0.01), kv
    # TP / SP: the formula reproduces the paper's Table 2 rows for the korthikanti shape
    cfg = korthikanti(1)
    for t in (2, 4):
        for case, sp, mode in [("tp", False, "none"), ("tp+sp", True, "none"), ("tp+selective", False, "selective"),
                               ("tp+sp+selective", True, "selective")]:
            want = layer_activation_bytes(cfg.model, cfg.train.seq_len, cfg.train.micro_batch, t, sp, mode)
            assert want == pytest.approx(paper(cfg, case, t), rel=0.01), (t, case)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_layer_matches_the_planner(cp):
    """A cp rank keeps its seq_len / cp tokens' activations plus the gathered keys/values of the rest of
    the sequence: the ledger's count (meta, fused attention) against the planner's per-layer term."""
    from loom.planner.memory import memory
    from loom.planner.workload import Layout, Workload
    from loom.planner.hardware import load_gpu

    cfg = load_config("tiny", LLAMA + ["model.kv_heads=2", f"parallel.cp={cp}"])
    got = measure_activations(cfg, device="meta")["layer_activation_bytes"]
    one = measure_activations(load_config("tiny", LLAMA + ["model.kv_heads=2"]), device="meta")["layer_activation_bytes"]
    m, t = cfg.model, cfg.train
    w = Workload(m, t.seq_len, 8, cp, load_gpu("h100"), compile="off")  # the ledger counts eager blocks
    want = memory(w, Layout(cp=cp, micro_batch=t.micro_batch))["activations"] / m.layers
    assert got == pytest.approx(want, rel=0.02)
    gathered = 2 * t.micro_batch * (t.seq_len - t.seq_len // cp) * m.kv_heads * m.head_dim * 2
    output = t.micro_batch * (t.seq_len // cp) * m.heads * m.head_dim * 2  # kept per chunk and concatenated
    assert got == pytest.approx(one / cp + gathered + output, rel=0.02)  # fails if the rank held whole sequences


def test_auto_recompute_recomputes_only_what_the_memory_needs():
    """recompute.mode=auto against a hand budget: no limit or ample memory recompute nothing; a memory that
    leaves less than everything-selective for activations fits (measured) and is the cheapest that does
    (one fewer full layer would not fit); too little memory for the states is refused, naming the numbers."""
    from loom.errors import UserError
    from loom.memory import describe_plan, plan_auto

    extra = ["model.attention=math", "model.layers=4"]
    cfg = small_config(*extra, "recompute.mode=auto")
    none, sel, full = (measure_activations(small_config(*extra, f"recompute.mode={m}")) for m in
                       ("none", "selective", "full"))
    assert set(plan_auto(cfg, memory_bytes=None)["plan"].values()) == {"none"}
    ample = plan_auto(cfg, memory_bytes=auto_memory_for(extra, none["total_activation_bytes"]))
    assert set(ample["plan"].values()) == {"none"} and "4 none" in describe_plan(ample)
    budget = sel["total_activation_bytes"] - 1
    tight = plan_auto(cfg, memory_bytes=auto_memory_for(extra, budget))
    assert tight["budget_bytes"] == pytest.approx(budget, rel=1e-9)
    plan = tight["plan"]
    n_full = sum(v == "full" for v in plan.values())
    assert n_full >= 1
    fitted = measure_activations(cfg, device="meta", layer_plan=plan)["total_activation_bytes"]
    assert fitted <= budget and fitted == tight["activation_bytes"]
    # one full layer fewer (kept whole instead) no longer fits: nothing was recomputed without need
    lighter = dict(plan, **{next(k for k, v in plan.items() if v == "full"): "none"})
    assert measure_activations(cfg, device="meta", layer_plan=lighter)["total_activation_bytes"] > budget
    assert full["total_activation_bytes"] < budget
    with pytest.raises(UserError, match=r"recompute.mode=auto: the parameters, gradients and optimizer state take"):
        plan_auto(cfg, memory_bytes=auto_memory_for(extra, 0) * 0.5)


def test_auto_recompute_that_cannot_fit_exits_2_and_leaves_nothing(tmp_path):
    from conftest import SMALL, run_main

    run_dir = tmp_path / "run"  # in this process: both are refused before anything is built or written
    out = run_main("train", "--config", "tiny", "--run-dir", str(run_dir), *(f"--{o}" for o in SMALL),
                   "--recompute.mode=auto", "--recompute.memory_gib=0.0001")
    assert out.returncode == 2, out.stderr
    assert "recompute.mode=auto: the parameters" in out.stderr and "MiB of memory" in out.stderr
    assert not run_dir.exists()
    bad = run_main("train", "--config", "tiny", "--run-dir", str(run_dir), "--recompute.memory_gib=-1")
    assert bad.returncode == 2 and "recompute.memory_gib=-1" in bad.stderr and not run_dir.exists()


def test_auto_recompute_counts_autocasts_weight_copies_and_rl_needs_a_memory():
    """Training fp32 master weights in bf16 without data parallelism, autocast keeps a 16-bit copy of every
    weight for backward: auto counts 2 bytes a trained weight (none under FSDP, which frees its casts); loom rl,
    whose engine and reference model come after the plan, must be given the memory training may use."""
    from loom.config import load_config
    from loom.memory import plan_auto, state_bytes
    from loom.rules import recipe_problem

    extra = ["model.attention=math", "recompute.mode=auto"]
    big = 2.0**40
    bf16 = plan_auto(small_config(*extra, "train.dtype=bfloat16"), memory_bytes=big)
    params = state_bytes(small_config(*extra))["params_trained"]
    assert bf16["copy_bytes"] == 2 * params and "autocast weight copies" in describe(bf16)
    assert plan_auto(small_config(*extra), memory_bytes=big)["copy_bytes"] == 0  # fp32: nothing cast
    sharded = small_config(*extra, "train.dtype=bfloat16", "parallel.dp_shard=2")
    assert plan_auto(sharded, memory_bytes=big)["copy_bytes"] == 0
    rl = load_config("tiny-grpo", ["recompute.mode=auto"])
    assert "recompute.memory_gib" in recipe_problem("rl", rl)
    assert recipe_problem("rl", load_config("tiny-grpo", ["recompute.mode=auto", "recompute.memory_gib=4"])) is None


def describe(plan):
    from loom.memory import describe_plan

    return describe_plan(plan)
