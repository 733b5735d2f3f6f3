"""Structured output and tool calls for `loom serve`: OpenAI's `response_format` and chat `tools` /
`tool_choice` read and checked (`read`), the grammar each choice decodes under (`grammar`, llguidance through
loom/infer/grammar.py), the tools rendered by the model's chat template (`render`) and the tool calls parsed
back out of the completion (`parse_tool_calls`).

- `response_format`: {"type": "text"} (nothing), {"type": "json_object"} (a JSON object), {"type":
  "json_schema", "json_schema": {"name": ..., "schema": {...}}} (a JSON document valid under the schema). The
  completion is decoded under the grammar token by token, so it parses and validates unless max_tokens cuts it
  (finish_reason "length"); JSON is written compactly (no whitespace between tokens).
- `tools` (chat only): [{"type": "function", "function": {"name", "description", "parameters"}}], passed to
  the chat template as `tools` (as transformers' apply_chat_template does). The template's tool-call format is
  read from its source: Qwen / Hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) when it
  mentions <tool_call>, else Llama 3's JSON ({"name": ..., "parameters": {...}}). Tool calls in the reply come
  back as `message.tool_calls` with finish_reason "tool_calls"; the text around them is `content`.
- `tool_choice`: "auto" (default with tools: the model may call), "none" (the reply is not parsed for calls),
  "required" or {"type": "function", "function": {"name": N}}: the reply is decoded under a grammar of one call
  of any tool / of tool N in the template's format, its arguments valid under the tool's `parameters`.
- Messages may carry the conversation's earlier calls: an assistant message with `tool_calls` (content may be
  null; the calls' `arguments` JSON strings are handed to the template as objects) and `tool` messages.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from loom.serve.protocol import ApiError

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
ANY_OBJECT = {"type": "object"}


@dataclass
class Structured:
    """What a request asks beyond text: `schema` (the response format's JSON schema; ANY_OBJECT for
    json_object; None: free text), the tools and tool choice, and the chat messages as the template reads them
    (None: the plain messages the protocol checked do)."""

    schema: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    messages: list[dict] | None = None

    @property
    def forced(self) -> str | None:
        """The tool every reply must call ("" for any tool), or None when the reply is free."""
        if not self.tools or self.tool_choice in ("auto", "none"):
            return None
        return "" if self.tool_choice == "required" else self.tool_choice["function"]["name"]

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constrained(self) -> bool:
        return self.schema is not None or self.forced is not None


def read(body: dict, chat: bool) -> Structured:
    """`response_format`, `tools`, `tool_choice` and tool messages of a request body, checked (ApiError, 400,
    naming the field)."""
    out = Structured(schema=_response_format(body.get("response_format")))
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not chat and (tools is not None or choice is not None):
        raise ApiError("tools and tool_choice are for /v1/chat/completions", param="tools" if tools is not None
                       else "tool_choice", code="unsupported_parameter")
    if tools is not None:
        out.tools = _tools(tools)
    if choice is not None:
        out.tool_choice = _tool_choice(choice, out.tools)
    if out.forced is not None and out.schema is not None:
        raise ApiError("response_format and a tool_choice that forces a call both constrain the reply; give one",
                       param="tool_choice", code="invalid_value")
    if chat and isinstance(body.get("messages"), list):
        out.messages = _tool_messages(body["messages"]) if out.tools or _has_tool_turns(body["messages"]) else None
    return out


def protocol_body(body: dict, structured: Structured) -> dict:
    """The body the plain chat checks (loom/serve/protocol.py) read: tool turns as text turns (their content,
    or "" for an assistant turn that only calls tools)."""
    if structured.messages is None:
        return body
    return {**body, "messages": [{"role": m["role"], "content": m.get("content") or ""}
                                 for m in structured.messages]}


def _response_format(value) -> dict | None:
    if value is None:
        return None
    kinds = '"text", "json_object" or "json_schema"'
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ApiError(f"response_format must be an object with a \"type\" ({kinds}), got "
                       f"{json.dumps(value)[:80]}", param="response_format", code="invalid_value")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise ApiError(f"response_format.type={kind[:40]!r} is not supported; give {kinds}",
                       param="response_format.type", code="invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError("response_format.json_schema must be an object {\"name\": ..., \"schema\": {...}}",
                       param="response_format.json_schema", code="invalid_value")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not NAME.match(name)):
        raise ApiError(f"response_format.json_schema.name={json.dumps(name)[:70]} must be 1-64 letters, digits, "
                       "'_', '-' or '.'", param="response_format.json_schema.name", code="invalid_value")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ApiError(f"response_format.json_schema.schema must be a JSON schema object, got "
                       f"{json.dumps(schema)[:80]}", param="response_format.json_schema.schema",
                       code="invalid_value")
    return schema


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list) or not tools:
        raise ApiError("tools must be a non-empty list of {\"type\": \"function\", \"function\": {\"name\", "
                       "\"description\", \"parameters\"}}", param="tools", code="invalid_value")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ApiError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}, got "
                           f"{json.dumps(tool)[:80]}", param=f"tools[{i}]", code="invalid_value")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name) or name in seen:
            raise ApiError(f"tools[{i}].function.name={json.dumps(name)[:70]} must be 1-64 letters, digits, '_', "
                           "'-' or '.', and differ from the other tools'", param=f"tools[{i}].function.name",
                           code="invalid_value")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ApiError(f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters", code="invalid_value")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ApiError(f"tools[{i}].function.description must be a string",
                           param=f"tools[{i}].function.description", code="invalid_value")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def _tool_choice(choice, tools: list[dict] | None):
    if tools is None:
        raise ApiError("tool_choice needs tools", param="tool_choice", code="invalid_value")
    if choice in ("none", "auto", "required"):
        return choice
    names = [t["function"]["name"] for t in tools]
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and isinstance(
        choice.get("function"), dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise ApiError(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                       f"\"function\": {{\"name\": N}}}} with N one of the tools ({', '.join(names)}); got "
                       f"{json.dumps(choice)[:80]}", param="tool_choice", code="invalid_value")
    return {"type": "function", "function": {"name": name}}


def _has_tool_turns(messages: list) -> bool:
    return any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages)


def _tool_messages(messages: list) -> list[dict]:
    """The messages as a tool-using template reads them: calls' arguments as objects, tool results as text."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a string \"role\"", param=f"messages[{i}]",
                           code="invalid_value")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
            m["content"] = content = "".join(p["text"] for p in content)
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise ApiError(f"messages[{i}].tool_calls must be a list, on an assistant message",
                               param=f"messages[{i}].tool_calls", code="invalid_value")
            m["tool_calls"] = [_call_for_template(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
            if content is None:
                m["content"] = ""
        if not isinstance(m.get("content"), str):
            raise ApiError(f"messages[{i}].content must be a string (or text parts)", param=f"messages[{i}].content",
                           code="invalid_value")
        out.append(m)
    return out


def _call_for_template(call, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}",
                       param=where, code="invalid_value")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ApiError(f"{where}.function.arguments is not valid JSON", param=f"{where}.function.arguments",
                           code="invalid_value") from None
    return {**call, "type": "function", "function": {"name": fn["name"], "arguments": args}}


# --- the template's format ------------------------------------------------------------------------------------


def tool_format(template) -> str:
    """"hermes" (Qwen 2.5/3, Hermes: <tool_call> JSON </tool_call>) or "llama3" (a bare JSON call with
    "parameters"), from the chat template's source."""
    return "hermes" if "<tool_call>" in template.source else "llama3"


def check_template(template, structured: Structured) -> None:
    if structured.tools and "tools" not in template.source:
        raise ApiError("the model's chat template does not render tools (it never reads a `tools` variable); "
                       "leave tools out or serve a model whose template has them", param="tools",
                       code="unsupported_parameter")


def render(template, structured: Structured, messages: list[dict]) -> str:
    """The prompt text: the messages (the structured ones when the request has tool turns) and the tools."""
    import jinja2

    context = {"tools": structured.tools} if structured.tools else {}
    try:
        return template.render(structured.messages or messages, add_generation_prompt=True, **context)
    except jinja2.TemplateError as e:
        raise ApiError(f"the chat template could not render these messages: {e}", param="messages",
                       code="invalid_value") from None


def _call_schema(tool: dict, style: str) -> dict:
    key = "arguments" if style == "hermes" else "parameters"
    return {"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                             key: tool["function"]["parameters"]},
            "required": ["name", key], "additionalProperties": False}


def grammar(grammars, structured: Structured, template) -> str | None:
    """The compiled grammar every choice decodes under, or None (GrammarError: the schema is refused)."""
    if structured.schema is not None:
        return grammars.json_schema(structured.schema)
    forced = structured.forced
    if forced is None:
        return None
    style = tool_format(template)
    tools = [t for t in structured.tools if not forced or t["function"]["name"] == forced]
    schemas = [_call_schema(t, style) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if style == "llama3":
        return grammars.json_schema(schema)
    options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    body = json.dumps({**schema, "x-guidance": options})
    return grammars.lark(f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {body}\n')


# --- parsing the reply --------------------------------------------------------------------------------------------

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str, style: str, names: set[str] | None = None) -> tuple[str | None, list[dict]]:
    """A reply's text -> (its content without the calls, or None when nothing else is said; OpenAI tool_calls).
    `style`: "hermes" or "llama3" (`tool_format`). A call that does not parse, or (with `names`) names no tool,
    stays in the content."""
    calls: list[dict] = []
    if style == "hermes":
        kept, at = [], 0
        for match in HERMES.finditer(text):
            call = _call(match.group(1), ("arguments", "parameters"), names)
            if call is None:
                continue
            kept.append(text[at:match.start()])
            at = match.end()
            calls.append(call)
        content = "".join(kept) + text[at:]
    else:
        body = text.strip()
        body = body[len("<|python_tag|>"):] if body.startswith("<|python_tag|>") else body
        found = [_call(body, ("parameters", "arguments"), names)]
        if found[0] is None and body.startswith("{") and ";" in body:  # several calls, ";"-separated
            found = [_call(p, ("parameters", "arguments"), names) for p in body.split(";")]
        if all(c is not None for c in found):
            calls, content = found, ""
        else:
            content = text
    if not calls:
        return text, []
    return content.strip() or None, calls


def _call(raw: str, keys: tuple[str, str], names: set[str] | None) -> dict | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if not isinstance(args, (dict, str)):
        return None
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": arguments}}
