"""`loom serve` (loom/serve/): the official `openai` client against the server on a tiny random model, in this
process (uvicorn in a thread). Greedy completions and chat completions, streamed and not, equal `loom
generate`'s records (tokens, text, log-probs); sampled choices equal the engine's with the same seeds; 32
concurrent streams are decoded together (metrics); a client that goes away frees its slot; bad requests get
400 and an OpenAI error body and the server keeps serving; an API key is required when set; a full queue
answers 429; the step-wise engine API (submit / step / cancel) gives generate's tokens."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import pytest
import torch

from conftest import run_main

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from loom.cli import main  # noqa: E402
from loom.infer.engine import Engine  # noqa: E402
from loom.infer.sampling import SamplingParams  # noqa: E402
from loom.serve import load  # noqa: E402
from loom.serve.app import create_app  # noqa: E402
from loom.serve.protocol import Limits  # noqa: E402

CONTEXT = 96
PROMPTS = ["the quick brown fox", "say ok 3", "jumps over"]
CHAT = [{"role": "user", "content": "say ok 1"}]


def model_dir(path):
    """A loom model directory: a random 2-layer GQA model with a ChatML byte-level BPE (test_chat's)."""
    from test_chat import write_tokenizer

    from loom.config import Config, ModelConfig
    from loom.models.io import save_model_dir
    from loom.models.llama import build_model

    write_tokenizer(path)
    cfg = Config(model=ModelConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=300,
                                   max_seq_len=CONTEXT))
    cfg.train.seq_len = CONTEXT
    model = build_model(cfg.model, seed=0)
    g = torch.Generator().manual_seed(0)  # the same weights in every run (the global generator is not seeded here)
    with torch.no_grad():  # sharper than the init's: greedy picks are far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3, generator=g)
    save_model_dir(model, cfg, path, tokenizer_path=path / "tokenizer.json")
    return path


class Server:
    """uvicorn serving `served` on a free port, in a thread."""

    def __init__(self, served, start_scheduler: bool = True):
        self.served = served
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(create_app(served), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        if start_scheduler:
            served.scheduler.start()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def metrics(self, headers=None) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=headers).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.served.scheduler.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return model_dir(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def server(tiny):
    s = Server(load(str(tiny), max_batch=16, sync_every=4, limits=Limits(max_tokens=64, max_n=4)))
    yield s
    s.close()


@pytest.fixture(scope="module")
def generated(tiny, tmp_path_factory):
    """`loom generate`'s greedy records for PROMPTS and the chat CHAT (12 new tokens)."""
    d = tmp_path_factory.mktemp("gen")
    (d / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS)
                                + json.dumps({"messages": CHAT}) + "\n")
    assert main(["generate", "--checkpoint", str(tiny), "--input", str(d / "in.jsonl"), "--output",
                 str(d / "out.jsonl"), "--max-new-tokens", "12", "--device", "cpu"]) == 0
    return [json.loads(x) for x in (d / "out.jsonl").read_text().splitlines()]


def close(got, want):
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-5


def test_completions_equal_loom_generate_streamed_or_not(server, generated):
    c = server.client
    for prompt, want in zip(PROMPTS, generated):
        done = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
        choice = done.choices[0]
        assert choice.token_ids == want["tokens"] and choice.text == want["completion"]
        close(choice.logprobs.token_logprobs, want["logprobs"])
        for s, lp, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
            assert top[s] == lp and len(top) <= 2 and max(top.values()) == lp  # greedy: the chosen is the best
        assert choice.finish_reason == want["finish_reason"]
        assert done.usage.completion_tokens == len(want["tokens"]) and done.usage.prompt_tokens > 0
        chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                           stream=True, stream_options={"include_usage": True}))
        assert len(chunks) > 2  # streamed in windows, not one body
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == want["completion"]
        assert [t for ch in chunks if ch.choices for t in ch.choices[0].token_ids] == want["tokens"]
        close([x for ch in chunks if ch.choices for x in ch.choices[0].logprobs.token_logprobs], want["logprobs"])
        assert chunks[-1].usage.completion_tokens == len(want["tokens"])
    # a prompt of token ids continues as its text does
    ids = server.served.tokenizer.encode(PROMPTS[0])
    assert c.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0).choices[0].token_ids == \
        generated[0]["tokens"]


def test_chat_completions_use_the_template_and_equal_loom_generate(server, generated):
    """... and each token's 3 most likely tokens are those of the model's forward over prompt + completion."""
    from loom.post.chat import generation_prompts

    want = generated[-1]
    c = server.client
    done = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, logprobs=True,
                                     top_logprobs=3)
    choice = done.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want["completion"]
    assert choice.token_ids == want["tokens"]
    close([x.logprob for x in choice.logprobs.content], want["logprobs"])
    tok = server.served.tokenizer
    prompt = tok.encode(generation_prompts([("chat", {"messages": CHAT})], tok.path)[0])
    with torch.no_grad():
        logp = server.served.scheduler.engine.model(torch.tensor([prompt + want["tokens"]]))[0].double().log_softmax(-1)
    for i, x in enumerate(choice.logprobs.content):
        best = logp[len(prompt) - 1 + i].topk(3)
        assert [e.token for e in x.top_logprobs] == [tok.decode([t]) for t in best.indices.tolist()]
        assert max(abs(e.logprob - v) for e, v in zip(x.top_logprobs, best.values.tolist())) < 1e-4
        assert x.top_logprobs[0].logprob == x.logprob  # greedy: the chosen token is the most likely
    chunks = list(c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want["completion"]
    assert chunks[-1].choices[0].finish_reason == want["finish_reason"]


def test_chat_stops_at_the_end_of_turn(tmp_path, server, monkeypatch):
    """A model forced to continue "\\n" with a word, "ok", <|im_end|>: the chat reply is the word and "ok", ended
    by the template's end-of-turn (finish_reason stop), streamed or not; a model without a chat template
    answers chat requests with 400."""
    from test_chat import forced_model_dir, write_tokenizer

    from loom.data.tokenizer import Tokenizer

    raw = write_tokenizer(tmp_path)
    tok = Tokenizer.from_file(tmp_path)
    nl, ok, end = tok.encode("\n")[-1], tok.encode("ok")[0], raw.token_to_id("<|im_end|>")
    fox = max(range(5, tok.vocab_size), key=lambda i: len(tok.decode([i])))
    forced_model_dir(tmp_path, {nl: fox, fox: ok, ok: end, end: nl})
    s = Server(load(str(tmp_path), name="forced"))
    try:
        done = s.client.chat.completions.create(model="forced", messages=CHAT, max_tokens=10, temperature=0)
        assert done.choices[0].message.content == tok.decode([fox, ok])
        assert done.choices[0].finish_reason == "stop" and done.choices[0].token_ids == [fox, ok, end]
        chunks = list(s.client.chat.completions.create(model="forced", messages=CHAT, max_tokens=10, temperature=0,
                                                       stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == tok.decode([fox, ok])
        assert chunks[-1].choices[0].finish_reason == "stop"
    finally:
        s.close()
    monkeypatch.setattr(server.served, "template", None)
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
    assert "has no chat template" in r.json()["error"]["message"]


def test_sampled_choices_equal_the_engines_with_the_same_seeds(server):
    """n=3, temperature 0.8, top_k 20, top_p 0.9, seed 5: choice k is the engine's sample with seed 5 + k, and a
    stop string cuts the text as the engine's Completion.text does."""
    s = server.served
    ids = s.tokenizer.encode(PROMPTS[1])
    done = server.client.completions.create(model="tiny", prompt=PROMPTS[1], n=3, max_tokens=10, temperature=0.8,
                                            top_p=0.9, seed=5, extra_body={"top_k": 20}, logprobs=0)
    engine = Engine(s.scheduler.engine.model, max_batch=3, max_len=CONTEXT, decode=s.tokenizer.decode)
    want = engine.generate([ids] * 3, [SamplingParams(0.8, 20, 0.9, 10, s.stop_ids, 5 + k, s.stop_texts)
                                       for k in range(3)])
    assert [ch.token_ids for ch in done.choices] == [w.tokens for w in want]
    assert len({tuple(w.tokens) for w in want}) > 1  # the seeds differ
    for ch, w in zip(done.choices, want):
        close(ch.logprobs.token_logprobs, w.logprobs)
    assert done.usage.completion_tokens == sum(len(w.tokens) for w in want)
    text = want[0].text(s.tokenizer.decode)
    stop = text[3:5]
    cut = server.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0.8, top_p=0.9,
                                           seed=5, extra_body={"top_k": 20}, stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    chunks = list(server.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0.8,
                                                   top_p=0.9, seed=5, extra_body={"top_k": 20}, stop=[stop],
                                                   stream=True, n=2))
    assert "".join(ch.text for c in chunks for ch in c.choices if ch.index == 0) == text[:text.find(stop)]


def test_32_concurrent_streams_finish_and_are_decoded_together(server):
    before = server.metrics()

    async def one(client, i):
        text, reason = "", None
        stream = await client.completions.create(model="tiny", prompt=PROMPTS[i % 3] + " " * (i % 5),
                                                 max_tokens=8 + i % 7, temperature=0, stream=True)
        async for ch in stream:
            text += ch.choices[0].text
            reason = ch.choices[0].finish_reason or reason
        return reason

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    reasons = asyncio.run(run())
    assert len(reasons) == 32 and all(r in ("stop", "length") for r in reasons)
    after = server.metrics()
    steps = after["loom_decode_steps_total"] - before["loom_decode_steps_total"]
    rows = after["loom_decode_rows_total"] - before["loom_decode_rows_total"]
    assert steps > 0 and rows / steps > 4 and after["loom_decode_batch_max"] >= 8  # batched across requests
    assert after['loom_requests_total{endpoint="/v1/completions",status="200"}'] - \
        before['loom_requests_total{endpoint="/v1/completions",status="200"}'] == 32
    assert after["loom_running_requests"] == 0 and after["loom_queue_length"] == 0
    assert after["loom_time_to_first_token_seconds_count"] - before["loom_time_to_first_token_seconds_count"] == 32


def slowed(engine, monkeypatch, seconds=0.02):
    real = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(seconds) or real())


def test_a_client_that_goes_away_frees_its_slot(server, monkeypatch):
    engine = server.served.scheduler.engine
    slowed(engine, monkeypatch, 0.05)  # 60 tokens take >= 15 windows x 0.05 s, well past the 0.2 s limit below
    before = server.metrics()["loom_generation_tokens_total"]
    stream = server.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=60, temperature=0,
                                              stream=True)
    next(iter(stream))
    assert engine.running == 1
    stream.close()  # the client hangs up mid-stream
    deadline = time.time() + 5
    while engine.running and time.time() < deadline:
        time.sleep(0.02)
    assert engine.running == 0 and server.metrics()["loom_running_requests"] == 0
    time.sleep(0.1)
    assert server.metrics()["loom_generation_tokens_total"] - before < 60  # cut short, not run to max_tokens
    # a request past its time limit is cancelled too (504)
    monkeypatch.setattr(server.served, "timeout_s", 0.2)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 60, "temperature": 0})
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    time.sleep(0.1)
    assert engine.running == 0


BAD = [
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 400,
     "'gpt-4' is not served here; this server serves 'tiny'"),
    ("/v1/completions", {"prompt": "fox " * 200}, 400, r"the prompt is \d+ tokens; this server takes prompts of at "
                                                      r"most 95 tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fox " * 200}]}, 400, "the prompt is"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, r"temperature=-1 is out of range"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, r"top_p=0 is out of range; it must be in \(0, 1\]"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, r"top_p=1.5 is out of range"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, r"n=0 is out of range; it must be in \[1, 4\]"),
    ("/v1/completions", {"prompt": "a", "n": 5}, 400, r"n=5 is out of range"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400,
     r"max_tokens=0 is out of range; it must be in \[1, 64\]"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 65}, 400, r"max_tokens=65 is out of range"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, r'temperature must be a number, got "hot"'),
    ("/v1/completions", {"prompt": "a", "seed": 2 ** 70}, 400, r"seed=\d+ is out of range"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs=21"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt must be a non-empty string or a non-empty list of token ids"),
    ("/v1/completions", {"prompt": [1, 999]}, 400, r"token ids outside the vocabulary \[0, 300\)"),
    ("/v1/completions", {}, 400, "prompt is required"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop must be a non-empty string"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, r"messages\[0\].*role"),
    ("/v1/completions", b"{not json", 400, "the request body is not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "the request body must be a JSON object"),
    ("/v1/completions", b'{"prompt": "' + b"x" * (2 << 20) + b'"}', 413, "the request body is"),
]


@pytest.mark.parametrize("endpoint,body,status,message", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(server, endpoint, body, status, message):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + endpoint, headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and re.search(message, error["message"]), error
    good = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_api_key_is_required_on_every_endpoint_but_health(server, monkeypatch):
    monkeypatch.setattr(server.served, "api_key", "sekrit")
    right = {"Authorization": "Bearer sekrit"}
    before = server.metrics(right)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        for method, path in (("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("get", "/v1/models"),
                             ("get", "/metrics")):
            r = httpx.request(method, server.url + path, headers=headers,
                              json={"prompt": "a", "messages": CHAT, "max_tokens": 4})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200
    after = server.metrics(right)
    assert after["loom_generation_tokens_total"] == before["loom_generation_tokens_total"]  # no tokens generated
    assert after["loom_decode_steps_total"] == before["loom_decode_steps_total"]
    with pytest.raises(openai.AuthenticationError):
        server.client.completions.create(model="tiny", prompt="a", max_tokens=2)
    keyed = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0)
    assert keyed.completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens >= 1
    assert [m.id for m in keyed.models.list()] == ["tiny"]


def test_a_full_queue_answers_429(tiny):
    """The scheduler held back: two single-choice requests fill a queue of two, a third gets 429 at once; once
    the scheduler runs, the two queued ones finish."""
    s = Server(load(str(tiny), max_batch=2, max_queue=2), start_scheduler=False)
    try:
        results = []

        def post():
            results.append(httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3}, timeout=30))

        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while s.metrics()["loom_queue_length"] < 2 and time.time() < deadline:
            time.sleep(0.02)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert "queue is full (2 requests wait, at most 2)" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "a", "max_tokens": 3, "n": 2})
        assert r.status_code == 429
        s.served.scheduler.start()
        for t in threads:
            t.join(timeout=30)
        assert [r.status_code for r in results] == [200, 200]
        assert s.metrics()["loom_queue_length"] == 0
    finally:
        s.close()


def test_step_wise_engine_api(server):
    """submit / step / cancel: requests submitted between steps give generate's tokens; a cancelled running one
    gives its slot back, a cancelled waiting one never runs; the checks at submit are generate's."""
    from loom.errors import UserError

    model = server.served.scheduler.engine.model
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    want = Engine(model, max_batch=2, max_len=CONTEXT).generate(prompts, SamplingParams(max_new_tokens=9))
    engine = Engine(model, max_batch=2, max_len=CONTEXT, sync_every=2)
    first = engine.submit(prompts[0], SamplingParams(max_new_tokens=9))
    updates = engine.step()
    later = [engine.submit(p, SamplingParams(max_new_tokens=9)) for p in prompts[1:]]  # arrive mid-generation
    doomed = engine.submit([1, 2], SamplingParams(max_new_tokens=9))
    engine.cancel(doomed)
    while engine.waiting or engine.running:
        updates += engine.step()
    for r, w in zip([first, *later], want):
        assert r.state == "done" and r.out.tokens == w.tokens
        assert [t for u in updates if u.request is r for t in u.tokens] == w.tokens
    assert doomed.state == "cancelled" and not doomed.out.tokens
    running = engine.submit(prompts[0], SamplingParams(max_new_tokens=50))
    engine.step()
    assert engine.running == 1
    engine.cancel(running)
    assert engine.running == 0 and running.state == "cancelled" and engine.step() == []
    with pytest.raises(UserError, match="prompt 7 has 96 tokens; it needs 1 to 95"):
        engine.submit([1] * 96, index=7)


def test_serve_command_refuses_what_it_cannot_do(tiny, monkeypatch):
    from loom.serve import _loopback

    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("localhost") and not _loopback("0.0.0.0")
    r = run_main("serve", "--model", str(tiny), "--nproc", "0")
    assert r.returncode == 2 and "--nproc=0 must be >= 1" in r.stderr
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    r = run_main("serve", "--model", str(tiny))
    assert r.returncode == 2 and "pip install 'loom[serve]'" in r.stderr


def test_tensor_parallel_serving_equals_one_process(tiny, tmp_path):
    """`loom serve --nproc 2` (two gloo ranks, each with half the heads and its own keys and values; rank 0 serves
    HTTP and the other steps in lockstep): greedy and seeded sampled completions give one process's engine's
    tokens, log-probs within 1e-5; a request after them still works, and the server stops cleanly."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "loom.cli", "serve", "--model", str(tiny), "--nproc", "2",
                             "--port", str(port), "--device", "cpu", "--max-batch", "4"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model=tiny.name, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=1)
        sampled = client.completions.create(model=tiny.name, prompt=PROMPTS[1], max_tokens=8, temperature=0.9,
                                            seed=11, n=2)
        again = client.completions.create(model=tiny.name, prompt=PROMPTS[2], max_tokens=4, temperature=0)
        # issue 57: every rank scores the prompt in the same step; penalties sample the same on every rank
        scored = client.completions.create(model=tiny.name, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1)
        penalised = client.completions.create(model=tiny.name, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                              presence_penalty=1.5, extra_body={"repetition_penalty": 1.3})
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    from loom import load_model
    from loom.data.tokenizer import Tokenizer
    from loom.post.chat import stop_token_ids

    tok = Tokenizer.from_file(tiny / "tokenizer.json")
    engine = Engine(load_model(str(tiny)), max_batch=4, max_len=CONTEXT)
    greedy, s0, s1, last = engine.generate(
        [tok.encode(PROMPTS[0]), tok.encode(PROMPTS[1]), tok.encode(PROMPTS[1]), tok.encode(PROMPTS[2])],
        [SamplingParams(max_new_tokens=8), SamplingParams(temperature=0.9, seed=11, max_new_tokens=8),
         SamplingParams(temperature=0.9, seed=12, max_new_tokens=8), SamplingParams(max_new_tokens=4)])
    assert got.choices[0].token_ids == greedy.tokens
    assert max(abs(a - b) for a, b in zip(got.choices[0].logprobs.token_logprobs, greedy.logprobs)) < 1e-5
    assert [c.token_ids for c in sorted(sampled.choices, key=lambda c: c.index)] == [s0.tokens, s1.tokens]
    assert again.choices[0].token_ids == last.tokens
    ids = tok.encode(PROMPTS[0])
    with torch.no_grad():
        logp = engine.model(torch.tensor([ids]))[0].double().log_softmax(-1)
    want = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(scored.choices[0].logprobs.token_logprobs[1:], want)) < 1e-5
    p = SamplingParams(max_new_tokens=8, presence_penalty=1.5, repetition_penalty=1.3,
                       stop_token_ids=stop_token_ids(tok))
    assert penalised.choices[0].token_ids == engine.generate([ids], p)[0].tokens != greedy.tokens


def _sharded_serve_rank(model: str, prompts: list[list[int]]):
    """A `loom serve --nproc` rank's load, with loading the whole model made an error: its shapes and tokens."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import loom

    def whole(*args, **kwargs):
        raise AssertionError("a serving rank loaded the whole model")

    real, loom.load_model = loom.load_model, whole
    try:  # a kept rank runs later tests' tasks too: they get loom.load_model back
        served = load(model, max_batch=4, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        engine = served.scheduler.engine
        wq = dict(engine.model.named_parameters())["layers.0.attention.wq.weight"]
        done = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    finally:
        loom.load_model = real
    return tuple(wq.to_local().shape), [d.tokens for d in done]


def test_tensor_parallel_serving_builds_each_shard_on_meta(tiny):
    """`loom serve --nproc 2` builds its model as RL builds the engine's (loom.build.build_in_layout): on meta,
    sharded, each rank reading its half of the weights; no rank loads the whole model, and the tokens are one
    process's."""
    from distributed import shared_pool

    from loom import load_model
    from loom.data.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tiny / "tokenizer.json")
    prompts = [tok.encode(p) for p in PROMPTS]
    results = shared_pool(2).run(_sharded_serve_rank, str(tiny), prompts)
    want = [d.tokens for d in Engine(load_model(str(tiny)), max_batch=4, max_len=CONTEXT).generate(
        prompts, SamplingParams(max_new_tokens=6))]
    for shape, tokens in results:
        assert shape == (4 * 16 // 2, 64)  # half of the 4 heads x head_dim 16 rows
        assert tokens == want


def peft_dir(base, path):
    """A PEFT LoRA adapter directory on `base` (rank 4, alpha 16): random lora_A and lora_B on the
    column-parallel q_proj and up_proj and the row-parallel o_proj and down_proj of every layer."""
    from safetensors.torch import save_file

    from loom.interop.hf_names import loom_to_hf_name

    path.mkdir()
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in range(2):
        for name, (out, inp) in {"attention.wq": (64, 64), "attention.wo": (64, 64),
                                 "feed_forward.w3": (128, 64), "feed_forward.w2": (64, 128)}.items():
            hf = loom_to_hf_name(f"layers.{layer}.{name}.weight").removesuffix(".weight")
            tensors[f"base_model.model.{hf}.lora_A.weight"] = torch.randn(4, inp, generator=g) * 0.3
            tensors[f"base_model.model.{hf}.lora_B.weight"] = torch.randn(out, 4, generator=g) * 0.3
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 16, "base_model_name_or_path": str(base),
        "target_modules": ["q_proj", "o_proj", "up_proj", "down_proj"]}))
    return path


def _sharded_peft_rank(model: str, ids: torch.Tensor):
    """A `loom serve --nproc` rank's model for a PEFT adapter directory, with loading (or merging) the whole model
    made an error: this rank's q_proj rows and the logits of `ids`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import loom
    from loom.interop import peft
    from loom.parallel.distributed import full_tensor
    from loom.serve import sharded_model

    def whole(*args, **kwargs):
        raise AssertionError("a serving rank loaded the whole model")

    real = loom.load_model, peft.load_peft_dir
    loom.load_model = peft.load_peft_dir = whole
    try:  # a kept rank runs later tests' tasks too: they get both back
        net = sharded_model(model, init_device_mesh("cpu", (dist.get_world_size(),)), "cpu")
        with torch.no_grad():
            logits = full_tensor(net(ids))
        wq = dict(net.named_parameters())["layers.0.attention.wq.weight"]
    finally:
        loom.load_model, peft.load_peft_dir = real
    return tuple(wq.to_local().shape), logits


def test_tensor_parallel_serving_merges_only_its_shard_of_a_peft_adapter(tiny, tmp_path):
    """`loom serve --nproc 2 --model PEFT_DIR`: each rank builds its shard of the base on meta and adds only its
    slices of the adapters' products (issue 58); the logits equal one process's merged model (fp32), and differ
    from the base's (the adapters are in)."""
    from distributed import shared_pool

    from loom import load_model

    adapter = peft_dir(tiny, tmp_path / "peft")
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    results = shared_pool(2).run(_sharded_peft_rank, str(adapter), ids)
    with torch.no_grad():
        want, base = load_model(str(adapter))(ids), load_model(str(tiny))(ids)
    assert (want - base).abs().max() > 0.1  # the adapters change the logits
    for shape, logits in results:
        assert shape == (32, 64)  # half of q_proj's 64 rows
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


def test_paged_keys_and_values_serve_the_same_tokens(tiny, generated):
    """--kv paged: the engine keeps keys and values in blocks (a request's n choices share their prompt's);
    greedy completions equal loom generate's and n=3 seeded choices equal the slab server's."""
    paged = Server(load(str(tiny), max_batch=4, paged=True, limits=Limits(max_tokens=64, max_n=4)))
    slab = Server(load(str(tiny), max_batch=4, limits=Limits(max_tokens=64, max_n=4)))
    try:
        assert paged.served.scheduler.engine.paged
        for prompt, want in zip(PROMPTS, generated):
            got = paged.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            assert got.choices[0].token_ids == want["tokens"]
        ask = dict(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0.8, seed=3, n=3)
        a, b = paged.client.completions.create(**ask), slab.client.completions.create(**ask)
        assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
        assert len({tuple(c.token_ids) for c in a.choices}) > 1  # sampled: the choices differ
    finally:
        paged.close()
        slab.close()
