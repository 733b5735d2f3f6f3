"""Hugging Face mixture-of-experts models <-> loom: Mixtral, Qwen2-MoE (shared expert with its sigmoid gate,
dense first layer) and Qwen3-MoE (q/k norm, renormalised top-k) compute transformers' logits in fp32,
convert both ways (transformers loads the export with the same logits), start `train.init_from` at
transformers' loss and generate transformers' greedy continuation; what loom cannot compute is refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import loom
from conftest import randomize_hf_weights, save_hf_models
from loom.cli import main
from loom.config import Config, ModelConfig, MoEConfig
from loom.errors import UserError
from loom.interop import convert, export_hf, hf_config_from_model, import_hf, model_config_from_hf
from loom.interop.hf_names import Piece, read_piece
from loom.models.llama import build_model

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # logits, fp32
LOSS_RTOL = 1e-5  # step-1 loss vs transformers, fp32
VOCAB = 512
KINDS = ["mixtral", "qwen2_moe", "qwen3_moe"]


def hf_config(kind: str):
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=64, rms_norm_eps=1e-6)
    if kind == "mixtral":  # every layer MoE, top-2 of 4, renormalised (always, in Mixtral)
        return transformers.MixtralConfig(**common, num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                                          num_experts_per_tok=2, rope_theta=1e6)
    if kind == "qwen2_moe":  # layer 0 dense (96 wide), experts 32 wide, shared expert 2 x 32, q/k/v biases
        return transformers.Qwen2MoeConfig(**common, num_hidden_layers=3, intermediate_size=96, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=64, norm_topk_prob=False,
                                           mlp_only_layers=[0], use_sliding_window=False)
    return transformers.Qwen3MoeConfig(**common, num_hidden_layers=2, intermediate_size=96, num_experts=8,
                                       num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                       head_dim=32)  # hidden / heads = 16


def random_hf_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return randomize_hf_weights(transformers.AutoModelForCausalLM.from_config(hf_config(kind)))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tokenizer_file):
    """{kind: (directory written by save_pretrained with tokenizer.json, the transformers model)}."""
    return save_hf_models(tmp_path_factory, KINDS, random_hf_model, tokenizer_file)


def logits(model, ids):
    with torch.no_grad():
        out = model(input_ids=ids) if isinstance(model, transformers.PreTrainedModel) else model(ids)
    return getattr(out, "logits", out).float()


def prompts(seed: int = 1):
    return torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(seed))


def tensor_names(directory) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def chosen_experts(hf_model, ids):
    """transformers' expert choice [tokens, k] on the first MoE layer (from its router's own output)."""
    seen = {}

    def hook(module, args, out):
        seen["index"] = out[2]

    layer = next(layer for layer in hf_model.model.layers if hasattr(layer.mlp, "gate"))
    handle = layer.mlp.gate.register_forward_hook(hook)
    logits(hf_model, ids)
    handle.remove()
    return seen["index"]


# --- logits, both directions --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers_and_round_trip(tmp_path, hf_dirs, kind):
    src, hf_model = hf_dirs[kind]
    ids = prompts()
    want = logits(hf_model, ids)
    # The tokens really go to different experts: every expert is used and most tokens' choices differ from
    # the first token's, so a wrong expert order or router row would change the result.
    index = chosen_experts(hf_model, ids)
    experts = hf_model.config.num_local_experts if kind != "qwen2_moe" else hf_model.config.num_experts
    assert set(index.flatten().tolist()) == set(range(experts))
    assert len({tuple(sorted(row)) for row in index.tolist()}) >= 4

    model = loom.load_model(src)
    cfg = model.cfg
    assert (cfg.moe.router, cfg.moe.capacity_factor) == ("softmax", 0.0)
    assert cfg.moe.renormalize == (kind != "qwen2_moe")
    assert (cfg.moe.shared_experts, cfg.moe.shared_gate, cfg.moe.first_dense) == (
        (2, True, 1) if kind == "qwen2_moe" else (0, False, 0))
    assert cfg.moe.load_balance_coeff == hf_model.config.router_aux_loss_coef
    assert (logits(model, ids) - want).abs().max().item() < TOL

    loom_dir = convert(src, tmp_path / "loom", to="loom")
    assert (logits(loom.load_model(loom_dir), ids) - want).abs().max().item() < TOL
    back = convert(loom_dir, tmp_path / "hf2", to="hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    assert type(reloaded).__name__ == type(hf_model).__name__
    assert reloaded.config.to_dict()["mlp_only_layers" if kind == "qwen2_moe" else "num_experts_per_tok"] == (
        [0] if kind == "qwen2_moe" else 2)
    assert (logits(reloaded, ids) - want).abs().max().item() < TOL
    # The export is written as save_pretrained writes it (one tensor per expert), so older readers load it too.
    assert tensor_names(back) == tensor_names(src)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_routing_or_mapping_would_be_caught(hf_dirs, kind):
    """Each mapping choice matters: swapping two experts, flipping the top-k renormalisation or dropping the
    shared expert's gate moves the logits far beyond the tolerance."""
    src, hf_model = hf_dirs[kind]
    ids = prompts()
    want = logits(hf_model, ids)

    def off_by(mutate) -> float:
        model = loom.load_model(src)
        moe = next(b.feed_forward for b in model.layers.values() if hasattr(b.feed_forward, "router"))
        with torch.no_grad():
            mutate(moe)
        return (logits(model, ids) - want).abs().max().item()

    def swap_experts(moe):
        for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
            w[[0, 1]] = w[[1, 0]]

    def flip_renormalize(moe):
        moe.router.renormalize = not moe.router.renormalize

    assert off_by(swap_experts) > 100 * TOL
    assert off_by(flip_renormalize) > 100 * TOL
    if kind == "qwen2_moe":
        assert off_by(lambda moe: setattr(moe, "shared_gate", None)) > 100 * TOL


def test_fused_expert_layout_is_read(tmp_path, hf_dirs):
    """transformers 5 holds experts fused (gate_up_proj [E, 2 ffn, hidden], down_proj [E, hidden, ffn]);
    a directory saved in that layout imports, and train.init_from reads it, to the same weights."""
    from safetensors.torch import save_file

    from loom.interop.pretrained import describe_source, load_pretrained

    for kind in ("mixtral", "qwen3_moe"):
        src, hf_model = hf_dirs[kind]
        state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in state)  # the in-memory layout is fused
        fused = tmp_path / kind
        fused.mkdir()
        (fused / "config.json").write_text((src / "config.json").read_text())
        save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
        ids = prompts()
        imported = loom.load_model(fused)
        assert (logits(imported, ids) - logits(hf_model, ids)).abs().max().item() < TOL
        model = build_model(describe_source(fused).model, seed=3)
        assert load_pretrained(model, fused) == {"kind": "hf", "elements_read": model.num_params()}
        for (name, a), b in zip(model.state_dict().items(), imported.state_dict().values()):
            assert torch.equal(a, b), name


def test_pieces_read_any_slice(tmp_path):
    """What a rank holding part of the experts (EP, FSDP) or of each (TP) reads: any slice of a stacked
    expert weight, from per-expert or fused tensors on disk, equals that slice of the whole."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    per_expert = {f"e{i}": torch.randn(6, 5, generator=g) for i in range(4)}  # nn.Linear [out, in]
    fused = torch.randn(4, 12, 5, generator=g)  # [E, 2 x 6 rows, in]
    save_file({**per_expert, "fused": fused}, str(tmp_path / "w.safetensors"))
    whole = {
        "experts": torch.stack([per_expert[f"e{i}"].t() for i in range(4)]),
        "up": fused[:, 6:].transpose(1, 2),
    }
    pieces = {"experts": Piece(tuple(f"e{i}" for i in range(4)), "experts"), "up": Piece(("fused",), "fused", (6, 12))}
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        for key, piece in pieces.items():
            assert torch.equal(read_piece(piece, f.get_slice), whole[key])
            for where in [(slice(1, 3), slice(0, 5), slice(0, 6)), (slice(0, 4), slice(2, 4), slice(3, 6)),
                          (slice(3, 4), slice(4, 5), slice(0, 2))]:
                assert torch.equal(read_piece(piece, f.get_slice, where), whole[key][where]), (key, where)


def test_loom_born_moe_exports_with_its_layer_rule(tmp_path):
    """An MoE model made in loom (MoE on layers 0 and 2 of 4: moe.interval=2) exports as Qwen3-MoE with
    mlp_only_layers [1, 3]; transformers computes its logits, and reading it back gives the same rule."""
    cfg = Config(model=ModelConfig(layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=80, vocab_size=200,
                                   max_seq_len=64, qk_norm=True,
                                   moe=MoEConfig(experts=4, top_k=2, ffn_hidden=40, interval=2, renormalize=True)))
    model = build_model(cfg.model, seed=0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.08)
    out = export_hf(model, cfg, tmp_path / "out")
    hf = json.loads((out / "config.json").read_text())
    assert (hf["model_type"], hf["mlp_only_layers"], hf["norm_topk_prob"]) == ("qwen3_moe", [1, 3], True)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    assert (logits(reloaded, ids) - logits(model, ids)).abs().max().item() < TOL
    back = model_config_from_hf(hf)
    assert (back.moe.first_dense, back.moe.interval, back.moe_layers) == (0, 2, 2)


# --- train.init_from and generate ------------------------------------------------------------------------


RUN = ["train.seq_len=32", "train.micro_batch=2", "train.global_batch=4", "train.steps=1", "train.eval_samples=4",
       "data.corpus_max_bytes=300000", "log.progress=none", "log.tensorboard=false", "checkpoint.save_final=false"]


def transformers_loss(hf_model, overrides) -> float:
    """transformers' mean next-token cross-entropy (float64) on the global batch of step 1 as `loom train`
    reads it with these overrides."""
    from loom.config import load_config
    from loom.data.token_datasets import build_datasets
    from loom.data.tokenizer import load_tokenizer
    from loom.interop.pretrained import resolve_init_from

    cfg = resolve_init_from(load_config("tiny", overrides, validate=False), overrides)
    train, _ = build_datasets(cfg, load_tokenizer(cfg))
    batch = train.batch(0, cfg.train.global_batch)
    out = logits(hf_model, batch["input_ids"]).double()
    return F.cross_entropy(out.flatten(0, 1), batch["labels"].flatten()).item()


def step1_row(run_dir) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r.get("step") == 1 and "loss" in r)


@pytest.mark.parametrize("kind", KINDS)
def test_init_from_hf_step1_loss_matches_transformers(tmp_path, hf_dirs, kind):
    src, hf_model = hf_dirs[kind]
    overrides = RUN + [f"train.init_from={src}"]
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "tiny", "--run-dir", str(run_dir), *[f"--{o}" for o in overrides]]) == 0
    want = transformers_loss(hf_model, overrides)
    step1 = step1_row(run_dir)
    print(f"{kind}: step-1 loss {step1['loss']!r} vs transformers {want!r}")
    assert math.isclose(step1["loss"], want, rel_tol=LOSS_RTOL), (step1["loss"], want)
    assert abs(want - math.log(VOCAB)) > 0.1  # far from a random start: the weights came from the source
    assert "moe_load_balance_loss" in step1  # it trained as an MoE model


@pytest.mark.parametrize("kind", KINDS)
def test_generate_on_converted_model_is_greedy_transformers(tmp_path, hf_dirs, capsys, kind):
    from loom.data.tokenizer import Tokenizer

    src, hf_model = hf_dirs[kind]
    loom_dir = convert(src, tmp_path / "loom", to="loom")
    tok = Tokenizer.from_file(loom_dir / "tokenizer.json")
    for prompt in ("def main():", "import os\nclass"):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = hf_model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        new = out[0, ids.shape[1]:].tolist()
        assert tok.eod_id not in new and len(set(new)) > 1
        capsys.readouterr()
        assert main(["generate", "--checkpoint", str(loom_dir), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
        assert capsys.readouterr().out.rstrip("\n") == prompt + tok.decode(new)


# --- refusals --------------------------------------------------------------------------------------------


def test_refuses_what_loom_cannot_compute(hf_dirs):
    base = {kind: json.loads((hf_dirs[kind][0] / "config.json").read_text()) for kind in KINDS}
    cases = [
        ("mixtral", {"sliding_window": 16}, "sliding_window=16 is unsupported"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is unsupported"),
        ("mixtral", {"num_experts_per_tok": 1}, "num_experts_per_tok=1 with model_type='mixtral'"),
        ("qwen3_moe", {"num_experts_per_tok": 1}, "num_experts_per_tok=1 with norm_topk_prob=true"),
        ("qwen2_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2 with mlp_only_layers=\[0\] makes layers "
                                                  r"\[1\] MoE, which loom cannot express"),
        ("qwen2_moe", {"mlp_only_layers": [2]}, r"makes layers \[0, 1\] MoE"),
        ("qwen3_moe", {"mlp_only_layers": [0, 1]}, r"makes layers \[\] MoE"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an integer >= 1"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 48}, "shared_expert_intermediate_size=48 must be a "
                                                               "positive multiple of moe_intermediate_size=32"),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window=true"),
        ("qwen2_moe", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
         "layer_types holds 'sliding_attention'"),
        ("qwen3_moe", {"attention_bias": True}, "attention_bias=true is unsupported for qwen3_moe"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "model.moe.top_k=9 must be in 1..model.moe.experts=8"),
        ("qwen3_moe", {"num_experts": 0, "num_local_experts": 0}, "num_experts=0 makes every layer dense"),
    ]
    for kind, patch, message in cases:
        with pytest.raises(UserError, match=message):
            model_config_from_hf({**base[kind], **patch})
    # What is valid still reads: a prefix of dense layers, every other layer, and norm_topk_prob=false at top-1.
    ok = model_config_from_hf({**base["qwen3_moe"], "mlp_only_layers": [0], "num_experts_per_tok": 1,
                               "norm_topk_prob": False})
    assert (ok.moe.first_dense, ok.moe.interval, ok.moe.top_k, ok.moe.renormalize) == (1, 1, 1, False)
    ok = model_config_from_hf({**base["qwen2_moe"], "mlp_only_layers": [1]})  # MoE on layers 0 and 2
    assert (ok.moe.first_dense, ok.moe.interval) == (0, 2)


def test_cli_convert_refusal_exit_code(tmp_path, hf_dirs):
    import subprocess
    import sys

    from conftest import ROOT

    src, _ = hf_dirs["qwen2_moe"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    (bad / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()),
                                                 "decoder_sparse_step": 2}))
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "convert", str(bad), str(tmp_path / "out"), "--to",
                           "loom"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert "decoder_sparse_step=2" in proc.stderr and "model.moe.interval" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("change,message", [
    ({"moe": {"router": "sinkhorn", "top_k": 1}}, "model.moe.router='sinkhorn'"),
    ({"moe": {"capacity_factor": 1.25}}, "model.moe.capacity_factor=1.25"),
    ({"moe": {"renormalize": False}}, "model.moe.renormalize=false with model.moe.top_k=2 .Mixtral renormalises"),
    ({"moe": {"first_dense": 1}}, "model.moe.first_dense=1 with model.moe.interval=1 .Mixtral's layers are all MoE"),
    ({"moe": {"shared_experts": 1}}, "model.moe.shared_gate=false .Qwen2-MoE gates"),
    ({"qk_norm": True, "moe": {"shared_experts": 1, "shared_gate": True}}, "Qwen3-MoE has no shared experts"),
    ({"qkv_bias": True}, "model.qkv_bias=true without shared experts"),
])
def test_export_refuses_moe_without_hf_equivalent(tmp_path, change, message):
    fields = dict(layers=2, hidden=32, heads=2, kv_heads=2, ffn_hidden=64, vocab_size=50)
    moe = dict(experts=4, top_k=2, renormalize=True)
    cfg = Config(model=ModelConfig(**fields, **{k: v for k, v in change.items() if k != "moe"},
                                   moe=MoEConfig(**{**moe, **change.get("moe", {})})))
    with pytest.raises(UserError, match="no exact Hugging Face equivalent.*" + message):
        export_hf(build_model(cfg.model), cfg, tmp_path / "out")
    assert not list(tmp_path.iterdir())
    # Without the change it exports (as Mixtral).
    assert hf_config_from_model(ModelConfig(**fields, moe=MoEConfig(**moe)))["model_type"] == "mixtral"


def test_import_hf_names_missing_experts(tmp_path, hf_dirs):
    from safetensors.torch import load_file, save_file

    src, _ = hf_dirs["mixtral"]
    state = load_file(str(src / "model.safetensors"))
    state.pop("model.layers.1.block_sparse_moe.experts.2.w3.weight")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"experts of model.layers.1.mlp.experts.K.up_proj.weight are numbered "
                                        r"\[0, 1, 3\]"):
        import_hf(bad)


def test_init_from_hf_dp_shard2_step1_loss(tmp_path, hf_dirs):
    """dp_shard=2: FSDP shards each stacked expert weight by rows of its first dimension, so each rank
    builds its experts from its own per-expert Hugging Face tensors; the loss is transformers'."""
    from pool_launch import launch_in_pool

    src, hf_model = hf_dirs["qwen2_moe"]
    overrides = RUN + [f"train.init_from={src}", "parallel.dp_shard=2"]
    run_dir = tmp_path / "run"
    launch_in_pool("train", "tiny", run_dir, 2, overrides)  # `loom train --nproc 2`, in kept rank processes
    got, want = step1_row(run_dir)["loss"], transformers_loss(hf_model, overrides)
    assert math.isclose(got, want, rel_tol=LOSS_RTOL), (got, want)
