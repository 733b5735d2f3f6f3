"""Hugging Face Llama <-> loom: logits match transformers exactly (fp32) both ways; bad input is refused."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import randomize_hf_weights
import loom
from loom.config import Config, ModelConfig
from loom.errors import UserError
from loom.interop import convert, export_hf, hf_config_from_model, import_hf, model_config_from_hf
from loom.models.llama import build_model

transformers = pytest.importorskip("transformers")

TOL = 1e-4


def random_hf_model(kv_heads=2, tied=False, bias=False, rope_theta=10000.0, layers=2):
    """A small LlamaForCausalLM whose every tensor (norms and biases included) is random."""
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=160,
        vocab_size=300,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        tie_word_embeddings=tied,
        attention_bias=bias,
        mlp_bias=bias,
    )
    return randomize_hf_weights(transformers.LlamaForCausalLM(config))


def save_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(300)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def loom_logits(model, ids):
    with torch.no_grad():
        return model(ids).float()


def random_ids(batch=2, seq=24, vocab=300):
    return torch.randint(0, vocab, (batch, seq))


@pytest.mark.parametrize(
    "kv_heads,tied,bias,theta",
    [(2, False, False, 10000.0), (4, True, False, 500000.0), (2, True, True, 10000.0)],
    ids=["gqa-untied", "mha-tied-theta5e5", "gqa-tied-bias"],
)
def test_round_trip_matches_transformers(tmp_path, kv_heads, tied, bias, theta):
    hf_model = random_hf_model(kv_heads, tied, bias, theta)
    src = tmp_path / "hf"
    hf_model.save_pretrained(src)
    save_tokenizer(src)
    ids = random_ids()
    want = hf_logits(hf_model, ids)

    direct = loom.load_model(src)
    assert not direct.training
    got = loom_logits(direct, ids)
    assert got.shape == (2, 24, 300)
    assert (got - want).abs().max().item() < TOL
    assert direct.cfg.kv_heads == kv_heads and direct.cfg.tie_embeddings == tied and direct.cfg.bias == bias
    assert direct.cfg.rope_theta == theta

    loom_dir = convert(src, tmp_path / "loom", to="loom")
    assert (loom_dir / "model.safetensors").is_file() and (loom_dir / "config.toml").is_file()
    assert (loom_dir / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert (loom_logits(loom.load_model(loom_dir), ids) - want).abs().max().item() < TOL

    back = convert(loom_dir, tmp_path / "hf2", to="hf")
    assert (back / "tokenizer.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    assert (hf_logits(reloaded, ids) - want).abs().max().item() < TOL
    tok = transformers.AutoTokenizer.from_pretrained(back)
    assert tok("w5 w7")["input_ids"] == [5, 7]


def test_sharded_input_and_output(tmp_path):
    hf_model = random_hf_model(layers=3)
    src = tmp_path / "hf"
    hf_model.save_pretrained(src, max_shard_size="60KB")
    assert (src / "model.safetensors.index.json").is_file() and not (src / "model.safetensors").exists()
    ids = random_ids()
    want = hf_logits(hf_model, ids)
    model, cfg, tokenizer = import_hf(src)
    assert tokenizer is None and cfg.name == "hf" and cfg.model.layers == 3
    assert (loom_logits(model, ids) - want).abs().max().item() < TOL

    out = export_hf(model, cfg, tmp_path / "sharded", max_shard_bytes=50_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dirs left behind
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert (hf_logits(reloaded, ids) - want).abs().max().item() < TOL

    # A shard that the index names but that is gone is reported by name.
    missing = sorted(files)[0]
    (out / missing).unlink()
    with pytest.raises(UserError, match=missing):
        loom.load_model(out)


def test_loom_trained_model_exports(tmp_path):
    """A model born in loom (not imported) exports and transformers computes the same logits."""
    cfg = Config(model=ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, vocab_size=200,
                                   max_seq_len=64, rope_theta=20000.0, norm_eps=1e-6))
    model = build_model(cfg.model, seed=0).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    out = export_hf(model, cfg, tmp_path / "out")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    ids = random_ids(vocab=200, seq=32)
    assert (hf_logits(reloaded, ids) - loom_logits(model, ids)).abs().max().item() < TOL


def test_mapping_errors_would_be_caught(tmp_path):
    """Swapping gate and up projections changes the logits well beyond the tolerance."""
    hf_model = random_hf_model()
    src = tmp_path / "hf"
    hf_model.save_pretrained(src)
    ids = random_ids()
    model = loom.load_model(src)
    ff = model.layers["0"].feed_forward
    with torch.no_grad():
        w1 = ff.w1.weight.clone()
        ff.w1.weight.copy_(ff.w3.weight)
        ff.w3.weight.copy_(w1)
    assert (loom_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item() > 100 * TOL


def test_refuses_non_llama_and_missing(tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(UserError, match=r"model_type 'gpt2'.*valid: 'llama'"):
        loom.load_model(gpt2)
    with pytest.raises(UserError, match="model_type"):
        convert(gpt2, tmp_path / "out", to="loom")
    assert not (tmp_path / "out").exists()

    with pytest.raises(UserError, match="does not exist"):
        loom.load_model(tmp_path / "nope")
    with pytest.raises(UserError, match="does not exist"):
        import_hf(tmp_path / "nope")
    with pytest.raises(UserError, match="valid: loom, hf"):
        convert(gpt2, tmp_path / "x", to="gguf")

    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(hf_config_from_model(ModelConfig())))
    with pytest.raises(UserError, match="no weights found"):
        import_hf(empty)


def test_refuses_unsupported_configs():
    base = hf_config_from_model(ModelConfig(hidden=64, heads=4, kv_heads=2))
    assert model_config_from_hf(base) == ModelConfig(hidden=64, heads=4, kv_heads=2, init_std=0.02)
    cases = {
        "rope_scaling": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}},
                         "yarn' is unsupported"),
        "llama3_incomplete": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}},
                              "llama3' needs numeric factor"),
        "legacy_rope_scaling": ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
                                "linear' is unsupported"),
        "act": ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        "qwen_window": ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=true"),
        "qwen3_bias": ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true is unsupported for qwen3"),
        "mlp_bias": ({"mlp_bias": True}, "mlp_bias=true"),
        "mistral_window": ({"model_type": "mistral", "sliding_window": 16}, "sliding_window=16"),
        "kv_heads": ({"num_key_value_heads": 3}, "kv_heads=3"),
    }
    for name, (patch, message) in cases.items():
        with pytest.raises(UserError, match=message):
            model_config_from_hf({**base, **patch})
    # A legacy (transformers 4) config: top-level rope_theta, no rope_parameters; Mistral without window.
    legacy = {k: v for k, v in base.items() if k != "rope_parameters"}
    assert model_config_from_hf({**legacy, "rope_theta": 1234.0}).rope_theta == 1234.0
    assert model_config_from_hf({**base, "model_type": "mistral", "sliding_window": None}).kv_heads == 2
    # Llama 3.1 scaling (legacy rope_scaling spelling too) and a decoupled head size are accepted.
    llama31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    got = model_config_from_hf({**legacy, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama31}})
    assert (got.rope_scaling, got.rope_factor, got.rope_original_max_len, got.rope_theta) == ("llama3", 8.0, 8192, 5e5)
    # Its bounds are the ones a TOML config gets (ModelConfig.validate), named with the config.json's path.
    for patch, message in [({"factor": 0.5}, "model.rope_factor=0.5 must be a finite number >= 1"),
                           ({"high_freq_factor": 1.0}, "model.rope_high_freq_factor=1.0 must exceed")]:
        with pytest.raises(UserError, match=r"^config\.json: " + message):
            model_config_from_hf({**legacy, "rope_scaling": {"rope_type": "llama3", **llama31, **patch}})
    assert model_config_from_hf({**base, "head_dim": 32}).head_dim == 32


@pytest.mark.parametrize("change", [{"mlp": "gelu"}, {"norm": "layernorm"}, {"position": "learned"}])
def test_export_refuses_non_llama_models(tmp_path, change):
    cfg = Config(model=ModelConfig(hidden=32, heads=2, kv_heads=2, ffn_hidden=64, vocab_size=50, **change))
    model = build_model(cfg.model)
    with pytest.raises(UserError, match="only Llama-, Qwen2- and Qwen3-shaped models export"):
        export_hf(model, cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_strict_weights_and_no_overwrite(tmp_path):
    hf_model = random_hf_model()
    src = tmp_path / "hf"
    hf_model.save_pretrained(src)
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    state.pop("model.layers.1.mlp.up_proj.weight")
    state["model.layers.0.extra.weight"] = torch.zeros(3)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\].*extra"):
        loom.load_model(src)

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    cfg = Config(model=ModelConfig(hidden=32, heads=2, kv_heads=2, ffn_hidden=64, vocab_size=50))
    with pytest.raises(UserError, match="not an empty directory"):
        export_hf(build_model(cfg.model), cfg, busy)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def test_llama31_rope_scaling_matches_transformers_through_convert_and_back(tmp_path):
    """Llama 3.1 / 3.2 checkpoints scale RoPE ("llama3"): low frequencies slowed by `factor`, high ones
    kept, a ramp between. A sequence past the original context exercises every band."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=160, vocab_size=300,
                                      max_position_embeddings=128, rope_theta=10000.0, rope_scaling=scaling)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).float().eval()
    src = tmp_path / "hf"
    hf_model.save_pretrained(src)
    save_tokenizer(src)
    ids = random_ids(seq=100)
    want = hf_logits(hf_model, ids)
    model = loom.load_model(src)
    assert (model.cfg.rope_scaling, model.cfg.rope_factor, model.cfg.rope_original_max_len) == ("llama3", 8.0, 32)
    assert (loom_logits(model, ids) - want).abs().max().item() < TOL
    # The scaling matters here: plain RoPE with the same weights is far off.
    plain = loom.load_model(src)
    plain.cfg.rope_scaling = "none"
    plain.reset_buffers()
    assert (loom_logits(plain, ids) - want).abs().max().item() > 10 * TOL
    loom_dir = convert(src, tmp_path / "loom", to="loom")
    assert (loom_logits(loom.load_model(loom_dir), ids) - want).abs().max().item() < TOL
    back = convert(loom_dir, tmp_path / "hf2", to="hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    assert (hf_logits(reloaded, ids) - want).abs().max().item() < TOL


def test_qwen2_matches_transformers_converts_both_ways_and_generates(tmp_path):
    """Qwen2 / Qwen2.5 (the most common fine-tuning base): biases on the query/key/value projections only,
    tied embeddings in the small sizes, rope_theta 1e6."""
    config = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=160, vocab_size=300,
                                      max_position_embeddings=128, rope_theta=1e6, tie_word_embeddings=True,
                                      use_sliding_window=False)
    torch.manual_seed(0)
    hf_model = transformers.Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)  # large enough that dropping a bias would show
    src = tmp_path / "qwen"
    hf_model.save_pretrained(src)
    save_tokenizer(src)
    ids = random_ids(seq=40)
    want = hf_logits(hf_model, ids)
    model = loom.load_model(src)
    assert model.cfg.qkv_bias and not model.cfg.bias and model.cfg.tie_embeddings
    assert model.layers["0"].attention.wq.bias is not None and model.layers["0"].attention.wo.bias is None
    assert (loom_logits(model, ids) - want).abs().max().item() < TOL
    loom_dir = convert(src, tmp_path / "loom", to="loom")
    back = convert(loom_dir, tmp_path / "hf2", to="hf")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
    assert type(reloaded).__name__ == "Qwen2ForCausalLM"
    assert (hf_logits(reloaded, ids) - want).abs().max().item() < TOL
    # loom generate on the converted model: greedy, so each token is transformers' argmax so far
    import contextlib
    import io

    from tokenizers import Tokenizer

    from loom.cli import main

    seq = torch.tensor([[5, 6, 7]])
    for _ in range(5):
        seq = torch.cat([seq, hf_logits(hf_model, seq)[:, -1:].argmax(-1)], dim=1)
    expected = Tokenizer.from_file(str(src / "tokenizer.json")).decode(seq[0, 3:].tolist())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["generate", "--checkpoint", str(loom_dir), "--prompt", "w5 w6 w7", "--max-new-tokens", "5",
                     "--temperature", "0"]) == 0
    assert expected and expected in printed.getvalue(), (expected, printed.getvalue())


def test_one_rule_tells_a_hugging_face_directory_from_a_loom_one(tmp_path):
    """`is_hf_dir` is the rule loom.load_model, train.init_from, loom generate and the LoRA base fingerprint all
    ask: a config.json alone is Hugging Face's; beside a config.toml, a run's checkpoints/ or a latest pointer, the
    directory is loom's."""
    from loom.generate import find_tokenizer
    from loom.interop import is_hf_dir
    from loom.models.io import save_model_dir

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert is_hf_dir(hf)
    loom_dir = tmp_path / "loom"  # a loom model directory carrying a config.json beside its own
    loom_dir.mkdir()
    cfg = Config(model=ModelConfig(layers=1, hidden=16, heads=2, kv_heads=2, ffn_hidden=32, vocab_size=32))
    save_model_dir(build_model(cfg.model), cfg, loom_dir)
    (loom_dir / "config.json").write_text("{}")
    (loom_dir / "tokenizer.json").write_text("{}")
    for marker in ("checkpoints", "latest"):
        other = tmp_path / marker
        other.mkdir()
        (other / "config.json").write_text("{}")
        (other / marker).mkdir() if marker == "checkpoints" else (other / marker).write_text("step-1\n")
        assert not is_hf_dir(other), marker
    assert not is_hf_dir(loom_dir)
    assert find_tokenizer(str(loom_dir)) == loom_dir / "tokenizer.json"
    assert loom.load_model(loom_dir).cfg == cfg.model
