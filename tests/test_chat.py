"""Chat models that stop and keep what makes them chat models (loom/post/chat.py, loom/infer/, loom/models/io.py,
loom/interop/hf_io.py, loom/post/rl/rewards.py): stop ids from every source, the engine's stop tokens and
stop strings, `loom generate`'s chat records and finish reasons, the template and special tokens carried from
a Hugging Face ChatML model through SFT, DPO, RL and `--export-hf` back to transformers, and a failing reward
function as bad input."""

import json
import re

import pytest
import torch

from loom.cli import main
from loom.errors import UserError
from loom.post.chat import CHATML, encode_chat, load_template, stop_token_ids

transformers = pytest.importorskip("transformers")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot|>", "<|gen_eos|>"]
REPLY = "ok"
CHATS = [[{"role": "user", "content": f"say ok {i}"}, {"role": "assistant", "content": REPLY}] for i in range(12)]
# A tiny run from the Hugging Face model: SFT to fit the one reply, then a step of DPO and of RL from its run.
TINY = ["train.seq_len=32", "train.micro_batch=8", "train.global_batch=8", "log.progress=none",
        "log.tensorboard=false", "optim.warmup_steps=0", "train.eval_interval=0", "train.threads=1"]


def write_tokenizer(directory, eos="<|im_end|>", template=CHATML, generation=None):
    """A byte-level BPE with ChatML's special tokens (and two more, to tell the stop sources apart), its
    tokenizer_config.json (ChatML, `eos`) and optionally a generation_config.json."""
    from conftest import byte_level_bpe

    text = [json.dumps(c) for c in CHATS] * 5 + ["the quick brown fox jumps over the lazy dog"] * 5
    tok = byte_level_bpe(text, 300, SPECIALS)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation}))
    return tok


def test_stop_ids_come_from_every_source(tmp_path):
    """End-of-document, tokenizer_config.json's eos_token, generation_config.json's eos_token_id list and the
    template's end-of-turn: each source adds its own id, and a chat_template.jinja beside the tokenizer is the
    template (transformers 5 saves it there)."""
    from loom.data.tokenizer import Tokenizer

    raw = write_tokenizer(tmp_path / "a", eos="<|eot|>", generation=[SPECIALS.index("<|gen_eos|>"), 100])
    ids = {name: raw.token_to_id(name) for name in SPECIALS}
    tok = Tokenizer.from_file(tmp_path / "a")
    assert set(stop_token_ids(tok)) == {ids["<|endoftext|>"], ids["<|eot|>"], ids["<|gen_eos|>"], 100,
                                        ids["<|im_end|>"]}
    write_tokenizer(tmp_path / "b", eos="<|eot|>", template=None)  # no template, no generation config
    assert set(stop_token_ids(Tokenizer.from_file(tmp_path / "b"))) == {ids["<|endoftext|>"], ids["<|eot|>"]}
    # chat_template.jinja wins over tokenizer_config.json's and takes its special tokens from there
    (tmp_path / "b" / "chat_template.jinja").write_text(CHATML.replace("<|im_end|>", "<|gen_eos|>"))
    template = load_template("auto", tmp_path / "b" / "tokenizer.json", "rl.template")
    assert template.name.endswith("chat_template.jinja") and template.special["eos_token"] == "<|eot|>"
    assert ids["<|gen_eos|>"] in stop_token_ids(Tokenizer.from_file(tmp_path / "b"))
    # the built-in templates' end-of-turn tokens
    from loom.post.chat import end_of_turn

    assert end_of_turn(load_template("chatml"), tok) == ids["<|im_end|>"]
    assert end_of_turn(load_template("llama3"), tok) is None  # <|eot_id|> is no token of this tokenizer
    # ... so generation stops at its text instead; ChatML's end-of-turn is a token here, no text stop needed
    from loom.post.chat import stop_texts

    assert stop_texts(tok, load_template("llama3")) == ("<|eot_id|>",)
    assert stop_texts(tok, load_template("chatml")) == () and stop_texts(tok) == ()


@pytest.mark.parametrize("key", ["pref.template", "rl.template"])
def test_template_errors_name_their_own_key(key, tmp_path):
    write_tokenizer(tmp_path, template=None)
    with pytest.raises(UserError, match=rf"^{key}=auto takes the chat template .*set {key}=llama3"):
        load_template("auto", tmp_path / "tokenizer.json", key)
    with pytest.raises(UserError, match=rf"^{key}='nope.jinja' is neither"):
        load_template("nope.jinja", None, key)


def forced_model_dir(directory, chain: dict[int, int]):
    """A loom model directory whose model continues token t with chain[t] whatever came before: every layer
    adds nothing (output projections zero), so the final hidden state is the current token's normalised
    embedding, and the output row of chain[t] is that embedding (its logit is the largest: cosine 1)."""
    from loom.config import ModelConfig, Config
    from loom.models.io import save_model_dir
    from loom.models.llama import build_model

    cfg = Config(model=ModelConfig(layers=1, hidden=64, heads=4, kv_heads=2, ffn_hidden=64, vocab_size=300,
                                   max_seq_len=64, tie_embeddings=False))
    cfg.train.seq_len = 64
    model = build_model(cfg.model, seed=0)
    with torch.no_grad():
        for block in model.layers.values():
            block.attention.wo.weight.zero_()
            block.feed_forward.w2.weight.zero_()
        model.output.weight.zero_()
        emb = model.tok_embeddings.weight
        for t, nxt in chain.items():
            model.output.weight[nxt] = 10 * emb[t] / emb[t].norm()
    save_model_dir(model, cfg, directory, tokenizer_path=directory / "tokenizer.json")
    return model


def test_generate_stops_at_the_end_of_turn_and_at_stop_strings(tmp_path, capsys):
    """A model forced to continue "\\n" with a word, "ok", "<|im_end|>", "\\n", the word, ...: `loom
    generate` stops at <|im_end|> (tokenizer_config.json's eos_token) with finish_reason stop, keeps each
    record's other fields, renders chat records with the model's template, stops at --stop text (cut before
    it), and without a stop ends by length."""
    from loom.data.tokenizer import Tokenizer
    from loom.infer.engine import Engine
    from loom.infer.sampling import SamplingParams

    model_dir = tmp_path / "model"
    raw = write_tokenizer(model_dir)
    tok = Tokenizer.from_file(model_dir)
    nl, ok, end = tok.encode("\n")[-1], tok.encode("ok")[0], raw.token_to_id("<|im_end|>")
    fox = max(range(len(SPECIALS), tok.vocab_size), key=lambda i: len(tok.decode([i])))  # a long word
    F, O = tok.decode([fox]), tok.decode([ok])  # noqa: N806 (their texts)
    model = forced_model_dir(model_dir, {nl: fox, fox: ok, ok: end, end: nl})
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "id": 7}) + "\n"
                    + json.dumps({"prompt": "say\n", "id": 8, "tag": ["x"]}) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--checkpoint", str(model_dir), "--input", str(data), "--output", str(out),
                 "--max-new-tokens", "8", "--device", "cpu"]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [7, 8] and records[1]["tag"] == ["x"]
    assert records[0]["messages"][0]["content"] == "hi"
    for r in records:
        assert r["tokens"] == [fox, ok, end] and r["finish_reason"] == "stop" and r["completion"] == F + O
    # --stop: the completion ends before the text; the token that completes it is the last one
    assert main(["generate", "--checkpoint", str(model_dir), "--input", str(data), "--output", str(out),
                 "--max-new-tokens", "8", "--device", "cpu", "--stop", O, "--stop", "zzz"]) == 0
    for r in (json.loads(x) for x in out.read_text().splitlines()):
        assert r["tokens"] == [fox, ok] and r["finish_reason"] == "stop" and r["completion"] == F
    # no stop id: the model runs on to the length limit (the stop above was the end-of-turn's doing)
    engine = Engine(model, max_batch=2, max_len=32, sync_every=2, decode=tok.decode)
    prompt = tok.encode("say\n")
    free = engine.generate([prompt], SamplingParams(max_new_tokens=6))[0]
    assert free.tokens == [fox, ok, end, nl, fox, ok] and free.finish_reason == "length"
    # a stop string spanning windows (sync_every=2: tokens 1 | 2 3 | 4 5), and one inside a token's text
    across, inside = O[-1] + "<|im_end|>\n", F[-1]
    cut = engine.generate([prompt, prompt], [SamplingParams(max_new_tokens=6, stop=(across,)),
                                             SamplingParams(max_new_tokens=6, stop=(inside,))])
    assert cut[0].tokens == [fox, ok, end, nl] and cut[0].text(tok.decode) == F + O[:-1]
    assert cut[1].tokens == [fox] and cut[1].text(tok.decode) == F[:F.index(inside)]
    assert {c.finish_reason for c in cut} == {"stop"}
    with pytest.raises(UserError, match="no decode function"):
        Engine(model, max_batch=1, max_len=16).generate([prompt], SamplingParams(stop=("x",)))
    # a chat record for a model without a chat template: exit 2 naming the record
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert main(["generate", "--checkpoint", str(model_dir), "--input", str(data), "--output", str(out),
                 "--device", "cpu"]) == 2
    assert f"{data}, line 1: a chat record" in capsys.readouterr().err


@pytest.fixture(scope="module")
def qwen_chat(tmp_path_factory):
    """A tiny Qwen3-shaped Hugging Face model with a ChatML tokenizer (eos_token <|im_end|>), and a loom SFT run
    from it on chat records whose one reply is "ok<|im_end|>", exported with --export-hf."""
    root = tmp_path_factory.mktemp("qwen-chat")
    hf_dir = root / "hf"
    raw = write_tokenizer(hf_dir)
    config = transformers.Qwen3Config(vocab_size=raw.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, tie_word_embeddings=True,
                                      eos_token_id=raw.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    sft = root / "sft"
    assert main(["sft", "--config", "tiny-sft", "--run-dir", str(sft), f"--train.init_from={hf_dir}",
                 f"--sft.data={chats}", "--sft.template=auto", "--sft.packing=false", "--train.steps=25",
                 "--optim.lr=1e-2", "--optim.min_lr=1e-2", f"--sft.valid_data={chats}", *[f"--{o}" for o in TINY],
                 "--export-hf", str(root / "export")]) == 0
    return root, raw


def test_sft_run_carries_the_template_and_generation_stops_at_im_end(qwen_chat):
    root, raw = qwen_chat
    ckpt = next((root / "sft" / "checkpoints").glob("step-*"))
    for directory in (root / "sft", ckpt):  # run directory and checkpoint carry the chat files
        config = json.loads((directory / "tokenizer_config.json").read_text())
        assert config["chat_template"] == CHATML and config["eos_token"] == "<|im_end|>"
        assert (directory / "generation_config.json").is_file()
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": c[:1], "n": i}) + "\n" for i, c in enumerate(CHATS[:4])))
    out = root / "generated.jsonl"
    assert main(["generate", "--checkpoint", str(root / "sft"), "--input", str(prompts), "--output", str(out),
                 "--max-new-tokens", "6", "--device", "cpu"]) == 0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["n"] for r in records] == [0, 1, 2, 3]
    for r in records:  # learned: the reply, then the end of the turn
        assert r["finish_reason"] == "stop" and r["tokens"][-1] == raw.token_to_id("<|im_end|>"), r
        assert r["completion"] == REPLY


def test_export_applies_the_chat_template_as_loom_does(qwen_chat, tmp_path):
    """--export-hf wrote a Hugging Face directory whose tokenizer transformers reads whole: the chat template
    gives loom's ids, eos_token and generation_config.json's eos_token_id are the end of turn, and the model's
    logits are the run's. `loom convert --to loom` keeps the chat files too."""
    from loom.data.tokenizer import Tokenizer
    from loom.interop import convert

    root, raw = qwen_chat
    loom_dir = convert(root / "hf", tmp_path / "loom", to="loom")
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (loom_dir / name).read_bytes() == (root / "hf" / name).read_bytes()
    export = root / "export"
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(export))
    template = load_template("auto", export / "tokenizer.json")
    tok = Tokenizer.from_file(export)
    for messages in CHATS[:3]:
        ids, _ = encode_chat(template, tok, messages, "test")
        hf = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert ids.tolist() == list(hf)
        prompt = hf_tok.apply_chat_template(messages[:1], tokenize=True, add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        assert list(prompt) == tok.encode(template.render(messages[:1], add_generation_prompt=True))
    end = raw.token_to_id("<|im_end|>")
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.eos_token_id == end
    generation = json.loads((export / "generation_config.json").read_text())["eos_token_id"]
    assert end in (generation if isinstance(generation, list) else [generation])
    from loom import load_model

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(template.render(CHATS[0]))])
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, load_model(str(root / "sft"))(ids), atol=1e-4, rtol=1e-4)


def test_dpo_from_the_sft_run_with_template_auto(qwen_chat, tmp_path):
    """SFT -> DPO with pref.template=auto: the template comes from the run directory's tokenizer files."""
    root, _ = qwen_chat
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": c[:1], "chosen": [c[1]], "rejected": [
        {"role": "assistant", "content": "no"}]}) + "\n" for c in CHATS))
    assert main(["dpo", "--config", "tiny-dpo", "--run-dir", str(tmp_path / "dpo"), f"--train.init_from={root / 'sft'}",
                 f"--pref.data={pairs}", f"--pref.valid_data={pairs}", "--pref.template=auto", "--train.steps=1",
                 *[f"--{o}" for o in TINY]]) == 0


@pytest.mark.parametrize("stop", ["", "k"])
def test_rl_from_the_sft_run_stops_at_the_end_of_turn(stop, qwen_chat, tmp_path, monkeypatch):
    """SFT -> RL with rl.template=auto; the rollouts end at <|im_end|> (every completion stopped, shorter than
    rl.max_new_tokens, and rewarded: its text is the reply without the end-of-turn), with rl.stop at the
    stop string (the reward function sees the text before it); a reward module in the current directory
    imports without PYTHONPATH."""
    root, raw = qwen_chat
    sft = root / "sft"
    answer = REPLY[:REPLY.index(stop)] if stop else REPLY
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": c[:1], "answer": answer}) + "\n" for c in CHATS))
    (tmp_path / "my_chat_reward.py").write_text(
        "def score(prompt, completion, answer):\n    return float(completion == answer)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["rl", "--config", "tiny-grpo", "--run-dir", str(tmp_path / "rl"), f"--train.init_from={sft}",
                 f"--rl.prompts={prompts}", f"--rl.valid_prompts={prompts}", "--rl.template=auto",
                 "--rl.reward=my_chat_reward:score", *([f"--rl.stop={stop}"] if stop else []),
                 "--rl.group_size=4", "--rl.max_new_tokens=8", "--rl.engine_batch=8", "--train.steps=1",
                 "--rl.temperature=0.3", "--checkpoint.save_final=false", *[f"--{o}" for o in TINY]]) == 0
    row = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][0]
    reply = len(raw.encode(REPLY).ids)  # the reply's tokens; + 1 with the end of turn
    assert row["stopped"] == 1.0 and row["reward"] > 0.5, row
    assert row["response_length"] <= (reply if stop else reply + 1), row


@pytest.mark.parametrize("case, body, message", [
    (0, "def f(prompt, completion):\n    return 1.0\n", "raised TypeError: .*unexpected keyword argument 'answer'"),
    (1, "def f(prompt, completion, **kw):\n    raise ValueError('bad ' + kw['answer'])\n", "raised ValueError: bad 4"),
    (2, "def f(prompt, completion, **kw):\n    return None\n", "returned None"),
])
def test_failing_reward_function_exits_2_and_leaves_no_run_dir(case, body, message, tmp_path, monkeypatch, capsys):
    """The user's function fails on the first rollouts (the starting evaluation): exit 2 naming the function,
    the record and the error, and the run directory it made is gone. The module lies in the current directory
    (no PYTHONPATH)."""
    write_tokenizer(tmp_path / "tok")
    (tmp_path / f"bad_reward_{case}.py").write_text(body)  # a module name of its own: imports are cached
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+2=", "answer": "4"}) + "\n" for i in range(8)))
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert main(["rl", "--config", "tiny-grpo", "--run-dir", str(run), f"--rl.prompts={prompts}",
                 f"--rl.valid_prompts={prompts}", f"--rl.reward=bad_reward_{case}:f",
                 f"--data.tokenizer={tmp_path / 'tok' / 'tokenizer.json'}", "--model.layers=1", "--model.hidden=32",
                 "--model.heads=2", "--model.kv_heads=1", "--model.ffn_hidden=64", "--rl.group_size=2",
                 "--rl.max_new_tokens=2", "--rl.engine_batch=8", "--train.global_batch=4", "--train.micro_batch=4",
                 "--train.steps=1", "--train.eval_interval=0", "--log.progress=none", "--log.tensorboard=false"]) == 2
    err = capsys.readouterr().err
    assert f"rl.reward=bad_reward_{case}:f" in err and "prompt record" in err and '"answer": "4"' in err, err
    assert re.search(message, err), err
    assert not run.exists()


def test_missing_reward_module_says_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["rl", "--config", "tiny-grpo", "--run-dir", str(tmp_path / "run"),
                 "--rl.reward=not_here_reward:f", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "cannot import 'not_here_reward'" in err and str(tmp_path) in err


def test_export_hf_refused_before_training(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    run = tmp_path / "run"
    assert main(["sft", "--config", "tiny-sft", "--run-dir", str(run), "--export-hf", str(taken)]) == 2
    assert f"output {taken} already exists" in capsys.readouterr().err
    assert main(["sft", "--config", "tiny-sft", "--run-dir", str(run), "--export-hf", str(tmp_path / "new"),
                 "--checkpoint.save_final=false"]) == 2
    assert "checkpoint.save_final=false" in capsys.readouterr().err and not run.exists()


def test_built_in_template_is_carried_into_the_run(tmp_path):
    """SFT with sft.template=chatml on a tokenizer that came without a template: the run directory and its
    checkpoint carry ChatML, so the next stage's template=auto finds it."""
    write_tokenizer(tmp_path / "tok", template=None)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    run = tmp_path / "run"
    assert main(["sft", "--config", "tiny-sft", "--run-dir", str(run), f"--data.tokenizer={tmp_path / 'tok'}",
                 f"--sft.data={chats}", f"--sft.valid_data={chats}", "--sft.template=chatml", "--train.steps=1",
                 "--model.layers=1", "--model.hidden=32", "--model.heads=2", "--model.kv_heads=1",
                 "--model.ffn_hidden=64", "--model.vocab_size=300", "--model.max_seq_len=32",
                 *[f"--{o}" for o in TINY]]) == 0
    for directory in (run, run / "checkpoints" / "step-1"):
        template = load_template("auto", directory / "tokenizer.json", "pref.template")
        assert template.source == CHATML and template.special["eos_token"] == "<|im_end|>"
