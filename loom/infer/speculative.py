"""Speculative decoding with prompt-lookup drafts (`Engine(speculative="ngram", draft_tokens=K)`): each step, every
busy request guesses up to K next tokens by finding its last n tokens (n = 3, then 2, then 1) earlier in its prompt
and completion and copying what followed there; one target forward over [last token, draft...] of every request
(a packed forward that starts at each request's position and reads its earlier keys: `bind_packed(..., starts)`)
gives the target's logits at every drafted position, and the drafts are checked against them:

- greedy: a draft token is kept while it equals the target's argmax; then the target's own next token (the first
  that differs, or the one after the whole draft) is appended too. The output is exactly greedy decoding's.
- sampling: standard speculative rejection sampling with a deterministic draft (a point mass q on the drafted
  token d): d is kept with probability p(d), p the target's distribution after temperature, top-k and top-p; a
  rejected d is replaced by a draw from the residual max(p - q, 0) normalised (p without d); after a whole kept
  draft one more token is drawn from p. Each emitted token is distributed exactly as p given the tokens before it,
  so the law of the completion is unchanged (its draws are not the non-speculative engine's: other uniforms).

Every step so emits 1 to K + 1 tokens per request for one read of the weights, which is what a batch-1 decode step
costs; `stats`: "spec_steps" (target forwards), "spec_request_steps" (requests verified, summed over steps),
"spec_draft_tokens", "spec_accepted_tokens" (drafted tokens kept). Tokens per request step =
(accepted + request steps) / request steps. Log-probabilities are those the plain engine reports: `logprobs` the
raw log-softmax, `sampling_logprobs` log p of the emitted token. Keys and values written for rejected drafts lie
past the request's length and are overwritten before anything reads them.

Requests the engine decodes with features the verifier does not implement (top log-probs, penalties, logit bias,
min_tokens, grammar constraints, LoRA adapters per request) take the ordinary decode window instead (`NgramSpeculator.takes`)."""

from __future__ import annotations

import torch

from loom.infer.postprocess import stop_at_string
from loom.infer.request import Request
from loom.infer.sampling import SamplingParams
from loom.parallel.distributed import full_tensor


def ngram_draft(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of `tokens`' last n tokens (the longest n
    in max_n..min_n that occurs earlier); [] if none does."""
    length = len(tokens)
    if k < 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n:]
        for i in range(length - n - 1, -1, -1):  # most recent first; what follows it exists (i + n < length)
            if tokens[i:i + n] == pattern:
                return tokens[i + n:i + n + k]
    return []


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the engine samples from (loom/infer/sampling.py `Sampler`), fp32 logits [rows, vocab] ->
    probabilities [rows, vocab]: temperature, then top-k (ties with the k-th kept), then top-p (the smallest set of
    most likely tokens holding top_p of the mass); a point mass on the argmax when greedy."""
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    x = logits / p.temperature
    vocab = x.shape[-1]
    if 0 < p.top_k < vocab:
        kth = x.topk(p.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x.softmax(-1)


def verify(probs: torch.Tensor, draft: list[int], uniforms: torch.Tensor) -> tuple[list[int], int]:
    """Rejection sampling of one request's draft: `probs` [len(draft) + 1, vocab] the target's distributions at the
    drafted positions and the one after; `uniforms` [2 x (len(draft) + 1)] in [0, 1) -> (the emitted tokens, how many
    drafted tokens were kept). Token i of the draft is kept if uniforms[2i] < p_i(d_i); the first rejected one is
    replaced by a draw (inverse CDF at uniforms[2i + 1]) from p_i without d_i, renormalised; a whole kept draft is
    followed by a draw from the last row."""
    out = []
    for i, d in enumerate(draft):
        row = probs[i]
        if uniforms[2 * i] < row[d]:
            out.append(d)
            continue
        residual = row.clone()
        residual[d] = 0
        return out + [draw(residual, uniforms[2 * i + 1])], i
    return out + [draw(probs[len(draft)], uniforms[2 * len(draft) + 1])], len(draft)


def draw(weights: torch.Tensor, u: torch.Tensor) -> int:
    """The token at which the CDF of (unnormalised) `weights` reaches u x their sum."""
    cdf = weights.double().cumsum(0)
    return int(torch.searchsorted(cdf, u.double() * cdf[-1], right=True).clamp(max=len(cdf) - 1))


class NgramSpeculator:
    """Prompt-lookup speculative decoding for one engine: `draft_tokens` tokens drafted per request and step from
    n-grams of `max_n` down to `min_n` tokens. `runner`: the engine's `Runner` (its model, head and key/value
    memory); `stats`: the engine's counters."""

    def __init__(self, runner, stats: dict, draft_tokens: int, max_len: int, decode=None, max_n: int = 3,
                 min_n: int = 1):
        self.runner, self.slab, self.stats = runner, runner.slab, stats
        self.k, self.max_len, self.decode, self.max_n, self.min_n = draft_tokens, max_len, decode, max_n, min_n
        for key in ("spec_steps", "spec_request_steps", "spec_draft_tokens", "spec_accepted_tokens"):
            stats.setdefault(key, 0)

    @staticmethod
    def takes(seqs: list[Request]) -> bool:
        """Whether every request is one the verifier decodes as the plain engine would."""
        return all(s.params.logprobs == 0 and s.constraint is None and s.adapter is None and not s.params.logit_bias
                   and s.params.presence_penalty == 0 and s.params.frequency_penalty == 0
                   and s.params.repetition_penalty == 1 and s.params.min_tokens == 0 for s in seqs)

    @torch.no_grad()
    def step(self, rows: list[int], seqs: list[Request]) -> None:
        """One speculative step of the busy slots `rows` (their requests `seqs`): draft, verify in one forward,
        append the emitted tokens to each request's completion (up to what ends it)."""
        drafts = []
        for s in seqs:
            left = min(s.params.max_new_tokens - len(s.out.tokens),
                       self.max_len - len(s.out.prompt) - len(s.out.tokens)) - 1  # the bonus token takes one
            drafts.append(ngram_draft(s.out.prompt + s.out.tokens, min(self.k, left), self.max_n, self.min_n))
        starts = [s.length for s in seqs]
        lengths = [1 + len(d) for d in drafts]
        self.slab.prepare(rows, starts, [a + n for a, n in zip(starts, lengths)], None)
        fed = [t for s, d in zip(seqs, drafts) for t in [s.out.tokens[-1], *d]]
        runner = self.runner
        positions = self.slab.bind_packed(rows, lengths, starts)
        tokens = torch.tensor(fed, device=runner.device)[None]
        # the decoder: on a CPU the packed small-batch products (a few rows per request, as a decode step has)
        hidden = full_tensor(runner.decoder(tokens, cache=self.slab, positions=positions, return_hidden=True))
        logits = runner._head_logits(hidden[0]).float().cpu()  # [fed, vocab]: the one read-back of the step
        logp = logits.log_softmax(-1)
        at, accepted = 0, 0
        for s, d, n in zip(seqs, drafts, lengths):
            rows_of = slice(at, at + n)
            at += n
            p = s.params
            if p.temperature == 0:  # greedy: keep the draft while it is the argmax, then the argmax
                best = logits[rows_of].argmax(-1).tolist()
                kept = next((i for i, t in enumerate(d) if t != best[i]), len(d))
                emitted, sampled = d[:kept] + [best[kept]], [0.0] * (kept + 1)
            else:
                probs = target_probs(logits[rows_of], p)
                emitted, kept = verify(probs, d, torch.rand(2 * n, generator=s.generator))
                sampled = [float(probs[i, t].log()) for i, t in enumerate(emitted)]
            accepted += kept
            self._append(s, emitted, [float(logp[rows_of][i, t]) for i, t in enumerate(emitted)], sampled)
            s.length += 1 + kept  # the fed last token and the kept drafts; the new last token is not written yet
        self.stats["spec_steps"] += 1
        self.stats["decode_steps"] += 1
        self.stats["spec_request_steps"] += len(seqs)
        self.stats["spec_draft_tokens"] += sum(map(len, drafts))
        self.stats["spec_accepted_tokens"] += accepted

    def _append(self, s: Request, tokens: list[int], logprobs: list[float], sampled: list[float]) -> None:
        out, p = s.out, s.params
        start = len(out.tokens)
        for t, lp, sp in zip(tokens, logprobs, sampled):
            out.tokens.append(t)
            out.logprobs.append(lp)
            out.sampling_logprobs.append(sp)
            self.stats["decoded_tokens"] += 1
            if t in p.stop_token_ids:
                out.finish_reason = "stop"
            elif len(out.tokens) >= p.max_new_tokens:
                out.finish_reason = "length"
            elif len(out.prompt) + len(out.tokens) >= self.max_len:
                out.finish_reason = "context"
            if out.finish_reason:
                break
        if p.stop:
            self.stats["decoded_tokens"] -= stop_at_string(out, p.stop, start, self.decode)
