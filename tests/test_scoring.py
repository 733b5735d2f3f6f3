"""The engine's prompt scoring and logits processing (issue 57, item 1), against references written here: prompt
log-probs (`SamplingParams.prompt_logprobs`, max_new_tokens=0) equal a direct fp32 forward of the model; greedy
and sampled decoding with presence / frequency / repetition penalties, logit_bias and min_tokens equal a loop
that runs the whole model on the whole sequence each step and applies the rules (vLLM's / HF's) in float64."""

from __future__ import annotations

import pytest
import torch

from loom.errors import UserError
from loom.infer.engine import Engine
from loom.infer.sampling import SamplingParams

VOCAB, CONTEXT = 96, 64


@pytest.fixture(scope="module")
def model():
    from loom.config import ModelConfig
    from loom.models.llama import build_model

    cfg = ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=VOCAB, max_seq_len=CONTEXT)
    net = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # sharp logits: greedy picks far from ties
        for p in net.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3, generator=g)
    return net.eval()


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12], [3, 3, 3, 40, 41, 42, 43, 44, 45, 46, 2]]


def raw(model, ids: list[int] | None, rows: list[list[int]] | None = None) -> torch.Tensor:
    """The logits of a direct forward of `ids` [len, vocab], or of `rows` of one length [rows, len, vocab]; float64."""
    with torch.no_grad():
        return model(torch.tensor(rows or [ids])).double()[0 if rows is None else slice(None)]


def direct(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of a direct forward, float64 [len, vocab]."""
    return raw(model, ids).log_softmax(-1)


def test_prompt_logprobs_equal_a_direct_forward_and_take_no_slot(model):
    engine = Engine(model, max_batch=2, max_len=CONTEXT)
    full = [list(range(1, CONTEXT + 1))]  # a prompt filling max_len can be scored (no slot, no completion)
    prompts = PROMPTS + full
    scored = engine.generate(prompts, SamplingParams(max_new_tokens=0, prompt_logprobs=3))
    assert engine.stats["prefill_steps"] == 0 and engine.stats["scored_tokens"] == sum(map(len, prompts))
    for ids, out in zip(prompts, scored):
        ref = direct(model, ids)
        assert out.tokens == [] and out.finish_reason == "length"
        assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] is None
        want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(out.prompt_logprobs[1:], want)) < 1e-5
        for i in range(1, len(ids)):
            top = ref[i - 1].topk(3)
            assert [t for t, _ in out.prompt_top_logprobs[i]] == top.indices.tolist()
            assert max(abs(v - w) for (_, v), w in zip(out.prompt_top_logprobs[i], top.values.tolist())) < 1e-5
    # scoring while generating: the prompt's log-probs and the same tokens as without
    plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    both = engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, prompt_logprobs=0))
    for p, b, s in zip(plain, both, scored):
        assert b.tokens == p.tokens and b.prompt_top_logprobs == []
        assert max(abs(x - y) for x, y in zip(b.prompt_logprobs[1:], s.prompt_logprobs[1:])) < 1e-5
    with pytest.raises(UserError, match="max_new_tokens=0"):
        engine.generate([[1, 2]], SamplingParams(max_new_tokens=0))


def process(logits: torch.Tensor, p: SamplingParams, prompt: list[int], done: list[int]) -> torch.Tensor:
    """The reference: vLLM's order (bias, min_tokens, repetition over prompt + completion, frequency and presence
    over the completion), float64, token by token."""
    x = logits.clone()
    for t, b in p.logit_bias:
        x[t] += b
    if len(done) < p.min_tokens:
        for t in p.stop_token_ids:
            x[t] = float("-inf")
    for t in set(prompt) | set(done):
        if p.repetition_penalty != 1:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(done):
        x[t] -= p.frequency_penalty * done.count(t) + p.presence_penalty
    return x


def reference(model, prompt: list[int], params: list[SamplingParams], seeds: list[int], steps: int):
    """Whole-sequence forwards (one batched forward per token, every row continuing past its stop): greedy
    argmax, or the inverse CDF of softmax(x / T) at the request's uniforms (one per token from
    torch.Generator().manual_seed(seed), as the engine draws them). -> per row (tokens up to and with the first
    stop, log-probs of the raw logits)."""
    done = [[] for _ in params]
    lps = [[] for _ in params]
    uniforms = [torch.rand(steps, generator=torch.Generator().manual_seed(s)).double() for s in seeds]
    for k in range(steps):
        logits = raw(model, None, [prompt + d for d in done])[:, -1]
        for r, (p, d) in enumerate(zip(params, done)):
            x = process(logits[r], p, prompt, d)
            if p.temperature == 0:
                t = int(x.argmax())
            else:
                cdf = (x / p.temperature).softmax(-1).cumsum(-1)
                t = min(int(torch.searchsorted(cdf, uniforms[r][k] * cdf[-1], right=True)), VOCAB - 1)
            lps[r].append(logits[r].log_softmax(-1)[t].item())
            d.append(t)
    out = []
    for p, d, lp in zip(params, done, lps):
        end = next((i + 1 for i, t in enumerate(d) if t in p.stop_token_ids), len(d))
        out.append((d[:end], lp[:end]))
    return out


CASES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.6),
    "negative presence": dict(presence_penalty=-2.0),
    "logit_bias": dict(logit_bias=((17, 6.0), (30, -100.0))),
    "min_tokens": dict(min_tokens=7),  # with stop_token_ids: a token the plain run emits early
    "all": dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias=((17, 2.5),)),
}


def test_penalties_bias_and_min_tokens_equal_the_reference(model):
    """Each processing alone and all together, greedy and sampled, in one batch with rows that do not process;
    windows of 3 steps (the history kept on the device within a window, rebuilt between windows)."""
    prompt, steps = PROMPTS[0], 10
    engine = Engine(model, max_batch=16, max_len=CONTEXT, sync_every=3)
    plain = [SamplingParams(temperature=t, max_new_tokens=steps, seed=3) for t in (0.0, 0.8)]
    first = engine.generate([prompt] * 2, plain)
    stops = {p.temperature: (o.tokens[1],) for p, o in zip(plain, first)}  # each plain run's second token
    params = [SamplingParams(**{**base.__dict__, **kw, "stop_token_ids": stops[base.temperature] * ("min_tokens" in kw)})
              for base in plain for kw in CASES.values()]
    got = engine.generate([prompt] * (len(params) + 2), params + plain)
    for o, f in zip(got[-2:], first):
        assert o.tokens == f.tokens  # rows without processing in the same batch: unchanged
    want = reference(model, prompt, params, [3] * len(params), steps)
    for p, g, (tokens, lps), name in zip(params, got, want, [*CASES] * 2):
        base = first[p.temperature > 0].tokens
        assert g.tokens == tokens, (name, p.temperature)
        assert g.tokens[:len(base)] != base[:len(g.tokens)], f"{name} changed no token: the test would pass with it off"
        assert max(abs(a - b) for a, b in zip(g.logprobs, lps)) < 1e-5  # reported: the raw logits' log-probs
        if name == "min_tokens":
            assert p.stop_token_ids[0] not in g.tokens[:7] and len(g.tokens) >= 7


def test_min_tokens_holds_stop_strings_back(model):
    """As vLLM: no stop string ends a completion before min_tokens tokens, and one found only in the text of
    the tokens before the min_tokens-th does not count; the text is cut at the occurrence that ended it."""
    decode = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731 (each token's text tells it apart)
    engine = Engine(model, max_batch=2, max_len=CONTEXT, sync_every=3, decode=decode)
    plain = engine.generate([PROMPTS[2]], SamplingParams(max_new_tokens=14))[0].tokens
    assert len(plain) == 14
    for stop_token, least in [(plain[1], 5), (plain[0], 0)]:
        p = SamplingParams(max_new_tokens=14, stop=(f"<{stop_token}>",), min_tokens=least)
        got = engine.generate([PROMPTS[2]], p)[0]
        # the reference: the first token equal to the stop token at index >= max(min_tokens - 1, 0)
        end = next((i + 1 for i, t in enumerate(plain) if t == stop_token and i >= least - 1), None)
        assert got.tokens == plain[:end]
        if end is not None:
            assert got.finish_reason == "stop" and got.text(decode) == decode(plain[:end - 1])
    assert least == 0 and end == 1  # without min_tokens the stop string ends it at once


def test_bad_processing_values_are_refused(model):
    engine = Engine(model, max_batch=1, max_len=CONTEXT)
    for kw, message in [(dict(presence_penalty=2.5), r"presence_penalty=2.5 \(must be in \[-2, 2\]\)"),
                        (dict(frequency_penalty=-3), "frequency_penalty=-3"),
                        (dict(repetition_penalty=0.0), r"repetition_penalty=0.0 \(must be in \(0, inf\]\)"),
                        (dict(min_tokens=20, max_new_tokens=10), "min_tokens=20"),
                        (dict(logit_bias=((3, 101.0),)), r"logit_bias values must be in \[-100, 100\]"),
                        (dict(prompt_logprobs=-1, max_new_tokens=0), "prompt_logprobs=-1")]:
        with pytest.raises(UserError, match=message):
            engine.submit([1, 2], SamplingParams(**kw))
