"""Pretrained weights: Llama 3.1 RoPE scaling, Qwen2.5 (q/k/v biases) and Qwen3 (q/k norm, decoupled head
size) compute transformers' logits; `train.init_from` starts training at transformers' loss in one process
and under tp=2, pp=2 and dp_shard=2 (each rank reading only its slices); contradictions are refused."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import loom
from conftest import ROOT, randomize_hf_weights, save_hf_models
from loom.cli import main
from loom.config import load_config
from loom.interop import convert
from loom.interop.pretrained import describe_source, load_pretrained, resolve_init_from
from loom.models.llama import build_model

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # logits, fp32
LOSS_RTOL = 1e-5  # step-1 loss vs transformers, fp32
VOCAB = 512
RUN = ["train.seq_len=32", "train.micro_batch=2", "train.global_batch=8", "train.steps=1", "train.eval_samples=4",
       "data.corpus_max_bytes=300000", "log.progress=none", "log.tensorboard=false", "checkpoint.save_final=false"]


def hf_config(kind: str):
    common = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=160, vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-6)
    if kind == "llama31":  # original context 16 < 32 positions used: the scaling changes the result
        return transformers.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0})
    if kind == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)  # hidden/heads = 16


def random_hf_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return randomize_hf_weights(transformers.AutoModelForCausalLM.from_config(hf_config(kind)))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tokenizer_file):
    """{kind: (directory written by save_pretrained with tokenizer.json, the transformers model)}."""
    return save_hf_models(tmp_path_factory, ("llama31", "qwen2", "qwen3"), random_hf_model, tokenizer_file)


def first_batch(overrides):
    """The global batch of step 1 as `loom train` reads it (independent of the layout)."""
    from loom.data.token_datasets import build_datasets
    from loom.data.tokenizer import load_tokenizer

    cfg = resolve_init_from(load_config("tiny", overrides, validate=False), overrides)
    train, _ = build_datasets(cfg, load_tokenizer(cfg))
    return train.batch(0, cfg.train.global_batch)


def reference_loss(model_fn, batch) -> float:
    """Mean next-token cross-entropy over the batch, in float64, from `model_fn(ids) -> logits`."""
    with torch.no_grad():
        logits = model_fn(batch["input_ids"]).double()
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()


def step1_loss(run_dir) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in rows if r.get("step") == 1 and "loss" in r)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], capture_output=True, text=True, cwd=ROOT)


# --- the model computes what transformers computes ------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama31", "qwen2", "qwen3"])
def test_logits_match_transformers(tmp_path, hf_dirs, kind):
    src, hf_model = hf_dirs[kind]
    ids = torch.randint(0, VOCAB, (2, 48))
    with torch.no_grad():
        want = hf_model(input_ids=ids).logits
    model = loom.load_model(src)
    cfg = model.cfg
    assert (cfg.rope_scaling == "llama3") == (kind == "llama31")
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.tie_embeddings) == (kind == "qwen2", kind == "qwen3", kind == "qwen2")
    assert cfg.head_dim == (32 if kind == "qwen3" else 16)
    with torch.no_grad():
        got = model(ids)
    assert (got - want).abs().max().item() < TOL

    # The feature is not silently off: without it the logits are far from transformers'.
    with torch.no_grad():
        if kind == "llama31":
            from loom.models.llama import rope_tables

            model.rope_cos, model.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        elif kind == "qwen2":
            for layer in model.layers.values():
                layer.attention.wq.bias.zero_()
        else:
            for layer in model.layers.values():
                layer.attention.q_norm = layer.attention.k_norm = None
        assert (model(ids) - want).abs().max().item() > 100 * TOL

    # loom convert both ways: same logits, and transformers loads the result as the same architecture.
    loom_dir = convert(src, tmp_path / "loom", to="loom")
    with torch.no_grad():
        assert (loom.load_model(loom_dir)(ids) - want).abs().max().item() < TOL
    back = convert(loom_dir, tmp_path / "hf2", to="hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    assert type(reloaded).__name__ == type(hf_model).__name__
    with torch.no_grad():
        assert (reloaded(input_ids=ids).logits - want).abs().max().item() < TOL


def test_generate_on_converted_qwen(tmp_path, hf_dirs, capsys):
    """`loom generate` on a converted Qwen3 model continues a prompt as transformers' greedy search does."""
    from loom.data.tokenizer import Tokenizer

    src, hf_model = hf_dirs["qwen3"]
    loom_dir = convert(src, tmp_path / "qwen-loom", to="loom")
    prompt = "def main():"
    tok = Tokenizer.from_file(loom_dir / "tokenizer.json")
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = hf_model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    assert tok.eod_id not in new
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(loom_dir), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == prompt + tok.decode(new)


# --- train.init_from ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama31", "qwen2", "qwen3"])
def test_init_from_hf_step1_loss_matches_transformers(tmp_path, hf_dirs, kind):
    src, hf_model = hf_dirs[kind]
    overrides = RUN + [f"train.init_from={src}"]
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--run-dir", str(run_dir), *[f"--{o}" for o in overrides]]) == 0
    want = reference_loss(lambda ids: hf_model(input_ids=ids).logits, first_batch(overrides))
    got = step1_loss(run_dir)
    print(f"step-1 loss {got!r} vs transformers {want!r}: relative difference {abs(got - want) / want:.1e}")
    assert math.isclose(got, want, rel_tol=LOSS_RTOL), (got, want)
    saved = load_config(str(run_dir / "config.toml"))
    assert saved.model == describe_source(src).model and saved.data.tokenizer == str(src / "tokenizer.json")
    # A random start is far from it: the weights really came from the source.
    assert abs(want - math.log(VOCAB)) > 0.1


# (layout, model): each layout with the feature its sharding could get wrong.
LAYOUTS = [
    pytest.param(["parallel.tp=2"], "qwen3", id="tp2-qwen3"),  # q/k norm over sharded heads, decoupled head size
    pytest.param(["parallel.pp=2"], "llama31", id="pp2-llama31"),
    pytest.param(["parallel.dp_shard=2"], "qwen2", id="dp_shard2-qwen2"),  # sharded biases, tied embeddings
    pytest.param(["parallel.cp=2"], "llama31", id="cp2-llama31"),  # scaled RoPE at each chunk's positions
    pytest.param(["parallel.tp=2", "parallel.sp=true"], "qwen2", id="tp2-sp-qwen2"),
]


@pytest.mark.parametrize("extra,kind", LAYOUTS)
def test_init_from_hf_parallel_step1_loss(tmp_path, hf_dirs, extra, kind):
    """`loom train --nproc 2` in the session's kept rank processes (tests/pool_launch.py); the command itself
    with train.init_from is run by test_init_from_loom_checkpoint_and_model_dir."""
    from pool_launch import launch_in_pool

    src, hf_model = hf_dirs[kind]
    overrides = RUN + [f"train.init_from={src}", *extra]
    run_dir = tmp_path / "run"
    launch_in_pool("train", "tiny", run_dir, 2, overrides)
    want = reference_loss(lambda ids: hf_model(input_ids=ids).logits, first_batch(overrides))
    got = step1_loss(run_dir)
    print(f"step-1 loss {got!r} vs transformers {want!r}: relative difference {abs(got - want) / want:.1e}")
    assert math.isclose(got, want, rel_tol=LOSS_RTOL), (got, want)


def test_init_from_loom_checkpoint_and_model_dir(tmp_path, hf_dirs):
    """A loom checkpoint (DCP shards, read into dp_shard=2) and a converted loom model directory (one
    process) start at the loss that model has when loaded whole in one process."""
    src, hf_model = hf_dirs["qwen3"]
    first = tmp_path / "first"
    base = [o for o in RUN if not o.startswith("checkpoint.save_final")]
    assert main(["train", "--config", "tiny", "--run-dir", str(first), f"--train.init_from={src}",
                 *[f"--{o}" for o in base]]) == 0
    ckpt = first / "checkpoints" / "step-1"
    assert (ckpt / ".metadata").is_file()
    overrides = RUN + [f"train.init_from={first}", "parallel.dp_shard=2"]
    run_dir = tmp_path / "from-ckpt"
    proc = cli("train", "--config", "tiny", "--run-dir", str(run_dir), "--nproc", "2", *[f"--{o}" for o in overrides])
    assert proc.returncode == 0, proc.stderr[-4000:]
    batch = first_batch(overrides)
    trained = loom.load_model(first)
    want = reference_loss(trained, batch)
    assert math.isclose(step1_loss(run_dir), want, rel_tol=LOSS_RTOL)
    assert abs(want - reference_loss(lambda ids: hf_model(input_ids=ids).logits, batch)) > 1e-4  # it was updated

    loom_dir = convert(src, tmp_path / "qwen-loom", to="loom")
    overrides = RUN + [f"train.init_from={loom_dir}"]
    run_dir = tmp_path / "from-dir"
    assert main(["train", "--config", "tiny", "--run-dir", str(run_dir), *[f"--{o}" for o in overrides]]) == 0
    want = reference_loss(lambda ids: hf_model(input_ids=ids).logits, first_batch(overrides))
    assert math.isclose(step1_loss(run_dir), want, rel_tol=LOSS_RTOL)


def test_load_pretrained_one_process_reads_everything(hf_dirs):
    src, _ = hf_dirs["qwen2"]
    model = build_model(describe_source(src).model, seed=1)
    assert load_pretrained(model, src) == {"kind": "hf", "elements_read": model.num_params()}


def test_load_pretrained_reads_only_local_slices_tp2_dp_shard2(hf_dirs):
    """tp=2 x dp_shard=2 (2-D DTensors, FSDP sharding TP shards): every weight is exact, and each rank
    read exactly its local elements, a fraction of the model."""
    from distributed import shared_pool
    from pretrained_ranks import load_on_rank

    src, _ = hf_dirs["qwen3"]
    overrides = RUN + [f"train.init_from={src}", "parallel.tp=2", "parallel.dp_shard=2"]
    results = shared_pool(4).run(load_on_rank, str(src), overrides)
    for read, local, total in results:
        assert read == local and read < total / 2, (read, local, total)


def test_refusals(tmp_path, hf_dirs, tokenizer_file, capsys):
    src, _ = hf_dirs["qwen3"]

    def train(*extra, init_from=src):
        capsys.readouterr()
        code = main(["train", "--config", "tiny", "--print-config", "--train.seq_len=32",
                     f"--train.init_from={init_from}", *extra])
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        return code, out.out, out.err

    # The architecture comes from PATH: the file's [model] values are replaced, a free key may be set.
    code, out, err = train("--model.max_seq_len=48", "--model.layers=4", "--model.dropout=0.1")
    assert code == 0, err
    assert "head_dim = 32" in out and "qk_norm = true" in out and "max_seq_len = 48" in out and "layers = 4" in out
    assert "dropout = 0.1" in out and f'tokenizer = "{src / "tokenizer.json"}"' in out

    code, _, err = train("--model.layers=3")
    assert code == 2 and "model.layers=3 contradicts train.init_from" in err, err
    code, _, err = train("--model.qk_norm=false")
    assert code == 2 and "model.qk_norm=False contradicts" in err, err

    # A tokenizer with the same vocabulary (another copy) is accepted, another vocabulary is refused.
    code, _, err = train(f"--data.tokenizer={tokenizer_file}")
    assert code == 0, err
    from loom.data.tokenizer import get_tokenizer

    other = tmp_path / "other.json"
    get_tokenizer("bpe", 400, 300000).save(other)
    code, _, err = train(f"--data.tokenizer={other}")
    assert code == 2 and "another vocabulary" in err, err

    code, _, err = train(init_from=tmp_path / "nope")
    assert code == 2 and "does not exist" in err
    notok = tmp_path / "notok"
    notok.mkdir()
    for f in src.iterdir():
        if f.name != "tokenizer.json":
            (notok / f.name).write_bytes(f.read_bytes())
    code, _, err = train(init_from=notok)
    assert code == 2 and "has no tokenizer.json" in err

    # The exit code of the command itself (a contradicting override, through `loom train`).
    proc = cli("train", "--config", "tiny", "--print-config", f"--train.init_from={src}", "--model.hidden=32")
    assert proc.returncode == 2 and "model.hidden=32 contradicts" in proc.stderr and "Traceback" not in proc.stderr
