"""The HTTP side of `loom serve`: a FastAPI app whose handlers check a request, hand its choices to the
scheduler thread (loom/serve/scheduler.py) and answer as OpenAI does, in one body or as server-sent events.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (no key needed),
GET /metrics (Prometheus text). With an API key every endpoint but /health needs `Authorization: Bearer KEY`.

Text. A choice's text is the engine's `Completion.text`: without the stop token that ended it, cut before a stop
string. Streamed deltas hold back the end of the text that could still begin a stop string (and an unfinished
UTF-8 character), so the chunks add up to the same text. Log-probs: each generated token's log-probability
under the model's raw logits (temperature 1, the engine's `Completion.logprobs`), the stop token included, and
the N most likely tokens' (`logprobs` N on completions, `top_logprobs` N on chat; the engine's
`Completion.top_logprobs`, a top-k of the logits in the decode step). Each choice also carries `token_ids`, the
generated ids (not an OpenAI field).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from loom.errors import UserError
from loom.serve.metrics import Metrics
from loom.serve.protocol import (ApiError, Limits, Parsed, chat_request, completion_request, prompt_batch,
                                 read_json)
from loom.serve.scheduler import QueueFull, Scheduler
from loom.serve.structured import Structured, parse_tool_calls, protocol_body, tool_format
from loom.serve.structured import read as read_structured


@dataclass
class Served:
    """What the app serves: the engine's scheduler, the tokenizer and the model's stops, and the bounds."""

    name: str
    scheduler: Scheduler
    tokenizer: object  # loom.data.tokenizer.Tokenizer
    context: int  # the model's max_seq_len: prompt + completion
    stop_ids: tuple[int, ...]
    stop_texts: tuple[str, ...]
    template: object = None  # loom.post.chat.ChatTemplate, or None: no chat completions
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    timeout_s: float = 600.0  # per request, from arrival to its last token
    max_body: int = 1 << 20  # bytes
    created: int = field(default_factory=lambda: int(time.time()))
    grammars: object = None  # loom.infer.grammar.Grammars, built at the first structured request
    adapters: dict = field(default_factory=dict)  # LoRA adapter name -> path (`--lora`), chosen by "model"

    def pick_model(self, body: dict) -> tuple[dict, str | None]:
        """The request's "model": the base (None) or one of the adapters; the body the protocol checks (the
        base's name for an adapter's); 400 naming every served model for another name."""
        model = body.get("model")
        if not self.adapters or model is None or model == self.name:
            return body, None
        if model not in self.adapters:
            served = ", ".join(repr(n) for n in (self.name, *self.adapters))
            raise ApiError(f"the model {str(model)[:100]!r} is not served here; this server serves {served}",
                           param="model", code="model_not_found")
        return {**body, "model": self.name}, model

    @property
    def metrics(self) -> Metrics:
        return self.scheduler.metrics

    def grammar_tables(self):
        """llguidance's table of this model's tokens (`Grammars`), built once (called off the event loop)."""
        with _GRAMMAR_LOCK:
            if self.grammars is None:
                from loom.infer.grammar import Grammars

                try:
                    self.grammars = Grammars(self.tokenizer, self.scheduler.engine.vocab, self.stop_ids)
                except UserError as e:
                    raise ApiError(str(e), status=501, code="unsupported_parameter",
                                   param="response_format") from None
        return self.grammars


_GRAMMAR_LOCK = threading.Lock()


class _Choice:
    """One choice's tokens as they arrive, and how much of its text was sent."""

    def __init__(self, index: int, stops: tuple[str, ...], decode):
        self.index, self.stops, self.decode = index, stops, decode
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []  # per token, the most likely (id, log-prob), if asked for
        self.finish: str | None = None
        self.out = None  # the engine's Completion, when finished
        self.sent = ""  # the text sent
        self.sent_tokens = 0
        self.ended = False  # the finish sent
        self.tools: tuple[str, set[str]] | None = None  # (format, tool names): the reply is parsed for tool calls

    def calls(self) -> tuple[str | None, list[dict]]:
        """A finished reply parsed for tool calls (`self.tools`): its content and OpenAI tool_calls."""
        return parse_tool_calls(self.text(), *self.tools)

    def text(self) -> str:
        """The text so far: all of it once finished, else without an end that may still change."""
        if self.out is not None:
            return self.out.text(self.decode)
        text = self.decode(self.tokens)
        hold = len(text) - len(text.rstrip("\ufffd"))  # an unfinished UTF-8 character
        for stop in self.stops:  # an end that could begin a stop string
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return text[:len(text) - hold]

    def delta(self) -> tuple[str, list[int], list[float], list]:
        """Text, token ids, log-probs and most likely tokens not sent yet."""
        text = self.text()
        delta = ""
        if text.startswith(self.sent):
            delta, self.sent = text[len(self.sent):], text
        n = self.sent_tokens
        self.sent_tokens = len(self.tokens)
        self.ended = self.finish is not None
        return delta, self.tokens[n:], self.logprobs[n:], self.top[n:]

    @property
    def pending(self) -> bool:
        """Tokens or the finish not sent yet."""
        return self.sent_tokens < len(self.tokens) or (self.finish is not None and not self.ended)

    @property
    def reason(self) -> str | None:
        return None if self.finish is None else "stop" if self.finish == "stop" else "length"


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def create_app(served: Served) -> FastAPI:
    app = FastAPI(title="loom serve", docs_url=None, redoc_url=None, openapi_url=None)
    metrics, tok = served.metrics, served.tokenizer

    endpoints = {"/v1/completions", "/v1/chat/completions", "/v1/models"}

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        label = path if path in endpoints else "other"  # the metric's labels stay few whatever clients send
        if served.api_key is not None and path != "/health":
            given = request.headers.get("authorization", "")
            want = f"Bearer {served.api_key}"
            if not hmac.compare_digest(given.encode(), want.encode()):
                metrics.request(label, 401)
                return _error(ApiError("a valid API key is required: send the header 'Authorization: Bearer KEY'",
                                       status=401, code="invalid_api_key"))
        response = await call_next(request)
        if path not in ("/health", "/metrics"):
            metrics.request(label, response.status_code)
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        adapters = [{"id": name, "object": "model", "created": served.created, "owned_by": "loom",
                     "parent": served.name, "root": path, "max_model_len": served.context}
                    for name, path in served.adapters.items()]
        base = {"id": served.name, "object": "model", "created": served.created, "owned_by": "loom",
                "max_model_len": served.context}
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = read_json(await _body(request))
            prompts = prompt_batch(body, served.limits)
        except ApiError as e:
            return _error(e)
        if prompts is None:
            return await _answer(request, chat=False, body=body)
        # several prompts: one request each, submitted together (so decoded, or scored, together), choices joined
        replies = await asyncio.gather(*(_answer(request, chat=False, body={**body, "prompt": p}) for p in prompts))
        for reply in replies:
            if reply.status_code != 200:
                return reply
        parts = [json.loads(reply.body) for reply in replies]
        n = len(parts[0]["choices"])
        out = {**parts[0], "choices": [{**c, "index": i * n + c["index"]} for i, part in enumerate(parts)
                                       for c in part["choices"]],
               "usage": {k: sum(part["usage"][k] for part in parts) for k in parts[0]["usage"]}}
        return JSONResponse(out)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _answer(request, chat=True)

    async def _body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > served.max_body:
            raise ApiError(f"the request body is {length} bytes; at most {served.max_body}", status=413,
                           code="body_too_large")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > served.max_body:
                raise ApiError(f"the request body is over {served.max_body} bytes", status=413, code="body_too_large")
        return bytes(raw)

    def _prompt(parsed: Parsed, structured: Structured) -> list[int]:
        if parsed.messages is not None:
            from loom.post.chat import generation_prompts
            from loom.serve.structured import check_template, render

            if served.template is None:
                raise ApiError(f"the model {served.name!r} has no chat template (chat_template.jinja or "
                               "tokenizer_config.json's chat_template beside its tokenizer); send a prompt to "
                               "/v1/completions instead", param="messages", code="no_chat_template")
            if structured.tools or structured.messages is not None:  # tools, or earlier calls and their results
                check_template(served.template, structured)
                return tok.encode(render(served.template, structured, parsed.messages))
            try:
                text = generation_prompts([("messages", {"messages": parsed.messages})], tok.path, served.template)[0]
            except UserError as e:
                raise ApiError(str(e), param="messages", code="invalid_value") from None
            return tok.encode(text)
        if isinstance(parsed.prompt, str):
            return tok.encode(parsed.prompt)
        return list(parsed.prompt)

    def _check(parsed: Parsed, structured: Structured) -> tuple[list[int], list, list]:
        """The prompt ids, each choice's SamplingParams, checked by the engine as it would at submit, and each
        choice's grammar matcher (None: unconstrained)."""
        ids = _prompt(parsed, structured)
        limit = min(served.context - (parsed.max_tokens != 0), served.limits.max_prompt_tokens)  # 0: scored only
        if not ids:
            raise ApiError("the prompt is empty after tokenization", param="prompt", code="invalid_value")
        if len(ids) > limit:
            raise ApiError(f"the prompt is {len(ids)} tokens; this server takes prompts of at most {limit} tokens "
                           f"(the model's context is {served.context} tokens: prompt and completion)",
                           param="messages" if parsed.messages is not None else "prompt",
                           code="context_length_exceeded")
        vocab = served.scheduler.engine.vocab
        if min(ids) < 0 or max(ids) >= vocab:
            raise ApiError(f"the prompt has token ids outside the vocabulary [0, {vocab})", param="prompt",
                           code="invalid_value")
        room = served.context - len(ids)
        limit = room if parsed.max_tokens is None else min(parsed.max_tokens, room)
        params = parsed.params(limit, served.stop_ids, served.stop_texts)
        try:
            for p in params:
                served.scheduler.engine.check(ids, p)
        except UserError as e:
            raise ApiError(str(e), code="invalid_value") from None
        return ids, params, _constraints(structured, parsed.n)

    def _constraints(structured: Structured, n: int) -> list:
        if not structured.constrained:
            return [None] * n
        from loom.infer.grammar import GrammarError
        from loom.serve.structured import grammar

        if not served.scheduler.engine.constrains:
            raise ApiError("response_format and forced tool calls are not supported with tensor-parallel serving "
                           "(--nproc > 1)", param="response_format" if structured.schema is not None else
                           "tool_choice", code="unsupported_parameter")
        grammars = served.grammar_tables()
        try:
            compiled = grammar(grammars, structured, served.template)
        except GrammarError as e:
            param = "response_format.json_schema.schema" if structured.schema is not None else "tools"
            raise ApiError(f"{param} is not a JSON schema this server can follow: {e}", param=param,
                           code="invalid_value") from None
        return [grammars.matcher(compiled) for _ in range(n)]

    async def _answer(request: Request, chat: bool, body: dict | None = None):
        try:
            body = read_json(await _body(request)) if body is None else body  # completions: read by the handler
            body, adapter = served.pick_model(body)
            structured = read_structured(body, chat)
            parsed = (chat_request if chat else completion_request)(protocol_body(body, structured), served.name,
                                                                     served.limits)
            # templates, tokenizers and grammars off the event loop
            ids, params, constraints = await run_in_threadpool(_check, parsed, structured)
            if adapter is not None and any(p.prompt_logprobs is not None for p in params):
                raise ApiError(f"echo with logprobs (scoring the prompt) runs on the base model, not the adapter "
                               f"{adapter!r}", param="echo", code="unsupported_parameter")
            ticket = served.scheduler.submit([(ids, p, c, adapter) for p, c in zip(params, constraints)],
                                             asyncio.get_running_loop())
            ticket.model = adapter or served.name
        except ApiError as e:
            return _error(e)
        except QueueFull as e:
            return _error(ApiError(str(e), status=429, code="queue_full", type="rate_limit_error"))
        metrics.add(prompt_tokens=len(ids))
        stops = params[0].stop
        choices = [_Choice(k, stops, tok.decode) for k in range(parsed.n)]
        if chat and structured.parses_tools:
            for c in choices:
                c.tools = (tool_format(served.template), {t["function"]["name"] for t in structured.tools})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if parsed.stream:
            return StreamingResponse(_stream(request, ticket, parsed, ids, choices, rid, chat),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        deadline = ticket.arrived + served.timeout_s
        try:
            while any(c.finish is None for c in choices):
                await _next(request, ticket, choices, deadline)
        except ApiError as e:
            return _error(e)
        finally:
            if any(c.finish is None for c in choices):
                served.scheduler.cancel(ticket)
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
               "model": ticket.model, "choices": [_full_choice(c, parsed, chat) for c in choices],
               "usage": _usage(ids, choices)}
        return JSONResponse(out)

    async def _next(request: Request, ticket, choices: list[_Choice], deadline: float) -> None:
        """Wait for the next event of `ticket` (checking for a gone client every second) and apply it."""
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise ApiError(f"the request did not finish within the server's limit of {served.timeout_s:g} s",
                               status=504, code="timeout", type="timeout_error")
            try:
                event = await asyncio.wait_for(ticket.events.get(), min(1.0, left))
                break
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ApiError("the client went away", status=499, code="client_closed") from None
        if isinstance(event, Exception):
            raise ApiError(str(event), status=500, code="engine_error", type="server_error")
        k, tokens, logprobs, top, reason = event
        c = choices[k]
        c.tokens += tokens
        c.logprobs += logprobs
        c.top += top
        if reason is not None:
            c.finish = reason
            c.out = ticket.requests[k].out

    def _logprobs(chat: bool, tokens: list[int], logprobs: list[float], top: list, offset: int):
        strings = [tok.decode([t]) for t in tokens]
        top = top or [[] for _ in tokens]  # logprobs 0: no list of the most likely tokens
        if chat:
            def entry(s: str, lp: float) -> dict:
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

            return {"content": [{**entry(s, lp), "top_logprobs": [entry(tok.decode([i]), v) for i, v in best]}
                                for s, lp, best in zip(strings, logprobs, top)]}
        offsets, at = [], offset
        for s in strings:
            offsets.append(at)
            at += len(s)
        # as OpenAI's legacy completions: the most likely tokens, and the chosen one
        return {"tokens": strings, "token_logprobs": logprobs, "text_offset": offsets,
                "top_logprobs": [{**{tok.decode([i]): v for i, v in best}, s: lp}
                                 for s, lp, best in zip(strings, logprobs, top)]}

    def _echoed(c: _Choice, parsed: Parsed) -> dict:
        """A completions choice with echo: the prompt's text before the completion's; with logprobs, the prompt's
        tokens (the first without a log-prob, None) before the completion's, offsets into the whole text."""
        out = c.out
        prompt = parsed.prompt if isinstance(parsed.prompt, str) else tok.decode(out.prompt)
        row = {"index": c.index, "text": prompt + c.text(), "logprobs": None, "finish_reason": c.reason,
               "token_ids": c.tokens}
        if parsed.logprobs is not None:
            top = out.prompt_top_logprobs or [None] * len(out.prompt)
            head = _logprobs(False, out.prompt, out.prompt_logprobs, [t or [] for t in top], 0)
            head["top_logprobs"][0] = None  # the first token has no log-prob, nor most likely tokens
            tail = _logprobs(False, c.tokens, c.logprobs, c.top, len(prompt))
            row["logprobs"] = {k: head[k] + tail[k] for k in head}
        return row

    def _full_choice(c: _Choice, parsed: Parsed, chat: bool) -> dict:
        if parsed.echo:
            return _echoed(c, parsed)
        text = c.text()
        lp = None if parsed.logprobs is None else _logprobs(chat, c.tokens, c.logprobs, c.top, 0)
        if chat:
            message, reason = {"role": "assistant", "content": text}, c.reason
            if c.tools is not None:
                content, calls = c.calls()
                if calls:
                    message, reason = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
            return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": reason,
                    "token_ids": c.tokens}
        return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.reason, "token_ids": c.tokens}

    def _usage(ids: list[int], choices: list[_Choice]) -> dict:
        generated = sum(len(c.tokens) for c in choices)
        return {"prompt_tokens": len(ids), "completion_tokens": generated, "total_tokens": len(ids) + generated}

    async def _stream(request: Request, ticket, parsed: Parsed, ids, choices: list[_Choice], rid: str, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        deadline = ticket.arrived + served.timeout_s

        def chunk(choice_rows: list[dict], usage=None) -> str:
            out = {"id": rid, "object": kind, "created": created, "model": ticket.model, "choices": choice_rows}
            if usage is not None:
                out["usage"] = usage
            return f"data: {json.dumps(out, ensure_ascii=False)}\n\n"

        try:
            if chat:  # the role first, as OpenAI does
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for c in choices])
            while any(c.finish is None for c in choices):
                try:
                    await _next(request, ticket, choices, deadline)
                except ApiError as e:
                    yield f"data: {json.dumps(e.body())}\n\n"
                    return
                rows = []
                for c in (c for c in choices if c.pending):
                    if c.tools is not None and c.finish is None:  # tool calls are parsed from the whole reply
                        continue
                    offset = len(c.sent)
                    text, tokens, logprobs, top = c.delta()
                    lp = None if parsed.logprobs is None else _logprobs(chat, tokens, logprobs, top, offset)
                    row = {"index": c.index, "logprobs": lp, "finish_reason": c.reason, "token_ids": tokens}
                    if chat:
                        row["delta"] = {"content": text}
                        if c.tools is not None and (called := c.calls())[1]:
                            row["delta"] = {"content": called[0], "tool_calls": [{"index": i, **call} for i, call
                                                                                 in enumerate(called[1])]}
                            row["finish_reason"] = "tool_calls"
                    else:
                        row["text"] = text
                    rows.append(row)
                if rows:
                    yield chunk(rows)
            if parsed.include_usage:
                yield chunk([], usage=_usage(ids, choices))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is closed), or a timeout: the slots go back
            if any(c.finish is None for c in choices):
                served.scheduler.cancel(ticket)

    return app
