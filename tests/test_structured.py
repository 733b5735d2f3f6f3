"""Structured output and tool calls (loom/infer/grammar.py, loom/serve/structured.py): the engine's constrained
greedy tokens equal a reference loop (the model's full forward each step, llguidance's own mask), and the
unconstrained requests of the same batch are untouched; 100 sampled schema-constrained choices through `loom
serve` are 100 valid documents (a checker written here), where the same requests without response_format are
not; tools rendered as transformers' apply_chat_template renders them, a forced call decoded and parsed back
into OpenAI tool_calls (streamed and not); the tool-call parser on fixed Hermes/Qwen and Llama 3 texts; bad
response_format / tools / tool_choice get 400 naming the field."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

pytest.importorskip("llguidance")
fastapi = pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

from loom.infer.engine import Engine  # noqa: E402
from loom.infer.grammar import Grammars  # noqa: E402
from loom.infer.sampling import SamplingParams  # noqa: E402
from loom.serve.structured import parse_tool_calls  # noqa: E402

CONTEXT = 768
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "ok": {"type": "boolean"},
    "home": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
             "additionalProperties": False}},
    "required": ["name", "age", "tags", "ok", "home"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "time_now", "parameters": {"type": "object", "properties": {}}}}
# a Qwen 2.5-like template: the tools in the system turn, calls as <tool_call> JSON </tool_call>
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}\n{%- endfor %}\n</tools>\nCall one as <tool_call>\n{\"name\": N, \"arguments\": A}\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {\"name\": c.function.name, \"arguments\": c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def valid(doc, schema) -> bool:
    """`doc` valid under `schema`: the keywords SCHEMA and the tools use (type, properties, required,
    additionalProperties, maxLength, minimum, maximum, items, maxItems, enum)."""
    if "enum" in schema:
        return doc in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(doc, dict) and all(k in doc for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) is not False or set(doc) <= set(props))
                and all(valid(v, props[k]) for k, v in doc.items() if k in props))
    if kind == "array":
        return (isinstance(doc, list) and len(doc) <= schema.get("maxItems", len(doc))
                and all(valid(v, schema.get("items", {})) for v in doc))
    if kind == "string":
        return isinstance(doc, str) and len(doc) <= schema.get("maxLength", len(doc))
    if kind in ("integer", "number"):
        ok = isinstance(doc, int) if kind == "integer" else isinstance(doc, (int, float))
        return (ok and not isinstance(doc, bool) and schema.get("minimum", doc) <= doc
                <= schema.get("maximum", doc))
    if kind == "boolean":
        return isinstance(doc, bool)
    return kind is None


def parses(text: str, schema) -> bool:
    try:
        return valid(json.loads(text), schema)
    except ValueError:
        return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """test_serve's random model with a 256-token context and a template that renders tools."""
    import test_serve
    from test_chat import write_tokenizer

    path = tmp_path_factory.mktemp("structured") / "tiny"
    context, test_serve.CONTEXT = test_serve.CONTEXT, CONTEXT
    try:
        test_serve.model_dir(path)
    finally:
        test_serve.CONTEXT = context
    write_tokenizer(path, template=TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tiny):
    from test_serve import Server

    from loom.serve import load
    from loom.serve.protocol import Limits

    s = Server(load(str(tiny), max_batch=32, sync_every=4, limits=Limits(max_tokens=200, max_n=4)))
    yield s
    s.close()


def test_constrained_greedy_equals_a_reference_loop_and_leaves_other_rows_alone(server, tiny):
    """The engine's constrained greedy tokens (in a batch with an unconstrained request, decode windows of 4)
    equal a loop that runs the model's whole forward each step and masks with llguidance's own per-token mask;
    the unconstrained request gets the tokens it gets alone."""
    import llguidance

    from loom import load_model

    served = server.served
    model, tok = load_model(str(tiny)), served.tokenizer
    engine = Engine(model, max_batch=4, max_len=CONTEXT, sync_every=4)
    grammars = served.grammar_tables()
    grammar = grammars.json_schema(SCHEMA)
    prompt, other = tok.encode("the quick brown"), tok.encode("jumps over")
    params = SamplingParams(max_new_tokens=120, stop_token_ids=served.stop_ids)
    alone = engine.generate([other], params)[0].tokens
    requests = [engine.submit(prompt, params, constraint=grammars.matcher(grammar)), engine.submit(other, params)]
    while not all(r.done for r in requests):
        engine.step()
    got, mixed = requests[0].out.tokens, requests[1].out.tokens
    assert mixed == alone
    matcher = llguidance.LLMatcher(grammars.tokenizer, grammar)
    ids, want = list(prompt), []
    with torch.no_grad():
        while len(want) < 120:
            logits = model(torch.tensor([ids]))[0, -1].float()
            allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8) > 0
            logits[:len(allowed)][~allowed] = float("-inf")
            logits[len(allowed):] = float("-inf")
            t = int(logits.argmax())
            want.append(t)
            ids.append(t)
            if t in served.stop_ids:
                break
            assert matcher.consume_token(t)
    assert got == want and got[-1] in served.stop_ids
    assert parses(tok.decode(got[:-1]), SCHEMA)
    assert not parses(tok.decode(alone), SCHEMA)


def test_100_schema_constrained_choices_are_100_valid_documents(server):
    """25 concurrent requests of 4 sampled choices (completions and chat, streamed and not): every choice
    parses and validates and ends by a stop token; without response_format none of the first 32 does."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    async def one(client, i: int, constrained: bool):
        extra = {"response_format": fmt} if constrained else {}
        kw = dict(model="tiny", max_tokens=200 if constrained else 40, temperature=1.0, seed=100 * i, n=4)
        if i % 2:
            r = await client.chat.completions.create(messages=[{"role": "user", "content": f"person {i}"}],
                                                     extra_body=extra, **kw)
            return [(c.message.content, c.finish_reason) for c in r.choices]
        if i % 4 == 0:
            r = await client.completions.create(prompt=f"the quick {i}", extra_body=extra, **kw)
            return [(c.text, c.finish_reason) for c in r.choices]
        texts, reasons = ["", "", "", ""], [None] * 4
        async for chunk in await client.completions.create(prompt=f"fox {i}", extra_body=extra, stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.text
                reasons[c.index] = c.finish_reason or reasons[c.index]
        return list(zip(texts, reasons))

    async def run(constrained: bool, requests: int):
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
            return [x for r in await asyncio.gather(*(one(c, i, constrained) for i in range(requests))) for x in r]

    docs = asyncio.run(run(True, 25))
    assert len(docs) == 100
    bad = [(text, reason) for text, reason in docs if not parses(text, SCHEMA) or reason != "stop"]
    assert not bad, bad[:3]
    assert len({text for text, _ in docs}) > 50  # sampled: the documents differ
    free = asyncio.run(run(False, 8))  # the same requests' first 40 tokens
    assert not any(parses(text, SCHEMA) for text, _ in free)


def test_json_object_gives_an_object(server):
    r = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def _hf_prompt_tokens(tiny, messages, tools) -> int:
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny / "tokenizer.json"))
    text = hf.apply_chat_template(messages, tools=tools, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True,
                                  tokenize=False)
    assert "get_weather" in text
    return len(hf(text, add_special_tokens=False)["input_ids"])


def test_a_forced_tool_call_comes_back_as_tool_calls(server, tiny):
    """tools rendered as transformers renders them (the prompt's token count); tool_choice naming a tool:
    the reply is that call, its arguments valid under the tool's parameters, streamed or not; the next turn
    (the assistant's call and the tool's result) renders as transformers renders it."""
    messages = [{"role": "user", "content": "weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = server.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                                              tool_choice=choice, max_tokens=120, temperature=1.0, seed=5, n=3)
    assert r.usage.prompt_tokens == _hf_prompt_tokens(tiny, messages, [WEATHER, CLOCK])
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None, c
        (call,) = c.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert valid(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = server.client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, CLOCK],
                                                   tool_choice="required", max_tokens=120, temperature=0, stream=True)
    calls, reason = [], None
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            reason = c.finish_reason or reason
    assert reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("get_weather", "time_now")
    json.loads(calls[0].function.arguments)
    # the next turn: the call and its result go back to the template (arguments as an object)
    call = r.choices[0].message.tool_calls[0]
    turn = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = server.client.chat.completions.create(model="tiny", messages=turn, tools=[WEATHER], max_tokens=4,
                                               temperature=0)
    hf_turn = turn[:1] + [{"role": "assistant", "content": "", "tool_calls": [
        {**call.model_dump(), "function": {"name": call.function.name,
                                           "arguments": json.loads(call.function.arguments)}}]}] + turn[2:]
    assert r2.usage.prompt_tokens == _hf_prompt_tokens(tiny, hf_turn, [WEATHER])


def test_tool_calls_parse_from_hermes_and_llama3_texts():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "time_now", "arguments": {}}\n</tool_call>')
    content, calls = parse_tool_calls(text, "hermes", {"get_weather", "time_now"})
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("time_now", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # unterminated (the stop token came first), arguments given as a string
    _, calls = parse_tool_calls('<tool_call>{"name": "time_now", "arguments": "{}"}', "hermes")
    assert calls[0]["function"]["arguments"] == "{}"
    # not JSON, or a name that is no tool: plain content
    for bad in ("<tool_call>{oops}</tool_call>", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'):
        assert parse_tool_calls(bad, "hermes", {"time_now"}) == (bad, [])
    content, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Oslo; Bergen"}}', "llama3")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo; Bergen"}
    _, calls = parse_tool_calls('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}',
                                "llama3")
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert parse_tool_calls("The weather is fine.", "llama3") == ("The weather is fine.", [])


def test_a_llama3_forced_call_grammar_takes_exactly_the_call(server):
    from loom.post.chat import load_template
    from loom.serve.structured import Structured, grammar

    grammars = server.served.grammar_tables()
    tok = server.served.tokenizer
    forced = Structured(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "time_now"}})
    compiled = grammar(grammars, forced, load_template("llama3"))

    def takes(text: str) -> bool:
        m = grammars.matcher(compiled)
        for t in tok.encode(text):
            m.advance(t)
        return not m.matcher.is_error() and m.matcher.is_accepting()

    assert takes('{"name":"time_now","parameters":{}}')
    assert not takes('{"name":"get_weather","parameters":{}}')
    assert not takes('<tool_call>{"name":"time_now","arguments":{}}')


CHAT = [{"role": "user", "content": "hi"}]
BAD = [
    ({"prompt": "a", "response_format": "json"}, "response_format", "response_format must be an object"),
    ({"prompt": "a", "response_format": {"type": "xml"}}, "response_format.type", "'xml' is not supported"),
    ({"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an"),
    ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema", "must be a JSON schema object"),
    ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objekt"}}}}, "response_format.json_schema.schema", "is not a JSON schema this server can follow"),
    ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "letters, digits"),
    ({"prompt": "a", "tools": [WEATHER]}, "tools", "tools and tool_choice are for /v1/chat/completions"),
    ({"messages": CHAT, "tools": []}, "tools", "tools must be a non-empty list"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0]", "must be"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "letters"),
    ({"messages": CHAT, "tools": [WEATHER, WEATHER]}, "tools[1].function.name", "differ from the other"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools", "is not a JSON schema this server can follow"),
    ({"messages": CHAT, "tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "get_weather"),
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "with N one of the tools"),
    ({"messages": CHAT, "tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "both constrain"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments":
                                                                                          "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
]


@pytest.mark.parametrize("body,param,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_structured_requests_get_400_naming_the_field(server, body, param, message):
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.url + endpoint, json={**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and re.search(re.escape(message), error["message"]), error
    good = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert good.status_code == 200


def test_tools_need_a_template_that_renders_them(tmp_path):
    from test_serve import model_dir

    from loom.serve import load
    from loom.serve.app import create_app

    from fastapi.testclient import TestClient

    client = TestClient(create_app(load(str(model_dir(tmp_path / "plain")))))  # ChatML without tools
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "does not render tools" in r.json()["error"]["message"]
