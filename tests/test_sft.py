"""Supervised fine-tuning: chat templates against transformers, the loss mask, packing against unpacked
examples, malformed data, and every layout against one process (loom/post/, loom/models/llama.py)."""

import json
import math

import numpy as np
import pytest
import torch

from loom.cli import main
from loom.config import ModelConfig, load_config
from loom.errors import UserError
from loom.models.llama import build_model
from loom.models.losses import IGNORE, MaskedTokenCrossEntropy
from loom.post.chat import CHATML, LLAMA3, encode_chat, load_template
from test_parallel import metrics

SPECIALS = ["<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}],
    [{"role": "system", "content": "Answer briefly.\n"}, {"role": "user", "content": "  Reverse: río stone  "},
     {"role": "assistant", "content": "stone río"}, {"role": "user", "content": "And sort: b a"},
     {"role": "assistant", "content": " a b\n\n"}],
    [{"role": "user", "content": "{\"json\": [1, 2]} and <tags>"}, {"role": "assistant", "content": "ok"}],
]
# ChatML (renders as CHATML) with the assistant's reply and its <|im_end|> inside {% generation %}, the newline
# after it outside: transformers then reports which tokens are the assistant's (return_assistant_tokens_mask), the
# mask TRL's SFTTrainer trains on with assistant_only_loss=True (its tokenize_fn keeps it as "assistant_masks" and
# labels every other token -100): an independent reference for loom's prefix rendering.
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Exercises what transformers adds to Jinja: raise_exception, tojson (non-ASCII kept), trim/lstrip blocks.
FEATURES = """{% if messages[0]['role'] != 'system' and messages[0]['role'] != 'user' %}
{{ raise_exception('first message must be system or user') }}
{% endif %}
{% for m in messages %}
    {% if loop.first %}{{ bos_token }}{% endif %}
[{{ m['role'] | upper }}] {{ m | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT] {% endif %}"""


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A byte-level BPE with the Llama 3 and ChatML special tokens, built locally."""
    from conftest import byte_level_bpe

    text = [json.dumps(c) for c in CONVERSATIONS] * 20 + ["the quick brown fox jumps over the lazy dog"] * 20
    tok = byte_level_bpe(text, 400, SPECIALS)
    path = tmp_path_factory.mktemp("chat-tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def hf_and_loom(directory, tokenizer_json, template, bos, eos):
    from transformers import AutoTokenizer

    from loom.data.tokenizer import Tokenizer

    directory.mkdir(exist_ok=True)
    (directory / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "bos_token": bos, "eos_token": eos}))
    hf = AutoTokenizer.from_pretrained(str(directory))
    return hf, Tokenizer.from_file(directory), load_template("auto", directory / "tokenizer.json")


def hf_ids(hf, messages, **kw):
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return list(out["input_ids"]), out


@pytest.mark.parametrize("name,template,bos,eos", [("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
                                                   ("chatml", CHATML, None, "<|im_end|>"),
                                                   ("features", FEATURES, "<|begin_of_text|>", "<|endoftext|>")])
def test_template_tokens_equal_transformers(name, template, bos, eos, chat_tokenizer, tmp_path):
    hf, tok, loom_template = hf_and_loom(tmp_path / name, chat_tokenizer, template, bos, eos)
    for messages in CONVERSATIONS:
        ids, mask = encode_chat(loom_template, tok, messages, "test")
        assert ids.tolist() == hf_ids(hf, messages)[0]
        for gen in (True, False):  # the rendering itself, with and without the generation prompt
            assert loom_template.render(messages, gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)
    if name in ("llama3", "chatml"):  # the built-in copy renders as the tokenizer_config.json one
        assert load_template(name).render(CONVERSATIONS[1]) == loom_template.render(CONVERSATIONS[1])
    else:  # raise_exception becomes a UserError naming the record
        with pytest.raises(UserError, match="chat.jsonl, line 7: chat template .* refused .*must be system or user"):
            encode_chat(loom_template, tok, [{"role": "assistant", "content": "hi"}], "chat.jsonl, line 7")


@pytest.mark.parametrize("template", ["marked", "chatml"])
def test_assistant_mask_equals_transformers_generation_mask(template, chat_tokenizer, tmp_path):
    """Loom finds the assistant's tokens by rendering prefixes (of the marked template, or of the built-in ChatML it
    renders as); transformers, for TRL's assistant_only_loss, by {% generation %} markers: exactly each reply and
    its <|im_end|>, never the newline the template writes after it (the model stops at <|im_end|>)."""
    hf, tok, marked = hf_and_loom(tmp_path / "gen", chat_tokenizer, CHATML_GENERATION, None, "<|im_end|>")
    loom_template = marked if template == "marked" else load_template("chatml")
    for messages in CONVERSATIONS:
        ids, mask = encode_chat(loom_template, tok, messages, "test")
        want_ids, out = hf_ids(hf, messages, return_assistant_tokens_mask=True)
        assert ids.tolist() == want_ids
        assert mask.tolist() == list(out["assistant_masks"]), messages
        learned = tok.decode(ids[mask == 1])
        assert learned == "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")


def test_prompt_completion_masks_the_prompt():
    from loom.post.chat import encode_completion
    from loom.data.tokenizer import get_tokenizer

    tok = get_tokenizer("bpe", 512, 300000)
    ids, mask = encode_completion(tok, "Q: 2+2?\n", "4")
    p = tok.encode("Q: 2+2?\n")
    assert ids.tolist() == p + tok.encode("4") + [tok.eod_id]
    assert mask.tolist() == [0] * len(p) + [1] * (len(ids) - len(p))


# --- malformed data ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line,message", [
    ("{not json", "line 2: not valid JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
    ('{"text": "x"}', "line 2: a record needs \"messages\""),
    ('{"messages": []}', "line 2: \"messages\" must be a non-empty list"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "line 2: messages\\[0\\] .*\"role\" one of system, user"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "line 2: no assistant message"),
    ('{"prompt": "x", "completion": 3}', "line 2: \"prompt\" and \"completion\" must both be strings"),
])
def test_malformed_record_names_file_and_line(line, message, tmp_path):
    from loom.data.tokenizer import get_tokenizer
    from loom.post.sft_data import prepare

    path = tmp_path / "chat.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n' + line + "\n")
    with pytest.raises(UserError, match=f"{path}, {message}"):
        prepare([str(path)], get_tokenizer("bpe", 512, 300000), load_template("chatml"))


def test_malformed_data_exits_2(tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n\n'
                    '{"messages": "hello"}\n')
    assert main(["sft", "--config", "tiny-sft", "--run-dir", str(tmp_path / "run"), *[f"--{o}" for o in SFT],
                 f"--sft.data={path}"]) == 2
    assert f"{path}, line 3: \"messages\" must be a non-empty list" in capsys.readouterr().err


def test_sft_needs_data_and_refuses_learned_positions_with_sp(capsys):
    # packing restarts positions per example: the SFT recipe's rule (loom/rules.py recipe_problem)
    assert main(["sft", "--config", "tiny-sft", "--print-config", "--model.position=learned", "--parallel.tp=2",
                 "--parallel.sp=true"]) == 2
    assert "packed sequences restart learned positions" in capsys.readouterr().err
    with pytest.raises(UserError, match="sft.data and data.paths"):
        load_config("tiny-sft", ["data.paths=x"])
    assert main(["sft", "--config", "tiny", "--print-config"]) == 2


# --- packing ---------------------------------------------------------------------------------------------------


def _examples(vocab: int, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g)
        labels = ids[1:].clone()
        labels[: n // 3] = IGNORE  # the "prompt"
        out.append((ids[:-1], labels))
    return out


def _pack(examples, seq_len):
    x = torch.zeros(1, seq_len, dtype=torch.long)
    y = torch.full((1, seq_len), IGNORE)
    docs = torch.full((1, seq_len), len(examples))
    pos = torch.zeros(1, seq_len, dtype=torch.long)
    at = 0
    for d, (ids, labels) in enumerate(examples):
        n = len(ids)
        x[0, at:at + n], y[0, at:at + n], docs[0, at:at + n], pos[0, at:at + n] = ids, labels, d, torch.arange(n)
        at += n
    pos[0, at:] = torch.arange(seq_len - at)
    return {"input_ids": x, "labels": y, "doc_ids": docs, "positions": pos}


@pytest.mark.parametrize("variant", ["sdpa", "math", "learned-gelu"])
def test_packed_loss_and_gradients_equal_unpacked(variant):
    """One row holding three examples (and padding) gives each example's loss and gradients exactly as the
    example alone in its row: the masked mean over the packed row == the mean over the separate examples'
    supervised tokens, within 1e-5 in fp32."""
    extra = {"attention": "math"} if variant == "math" else {}
    if variant == "learned-gelu":
        extra = {"position": "learned", "mlp": "gelu", "norm": "layernorm", "bias": True}
    cfg = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=97, max_seq_len=64,
                      **extra)
    model = build_model(cfg, seed=3)
    loss = MaskedTokenCrossEntropy()
    examples = _examples(cfg.vocab_size, [13, 29, 9])

    def grads_of(total):
        model.zero_grad()
        total.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    packed = _pack(examples, 60)
    count = loss.count(packed)
    assert count == sum(int((y != IGNORE).sum()) for _, y in examples)
    kwargs = {k: packed[k] for k in ("doc_ids", "positions")}
    packed_loss = loss(model(packed["input_ids"], **kwargs), packed) / count
    packed_grads = grads_of(packed_loss)
    alone = sum(loss(model(x[None]), {"labels": y[None]}) for x, y in examples) / count
    alone_grads = grads_of(alone)
    assert abs(packed_loss.item() - alone.item()) < 1e-5 * alone.item()
    for name, g in alone_grads.items():
        assert torch.allclose(packed_grads[name], g, rtol=1e-5, atol=1e-6), name
    # The check can fail: without the document mask the packed loss differs; so it does with learned positions
    # not restarted (rotary scores depend on relative positions only, so there restarting changes nothing).
    unmasked = loss(model(packed["input_ids"], positions=packed["positions"]), packed) / count
    assert abs(unmasked.item() - alone.item()) > 1e-3
    if cfg.position == "learned":
        unrestarted = loss(model(packed["input_ids"], doc_ids=packed["doc_ids"]), packed) / count
        assert abs(unrestarted.item() - alone.item()) > 1e-3


def test_document_ids_from_end_of_document_tokens():
    from loom.data.samples import documents

    x = torch.tensor([[5, 6, 0, 7, 0, 0, 8, 9], [0, 1, 2, 3, 4, 5, 6, 7]])
    out = documents(x, eod=0)
    assert out["doc_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert out["positions"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_pretraining_document_mask_batches(tmp_path):
    from loom.data.token_datasets import build_datasets
    from loom.data.tokenizer import load_tokenizer

    from conftest import small_config

    # The embedded corpus is a dozen long documents: a whole pass over it (4,284 rows of 32) meets every boundary.
    cfg = small_config("data.document_mask=true", "train.steps=540")
    tok = load_tokenizer(cfg)
    train, _ = build_datasets(cfg, tok)
    batch = train.batch(0, len(train))
    x = batch["input_ids"]
    ends = (x == tok.eod_id).any(dim=1)
    assert ends.sum() >= 10  # rows that hold several documents
    rows = ends | (torch.arange(len(x)) < 50)  # those, and some that hold one
    for row, docs, pos in zip(x[rows].tolist(), batch["doc_ids"][rows].tolist(), batch["positions"][rows].tolist()):
        doc, at = 0, 0
        for i, t in enumerate(row):
            assert (docs[i], pos[i]) == (doc, i - at)
            if t == tok.eod_id:
                doc, at = doc + 1, i + 1


def _dataset(tmp_path, packing, overlong, seq_len=256, n=60):
    from loom.data.tokenizer import get_tokenizer
    from loom.post.sft_data import Examples, SFTDataset, prepare
    from loom.post.synthetic import write

    tok = get_tokenizer("bpe", 512, 300000)
    prefixes = prepare([str(write(tmp_path / "chat.jsonl", n))], tok, load_template("chatml"))
    examples = Examples(prefixes)
    return examples, SFTDataset(examples, np.arange(n), seq_len, packing, overlong, None, 1, tok.eod_id,
                                shuffle=False)


def test_rows_hold_every_example_once_with_its_mask(tmp_path):
    examples, packed = _dataset(tmp_path, True, "drop")
    _, padded = _dataset(tmp_path, False, "drop")
    _, cut = _dataset(tmp_path, True, "truncate")
    over = int((examples.sizes - 1 > 256).sum())
    assert over > 0 and packed.stats["overlong"] == over == packed.stats["dropped"]
    assert cut.stats["overlong"] == over and cut.stats["dropped"] < over  # truncated ones are kept
    assert f"{over} longer than seq_len + 1 tokens, {over} dropped, policy drop" in packed.summary(1, 1)
    assert packed.stats["padding"] < 0.5 * padded.stats["padding"]
    batch = packed.batch(0, len(packed))
    x, y, docs, pos = (batch[k].numpy() for k in ("input_ids", "labels", "doc_ids", "positions"))
    seen = []
    for r in range(len(packed)):
        for d in np.unique(docs[r]):
            where = np.flatnonzero(docs[r] == d)
            if (y[r, where] == IGNORE).all():  # padding
                continue
            assert (pos[r, where] == np.arange(len(where))).all()
            match = [e for e in range(len(examples)) if examples.sizes[e] == len(where) + 1
                     and (examples.get(e, len(where))[0] == x[r, where]).all()]
            e = match[0]
            full, mask = examples.get(e, len(where) + 1)
            assert (y[r, where] == np.where(mask[1:] > 0, full[1:].astype(np.int64), IGNORE)).all()
            seen.append(e)
    assert sorted(seen) == sorted(packed.members.tolist())


# --- the recipe in every layout -------------------------------------------------------------------------------

SFT = ["model.layers=4", "model.tie_embeddings=false", "model.hidden=64", "model.heads=4", "model.kv_heads=2",
       "model.ffn_hidden=160", "model.vocab_size=512", "model.max_seq_len=64", "train.seq_len=64", "train.steps=3",
       "train.global_batch=8", "data.corpus_max_bytes=300000", "log.progress=none", "log.tensorboard=false",
       "sft.data=synthetic:200", "optim.warmup_steps=1", "data.split=90,10"]


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory):
    """One process, the whole global batch in one micro-batch."""
    run_dir = tmp_path_factory.mktemp("sft-single") / "run"
    assert main(["sft", "--config", "tiny-sft", "--run-dir", str(run_dir), *[f"--{o}" for o in SFT],
                 "--train.micro_batch=8"]) == 0
    return run_dir


# Each with micro_batch=2 (gradient accumulation over 2-4 micro-batches): the masked loss's exact mean.
SFT_LAYOUTS = {"dp_shard2": ["parallel.dp_shard=2"], "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"],
               "cp2": ["parallel.cp=2"]}


# tp2: vocabulary-parallel cross-entropy skipping -100 labels
@pytest.mark.parametrize("name", list(SFT_LAYOUTS))
def test_packed_sft_layout_matches_single_process(name, sft_reference, tmp_path):
    from pool_launch import launch_in_pool

    # `loom sft --nproc 2`, in the session's kept rank processes
    launch_in_pool("sft", "tiny-sft", tmp_path / "run", 2, SFT + ["train.micro_batch=2"] + SFT_LAYOUTS[name])
    steps, evals = metrics(tmp_path / "run")
    ref_steps, ref_evals = metrics(sft_reference)
    assert len(steps) == len(ref_steps) == 3
    for got, want in zip(steps, ref_steps):
        for key in ("loss", "grad_norm"):
            assert math.isclose(got[key], want[key], rel_tol=1e-5), (name, got["step"], key, got[key], want[key])
    assert math.isclose(evals[-1]["val_loss"], ref_evals[-1]["val_loss"], rel_tol=1e-5)


def test_preprocess_sft_keeps_the_mask_and_is_what_a_run_reads(tmp_path, capsys, chat_tokenizer):
    from loom.data.tokenizer import Tokenizer, bpe_cache_path, get_tokenizer
    from loom.post.sft_data import Examples, prepare
    from loom.post.synthetic import write

    tok = get_tokenizer("bpe", 512, 300000)
    data = write(tmp_path / "chat.jsonl", 30)
    args = ["preprocess", "--sft", "--input", str(data), "--output-prefix", str(tmp_path / "p"), "--tokenizer",
            str(bpe_cache_path(512, 300000)), "--template", "chatml"]
    assert main(args) == 0
    assert "30 examples" in capsys.readouterr().out
    assert main(args) == 2  # never replaced without --overwrite
    stored, fresh = Examples([str(tmp_path / "p")]), Examples(prepare([str(data)], tok, load_template("chatml")))
    assert (stored.sizes == fresh.sizes).all() and (stored.first == fresh.first).all()
    for i in range(len(fresh)):
        for a, b in zip(stored.get(i, int(fresh.sizes[i])), fresh.get(i, int(fresh.sizes[i]))):
            assert (a == b).all()
    assert prepare([str(tmp_path / "p")], tok, load_template("chatml")) == [str(tmp_path / "p")]
    other = Tokenizer.from_file(chat_tokenizer)
    with pytest.raises(UserError, match="tokenized with another tokenizer"):
        prepare([str(tmp_path / "p")], other, load_template("chatml"))
