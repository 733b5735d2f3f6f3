"""Logits processing before sampling, per request (`SamplingParams`: logit_bias, min_tokens, repetition_penalty,
presence_penalty, frequency_penalty), on the logits' device for a window of decode steps.

The rules are vLLM's (and in order): the bias is added to the logits; before a request has `min_tokens` tokens
its stop tokens are masked out; HF's repetition penalty divides the positive logits of every token seen in the
prompt or the completion by the penalty and multiplies the negative ones; OpenAI's frequency and presence
penalties subtract `frequency_penalty` per occurrence in the completion and `presence_penalty` once per token
that occurs in it. Greedy requests take the argmax of the processed logits; the others sample from them.

The token history lives on the device: per processed request, the completion's counts [vocab] and the tokens
seen [vocab], built from the request's tokens when a window starts and updated with each step's tokens, so a
window needs no read-back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loom.infer.kv import upload

if TYPE_CHECKING:
    from loom.infer.sampling import SamplingParams


class LogitsProcessor:
    """The processing of the rows `rows` (of a window's requests) whose params change the logits (`processes`).
    `histories`: per row of the window, (prompt, completion so far) token ids."""

    def __init__(self, params: list[SamplingParams], histories: list[tuple[list[int], list[int]]], vocab: int,
                 device):
        rows = [i for i, p in enumerate(params) if p.processes]
        self.rows_list = rows
        p = [params[i] for i in rows]
        n = len(rows)
        # one copy to the device: per row its scalars, then the (row, id, value) triples of its history and bias
        seen_ids, count_ids, bias, stop = [], [], [], []
        for r, i in enumerate(rows):
            prompt, done = histories[i]
            if p[r].repetition_penalty != 1:
                seen_ids += [(r, t) for t in prompt]
            count_ids += [(r, t) for t in done]
            bias += [(r, t, b) for t, b in p[r].logit_bias]
            if p[r].min_tokens > len(done):
                stop += [(r, t) for t in p[r].stop_token_ids]
        scalars = [[p[r].repetition_penalty, p[r].frequency_penalty, p[r].presence_penalty,
                    p[r].min_tokens - len(histories[i][1]), float(not params[i].temperature > 0)]
                   for r, i in enumerate(rows)]
        head = [len(seen_ids), len(count_ids), len(bias), len(stop)]
        flat = ([float(x) for x in head] + [x for row in scalars for x in row]
                + [float(x) for pair in seen_ids + count_ids + stop for x in pair]
                + [float(x) for triple in bias for x in triple])
        table = upload(torch.tensor(flat, dtype=torch.float64), torch.device(device))
        at = 4
        s = table[at:at + 5 * n].view(n, 5).float()
        at += 5 * n
        self.rows = torch.tensor(rows, device=table.device)
        self.repetition, self.frequency, self.presence = s[:, 0:1], s[:, 1:2], s[:, 2:3]
        self.need = s[:, 3]  # tokens still to come before the stop tokens may be sampled
        self.greedy = s[:, 4].bool()
        self.any_greedy = any(not params[i].temperature > 0 for i in rows)
        self.repeats = any(q.repetition_penalty != 1 for q in p)

        def pairs(k):
            nonlocal at
            out = table[at:at + 2 * k].view(k, 2).long()
            at += 2 * k
            return out[:, 0], out[:, 1]

        self.seen = torch.zeros(n, vocab, dtype=torch.bool, device=table.device)
        self.counts = torch.zeros(n, vocab, dtype=torch.float32, device=table.device)
        self.stop = torch.zeros(n, vocab, dtype=torch.bool, device=table.device)
        r, t = pairs(head[0])
        self.seen[r, t] = True
        r, t = pairs(head[1])
        self.counts.index_put_((r, t), torch.ones(len(r), device=table.device), accumulate=True)
        self.seen |= self.counts > 0
        r, t = pairs(head[3])
        self.stop[r, t] = True
        b = table[at:at + 3 * head[2]].view(head[2], 3)
        self.bias = torch.zeros(n, vocab, dtype=torch.float32, device=table.device)
        self.bias.index_put_((b[:, 0].long(), b[:, 1].long()), b[:, 2].float(), accumulate=True)
        self._arange = torch.arange(n, device=table.device)

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """The window's logits [requests, vocab] at window step `step` -> fp32 copy with the processed rows
        changed."""
        out = logits.to(torch.float32, copy=True)
        z = out[self.rows] + self.bias
        z = z.masked_fill(self.stop & (self.need > step)[:, None], float("-inf"))
        if self.repeats:
            z = torch.where(self.seen, torch.where(z > 0, z / self.repetition, z * self.repetition), z)
        z = z - self.frequency * self.counts - self.presence * (self.counts > 0)
        out[self.rows] = z
        return out

    def observe(self, tokens: torch.Tensor) -> None:
        """The step's chosen tokens [requests] join the processed rows' histories."""
        t = tokens[self.rows]
        self.counts[self._arange, t] += 1
        self.seen[self._arange, t] = True
