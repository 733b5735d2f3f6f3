"""Sampling of the generation engine: per-request settings (`SamplingParams`) and `Sampler`, which picks
every request's next token on the logits' device.

Sampling is per request: temperature (0 = greedy), top-k, top-p, max_new_tokens, stop tokens and stop
strings, seed. Each
request draws its random numbers from its own generator, one uniform per token, so what it samples does
not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.errors import UserError
from loom.infer.kv import upload


@dataclass(frozen=True)
class SamplingParams:
    """How one request is continued. `temperature` 0 is greedy; `top_k` 0 and `top_p` 1 keep every token.
    Generation stops after `max_new_tokens`, at any of `stop_token_ids` (kept as the last token), once the
    decoded completion contains any of `stop` (text; the completion keeps the tokens up to the one that
    completes it, `Completion.text` cuts the text before it; the engine needs a `decode` for these), or when
    prompt + completion fill the engine's `max_len`. `seed` None draws one from the engine's seed. `logprobs` N > 0
    also returns, with each token, the N most likely tokens and their log-probabilities at temperature 1
    (`Completion.top_logprobs`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    # logits processing before sampling (loom/infer/logits.py; as vLLM): `logit_bias` ((id, bias), ...) added to
    # the logits; `min_tokens`: stop_token_ids masked out before that many tokens (stop strings held back too);
    # `repetition_penalty` (HF's, over prompt and completion: positive logits divided by it, negative ones
    # multiplied); `presence_penalty` / `frequency_penalty` (OpenAI's, over the completion: minus the penalty
    # once per token seen / per occurrence). Reported log-probs stay those of the raw logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # not None: score the prompt too (`Completion.prompt_logprobs`, and with N > 0 the N most likely tokens at
    # each prompt position, `Completion.prompt_top_logprobs`); max_new_tokens=0 then only scores it
    prompt_logprobs: int | None = None

    @property
    def processes(self) -> bool:
        """Whether the logits are changed before this request samples (loom/infer/logits.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias
                    or (self.min_tokens and self.stop_token_ids))

    def check(self) -> None:
        bad = []
        if not self.temperature >= 0:
            bad.append(f"temperature={self.temperature} (must be >= 0; 0 is greedy)")
        if self.top_k < 0:
            bad.append(f"top_k={self.top_k} (must be >= 0; 0 keeps every token)")
        if not 0 < self.top_p <= 1:
            bad.append(f"top_p={self.top_p} (must be in (0, 1])")
        if self.max_new_tokens < (0 if self.prompt_logprobs is not None else 1):
            bad.append(f"max_new_tokens={self.max_new_tokens} (must be >= 1, or 0 when scoring the prompt: "
                       "prompt_logprobs)")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad.append(f"prompt_logprobs={self.prompt_logprobs} (must be >= 0, or None: the prompt not scored)")
        for name, value, low, high in (("presence_penalty", self.presence_penalty, -2, 2),
                                       ("frequency_penalty", self.frequency_penalty, -2, 2),
                                       ("repetition_penalty", self.repetition_penalty, 0, float("inf"))):
            if not (low < value <= high if name == "repetition_penalty" else low <= value <= high):
                bad.append(f"{name}={value} (must be in {'(' if low == 0 else '['}{low}, {high}])")
        if not 0 <= self.min_tokens <= max(self.max_new_tokens, 0):
            bad.append(f"min_tokens={self.min_tokens} (must be in [0, max_new_tokens={self.max_new_tokens}])")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            bad.append("logit_bias values must be in [-100, 100]")
        if self.logprobs < 0:
            bad.append(f"logprobs={self.logprobs} (must be >= 0: the most likely tokens returned with each token)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad.append(f"stop={list(self.stop)} (stop strings must be non-empty text)")
        if bad:
            raise UserError("invalid sampling parameters: " + "; ".join(bad))


class Sampler:
    """Per-request sampling of a fixed set of requests for `steps` consecutive decode steps, entirely on the
    logits' device: the per-request settings become tensors once, and each hot (temperature > 0) request's
    uniforms for all the steps are drawn from its own generator up front (one per token, in order, so a
    request samples the same tokens however many steps a window holds) and moved in one copy. Greedy rows
    take the argmax (log-probability 0: a point mass); the others apply temperature, then top-k, then top-p
    (the smallest set of most likely tokens holding top_p of the mass), and invert the CDF at their uniform."""

    def __init__(self, params: list[SamplingParams], generators: list[torch.Generator], steps: int, vocab: int,
                 device, processor=None):
        self.hot = [i for i, p in enumerate(params) if p.temperature > 0]
        self.sorts = False
        # the logits of requests with penalties, logit_bias or min_tokens are processed first
        # (`loom.infer.logits.LogitsProcessor`, built by the caller for these params; None: none)
        self.processor = processor
        if not self.hot:
            return
        hot = [params[i] for i in self.hot]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in hot]
        self.sorts = min(top_k) < vocab or min(p.top_p for p in hot) < 1
        uniforms = torch.stack([torch.rand(steps, generator=generators[i]) for i in self.hot])
        # one copy to the device: row, temperature, top-k, top-p and the uniforms (float32, exact in float64)
        settings = torch.tensor([[i, p.temperature, k, p.top_p] for i, p, k in zip(self.hot, hot, top_k)],
                                dtype=torch.float64)
        table = upload(torch.cat([settings, uniforms.double()], 1), torch.device(device))
        self.idx = table[:, 0].long()
        self.temperature = table[:, 1:2].float()
        self.kth = table[:, 2:3].long() - 1
        self.top_p = table[:, 3:4].float()
        self.uniforms = table[:, 4:].float()  # [hot, steps]
        self.vocab = vocab

    def __call__(self, logits: torch.Tensor, greedy: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [rows, vocab] (fp32 or bf16) and their argmax [rows] at window step `step` -> (token [rows], its
        log-probability under the distribution it was drawn from)."""
        tokens = greedy.clone()  # a CUDA-graph step's own output, overwritten by its next replay
        chosen = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
        proc = self.processor
        if proc is not None:  # processed logits: greedy rows among them take their argmax
            logits = proc(logits, step)
            if proc.any_greedy:
                rows = proc.rows[proc.greedy]
                tokens[rows] = logits[rows].argmax(-1)
        if not self.hot:
            if proc is not None:
                proc.observe(tokens)
            return tokens, chosen
        x = logits[self.idx] / self.temperature
        order = None
        if self.sorts:
            x, order = x.sort(dim=-1, descending=True)
            kth = x.gather(1, self.kth)
            x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th logit stay, as in transformers
            probs = x.softmax(-1)
            x = x.masked_fill((probs.cumsum(-1) - probs > self.top_p) & (self.top_p < 1), float("-inf"))
        logp = x.log_softmax(-1)
        cdf = logp.exp().cumsum(-1)
        u = self.uniforms[:, step:step + 1]
        pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=self.vocab - 1)
        chosen[self.idx] = logp.gather(1, pick)[:, 0]
        tokens[self.idx] = pick[:, 0] if order is None else order.gather(1, pick)[:, 0]
        if proc is not None:
            proc.observe(tokens)
        return tokens, chosen


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of `Sampler`: logits [rows, vocab] (fp32) -> (token [rows], its log-probability under the
    distribution it was drawn from); each hot row draws one uniform from its generator."""
    return Sampler(params, generators, 1, logits.shape[-1], logits.device)(logits, logits.argmax(-1), 0)


def reduce_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [rows, vocab] (fp32, or the head's bf16) -> (the logits as given, argmax [rows], log-sum-exp
    [rows]), the reductions in fp32: what sampling and the log-probabilities read (they upcast what they take
    from bf16 logits, exactly). Inside a compiled step that computes the head (a GPU's, or a CPU's packed head)
    both reductions fuse into the step's graph, which then writes the logits once in the head's dtype."""
    x = logits.float()
    return logits, x.argmax(-1), x.logsumexp(-1)
