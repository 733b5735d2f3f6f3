"""`loom serve` scoring prompts and processing logits (issue 57, item 1), through the official `openai` client:
echo + logprobs + max_tokens=0 (and max_tokens=1, as lm-evaluation-harness's `local-completions` sends) give the
prompt's log-probs of a direct fp32 forward in the fields lm-eval reads (`token_logprobs`, `top_logprobs`,
`tokens`, `text_offset`); penalties, logit_bias, min_tokens and stop_token_ids on completions and chat equal the
reference of tests/test_scoring.py; bad values get a 400 naming the field and the server keeps serving."""

from __future__ import annotations

import re

import pytest
import torch

fastapi = pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_scoring import reference  # noqa: E402
from test_serve import CHAT, CONTEXT, Server, model_dir  # noqa: E402

from loom.infer.sampling import SamplingParams  # noqa: E402
from loom.serve import load  # noqa: E402
from loom.serve.protocol import Limits  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = model_dir(tmp_path_factory.mktemp("scoring") / "tiny")
    s = Server(load(str(path), max_batch=8, sync_every=4, limits=Limits(max_tokens=32, max_n=2)))
    yield s
    s.close()


def direct(served, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return served.served.scheduler.engine.model(torch.tensor([ids]))[0].double().log_softmax(-1)


def test_echo_scores_the_prompt_as_a_direct_forward(served):
    tok = served.served.tokenizer
    text = "the quick brown fox jumps"
    ids = tok.encode(text)
    ref = direct(served, ids)
    want = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    r = served.client.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=2,
                                         temperature=0)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text == text and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert lp.tokens == [tok.decode([t]) for t in ids] and len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], want)) < 1e-5
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(ids))]
    for i in range(1, len(ids)):
        best = ref[i - 1].topk(2)
        expect = {tok.decode([t]): v for t, v in zip(best.indices.tolist(), best.values.tolist())}
        expect[tok.decode([ids[i]])] = want[i - 1]  # OpenAI's: the most likely and the chosen token
        got = lp.top_logprobs[i]
        assert got.keys() == expect.keys() and max(abs(got[k] - expect[k]) for k in got) < 1e-5
    # what lm-eval's local-completions sends: token ids, echo, logprobs=1, max_tokens=1; it reads [ctxlen:-1]
    r = served.client.completions.create(model="tiny", prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                         temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and r.choices[0].token_ids == [int(ref[-1].argmax())]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], want)) < 1e-5
    assert abs(lp.token_logprobs[-1] - ref[-1].max().item()) < 1e-5
    # a prompt filling the whole context can be scored (max_tokens=0), one token longer cannot
    full = (ids * CONTEXT)[:CONTEXT]
    r = served.client.completions.create(model="tiny", prompt=full, max_tokens=0, echo=True, logprobs=0)
    ref = direct(served, full)
    got = r.choices[0].logprobs.token_logprobs
    assert max(abs(got[i] - ref[i - 1, full[i]].item()) for i in range(1, CONTEXT)) < 1e-5
    with pytest.raises(openai.BadRequestError, match="the prompt is 97 tokens"):
        served.client.completions.create(model="tiny", prompt=full + [5], max_tokens=0, echo=True, logprobs=0)


def test_several_prompts_in_one_request(served):
    """A list of prompts (lm-eval's batch_size > 1): prompt i's choice k is choice i * n + k, each as if sent
    alone; scored prompts equal a direct forward."""
    tok = served.served.tokenizer
    prompts = [tok.encode("the quick brown fox"), tok.encode("say ok 3"), tok.encode("jumps over")]
    r = served.client.completions.create(model="tiny", prompt=prompts, max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    for ids, c in zip(prompts, r.choices):
        ref = direct(served, ids)
        assert c.text == tok.decode(ids)
        assert max(abs(c.logprobs.token_logprobs[i] - ref[i - 1, ids[i]].item()) for i in range(1, len(ids))) < 1e-5
    texts = ["the quick brown fox", "say ok 3"]
    r = served.client.completions.create(model="tiny", prompt=texts, max_tokens=5, n=2, temperature=0.8, seed=4)
    alone = [served.client.completions.create(model="tiny", prompt=t, max_tokens=5, n=2, temperature=0.8, seed=4)
             for t in texts]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in r.choices] == [c.token_ids for a in alone for c in a.choices]
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_processing_equals_the_reference_on_completions_and_chat(served):
    tok = served.served.tokenizer
    model = served.served.scheduler.engine.model
    ids = tok.encode("jumps over the lazy")
    body = dict(presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.4, logit_bias={"17": 3.0})
    r = served.client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_body=body)
    p = SamplingParams(max_new_tokens=8, presence_penalty=0.5, frequency_penalty=0.4, repetition_penalty=1.4,
                       logit_bias=((17, 3.0),), stop_token_ids=served.served.stop_ids)
    (want, _), = reference(model, ids, [p], [0], 8)
    plain = served.client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert r.choices[0].token_ids == want != plain.choices[0].token_ids
    # chat: logit_bias forces a token; min_tokens keeps it out (a stop token here) for two tokens
    forced = tok.encode("x")[0]
    r = served.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0,
                                              logit_bias={str(forced): 100})
    assert r.choices[0].token_ids == [forced] * 4
    r = served.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                              logit_bias={str(forced): 100},
                                              extra_body={"min_tokens": 2, "stop_token_ids": [forced]})
    got = r.choices[0].token_ids
    assert len(got) == 3 and forced not in got[:2] and got[2] == forced and r.choices[0].finish_reason == "stop"


CHAT_BODY = {"messages": CHAT}
BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty", r"presence_penalty=2.5 is out of range; it must be in \[-2, 2\]"),
    ({"frequency_penalty": "x"}, "frequency_penalty", r'frequency_penalty must be a number, got "x"'),
    ({"repetition_penalty": 0}, "repetition_penalty", r"repetition_penalty=0 is out of range; it must be > 0"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", r"logit_bias keys must be token ids .* got 'abc'"),
    ({"logit_bias": {"5": 101}}, "logit_bias", r"logit_bias\['5'\]=101 must be a number in \[-100, 100\]"),
    ({"logit_bias": [1]}, "logit_bias", r"logit_bias must be an object"),
    ({"logit_bias": {"300": 1}}, None, r"token ids \[300\] \(stop_token_ids / logit_bias\) outside the vocabulary"),
    ({"stop_token_ids": [999]}, None, r"token ids \[999\] \(stop_token_ids / logit_bias\) outside the vocabulary"),
    ({"stop_token_ids": "x"}, "stop_token_ids", r"stop_token_ids must be a list of at most 64 token ids"),
    ({"min_tokens": -1}, "min_tokens", r"min_tokens=-1 is out of range"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", r"min_tokens=5 is out of range; it must be in \[0, 4\]"),
    ({"echo": True, "stream": True}, "echo", r"echo is not supported with stream=true"),
    ({"echo": "yes"}, "echo", r"echo must be true or false"),
    ({"max_tokens": 0}, "max_tokens", r"max_tokens=0 is out of range; it must be in \[1, 32\]"),
    ({**CHAT_BODY, "echo": True}, "echo", r"echo is not supported on /v1/chat/completions"),
    ({"prompt": ["a"] * 65}, "prompt", r"prompt holds 65 prompts; at most 64 in one request"),
    ({"prompt": ["a", "b"], "stream": True}, "prompt", r"several prompts in one request are not supported with"),
    ({"prompt": ["a", [1, 999]]}, "prompt", r"token ids outside the vocabulary"),
    ({**CHAT_BODY, "presence_penalty": -3}, "presence_penalty", r"presence_penalty=-3 is out of range"),
    ({**CHAT_BODY, "stop_token_ids": [1.5]}, "stop_token_ids", r"stop_token_ids must be a list"),
]


@pytest.mark.parametrize("body,param,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_values_get_400_naming_the_field_and_the_server_keeps_serving(served, body, param, message):
    chat = "messages" in body
    r = httpx.post(served.url + ("/v1/chat/completions" if chat else "/v1/completions"),
                   json={"model": "tiny", **({} if chat or "prompt" in body else {"prompt": "a"}), **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert re.search(message, error["message"]), error
    assert param is None or error["param"] == param
    good = httpx.post(served.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2,
                                                            "presence_penalty": 1.0})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
