"""LoRA (loom/models/lora.py, lora.* config): a tiny Qwen3-shaped Hugging Face model fine-tuned with adapters
lowers its held-out loss; FSDP equals one process; the PEFT export reproduces loom's logits in peft +
transformers and the merged export equals the adapter form; checkpoints hold the adapters only; DPO's
reference is the base with no second model; the planner's LoRA memory is the formula's."""

from __future__ import annotations

import gc
import json
import math
import os

import pytest
import torch

from conftest import randomize_hf_weights
from loom.cli import main
from loom.config import load_config
from loom.errors import UserError

transformers = pytest.importorskip("transformers")

VOCAB = 512
# A run from the HF base: fp32, one micro-batch (FSDP's run accumulates over two).
RUN = ["train.seq_len=64", "train.global_batch=8", "train.micro_batch=8", "train.steps=6", "train.eval_samples=8",
       "optim.lr=1e-2", "optim.warmup_steps=0", "optim.min_lr=1e-2", "data.split=80,20", "log.progress=none",
       "log.tensorboard=false", "sft.data=synthetic:120", "sft.template=chatml", "lora.rank=4", "lora.alpha=8",
       "lora.targets=all-linear", "checkpoint.interval=3"]


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory, tokenizer_file):
    """A tiny Qwen3 (q/k norms, head_dim 32 != hidden / heads, untied head) saved by transformers."""
    return _qwen3_base(tmp_path_factory, tokenizer_file, tied=False)


@pytest.fixture(scope="module")
def hf_base_tied(tmp_path_factory, tokenizer_file):
    """The same with the head tied to the embedding."""
    return _qwen3_base(tmp_path_factory, tokenizer_file, tied=True)


def _qwen3_base(tmp_path_factory, tokenizer_file, tied: bool):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=32, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=128,
                                   rms_norm_eps=1e-6, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    randomize_hf_weights(model)
    with torch.no_grad():  # a base that predicts something: smaller weights than the parity tests' spread
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(0.5)
    path = tmp_path_factory.mktemp("qwen3") / "hf"
    model.save_pretrained(path)
    (path / "tokenizer.json").write_bytes(tokenizer_file.read_bytes())
    return path


def _config(hf_base, *extra):
    from loom.interop.pretrained import resolve_init_from

    overrides = [f"train.init_from={hf_base}", *RUN, *extra]
    return resolve_init_from(load_config("tiny-sft", overrides, validate=False), overrides), overrides


def _sft_rank(run_dir: str, hf_base: str, extra: list[str], world: int):
    from loom.post import recipe_for
    from loom.train.trainer import Trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cfg, _ = _config(hf_base, *extra)
    trainer = Trainer(cfg, run_dir, quiet=True, recipe=recipe_for("sft"))
    before = trainer.evaluate()["val_loss"]  # step 0: B = 0, the base model
    trainer.fit()
    return before


def _metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, hf_base):
    """One process: (run directory, held-out loss of the base before training)."""
    run_dir = tmp_path_factory.mktemp("lora-sft") / "run"
    return run_dir, _sft_rank(str(run_dir), str(hf_base), [], 1)


# --- config and rules ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,message", [
    (["lora.rank=4", "lora.targets=q_proj,qkv"], "'qkv', which names no projection; valid: q_proj"),
    (["lora.rank=-1"], "lora.rank=-1 must be >= 0"),
    (["lora.rank=4", "lora.alpha=0"], "lora.alpha=0"),
    (["lora.rank=4", "lora.dropout=1"], r"lora.dropout=1\.0? must be in \[0, 1\)"),
    (["lora.rank=4", "parallel.tp=2"], "tensor parallelism would split the adapters' A"),
    (["lora.rank=4", "train.fp8=tensorwise"], "fp8 training replaces the linear layers"),
])
def test_bad_settings_are_refused_with_the_valid_choices(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config("tiny", overrides)


def test_moe_experts_take_no_adapters():
    with pytest.raises(UserError, match="mixtures of experts, whose stacked expert weights take no adapters"):
        load_config("tiny-moe", ["lora.rank=4", "lora.targets=q_proj,down_proj"])
    assert load_config("tiny-moe", ["lora.rank=4", "lora.targets=q_proj,o_proj"]).lora.rank == 4


# --- the module ------------------------------------------------------------------------------------------------


def test_adapters_start_at_the_base_and_merge_to_the_same_function():
    from loom.models.llama import build_model
    from loom.models.lora import adapters_disabled, apply_lora, merge, merged_state_dict, trainable_count

    cfg = load_config("tiny", ["model.layers=2", "model.hidden=32", "model.heads=4", "model.kv_heads=2",
                               "model.ffn_hidden=64", "model.vocab_size=64", "lora.rank=4", "lora.targets=all-linear",
                               "train.dtype=bfloat16"])
    model = build_model(cfg.model, seed=1)
    ids = torch.randint(0, 64, (2, 12))
    apply_lora(model, cfg.lora, torch.bfloat16)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)  # the base in train.dtype: no fp32 copy
    trained, total = trainable_count(model)
    assert trained == 2 * 4 * (32 + 32 + 32 + 16 + 32 + 16 + 32 + 32 + 32 + 64 + 32 + 64 + 64 + 32)  # r (in + out)
    model.float()
    with torch.no_grad():
        plain = build_model(cfg.model, seed=1)
        for p in plain.parameters():  # the same weights, rounded to bf16 alike
            p.copy_(p.bfloat16().float())
        base = plain(ids)
        assert torch.allclose(model(ids), base, atol=1e-6)  # B = 0
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
        adapted = model(ids)
        assert (adapted - base).abs().max() > 1e-2
        with adapters_disabled(model):
            assert torch.allclose(model(ids), base, atol=1e-6)
        state = merged_state_dict(model)
        assert not any("lora" in k for k in state)
        merged = merge(model)
        assert torch.allclose(merged(ids), adapted, atol=1e-5)
        assert all(torch.equal(state[k], v) for k, v in merged.state_dict().items())


def test_reward_model_head_trains_beside_the_adapters():
    from loom.build import build_in_layout, whole
    from loom.post.pref import RewardModel

    cfg = load_config("tiny", ["lora.rank=4"])
    model = build_in_layout(cfg, "meta", whole, extend=RewardModel().extend_model, adapters=True).model
    trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert "score.weight" in trained and all(n == "score.weight" or "lora_" in n for n in trained)
    assert len(trained) == 1 + 2 * 4 * cfg.model.layers  # q, k, v, o adapters of every layer, and the head


# --- training --------------------------------------------------------------------------------------------------


def test_lora_sft_lowers_held_out_loss_and_checkpoints_only_adapters(sft_run, hf_base):
    from torch.distributed.checkpoint import FileSystemReader

    run_dir, before = sft_run
    steps, evals = _metrics(run_dir)
    after = evals[-1]["val_loss"]
    assert after < before - 0.05, (before, after)
    assert steps[0]["loss"] == pytest.approx(before, rel=0.2)  # step 1 is the base
    ckpt = run_dir / "checkpoints" / "step-6"
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(k.endswith(("lora_A", "lora_B")) for k in model_keys), model_keys[:4]
    assert len(model_keys) == 2 * 7 * 2
    optim = [k for k in keys if k.startswith("optim.state.")]  # the frozen base has no optimizer state
    assert optim and all(".lora_A." in k or ".lora_B." in k for k in optim), optim[:4]
    assert json.loads((ckpt / "trainer_state.json").read_text())["lora_base"] == str(hf_base)


def test_lora_resume_continues_the_run(sft_run, hf_base, tmp_path):
    """Resumed from its step-3 checkpoint (adapters only), the run reaches the uninterrupted run's losses at steps
    4 to 6: the base is loaded again from train.init_from, the adapters and their optimizer state from the
    checkpoint."""
    import shutil

    from loom.post import recipe_for
    from loom.train.trainer import Trainer

    run_dir, _ = sft_run
    shutil.copytree(run_dir / "checkpoints" / "step-3", tmp_path / "run" / "checkpoints" / "step-3")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step-3\n")
    shutil.copyfile(run_dir / "metrics.jsonl", tmp_path / "run" / "metrics.jsonl")  # rows after step 3 are dropped
    cfg, _ = _config(hf_base, "checkpoint.resume=true")
    Trainer(cfg, tmp_path / "run", quiet=True, recipe=recipe_for("sft")).fit()
    got, want = _metrics(tmp_path / "run")[0], _metrics(run_dir)[0]
    assert [r["step"] for r in got] == list(range(1, 7))
    for g, w in zip(got[3:], want[3:]):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)


def _resumable_copy(run_dir, dst):
    import shutil

    shutil.copytree(run_dir / "checkpoints" / "step-3", dst / "checkpoints" / "step-3")
    (dst / "checkpoints" / "latest").write_text("step-3\n")
    shutil.copyfile(run_dir / "config.toml", dst / "config.toml")
    return (dst / "config.toml").read_bytes()


@pytest.mark.parametrize("change,named", [
    ("lora.targets=q_proj,v_proj", "lora.targets: ['all-linear'] in the checkpoint, ['q_proj', 'v_proj'] now (the "
     "trained adapters of k_proj, o_proj, gate_proj, up_proj, down_proj would be dropped)"),
    ("lora.alpha=16", "lora.alpha: 8.0 in the checkpoint, 16.0 now"),
    ("sft.template=llama3", "sft.template: 'chatml' in the checkpoint, 'llama3' now"),
    ("sft.packing=false", "sft.packing: True in the checkpoint, False now"),
])
def test_resume_that_changes_what_was_trained_is_refused_before_writing(change, named, sft_run, hf_base, tmp_path):
    """Changing the adapters or the examples on resume names the keys and the override, and leaves the run
    directory (its config.toml) as it was; the same change with checkpoint.allow_changes resumes."""
    from loom.post import recipe_for
    from loom.train.trainer import Trainer

    run_dir, _ = sft_run
    config = _resumable_copy(run_dir, tmp_path / "run")
    cfg, _ = _config(hf_base, "checkpoint.resume=true", change)
    with pytest.raises(UserError) as err:
        Trainer(cfg, tmp_path / "run", quiet=True, recipe=recipe_for("sft"))
    key = change.split("=")[0]
    assert named in str(err.value) and f"--checkpoint.allow_changes={key} " in str(err.value), str(err.value)
    assert (tmp_path / "run" / "config.toml").read_bytes() == config
    if key == "lora.alpha":
        cfg, _ = _config(hf_base, "checkpoint.resume=true", change, f"checkpoint.allow_changes={key}")
        resumed = Trainer(cfg, tmp_path / "run", quiet=True, recipe=recipe_for("sft"))
        assert resumed.state.step == 3 and resumed.cfg.lora.alpha == 16


def test_allow_changes_names_only_what_a_resume_may_change():
    with pytest.raises(UserError, match="checkpoint.allow_changes names 'train.seq_len', which a resume may not "
                                        "change on purpose; valid: lora.targets, lora.alpha, sft.data"):
        load_config("tiny", ["checkpoint.allow_changes=lora.alpha,train.seq_len"])


def test_lora_base_is_recorded_absolute_and_a_changed_base_is_refused(hf_base, tmp_path, monkeypatch):
    """A run started with a relative train.init_from records it absolute, so its adapters load from any directory;
    a base whose weights changed since is refused, by loading (loom.load_model, loom convert, loom generate) and by
    a resume."""
    import shutil

    from safetensors.torch import load_file, save_file

    import loom
    from loom.post import recipe_for
    from loom.train.trainer import Trainer

    shutil.copytree(hf_base, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    cfg, _ = _config("base", "train.steps=2", "train.eval_samples=4")
    assert cfg.train.init_from == str(tmp_path / "base")
    Trainer(cfg, tmp_path / "run", quiet=True, recipe=recipe_for("sft")).fit()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    loom.load_model(tmp_path / "run")
    weights = tmp_path / "base" / "model.safetensors"
    save_file({k: v * 1.01 for k, v in load_file(weights).items()}, weights)  # the base, trained a little further
    with pytest.raises(UserError, match="trained on the base model at .*base, whose weights have changed since"):
        loom.load_model(tmp_path / "run")
    cfg, _ = _config(tmp_path / "base", "train.steps=3", "train.eval_samples=4", "checkpoint.resume=true")
    with pytest.raises(UserError, match="whose weights have changed since"):
        Trainer(cfg, tmp_path / "run", quiet=True, recipe=recipe_for("sft"))


# FSDP (mixed requires_grad in every unit) and pipeline stages (one layer each, four micro-batches).
LAYOUTS = {"dp_shard2": ["parallel.dp_shard=2"], "pp2": ["parallel.pp=2"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_equals_one_process(layout, sft_run, hf_base, tmp_path):
    from distributed import shared_pool
    from loom.interop.peft import load_adapted

    run_dir, _ = sft_run
    fsdp_dir = tmp_path / layout
    shared_pool(2).run(_sft_rank, str(fsdp_dir), str(hf_base), [*LAYOUTS[layout], "train.micro_batch=2"], 2)
    got, want = _metrics(fsdp_dir)[0], _metrics(run_dir)[0]
    assert len(got) == len(want) == 6
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm"):
            assert math.isclose(g[key], w[key], rel_tol=1e-5), (g["step"], key, g[key], w[key])
    a, _, _ = load_adapted(fsdp_dir)
    b, _, _ = load_adapted(run_dir)
    sa, sb = a.state_dict(), b.state_dict()
    adapters = [k for k in sa if "lora_" in k]
    assert adapters and max((sa[k] - sb[k]).abs().max().item() for k in adapters) < 1e-5
    assert max(sb[k].abs().max().item() for k in adapters if k.endswith("lora_B")) > 1e-3  # trained


def test_lora_pipeline_on_a_tied_model_equals_one_process(hf_base_tied, tmp_path):
    """Issue 58 item 2: pipeline stages of a tied model hold the embedding and the head apart and sum their
    gradients; under LoRA both are frozen (no gradient), which crashed the exchange. Two stages equal one process."""
    from distributed import shared_pool

    one, two = tmp_path / "one", tmp_path / "two"
    extra = ["train.micro_batch=2", "train.steps=3"]
    _sft_rank(str(one), str(hf_base_tied), extra, 1)
    shared_pool(2).run(_sft_rank, str(two), str(hf_base_tied), [*extra, "parallel.pp=2"], 2)
    got, want = _metrics(two)[0], _metrics(one)[0]
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm"):
            assert math.isclose(g[key], w[key], rel_tol=1e-5), (g["step"], key, g[key], w[key])


# --- export ----------------------------------------------------------------------------------------------------


def test_peft_export_reproduces_loom_logits_and_merged_export_equals_adapters(sft_run, hf_base, tmp_path, capsys):
    import loom
    from peft import PeftModel

    from loom.interop.peft import load_adapted

    run_dir, _ = sft_run
    assert main(["convert", str(run_dir), str(tmp_path / "peft"), "--to", "peft"]) == 0
    assert (tmp_path / "peft" / "tokenizer.json").is_file()
    assert main(["convert", str(run_dir), str(tmp_path / "merged"), "--to", "hf", "--merge"]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"])
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    adapted, _, _ = load_adapted(run_dir)
    with torch.no_grad():
        mine = adapted(ids)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32).eval()
        theirs = PeftModel.from_pretrained(base, tmp_path / "peft").eval()(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        merged_logits = merged(input_ids=ids).logits
        loom_merged = loom.load_model(run_dir)(ids)  # what `loom generate --checkpoint RUN` runs
        plain = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32).eval()
        base_logits = plain(input_ids=ids).logits
    assert (mine - base_logits).abs().max() > 1e-3  # the adapters change the function
    assert (mine - theirs).abs().max() < 1e-4
    assert (merged_logits - theirs).abs().max() < 1e-4
    assert (loom_merged - mine).abs().max() < 1e-4
    with torch.no_grad():  # the adapter directory itself, as loom generate / loom serve --model take it
        from_peft = loom.load_model(tmp_path / "peft")(ids)
    assert (from_peft - theirs).abs().max() < 1e-4
    from loom.generate import find_tokenizer

    assert find_tokenizer(str(tmp_path / "peft")) == tmp_path / "peft" / "tokenizer.json"
    config["base_model_name_or_path"] = str(tmp_path / "nowhere")
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="nowhere.*is not a directory here"):
        loom.load_model(tmp_path / "peft")
    config.update(base_model_name_or_path=str(hf_base), use_dora=True)
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="use_dora"):
        loom.load_model(tmp_path / "peft")
    capsys.readouterr()
    assert main(["convert", str(run_dir), str(tmp_path / "x"), "--to", "hf"]) == 2
    assert "--to hf --merge" in capsys.readouterr().err and not (tmp_path / "x").exists()


# --- DPO -------------------------------------------------------------------------------------------------------


def test_dpo_lora_from_a_lora_sft_run_uses_the_base_without_a_second_model(sft_run, hf_base, tmp_path):
    """LoRA SFT -> LoRA DPO (train.init_from = the SFT run: its base with its adapters merged). DPO's reference
    log-probs are that model's (adapters off), equal to the merged SFT model loom.load_model returns, and the run
    holds one model: one Transformer alive, whose parameters are the base's plus the adapters, nothing else."""
    import loom
    from loom.interop import import_hf
    from loom.models.llama import Transformer
    from loom.post import recipe_for
    from loom.post.losses import sequence_logprobs
    from loom.train.trainer import Trainer

    run_dir, _ = sft_run
    overrides = [f"train.init_from={run_dir}", "train.seq_len=127", "train.global_batch=4", "train.micro_batch=4",
                 "train.steps=2", "train.eval_samples=4", "log.progress=none", "log.tensorboard=false",
                 "pref.data=synthetic:40", "data.split=80,20", "lora.rank=4", "optim.lr=1e-2", "optim.warmup_steps=0"]
    from loom.interop.pretrained import resolve_init_from

    cfg = resolve_init_from(load_config("tiny-dpo", overrides, validate=False), overrides)
    recipe = recipe_for("dpo")
    recipe.check(cfg)
    def alive():
        gc.collect()
        return [o for o in gc.get_objects() if isinstance(o, Transformer)]

    before = alive()  # other tests' models, if any are still referenced
    trainer = Trainer(cfg, tmp_path / "run", quiet=True, recipe=recipe)
    trainer.fit()
    models = [m for m in alive() if not any(m is b for b in before)]
    del before
    assert len(models) == 1, len(models)
    n_base = sum(p.numel() for n, p in models[0].named_parameters() if "lora_" not in n)
    base, _, _ = import_hf(hf_base)
    assert n_base == sum(p.numel() for p in base.parameters())
    rows = trainer.train_data.rows_of(trainer.train_data.used_pairs()[:2])
    with torch.no_grad():
        want = sequence_logprobs(loom.load_model(run_dir)(rows["input_ids"]), rows["labels"]).double().view(-1, 2)
        plain = sequence_logprobs(base(rows["input_ids"]), rows["labels"]).double().view(-1, 2)
    got = trainer.train_data.ref[torch.as_tensor(trainer.train_data.used_pairs()[:2])]
    assert torch.allclose(got, want, atol=1e-4)
    assert (got - plain).abs().max() > 1e-3  # the SFT adapters are in the reference: not the HF base alone
    # Resumed (adapters trained by now): the reference is computed again with them off, and is the same.
    first = trainer.train_data.ref
    del trainer, models
    cfg.checkpoint.resume, cfg.train.steps = True, 3
    resumed = Trainer(cfg, tmp_path / "run", quiet=True, recipe=recipe_for("dpo"))
    known = ~torch.isnan(first)
    assert known.any() and torch.allclose(resumed.train_data.ref[known], first[known], atol=1e-6)
    # Its adapters were trained on the SFT run's merged model, which peft cannot load as a base (and the HF base
    # alone is another model): the PEFT export is refused, naming the merged export to run instead, which works.
    from loom.interop import convert

    with pytest.raises(UserError, match=f"a LoRA run, whose own adapters are part of that base; .* Export the adapted "
                                        f"model merged instead: loom convert {tmp_path / 'run'} .* --to hf --merge"):
        convert(tmp_path / "run", tmp_path / "peft", "peft")
    assert not (tmp_path / "peft").exists()
    convert(tmp_path / "run", tmp_path / "merged", "hf", merge=True)
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged") is not None


# --- memory ----------------------------------------------------------------------------------------------------


def test_planner_lora_memory_is_the_formula_and_8b_is_plannable():
    from loom.planner.command import add_arguments, build_workload
    from loom.planner.memory import memory
    from loom.planner.params import total_params
    from loom.planner.search import search
    from loom.planner.workload import GIB, Layout

    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    w, _ = build_workload(p.parse_args(["--model", "llama3-8b", "--recipe", "sft", "--lora.rank=16", "--gpus", "2",
                                        "--seq", "2048", "--global-batch", "8"]))
    m = w.model
    # rank 16 on q, k, v, o: 16 x (in + out) per projection, 32 layers (Llama-3-8B: h 4096, 8 kv heads of 128)
    adapters = 32 * 16 * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096))
    frozen = total_params(m)
    got = memory(w, Layout(dp=2, micro_batch=1))
    assert got["params"] == pytest.approx((2 * frozen + 4 * adapters) / 2)
    assert got["grads"] == pytest.approx(4 * adapters / 2)
    assert got["optimizer"] == pytest.approx(8 * adapters / 2)
    full = memory(build_workload(p.parse_args(["--model", "llama3-8b", "--gpus", "2", "--seq", "2048",
                                               "--global-batch", "8"]))[0], Layout(dp=2, micro_batch=1))
    assert full["params"] + full["grads"] + full["optimizer"] - got["params"] - got["grads"] - got["optimizer"] \
        > 50 * GIB
    w1, _ = build_workload(p.parse_args(["--model", "llama3-8b", "--recipe", "sft", "--lora.rank=16", "--gpus", "1",
                                         "--seq", "2048", "--global-batch", "8", "--quick"]))
    best, _ = search(w1, top=1)
    assert best and best[0].fits and best[0].layout.tp == 1


def test_loom_memory_and_banner_know_lora():
    from loom.memory import state_bytes
    from loom.train.banner import lora_line

    cfg = load_config("tiny", ["lora.rank=8", "train.dtype=bfloat16", "parallel.dp_shard=1"])
    full = state_bytes(load_config("tiny"))
    got = state_bytes(cfg)
    trained, total = got["params_trained"], got["params_total"]
    assert total - trained == full["params_total"]
    assert got["params_bytes"] == 2 * (total - trained) + 4 * trained
    assert got["grads_bytes"] == 4 * trained and got["optimizer_bytes"] == 8 * trained
    line = lora_line(cfg, total, trained)
    assert f"{trained:,} trainable of {total:,}" in line and "16 -> 2 bytes per frozen parameter" in line


# --- RL --------------------------------------------------------------------------------------------------------


RL_LORA = ["lora.rank=4", "lora.targets=all-linear", "rl.kl_coef=0.1", "train.steps=2", "rl.valid_prompts=addition:4"]


@pytest.fixture(scope="module")
def rl_lora_run(tmp_path_factory):
    from test_rl import RL

    run_dir = tmp_path_factory.mktemp("rl-lora") / "run"
    assert main(["rl", "--config", "tiny-grpo", "--run-dir", str(run_dir), *[f"--{o}" for o in RL + RL_LORA]]) == 0
    return run_dir


def test_rl_lora_refits_merged_weights_and_engine_logprobs_equal_the_trainers(rl_lora_run):
    """GRPO with adapters and a KL term: the engine (no adapters) is refitted with W + scale B A after every
    update, so its log-probs stay the trainer's (the mismatch test_rl.py checks for full fine-tuning), the
    adapters do move, and the KL's reference is the base (adapters off): no second model."""
    from test_rl import rows

    steps, _ = rows(rl_lora_run)
    assert len(steps) == 2
    for r in steps:
        assert r["logp_abs_diff"] < 1e-4 and abs(r["prob_ratio_mean"] - 1) < 1e-4
    assert steps[0]["grad_norm"] > 0
    assert steps[0]["kl"] == pytest.approx(0, abs=1e-9) and steps[-1]["kl"] > 1e-9  # B = 0 at first: the base


def _rl_rank(run_dir: str, overrides: list[str], world: int) -> None:
    from loom.post import recipe_for
    from loom.train.trainer import Trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    recipe = recipe_for("rl")
    cfg = load_config("tiny-grpo", overrides)
    recipe.check(cfg)
    Trainer(cfg, run_dir, quiet=True, recipe=recipe).fit()


def test_rl_lora_fsdp_equals_one_process(rl_lora_run, tmp_path):
    from distributed import shared_pool
    from test_rl import RL, rows

    # The refit merges FSDP's row shards shard by shard (W_local + scale B_local A) into DTensors the engine gathers.
    shared_pool(2).run(_rl_rank, str(tmp_path / "run"), RL + RL_LORA + ["parallel.dp_shard=2"], 2)
    got, want = rows(tmp_path / "run")[0], rows(rl_lora_run)[0]
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert g["logp_abs_diff"] < 1e-4
        for key in ("loss", "grad_norm", "kl", "reward"):
            assert math.isclose(g[key], w[key], rel_tol=1e-5, abs_tol=1e-9), (g["step"], key, g[key], w[key])


def test_a_lora_run_served_per_request_equals_its_merged_model(sft_run, hf_base):
    """`loom serve --lora NAME=RUN` (loom/infer/adapters.py): the run's adapters on the base, chosen per request
    and batched with base requests, give the logits of the merged run (`loom.load_model(RUN)`) and leave the
    base rows the base's."""
    import loom
    from loom.infer.adapters import AdapterRows, attach_adapters

    run_dir, _ = sft_run
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    model = loom.load_model(hf_base)
    with torch.no_grad():
        base = model(ids)
        rows = attach_adapters(model, {"run": str(run_dir)})
        assert isinstance(rows, AdapterRows)
        rows.bind([0] * 24 + [None] * 24, ids.device)  # row 0 with the run's adapters, row 1 the base
        mixed = model(ids)
        rows.clear()
        merged = loom.load_model(run_dir)(ids)
    assert (merged[0] - base[0]).abs().max() > 1e-3  # the adapters change the function
    assert (mixed[0] - merged[0]).abs().max() < 1e-4
    assert (mixed[1] - base[1]).abs().max() < 1e-5
