"""The engine's postprocess: a run's `Window` back to the host in one copy, and onto each request's completion up
to what ends it: a stop token (matched on the device), max_new_tokens, the engine's max_len, or a stop string
(matched on the host, on the completion's text)."""

from __future__ import annotations

import torch

from loom.infer.request import Completion, Request
from loom.infer.runner import Window


def emit(seqs: list[Request], window: Window, max_len: int, decode) -> int:
    """Append each request's tokens of a window (`window.picks`: per step, tokens / log-probs / sampling
    log-probs of every request) up to the first that ends it; the window wrote `window.fed` tokens into each
    slot. The stop tokens are matched on the device; the host reads the whole window back in one copy.
    `decode` (ids -> text) reads the completions of requests with stop strings. Returns the tokens kept."""
    picks, stops, steps = window.picks, window.stops, window.steps
    tokens = torch.stack([o[0] for o in picks], 1)  # [requests, steps]
    columns = [tokens.double(), torch.stack([o[1] for o in picks], 1).double(),
               torch.stack([o[2] for o in picks], 1).double()]
    if stops is not None:
        hit = (tokens[:, :, None] == stops[:, None, :]).any(-1)
        first = torch.where(hit.any(1), hit.int().argmax(1), steps)  # the first stop token's step, or steps
        columns.append(first.double()[:, None])
    top = picks[0][3].shape[1] if len(picks[0]) > 3 else 0  # the most likely tokens of each step (`runner.pick`)
    if top:
        # ids, then log-probs: [requests, steps * top] each
        columns += [torch.stack([o[i] for o in picks], 1).double().flatten(1) for i in (3, 4)]
    base = 3 * steps + (stops is not None)
    table = torch.cat(columns, 1).tolist()  # the window's one read-back
    kept = 0
    for seq, row in zip(seqs, table):
        out, p = seq.out, seq.params
        stop_at = int(row[3 * steps]) if stops is not None else steps
        for step in range(steps):
            out.tokens.append(int(row[step]))
            out.logprobs.append(row[steps + step])
            out.sampling_logprobs.append(row[2 * steps + step])
            if p.logprobs:
                at = base + step * top
                out.top_logprobs.append([(int(row[at + j]), row[at + steps * top + j])
                                         for j in range(min(p.logprobs, top))])
            kept += 1
            if step == stop_at:
                out.finish_reason = "stop"
            elif len(out.tokens) >= p.max_new_tokens:
                out.finish_reason = "length"
            elif len(out.prompt) + len(out.tokens) >= max_len:
                out.finish_reason = "context"
            if out.finish_reason:
                break
        if p.stop:  # text stops: the host reads the completion's text (`decode`)
            kept -= stop_at_string(out, p.stop, len(out.tokens) - (step + 1), decode, p.min_tokens)
        seq.length += window.fed
    return kept


def stop_at_string(out: Completion, stops: tuple[str, ...], start: int, decode, min_tokens: int = 0) -> int:
    """End `out` at its first token whose completion text contains one of `stops` (earlier windows' text
    held none, so from token `start`, this window's first); returns the tokens dropped. A stop string may
    span tokens of earlier windows. `min_tokens` (as vLLM): no stop before that many tokens, and only a stop
    string that ends in the min_tokens-th token's text or later counts."""
    if not any(s in decode(out.tokens) for s in stops):
        return 0
    floor = len(decode(out.tokens[:min_tokens - 1])) if min_tokens > 1 else 0  # text held back from the stops
    for n in range(max(start + 1, min_tokens), len(out.tokens) + 1):
        head = decode(out.tokens[:n])
        hits = [(at, s) for s in stops if (at := head.find(s, max(0, floor - len(s) + 1))) >= 0]
        if hits:
            out.stop_offset, out.stop_string = min(hits)
            dropped = len(out.tokens) - n
            del out.tokens[n:], out.logprobs[n:], out.sampling_logprobs[n:], out.top_logprobs[n:]
            out.finish_reason = "stop"
            return dropped
    return 0
