"""Chat templates: a conversation -> token ids, and which of them the model learns (the assistant's).

A template is Jinja source, as Hugging Face stores it under `chat_template` in `tokenizer_config.json`,
rendered the way transformers' `apply_chat_template` renders it: an immutable sandboxed environment with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, `raise_exception(msg)`, a `tojson` filter
that keeps non-ASCII characters, `strftime_now`, a pass-through `{% generation %}` block, and the
variables `messages`, `add_generation_prompt` and the special tokens (`bos_token`, `eos_token`, ...). The
rendered text is tokenized whole, without added special tokens (the template writes them), so the ids
equal `apply_chat_template(messages, tokenize=True)`.

Which tokens are the assistant's, found by rendering prefixes: for assistant message i, the text of
messages[:i] with the generation prompt ends where its reply starts, and the text of messages[:i+1] ends
where the reply (with the template's end-of-turn marker) ends. Both must be prefixes of the whole
conversation's text, or the template does not render prefixes consistently (some drop earlier turns'
reasoning) and the record is refused. The whitespace a template writes after its end-of-turn marker (ChatML's
newline after <|im_end|>) is no part of the span: generation stops at the marker, so the model never writes it.
A token is supervised when it starts inside such a span (tokenizer offsets), so exactly the reply and its
end-of-turn token are learned, as transformers' `return_assistant_tokens_mask` (what TRL's `assistant_only_loss`
trains on) marks them for a template whose `{% generation %}` block ends at the marker, and nothing the user
wrote is.

Where a chat model's template and stops come from: the files carried beside its tokenizer.json (run
directories, checkpoints and `loom convert` keep them, loom.models.io.TOKENIZER_FILES): chat_template.jinja
(transformers 5 writes it) or tokenizer_config.json's chat_template (`find_template`), and the ids where
generation stops (`stop_token_ids`: end-of-document, eos_token, generation_config.json's eos_token_id, the
template's end-of-turn), which `loom generate` and `loom rl` both use.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from loom.errors import UserError

# Meta-Llama-3-8B-Instruct's template, as published in its tokenizer_config.json.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# ChatML (OpenAI; Qwen, SmolLM and others use it): <|im_start|>role\ncontent<|im_end|>\n per message.
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BUILT_IN = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "chatml": (CHATML, {"eos_token": "<|im_end|>"}),
}
ROLES = ("system", "user", "assistant")
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass
class ChatTemplate:
    source: str  # Jinja
    special: dict = field(default_factory=dict)  # bos_token, eos_token, ... as strings
    name: str = "custom"

    def __post_init__(self):
        import jinja2

        try:
            self.compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise UserError(f"chat template {self.name} is not valid Jinja: {e} (line {e.lineno})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **context) -> str:
        """`context`: more template variables (`tools`, as transformers' apply_chat_template passes them)."""
        return self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **{**self.special, **context})

    @functools.cached_property
    def space_after_turn(self) -> str:
        """The whitespace the template writes after an assistant's end-of-turn marker ("\n" after ChatML's
        <|im_end|>); "" when it writes none, or no marker at all."""
        after = _after_reply(self) or ""
        return after[len(after.rstrip()):] if after.strip() else ""


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_json_file(path: Path, what: str) -> dict:
    """A JSON object file (tokenizer_config.json, generation_config.json); UserError naming it otherwise."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}; expected {what}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} holds {type(config).__name__}; expected {what} (a JSON object)")
    return config


def special_tokens(config: dict) -> dict:
    """bos_token, eos_token, ... of a tokenizer_config.json's contents, as strings."""
    return {k: v for k in SPECIAL_KEYS if (v := _token_text(config.get(k))) is not None}


def _from_tokenizer_config(path: Path, key: str, jinja: Path | None = None) -> ChatTemplate:
    """The template of a tokenizer_config.json, or of `jinja` (chat_template.jinja, which transformers 5 writes
    beside it and reads first) with the config's special tokens."""
    config = read_json_file(path, "a tokenizer_config.json") if path.is_file() else {}
    if jinja is not None:
        return ChatTemplate(jinja.read_text(encoding="utf-8"), special_tokens(config), str(jinja))
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        raise UserError(f"{path} has no chat_template (a string, or a list holding one named 'default'), and no "
                        f"{JINJA} lies beside it; set {key}=llama3 or chatml, or to a file that has one")
    return ChatTemplate(source, special_tokens(config), str(path))


JINJA = "chat_template.jinja"


def template_dir(tokenizer_path: str | Path | None) -> Path | None:
    """The directory whose tokenizer files (tokenizer_config.json, chat_template.jinja) go with a tokenizer."""
    directory = Path(tokenizer_path) if tokenizer_path else None
    if directory is not None and directory.is_file():
        directory = directory.parent
    return directory


def find_template(tokenizer_path: str | Path | None, key: str = "sft.template") -> ChatTemplate | None:
    """The chat template carried beside a tokenizer (chat_template.jinja, else tokenizer_config.json's
    chat_template), or None when there is none."""
    directory = template_dir(tokenizer_path)
    if directory is None:
        return None
    jinja, config = directory / JINJA, directory / "tokenizer_config.json"
    if jinja.is_file():
        return _from_tokenizer_config(config, key, jinja)
    if config.is_file() and read_json_file(config, "a tokenizer_config.json").get("chat_template"):
        return _from_tokenizer_config(config, key)
    return None


def load_template(spec: str, tokenizer_path: str | Path | None = None, key: str = "sft.template") -> ChatTemplate:
    """`key` (sft.template, pref.template, rl.template): "auto" (chat_template.jinja or tokenizer_config.json
    beside the tokenizer), "llama3", "chatml", a tokenizer_config.json, or a .jinja file."""
    if spec in BUILT_IN:
        source, special = BUILT_IN[spec]
        return ChatTemplate(source, dict(special), spec)
    if spec == "auto":
        directory = template_dir(tokenizer_path)
        template = find_template(directory, key)
        if template is None:
            where = ("the bpe tokenizer has none" if directory is None else
                     f"{directory} holds neither {JINJA} nor a tokenizer_config.json with a chat_template")
            raise UserError(
                f"{key}=auto takes the chat template from the {JINJA} or tokenizer_config.json beside the "
                f"tokenizer, but {where}; set {key}=llama3 or chatml (built in), or to a tokenizer_config.json "
                "or .jinja file")
        return template
    path = Path(spec)
    if not path.is_file():
        raise UserError(f"{key}={spec!r} is neither a built-in template (llama3, chatml, auto) nor a file; "
                        "give one of those or a tokenizer_config.json / .jinja path")
    if path.suffix == ".json":
        return _from_tokenizer_config(path, key)
    return ChatTemplate(path.read_text(encoding="utf-8"), {}, str(path))


def end_of_turn(template: ChatTemplate, tokenizer) -> int | None:
    """The special token the template writes right after an assistant's reply (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>), found by rendering a reply; None when the template writes none (or writes it as text)."""
    after = _after_reply(template)
    ids = tokenizer.encode(after)[:1] if after else []
    return ids[0] if ids and tokenizer.decode(ids) in tokenizer.special_tokens() else None


def _after_reply(template: ChatTemplate) -> str | None:
    """What the template writes right after an assistant's reply ("<|im_end|>\n" for ChatML), or None."""
    import jinja2

    marker = "loom-reply-marker"
    try:
        text = template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}])
    except jinja2.TemplateError:
        return None
    return text[text.index(marker) + len(marker):] if marker in text else None


def stop_texts(tokenizer, template: ChatTemplate | None = None) -> tuple[str, ...]:
    """Text stops generation needs besides `stop_token_ids`: the template's end-of-turn marker when the tokenizer
    has no special token for it (the built-in chatml on a tokenizer without <|im_end|> spells it in ordinary
    tokens, so no stop id can catch it). `template` None: the one carried beside the tokenizer, if any."""
    if template is None:
        template = find_template(template_dir(tokenizer.path))
    if template is None or end_of_turn(template, tokenizer) is not None:
        return ()
    after = (_after_reply(template) or "").strip()
    return (after.split()[0],) if after else ()


def stop_token_ids(tokenizer, template: ChatTemplate | None = None) -> tuple[int, ...]:
    """Where generation stops, from every source loom knows, in one place: the end-of-document id, the
    `eos_token` of the tokenizer_config.json beside the tokenizer (or the template's), generation_config.json's
    `eos_token_id` (an id or a list), and the chat template's end-of-turn token (`end_of_turn`). `template`
    None: the one carried beside the tokenizer, if any."""
    ids = [tokenizer.eod_id]
    directory = template_dir(tokenizer.path)
    eos = []
    if directory is not None and (config := directory / "tokenizer_config.json").is_file():
        eos.append(special_tokens(read_json_file(config, "a tokenizer_config.json")).get("eos_token"))
    if template is None:
        template = find_template(directory)
    if template is not None:
        eos.append(template.special.get("eos_token"))
        ids.append(end_of_turn(template, tokenizer))
    ids += [tokenizer.tok.token_to_id(t) for t in eos if t]
    if directory is not None and (generation := directory / "generation_config.json").is_file():
        value = read_json_file(generation, "a generation_config.json").get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        ids += [v for v in values if isinstance(v, int) and 0 <= v < tokenizer.vocab_size]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def check_record(record, where: str) -> list[dict] | tuple[str, str]:
    """A record's conversation (messages) or (prompt, completion); UserError naming `where` otherwise."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with \"messages\" or \"prompt\" and \"completion\", got "
                        f"{type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise UserError(f"{where}: messages[{i}] = {json.dumps(m)[:120]} must be an object with \"role\" "
                                f"one of {', '.join(ROLES)} and a string \"content\"")
        if not any(m["role"] == "assistant" for m in messages):
            raise UserError(f"{where}: no assistant message, so nothing to learn; every conversation needs at "
                            "least one {\"role\": \"assistant\"} message")
        return messages
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
            raise UserError(f"{where}: \"prompt\" and \"completion\" must both be strings, the completion non-empty")
        return prompt, completion
    raise UserError(f"{where}: a record needs \"messages\" (a list of {{\"role\", \"content\"}}) or \"prompt\" and "
                    f"\"completion\"; it has keys {', '.join(map(repr, record)) or 'none'}")


def encode_chat(template: ChatTemplate, tokenizer, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, 0/1 mask of the assistant's tokens) of a conversation."""
    import jinja2

    try:
        text = template.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            lo = len(prompt := template.render(messages[:i], add_generation_prompt=True))
            hi = len(done := template.render(messages[:i + 1]))
            if not (text.startswith(done) and done.startswith(prompt)):
                raise UserError(
                    f"{where}: chat template {template.name} does not render this conversation's prefixes as "
                    f"prefixes of the whole (message {i}), so the assistant's tokens cannot be located; use a "
                    "template that renders earlier turns unchanged (e.g. sft.template=chatml)")
            space = template.space_after_turn  # never generated: not learned
            spans.append((lo, hi - len(space) if done.endswith(space) else hi))
    except jinja2.TemplateError as e:
        raise UserError(f"{where}: chat template {template.name} refused the conversation: {e}") from None
    enc = tokenizer.tok.encode(text, add_special_tokens=False)
    starts = np.array([s for s, _ in enc.offsets], dtype=np.int64)
    mask = np.zeros(len(enc.ids), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return np.asarray(enc.ids, dtype=np.int64), mask


def generation_prompts(records: list[tuple[str, dict]], tokenizer_path, template: ChatTemplate | None = None
                       ) -> list[str]:
    """`loom generate`'s prompts: each (where, record)'s "prompt", or its chat "messages" rendered with the
    model's chat template (`template`, else the one carried beside its tokenizer) and the generation prompt."""
    import jinja2

    texts = []
    for where, record in records:
        if "prompt" in record:
            texts.append(record["prompt"])
            continue
        if template is None:
            template = find_template(tokenizer_path)
            if template is None:
                raise UserError(f"{where}: a chat record (\"messages\") needs the model's chat template, but "
                                f"{template_dir(tokenizer_path)} holds neither {JINJA} nor a tokenizer_config.json "
                                "with a chat_template; give {\"prompt\": text} records instead")
        messages = record["messages"]
        bad = [i for i, m in enumerate(messages) if not isinstance(m, dict) or m.get("role") not in ROLES
               or not isinstance(m.get("content"), str)]
        if bad:
            raise UserError(f"{where}: messages[{bad[0]}] = {json.dumps(messages[bad[0]])[:120]} must be an object "
                            f"with \"role\" one of {', '.join(ROLES)} and a string \"content\"")
        try:
            texts.append(template.render(messages, add_generation_prompt=True))
        except jinja2.TemplateError as e:
            raise UserError(f"{where}: chat template {template.name} refused the conversation: {e}") from None
    return texts


def encode_completion(tokenizer, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
    """Plain text: prompt ids, then completion ids and the end-of-document token (when the tokenizer has one),
    the latter learned."""
    p, c = tokenizer.encode(prompt), tokenizer.encode(completion)
    if tokenizer.eod_id is not None:
        c = c + [tokenizer.eod_id]
    mask = np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(c), np.uint8)])
    return np.asarray(p + c, dtype=np.int64), mask
