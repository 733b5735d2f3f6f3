"""Constrained decoding: a request's next token restricted to what a grammar allows (structured output, `loom
serve`'s `response_format` and forced tool calls), with llguidance (the `structured` extra).

    grammars = Grammars(tokenizer, vocab=model_vocab, eos=stop_ids)    # once per model: the token table
    grammar = grammars.json_schema({"type": "object", ...})            # a compiled grammar, checked (GrammarError)
    engine.submit(prompt, params, constraint=grammars.matcher(grammar))  # one matcher per request

The engine (loom/infer/runner.py) asks `constrain(head, seqs)` for the logits a round samples from: each
constrained request's disallowed tokens at -inf (its argmax recomputed), the others' untouched; and after the
pick `advance(tokens, seqs)` feeds each constrained request its token. A decode window holding a constrained
request therefore waits for the device every step (the next mask depends on the token just picked: its host
time per token is the mask's, bench/structured_mask.py); the window's other requests keep their tokens. The
log-probabilities reported stay those of the raw logits (the most likely tokens listed are the allowed ones).

Once the grammar is complete the mask allows only the end tokens (`eos`: the model's stop ids), so a
constrained completion ends with a stop token, or by length (max_tokens) with the document unfinished, as
OpenAI's does. Per-token mask cost on a CPU and why llguidance: bench/structured_mask.py, docs/serve.md.
"""

from __future__ import annotations

import functools
import json

import torch

from loom.errors import UserError


class GrammarError(ValueError):
    """A schema or grammar that llguidance refuses; the message says why."""


class Grammars:
    """llguidance's token table for one tokenizer (`loom.data.tokenizer.Tokenizer`): built once (it walks the
    whole vocabulary), shared by every matcher. `vocab`: the model's logits width (at least the tokenizer's);
    `eos`: the token ids that end a completed document."""

    def __init__(self, tokenizer, vocab: int, eos: tuple[int, ...]):
        try:
            import llguidance
        except ImportError:
            raise UserError("structured output needs llguidance, which is not installed: pip install "
                            "'loom[structured]'") from None
        self._ll = llguidance
        if not eos:
            raise UserError("structured output needs an end token (the tokenizer has no stop token)")
        self.vocab = vocab
        self.tokenizer = llguidance.LLTokenizer(tokenizer.tok.to_str(), n_vocab=vocab, eos_token=list(eos))
        self.words = (vocab + 31) // 32  # the mask: one bit per token in int32 words
        self._cache: dict[str, str] = {}

    def json_schema(self, schema: dict | None) -> str:
        """The grammar of JSON documents valid under `schema` (None: any JSON object), compact (no whitespace
        between tokens, so a document's length is bounded by its schema's bounds); GrammarError if refused."""
        spec = {"type": "object"} if schema is None else schema
        key = json.dumps(spec, sort_keys=True)
        grammar = self._cache.get(key)
        if grammar is None:
            try:
                grammar = self._ll.LLMatcher.grammar_from_json_schema(
                    spec, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
            except (ValueError, TypeError, RuntimeError) as e:
                raise GrammarError(str(e)) from None
            self._check(grammar)
            if len(self._cache) < 256:
                self._cache[key] = grammar
        return grammar

    def lark(self, source: str) -> str:
        """A grammar in llguidance's Lark dialect (`%json {...}` embeds a JSON schema)."""
        grammar = self._ll.LLMatcher.grammar_from_lark(source)
        self._check(grammar)
        return grammar

    def _check(self, grammar: str) -> None:
        message = self._ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if message and not message.startswith("WARNING"):
            raise GrammarError(message)

    def matcher(self, grammar: str) -> "Constraint":
        return Constraint(self._ll.LLMatcher(self.tokenizer, grammar), self._end)

    @functools.cached_property
    def _end(self) -> torch.Tensor:
        """The bitmask that allows only the end tokens."""
        bits = torch.zeros(self.words * 32, dtype=torch.bool)
        bits[self.tokenizer.eos_tokens] = True
        weights = (1 << torch.arange(32, dtype=torch.int64))
        return (bits.view(self.words, 32).long() * weights).sum(1).to(torch.int32)


class Constraint:
    """One request's grammar state: the mask of its next token, advanced by each token it takes."""

    def __init__(self, matcher, end: torch.Tensor):
        self.matcher, self.end, self.words = matcher, end, end.numel()
        if matcher.is_error():
            raise GrammarError(matcher.get_error())

    @property
    def done(self) -> bool:
        """The document is complete (or the matcher failed): only an end token may follow, and later tokens of a
        window (after the end token, which the postprocess drops) are not fed to the matcher."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed-next-token bitmask into `row` (int32 [words], on the CPU); the end tokens only once
        done."""
        if self.done:
            row.copy_(self.end)
            return
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def advance(self, token: int) -> None:
        if not self.done:
            self.matcher.consume_token(token)


@functools.lru_cache(maxsize=8)
def _bits(device: torch.device) -> torch.Tensor:
    return (1 << torch.arange(32, dtype=torch.int64, device=device)).to(torch.int32)


def constrain(head: tuple, seqs: list) -> tuple:
    """The head's (logits [rows, vocab], argmax [rows], log-sum-exp [rows]) with each constrained request's
    (`Request.constraint`) disallowed tokens at -inf and its argmax over the rest; `head` itself is not changed.
    The log-sum-exp stays the raw logits' (reported log-probs are the model's)."""
    rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
    if not rows:
        return head
    logits, greedy, lse = head
    words = seqs[rows[0]].constraint.words
    masks = torch.empty(len(rows), words, dtype=torch.int32)
    for j, i in enumerate(rows):
        seqs[i].constraint.fill(masks[j])
    device = logits.device
    packed = masks.to(device, non_blocking=True)
    allowed = (packed[:, :, None] & _bits(device)) != 0  # [rows, words, 32]
    allowed = allowed.flatten(1)[:, :logits.shape[1]]
    index = torch.tensor(rows, device=device)
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    greedy = greedy.clone()
    greedy[index] = logits[index].float().argmax(-1)
    return logits, greedy, lse


def advance(tokens: torch.Tensor, seqs: list) -> None:
    """Feed each constrained request the token just picked for it (`tokens` [rows]; one read-back of theirs)."""
    rows = [i for i, s in enumerate(seqs) if s.constraint is not None and not s.constraint.done]
    if not rows:
        return
    picked = tokens[torch.tensor(rows, device=tokens.device)].tolist()
    for i, t in zip(rows, picked):
        seqs[i].constraint.advance(t)
