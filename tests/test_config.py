import pytest

from loom.config import Config, available_configs, dumps_toml, load_config
from loom.errors import UserError


def test_every_shipped_config_loads_and_round_trips():
    import tomllib

    names = available_configs()
    for required in ["tiny", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b",
                     "gpt3-175b", "korthikanti"]:
        assert required in names
    for name in names:
        cfg = load_config(name)
        again = load_config(None, tomllib.loads(dumps_toml(cfg.to_dict())))
        assert again.to_dict() == cfg.to_dict()


def test_published_shapes():
    c = load_config("llama3-8b").model
    assert (c.layers, c.hidden, c.heads, c.kv_heads, c.ffn_hidden, c.vocab_size, c.rope_theta) == (
        32, 4096, 32, 8, 14336, 128256, 500000.0)
    g = load_config("gpt3-175b").model
    assert (g.layers, g.hidden, g.heads, g.norm, g.mlp, g.position) == (96, 12288, 96, "layernorm", "gelu", "learned")
    k = load_config("korthikanti")
    assert k.model.attention == "math" and k.model.dropout > 0 and k.model.attn_dropout > 0 and k.train.dtype == "bfloat16"


def test_tiny_states_demo_shape_explicitly():
    import tomllib

    from loom.config import CONFIG_DIR

    raw = tomllib.loads((CONFIG_DIR / "tiny.toml").read_text())
    for key in ["layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab_size"]:
        assert key in raw["model"]
    assert "seq_len" in raw["train"] and "micro_batch" in raw["train"]


def test_overrides_later_wins_and_types():
    cfg = load_config("tiny", ["train.steps=7", "train.steps=9", "optim.lr=1e-3", "model.tie_embeddings=false",
                               "data.paths=a,b", "data.weights=1,3"])
    assert cfg.train.steps == 9 and cfg.optim.lr == 1e-3 and cfg.model.tie_embeddings is False
    assert cfg.data.paths == ["a", "b"] and cfg.data.weights == [1.0, 3.0]


@pytest.mark.parametrize(
    "override, fragments",
    [
        (["train.stpes=3"], ["train.stpes", "did you mean 'train.steps'"]),
        (["trian.steps=3"], ["trian", "did you mean 'train'"]),
        (["optim.lr=-1"], ["optim.lr=-1", "positive"]),
        (["optim.lr=0"], ["optim.lr=0", "positive"]),
        (["train.steps=many"], ["train.steps", "integer"]),
        (["train.global_batch=10", "train.micro_batch=4"], ["global_batch=10", "micro_batch=4", "1, 2, 5, 10"]),
        (["model.heads=6"], ["model.heads=6", "valid head counts"]),
        (["model.kv_heads=3"], ["kv_heads=3", "1, 2, 4, 8"]),
        (["model.norm=batchnorm"], ["batchnorm", "rmsnorm, layernorm"]),
        (["train.dtype=float16"], ["float16", "float32, bfloat16"]),
        (["model.tie_embeddings=maybe"], ["tie_embeddings", "true or false"]),
        (["parallel.tp=3"], ["parallel.tp=3", "valid tp sizes for this model: 1, 2, 4"]),
        (["parallel.pp=3"], ["pp x vpp = 3", "model.layers=4"]),
        (["parallel.dp_shard=0"], ["parallel.dp_shard=0", "positive integer"]),
        (["parallel.tp=2", "parallel.sp=true", "train.seq_len=255"], ["parallel.tp=2", "must divide train.seq_len=255"]),
        (["train.seq_len=100000"], ["seq_len=100000", "max_seq_len"]),
    ],
)
def test_bad_values_name_field_and_valid_choices(override, fragments):
    with pytest.raises(UserError) as err:
        load_config("tiny", override)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("given, meant", [
    ("train.learning_rate", "optim.lr"),  # another trainer's name for a key of another section
    ("train.min_lr", "optim.min_lr"),  # the same name, in another section
    ("optim.max_grad_norm", "train.grad_clip"),
    ("train.batch_size", "train.global_batch"),
    ("model.moe.expert", "model.moe.experts"),  # a typo inside a nested section
    ("rl.max_new_token", "rl.max_new_tokens"),
    ("lora.r", "lora.rank"),  # PEFT's and TRL's name
])
def test_unknown_key_suggests_across_sections(given, meant):
    with pytest.raises(UserError, match=f"unknown config key '{given}' \\(did you mean '{meant}'\\?\\)"):
        load_config("tiny", [f"{given}=1"])


@pytest.mark.parametrize("given, meant", [
    ("optim.lr_scheduler_type", "'optim.decay'? write --optim.decay=cosine, linear or constant"),
    ("train.bf16", "'train.dtype'? write --train.dtype=bfloat16)"),
    ("optim.warmup_ratio", "'optim.warmup_steps'? write --optim.warmup_steps=N, N = ratio x train.steps)"),
])
def test_other_trainers_settings_say_how_loom_writes_them(given, meant):
    with pytest.raises(UserError) as err:
        load_config("tiny", [f"{given}=1"])
    assert f"unknown config key '{given}' (did you mean {meant}" in str(err.value)


def test_other_trainers_names_point_at_real_keys():
    from loom.config.load import OTHER_NAMES

    keys = set(Config().field_values())
    assert [name for name, key in OTHER_NAMES.items() if key not in keys and not key.startswith("--")] == []


def test_unknown_config_name_suggests():
    with pytest.raises(UserError) as err:
        load_config("tinny")
    assert "did you mean 'tiny'" in str(err.value) and "llama3-8b" in str(err.value)


def test_toml_unknown_key_in_file(tmp_path):
    f = tmp_path / "x.toml"
    f.write_text("[model]\nlayerz = 3\n")
    with pytest.raises(UserError, match="did you mean 'model.layers'"):
        load_config(str(f))
    f.write_text("[model\n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(str(f))


def test_defaults_are_valid():
    Config().validate()


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.rope_factor=0.5", "model.rope_factor=0.5 must be a finite number >= 1"),
        ("model.rope_factor=inf", "model.rope_factor=inf must be a finite number >= 1"),
        ("model.rope_low_freq_factor=0", "model.rope_low_freq_factor=0.0 must be a finite number > 0"),
        ("model.rope_high_freq_factor=nan", "model.rope_high_freq_factor=nan must be a finite number > 0"),
        ("model.rope_high_freq_factor=1", "model.rope_high_freq_factor=1.0 must exceed model.rope_low_freq_factor=1.0"),
        ("model.rope_original_max_len=0", "model.rope_original_max_len=0 must be a positive integer"),
    ],
)
def test_llama3_rope_scaling_bounds(override, fragment):
    """Llama 3.1's RoPE scaling is checked once, with transformers' bounds (factor >= 1, 0 < low < high); the
    same values with plain RoPE are unused and accepted. A config.json goes through the same check
    (tests/test_hf_interop.py)."""
    assert load_config("tiny", ["model.rope_scaling=llama3"]).model.rope_factor == 8.0
    with pytest.raises(UserError) as err:
        load_config("tiny", ["model.rope_scaling=llama3", override])
    assert fragment in str(err.value)
    load_config("tiny", [override])


def test_section_checks_name_the_toml_key():
    """The shared checks spell a field as its TOML key (`model.moe.ffn_hidden`, not `ffn_hidden`)."""
    with pytest.raises(UserError, match=r"model\.moe\.ffn_hidden=-1 must be >= 0"):
        load_config("tiny-moe", ["model.moe.ffn_hidden=-1"])
    with pytest.raises(UserError, match=r"model\.moe\.load_balance_coeff=nan must be a finite number >= 0"):
        load_config("tiny-moe", ["model.moe.load_balance_coeff=nan"])
    with pytest.raises(UserError, match=r"rl\.gamma=1\.5 must be in \[0, 1\]"):
        load_config("tiny", ["rl.gamma=1.5"])


def test_advice_on_valid_but_doubtful_settings():
    from loom.config.advice import run_advice

    cfg = load_config("tiny-dpo", ["train.init_from=some/sft-run"], validate=False)
    (line,) = run_advice(cfg, "dpo")  # tiny-dpo's 1e-3 is tuned for random initialisation
    assert "optim.lr=0.001 starting from trained weights" in line
    assert run_advice(cfg, "sft") == []  # the same rate is not doubted for SFT
    cfg.optim.lr = 1e-6
    assert run_advice(cfg, "dpo") == []
    cfg = load_config("tiny", ["train.steps=4", "optim.warmup_steps=8", "optim.lr=1e-3"])
    assert run_advice(cfg, "train") == ["note: optim.warmup_steps=8 > train.steps=4: the learning rate rises to "
                                        "5.00e-04 at most and never reaches optim.lr=0.001; lower "
                                        "optim.warmup_steps to run at optim.lr"]


def test_a_whitespace_only_list_item_on_the_command_line_is_refused_not_dropped():
    """`--rl.stop=<newline>` used to become `rl.stop=[]` without a word (each item is stripped): a run whose
    completions then never stop. It is refused, naming the TOML form; ordinary lists still parse."""
    import pytest

    from loom.config import load_config
    from loom.errors import UserError

    with pytest.raises(UserError, match=r"rl.stop='\\n'.*write it in a TOML config"):
        load_config("tiny-grpo", ["rl.stop=\n"])
    with pytest.raises(UserError, match="only whitespace"):
        load_config("tiny-grpo", ["rl.stop=END, ,STOP"])
    assert load_config("tiny-grpo", ["rl.stop=</s>, END"]).rl.stop == ["</s>", "END"]
    assert load_config("tiny", ["lora.targets="]).lora.targets == []
