"""OpenAI request bodies read and checked (`completion_request`, `chat_request`), and the error body.

Every check names the field, its value and what would be valid, and fails with `ApiError` (HTTP 400 unless
said otherwise), whose body is OpenAI's: {"error": {"message", "type", "param", "code"}}. Nothing here reads a
file or runs the model: the `model` field is only compared with the served name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from loom.infer.sampling import SamplingParams


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):  # noqa: A002 (OpenAI's field name)
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may ask for."""

    max_tokens: int = 4096  # max_tokens (completion tokens per choice)
    max_n: int = 16
    max_prompt_tokens: int = 1 << 30  # further cut to the model's context by the server
    max_logprobs: int = 20
    max_stops: int = 16
    max_prompts: int = 64  # prompts in one completions request (a list of them)


@dataclass
class Parsed:
    """A checked request: the prompt (text or token ids), one SamplingParams per choice and how to answer."""

    prompt: str | list[int] | None  # completions: text or ids; chat: None (`messages`)
    messages: list[dict] | None
    n: int
    max_tokens: int | None  # None: up to the context
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no log-probs; else how many of the most likely tokens to list with each
    # logits processing (loom/infer/logits.py) and the request's own stop tokens, added to the model's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    echo: bool = False  # completions: the prompt's text (and with logprobs its tokens' log-probs) before the text

    def params(self, limit: int, stop_ids: tuple[int, ...], stop_texts: tuple[str, ...]) -> list[SamplingParams]:
        """One SamplingParams per choice; choice k uses seed + k (seedless: the engine draws one each). With echo
        and logprobs (or max_tokens 0) the prompt is scored too (`prompt_logprobs`)."""
        stops = tuple(dict.fromkeys(self.stop + stop_texts))
        scored = (self.logprobs or 0) if self.echo and (self.logprobs is not None or limit == 0) else None
        return [SamplingParams(self.temperature, self.top_k, self.top_p, limit,
                               tuple(dict.fromkeys(stop_ids + self.stop_token_ids)),
                               None if self.seed is None else self.seed + k, stops, self.logprobs or 0,
                               presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                               repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
                               min_tokens=min(self.min_tokens, limit), prompt_logprobs=scored)
                for k in range(self.n)]


def read_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _number(body: dict, key: str, default, low=None, high=None, low_open=False, integer=False):
    value = body.get(key, default)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ApiError(f"{key} must be {kind}, got {json.dumps(value)[:60]}", param=key, code="invalid_type")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        left = "(" if low_open else "["
        raise ApiError(f"{key}={value} is out of range; it must be in {left}{low}, {high}]", param=key,
                       code="invalid_value")
    return value


MAX_LOGIT_BIAS = 300  # entries of logit_bias, as OpenAI


def _processing(body: dict, limits: Limits, max_tokens: int | None) -> dict:
    """presence_penalty, frequency_penalty ([-2, 2]), repetition_penalty (> 0), logit_bias ({"token id": bias in
    [-100, 100]}), min_tokens (0 to max_tokens), stop_token_ids (a list of token ids); the ids are checked against
    the vocabulary by the engine (`Engine.check`)."""
    out = {key: float(_number(body, key, 0.0, -2, 2)) for key in ("presence_penalty", "frequency_penalty")}
    rep = _number(body, "repetition_penalty", 1.0)
    if not rep > 0 or rep == float("inf"):
        raise ApiError(f"repetition_penalty={rep} is out of range; it must be > 0 (1 leaves the logits as they are)",
                       param="repetition_penalty", code="invalid_value")
    out["repetition_penalty"] = float(rep)
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} entries {{\"token id\": bias}}, got "
                       f"{json.dumps(body.get('logit_bias'))[:80]}", param="logit_bias", code="invalid_value")
    pairs = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.strip().isdigit()):
            raise ApiError(f"logit_bias keys must be token ids (integers >= 0, as strings), got {key!r}",
                           param="logit_bias", code="invalid_value")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError(f"logit_bias[{key!r}]={json.dumps(value)[:40]} must be a number in [-100, 100]",
                           param="logit_bias", code="invalid_value")
        pairs.append((int(key), float(value)))
    out["logit_bias"] = tuple(pairs)
    out["min_tokens"] = _number(body, "min_tokens", 0, 0, max_tokens if max_tokens is not None else limits.max_tokens,
                                integer=True)
    ids = body.get("stop_token_ids")
    ids = [] if ids is None else ids
    if (not isinstance(ids, list) or len(ids) > 64
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise ApiError(f"stop_token_ids must be a list of at most 64 token ids (integers >= 0), got "
                       f"{json.dumps(body.get('stop_token_ids'))[:80]}", param="stop_token_ids", code="invalid_value")
    out["stop_token_ids"] = tuple(ids)
    return out


def _common(body: dict, served: str, limits: Limits, default_max_tokens: int | None, least_tokens: int = 1) -> dict:
    model = body.get("model")
    if model is not None and model != served:
        raise ApiError(f"the model {str(model)[:100]!r} is not served here; this server serves {served!r}",
                       param="model", code="model_not_found")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > limits.max_stops or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(f"stop must be a non-empty string or a list of at most {limits.max_stops} non-empty "
                       f"strings, got {json.dumps(body.get('stop'))[:80]}", param="stop", code="invalid_value")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ApiError(f"stream must be true or false, got {json.dumps(stream)[:40]}", param="stream",
                       code="invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError("stream_options must be an object", param="stream_options", code="invalid_type")
    seed = _number(body, "seed", None, -(2 ** 63), 2 ** 63 - 1 - limits.max_n, integer=True)  # choice k: seed + k
    max_tokens = _number(body, "max_tokens", default_max_tokens, least_tokens, limits.max_tokens, integer=True)
    return dict(
        n=_number(body, "n", 1, 1, limits.max_n, integer=True),
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0, 2)),
        top_p=float(_number(body, "top_p", 1.0, 0, 1, low_open=True)),
        top_k=_number(body, "top_k", 0, 0, integer=True),
        stop=tuple(stop), seed=seed, stream=bool(stream), include_usage=bool(options.get("include_usage")),
        **_processing(body, limits, max_tokens))


def prompt_batch(body: dict, limits: Limits) -> list | None:
    """The prompts of a completions request that sends several (a list of strings or of token-id lists), each
    answered as a request of its own and their choices joined (prompt i's choice k is choice i * n + k, as
    OpenAI's); None for one prompt."""
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)):
        return None
    if len(prompt) > limits.max_prompts:
        raise ApiError(f"prompt holds {len(prompt)} prompts; at most {limits.max_prompts} in one request",
                       param="prompt", code="invalid_value")
    if body.get("stream"):
        raise ApiError("several prompts in one request are not supported with stream=true; send one prompt per "
                       "streamed request", param="prompt", code="unsupported_parameter")
    return prompt


def completion_request(body: dict, served: str, limits: Limits) -> Parsed:
    """POST /v1/completions: prompt (a string or a list of token ids; a list holding one of either), max_tokens
    (default 16, as OpenAI's; 0 with echo: the prompt only, scored), logprobs (an integer, top-N), echo (the
    prompt before the completion, with logprobs its tokens' log-probs: what lm-evaluation-harness scores with)."""
    echo = body.get("echo", False)
    if not isinstance(echo, bool) and echo is not None:
        raise ApiError(f"echo must be true or false, got {json.dumps(echo)[:40]}", param="echo", code="invalid_type")
    common = _common(body, served, limits, min(16, limits.max_tokens), least_tokens=0 if echo else 1)
    if "prompt" not in body:
        raise ApiError("prompt is required: a string or a list of token ids", param="prompt", code="missing_field")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or ids) or not prompt:
        raise ApiError("prompt must be a non-empty string or a non-empty list of token ids (one prompt per "
                       "request)", param="prompt", code="invalid_value")
    if echo and common["stream"]:
        raise ApiError("echo is not supported with stream=true on this server; send stream=false", param="echo",
                       code="unsupported_parameter")
    if body.get("best_of") not in (None, 1, common["n"]):
        raise ApiError("best_of is not supported by this server (leave it out or equal to n)", param="best_of",
                       code="unsupported_parameter")
    if body.get("suffix"):
        raise ApiError("suffix is not supported by this server", param="suffix", code="unsupported_parameter")
    logprobs = _number(body, "logprobs", None, 0, limits.max_logprobs, integer=True)
    return Parsed(prompt=prompt, messages=None, logprobs=logprobs, echo=bool(echo), **common)


def chat_request(body: dict, served: str, limits: Limits) -> Parsed:
    """POST /v1/chat/completions: messages ({"role", "content"}: a string, or a list of text parts),
    max_tokens / max_completion_tokens (default: up to the context), logprobs (true/false) with top_logprobs."""
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is not None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    common = _common(body, served, limits, None)
    if body.get("echo"):
        raise ApiError("echo is not supported on /v1/chat/completions; send the prompt to /v1/completions with echo",
                       param="echo", code="unsupported_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list of {\"role\", \"content\"} objects", param="messages",
                       code="invalid_value")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # text parts: [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                               "supported", param=f"messages[{i}].content", code="invalid_value")
            content = "".join(p["text"] for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ApiError(f"messages[{i}] must be an object with a string \"role\" and a string (or text parts) "
                           f"\"content\", got {json.dumps(m)[:80]}", param=f"messages[{i}]", code="invalid_value")
        out.append({"role": m["role"], "content": content})
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool) and logprobs is not None:
        raise ApiError(f"logprobs must be true or false, got {json.dumps(logprobs)[:40]}", param="logprobs",
                       code="invalid_type")
    top = _number(body, "top_logprobs", 0, 0, limits.max_logprobs, integer=True)
    return Parsed(prompt=None, messages=out, logprobs=top if logprobs else None, **common)
