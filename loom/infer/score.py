"""Prompt scoring: the log-probability of every prompt token given the tokens before it, and the most likely
tokens at each prompt position (`SamplingParams.prompt_logprobs`; what an evaluation harness asks a server for
with `echo` and `logprobs`).

The prompts waiting to be scored run together, a plain causal forward of right-padded rows (no key/value memory:
scoring is independent of the slots, the paged blocks and any prefix cache), in batches of at most `budget`
padded tokens; the head runs only on the positions asked for, `chunk` rows at a time, so the logits of a whole
batch never exist at once. The first token of a prompt has no log-probability (None), as in OpenAI's answers.
"""

from __future__ import annotations

import torch

from loom.infer.kv import upload
from loom.parallel.distributed import full_tensor


def score_prompts(model, prompts: list[list[int]], tops: list[int], device, budget: int = 8192,
                  chunk: int = 1024) -> list[tuple[list[float | None], list[list[tuple[int, float]] | None]]]:
    """Per prompt: (log p(token i | tokens < i) for every i, None for i = 0; with tops[j] > 0 the tops[j]
    most likely (id, log-prob) at every position, best first, None for i = 0; else [] ). `model`: the engine's
    model (or its tensor-parallel shard): hidden states (`return_hidden=True`), then its head in fp32, as a
    direct forward computes them."""
    order = sorted(range(len(prompts)), key=lambda j: len(prompts[j]))
    out: list = [None] * len(prompts)
    start = 0
    while start < len(order):  # batches of similar lengths, at most `budget` padded tokens (at least one prompt)
        end = start + 1
        while end < len(order) and (end + 1 - start) * len(prompts[order[end]]) <= budget:
            end += 1
        batch = order[start:end]
        for j, result in zip(batch, _score_batch(model, [prompts[j] for j in batch],
                                                 [tops[j] for j in batch], device, chunk)):
            out[j] = result
        start = end
    return out


def _score_batch(model, prompts, tops, device, chunk):
    width = max(map(len, prompts))
    rows = [p + [0] * (width - len(p)) for p in prompts]
    tokens = upload(torch.tensor(rows), device)
    hidden = full_tensor(model(tokens, return_hidden=True))  # [batch, width, hidden]
    # the positions that predict a next prompt token: row b, positions 0..len-2, each predicting token i + 1
    where = [(b, i) for b, p in enumerate(prompts) for i in range(len(p) - 1)]
    top = max(tops)
    picked, best_ids, best_lp = [], [], []
    for at in range(0, len(where), chunk):
        part = where[at:at + chunk]
        b = torch.tensor([w[0] for w in part], device=hidden.device)
        i = torch.tensor([w[1] for w in part], device=hidden.device)
        logp = full_tensor(model.output(hidden[b, i])).float().log_softmax(-1)
        nxt = tokens[b, i + 1]
        picked.append(logp.gather(1, nxt[:, None])[:, 0])
        if top:
            values, ids = logp.topk(min(top, logp.shape[-1]), dim=1)
            best_ids.append(ids)
            best_lp.append(values)
    lps = torch.cat(picked).tolist() if picked else []
    ids = torch.cat(best_ids).tolist() if best_ids else []
    vals = torch.cat(best_lp).tolist() if best_lp else []
    results, at = [], 0
    for p, k in zip(prompts, tops):
        n = len(p) - 1
        mine = [None] + lps[at:at + n]
        best = [None] + [list(zip(ids[at + m][:k], vals[at + m][:k])) for m in range(n)] if k else []
        results.append((mine, best))
        at += n
    return results
