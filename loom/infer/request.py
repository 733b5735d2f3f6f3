"""A generation request and what it produces: `Request` (a prompt, its sampling parameters and seed, its state
as the engine runs it), `Completion` (its tokens and log-probabilities so far) and `Update` (what one
`Engine.step` added to it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loom.infer.sampling import SamplingParams


@dataclass
class Completion:
    """One finished request. `finish_reason`: "stop" (a stop token, the last of `tokens`, or a stop string,
    `stop_string`, which the last of `tokens` completes), "length" (max_new_tokens reached) or "context"
    (prompt + completion reached the engine's max_len)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # log-softmax of the raw logits (temperature 1)
    sampling_logprobs: list[float] = field(default_factory=list)  # under the distribution sampled from
    finish_reason: str = ""
    stop_string: str = ""  # the stop string (SamplingParams.stop) that ended it, if one did
    stop_offset: int = -1  # where that stop string begins in the completion's text (-1: its first occurrence)
    # with SamplingParams.logprobs = N > 0: per token, the N most likely (id, log-prob at temperature 1), best first
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs set: log p(prompt token i | those before), None for the first, and per
    # position the N most likely (id, log-prob) (None for the first; [] when N = 0): loom/infer/score.py
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)

    def text(self, decode) -> str:
        """The completion's text (`decode`: ids -> str): without the stop token that ended it, cut before the
        stop string that ended it."""
        if self.stop_string:
            text = decode(self.tokens)
            return text[:self.stop_offset if self.stop_offset >= 0 else text.find(self.stop_string)]
        return decode(self.tokens[:-1] if self.finish_reason == "stop" else self.tokens)


class Request:
    """A submitted request (`Engine.submit`): its prompt, sampling parameters and seed, and as it runs its
    `out` (the Completion so far). `state`: "waiting" (queued), "running" (holds a slot), "done" (finished:
    `out.finish_reason` says why) or "cancelled" (`Engine.cancel`). `index`: the caller's label (generate's
    prompt index), else the engine's running count of submitted requests."""

    def __init__(self, index: int, prompt: list[int], params: SamplingParams, seed: int):
        self.index, self.params, self.seed = index, params, seed
        self.out = Completion(prompt=list(prompt))
        self.generator = torch.Generator().manual_seed(seed)
        self.length = len(prompt)  # tokens whose keys and values are in the slot
        self.shared = False  # paged: its prompt's blocks and first-token logits come from an earlier request
        self.constraint = None  # a grammar's state (loom/infer/grammar.py): the tokens it may take next
        self.adapter: int | None = None  # the LoRA adapter it runs with (loom/infer/adapters.py), None: the base
        self.state = "waiting"

    @property
    def done(self) -> bool:
        return self.state in ("done", "cancelled")


@dataclass
class Update:
    """What one `Engine.step` did for one request: the tokens (and their log-probs at temperature 1) it
    appended, and whether the request finished (`request.out.finish_reason`)."""

    request: Request
    tokens: list[int]
    logprobs: list[float]
    finished: bool
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # SamplingParams.logprobs > 0
