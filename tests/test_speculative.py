"""Speculative decoding with prompt-lookup drafts (loom/infer/speculative.py): greedy output equal to the plain
engine's (slab and paged, stops and lengths), drafts accepted and counted; the rejection sampler's output has the
target's distribution (a tiny vocabulary, many draws) and so has a sampled engine's completion (two tokens against
the model's exact joint law); `loom generate --speculative ngram` writes what plain generation writes and reports
accepted tokens per step."""

from __future__ import annotations

import json
import random

import pytest
import torch

from loom.config import ModelConfig
from loom.errors import UserError
from loom.infer.engine import Engine
from loom.infer.sampling import SamplingParams
from loom.infer.speculative import ngram_draft, target_probs, verify
from loom.models.llama import Transformer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=97, hidden=48, layers=2, heads=4, kv_heads=2, ffn_hidden=96,
                                   max_seq_len=160)).eval()


def test_ngram_draft_copies_what_followed_the_latest_match():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2) == [7, 5]  # the latest match of [1, 2, 3]
    assert ngram_draft([4, 5, 6, 8, 5, 6], 3) == [8, 5, 6]  # a 2-gram when no 3-gram matches
    assert ngram_draft([4, 5, 6, 9, 6], 5) == [9, 6]  # a 1-gram; only what exists
    assert ngram_draft([1, 2, 3], 4) == [] and ngram_draft([1, 1, 2, 1], 0) == []


@pytest.mark.parametrize("paged", [False, True], ids=["slab", "paged"])
def test_greedy_equals_plain_greedy(model, paged):
    """Ragged prompts (one repetitive), a stop token, max_batch below the requests: tokens equal the plain engine's,
    log-probs to 1e-5, finish reasons too; drafts were made and some kept, and fewer forwards ran than tokens."""
    g = random.Random(0)
    prompts = [[g.randrange(97) for _ in range(g.randrange(3, 20))] for _ in range(5)] + [[1, 2, 3, 4, 5] * 6]
    params = [SamplingParams(max_new_tokens=8 + 4 * i, stop_token_ids=(7,)) for i in range(len(prompts))]
    want = Engine(model, max_batch=3, max_len=128, paged=paged).generate(prompts, params)
    engine = Engine(model, max_batch=3, max_len=128, paged=paged, block_size=8, speculative="ngram", draft_tokens=4)
    got = engine.generate(prompts, params)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert max(abs(a - b) for x, y in zip(got, want) for a, b in zip(x.logprobs, y.logprobs)) < 1e-5
    s = engine.stats
    assert s["spec_accepted_tokens"] > 0 and s["spec_draft_tokens"] >= s["spec_accepted_tokens"]
    assert s["decoded_tokens"] == sum(len(c.tokens) - 1 for c in got)  # every token but the prefill's first
    assert s["spec_request_steps"] + s["spec_accepted_tokens"] >= s["decoded_tokens"]
    assert s["spec_request_steps"] < s["decoded_tokens"]  # fewer target passes per request than tokens


def test_rejection_sampling_keeps_the_target_distribution():
    """Drafts of a fixed token under a 5-token target distribution (one draft likely, one unlikely, one outside
    top-k): the first emitted token's frequencies over 8,000 draws equal p (4 standard errors), and a kept draft's
    next token is drawn from the next row."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.0, 2.0, 0.3, 0.1]])
    g = torch.Generator().manual_seed(0)
    for params, draft in ((SamplingParams(temperature=0.8), 0), (SamplingParams(temperature=1.3), 3),
                          (SamplingParams(temperature=1.0, top_k=3), 4), (SamplingParams(temperature=1.0, top_p=0.7), 1)):
        probs = target_probs(logits, params)
        n = 8000
        first, second = torch.zeros(5), torch.zeros(5)
        for u in torch.rand(n, 4, generator=g):
            out, kept = verify(probs, [draft], u)
            first[out[0]] += 1
            if kept:
                second[out[1]] += 1
        err = (probs[0] * (1 - probs[0]) / n).sqrt()
        assert ((first / n - probs[0]).abs() <= 4 * err + 1e-9).all(), (params, first / n, probs[0])
        if second.sum() > 500:
            assert ((second / second.sum() - probs[1]).abs() <= 4 * (probs[1] / second.sum()).sqrt() + 1e-3).all()


def test_sampled_engine_keeps_the_joint_law():
    """400 sampled completions of a sharp 12-token model after a repetitive prompt (so that drafts exist; the first
    token comes from the prefill, the second from a verified one-token draft): every cell of the (t1, t2)
    frequencies is within 4.5 standard errors of the model's exact joint law p(t1) p(t2 | t1), and drafts were
    both kept and rejected."""
    torch.manual_seed(3)
    sharp = Transformer(ModelConfig(vocab_size=12, hidden=32, layers=1, heads=2, kv_heads=1, ffn_hidden=64,
                                    max_seq_len=64)).eval()
    with torch.no_grad():
        for w in sharp.parameters():
            if w.dim() > 1:
                w.normal_(0, 0.4)
    prompt = [1, 2, 3, 4] * 5
    n = 400
    engine = Engine(sharp, max_batch=32, max_len=40, speculative="ngram", draft_tokens=2)
    got = engine.generate([prompt] * n, [SamplingParams(temperature=1.0, max_new_tokens=3, seed=i) for i in range(n)])
    s = engine.stats
    assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
    p = SamplingParams(temperature=1.0)
    with torch.no_grad():
        first = target_probs(sharp(torch.tensor([prompt]))[0, -1:].float(), p)[0]
        seconds = target_probs(sharp(torch.tensor([prompt + [t] for t in range(12)]))[:, -1].float(), p)
    joint = first[:, None] * seconds  # [t1, t2]
    counts = torch.zeros(12, 12)
    for c in got:
        counts[c.tokens[0], c.tokens[1]] += 1
    err = (joint * (1 - joint) / n).sqrt()
    assert ((counts / n - joint).abs() <= 4.5 * err + 2 / n).all(), (counts / n - joint).abs().max()


def test_engine_refuses_unknown_speculation(model):
    with pytest.raises(UserError, match="speculative"):
        Engine(model, speculative="eagle")
    with pytest.raises(UserError, match="draft_tokens"):
        Engine(model, speculative="ngram", draft_tokens=0)


def test_generate_speculative_writes_what_plain_generation_writes(tmp_path):
    """`loom generate --speculative ngram --draft-tokens 3`: the same records as without it (greedy), and the
    summary reports tokens per step and accepted drafts; a bad --draft-tokens exits 2 naming it."""
    from conftest import run_main
    from test_serve import model_dir

    tiny = model_dir(tmp_path / "tiny")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                                               ("one two three one two three one two", "the quick brown fox")))
    outs = {}
    for mode in ("off", "ngram"):
        out = tmp_path / f"{mode}.jsonl"
        r = run_main("generate", "--checkpoint", str(tiny), "--input", str(tmp_path / "in.jsonl"), "--output",
                     str(out), "--max-new-tokens", "24", "--device", "cpu", "--speculative", mode, "--draft-tokens", "3")
        assert r.returncode == 0, r.stderr
        outs[mode] = [json.loads(x) for x in out.read_text().splitlines()]
    assert [o["tokens"] for o in outs["ngram"]] == [o["tokens"] for o in outs["off"]]
    assert "tokens per step" in r.stdout and "drafted tokens accepted" in r.stdout
    bad = run_main("generate", "--checkpoint", str(tiny), "--prompt", "hi", "--speculative", "ngram",
                   "--draft-tokens", "0")
    assert bad.returncode == 2 and "--draft-tokens=0" in bad.stderr


def test_serve_speculative_replies_as_plain_and_counts_drafts(tmp_path):
    """`loom serve --speculative ngram`: a greedy completion equals the plain server's and /metrics counts drafted,
    accepted tokens and request steps."""
    from test_serve import Server, model_dir

    from loom.serve import load
    from loom.serve.protocol import Limits

    tiny = model_dir(tmp_path / "tiny")
    replies, metrics = {}, {}
    for mode in ("off", "ngram"):
        server = Server(load(str(tiny), max_batch=2, speculative=mode, draft_tokens=3, limits=Limits(max_tokens=24)))
        try:
            replies[mode] = server.client.completions.create(model="tiny", prompt="one two three one two three one",
                                                             max_tokens=20, temperature=0).choices[0].token_ids
            metrics[mode] = server.metrics()
        finally:
            server.close()
    assert replies["ngram"] == replies["off"]
    m = metrics["ngram"]
    assert m["loom_spec_request_steps_total"] > 0 and m["loom_spec_draft_tokens_total"] >= m["loom_spec_accepted_tokens_total"]
    assert metrics["off"]["loom_spec_request_steps_total"] == 0
