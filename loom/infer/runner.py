"""The engine's run: the model forward of a round, from the scheduled requests to their sampled tokens, still on
the device. `Runner.prefill` runs the admitted prompts as one packed row and picks each request's first token;
`Runner.decode` runs a window of up to `sync_every` decode steps of the busy slots back to back, each step's
sampled tokens fed to the next without a read-back. Both return a `Window`, which the engine's postprocess
(loom/infer/postprocess.py) reads back in one copy.

A decode step runs eagerly on the decoder (the model, or on a CPU its packed twin: loom/infer/cpu) or, with
compile on, through `CompiledDecode` (loom/infer/step.py), which may compute the LM head and its reductions
inside the step (`Runner._head_in_step`)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from loom.infer.grammar import advance as feed_grammars
from loom.infer.grammar import constrain
from loom.infer.kv import upload
from loom.infer.logits import LogitsProcessor
from loom.infer.request import Request
from loom.infer.sampling import Sampler, reduce_logits
from loom.infer.step import CompiledDecode
from loom.parallel.distributed import full_tensor


def shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly tensor-parallel) parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Window:
    """What one run produced, on the device: `picks`, per step, the `pick` of every request (token, log-prob at
    temperature 1, sampling log-prob and with top log-probs asked the most likely ids and log-probs); `stops`: the
    requests' stop tokens (`Runner._stop_table`) or None; `steps`; `fed`: the tokens it wrote into each slot
    (0 for a prefill, whose prompt positions the slot already counts)."""

    picks: list
    stops: torch.Tensor | None
    steps: int
    fed: int


def pick(head, sampler: Sampler, step: int, top: int = 0):
    """The head's fp32 logits [requests, vocab] with their argmax and log-sum-exp (`reduce_logits`) -> next
    token, its log-prob under the raw logits (temperature 1) and under the distribution it was sampled
    from, and with `top` > 0 the `top` most likely tokens' ids and log-probs [requests, top]; all on the
    device."""
    logits, greedy, lse = head
    token, sampled = sampler(logits, greedy, step)
    picked = (token, logits.gather(1, token[:, None])[:, 0] - lse, sampled)
    if not top:
        return picked
    values, ids = logits.topk(top, dim=1)
    return picked + (ids, values - lse[:, None])


class Runner:
    """Runs the model for one engine. `decoder`: the module decode steps (and the prefill's head) run on, the
    model or its CPU twin (`cpu`, loom/infer/cpu, None off a CPU); `compiled`: the compiled decode step, or None
    (eager). `stats`: the engine's counters (prefill and decode steps, windows and compiled steps are kept
    here). `adapters`: LoRA adapters per request (`loom.infer.adapters.AdapterRows`), bound around each forward."""

    adapters = None

    def __init__(self, model: nn.Module, cpu, slab, max_batch: int, max_len: int, sync_every: int,
                 compile: bool, stats: dict):
        self.model, self.cpu, self.slab, self.stats = model, cpu, slab, stats
        self.decoder = model if cpu is None else cpu.decoder
        self.max_batch, self.max_len, self.sync_every = max_batch, max_len, sync_every
        self.vocab = model.cfg.vocab_size
        self.device = shard(next(model.parameters())).device
        attention = next(iter(model.layers.values())).attention
        kv_heads = shard(attention.wk.weight).shape[0] // attention.head_dim  # this rank's, under TP
        self.compiled = self._compile(attention, kv_heads) if compile else None

    def _compile(self, attention: nn.Module, kv_heads: int) -> CompiledDecode:
        """The compiled decode step, compiled for every bucket now (`stats["warmup_s"]`). Decode attention folds
        the query heads of a key/value head into queries (`KVSlab.attend`). The step computes the head and its
        reductions itself (`_head_in_step`); else it returns hidden states and the head runs after it
        (`_head_logits`, TP's gather)."""
        heads = shard(attention.wq.weight).shape[0] // attention.head_dim
        step = CompiledDecode(self.decoder, self.slab, heads // kv_heads, self._head_in_step(), self.max_batch,
                              self.max_len, self.device)
        self.stats["warmup_s"] = step.warmup()
        return step

    def _head_in_step(self) -> bool:
        """Whether the compiled step computes the LM head and its reductions: on a CPU when the head is packed;
        on a GPU unless the head is tensor-parallel (its logits are gathered outside the step). There the head,
        its argmax and log-sum-exp join the step's CUDA graph: the H200 kernel tables of 2026-11-26 showed them
        run eagerly after it, a cast to fp32 and five full passes over [rows, vocab] fp32 a step."""
        if self.cpu is not None:
            return self.cpu.head_in_step
        weight = getattr(self.decoder.output, "weight", None)
        return self.device.type == "cuda" and weight is not None and not isinstance(weight, DTensor)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the LM head (on a CPU as its decode path computes them)."""
        if self.cpu is not None:
            return self.cpu.head_logits(hidden)
        return full_tensor(self.decoder.output(hidden)).float()

    # --- prefill --------------------------------------------------------------------------------------------

    def prefill(self, rows: list[int], seqs: list[Request]) -> Window:
        """The admitted prompts as one packed row (no padding through the linear layers); each request's
        first token comes from the logits at its prompt's last position."""
        fresh = [b for b, seq in enumerate(seqs) if not seq.shared]
        head = self._prefill_head([rows[b] for b in fresh], [seqs[b] for b in fresh]) if fresh else None
        if len(fresh) < len(seqs):  # paged: requests sharing a prompt take its head's outputs (PagedKV)
            made = {tuple(seqs[b].out.prompt): j for j, b in enumerate(fresh)}
            parts = []
            for seq in seqs:
                j = made.get(tuple(seq.out.prompt))
                parts.append(tuple(t[j:j + 1] for t in head) if j is not None else self.slab.head_of(seq.out.prompt))
            head = tuple(torch.cat(t) for t in zip(*parts))
        self.slab.settle()
        picks = [pick(constrain(head, seqs), self._sampler(seqs, 1), 0, self._top(seqs))]
        feed_grammars(picks[0][0], seqs)  # constrained requests: their grammars take the token
        return Window(picks, self._stop_table(seqs), 1, fed=0)

    def _prefill_head(self, rows: list[int], seqs: list[Request]) -> tuple:
        """The packed prefill of the prompts of `seqs` into `rows` -> the head's outputs at their last positions."""
        starts = [self.slab.reused(r) for r in rows]  # paged: prompt positions found in the prefix cache
        lengths = [len(seq.out.prompt) - s for seq, s in zip(seqs, starts)]
        total = sum(lengths)
        ends = [end - 1 for end in itertools.accumulate(lengths)]  # each prompt's last token in the row
        # the tokens and the prompts' last positions in one copy
        host = upload(torch.tensor([t for seq, s in zip(seqs, starts) for t in seq.out.prompt[s:]] + ends),
                      self.device)
        tokens, last = host[:total][None], host[total:]
        positions = self.slab.bind_packed(rows, lengths, starts if any(starts) else None)
        self.stats["prefilled_tokens"] += total
        self.stats["prefill_steps"] += 1
        if self.adapters is not None:  # per request adapters: each prompt's tokens take its own
            self.adapters.bind([seq.adapter for seq, n in zip(seqs, lengths) for _ in range(n)], self.device)
        try:
            hidden = full_tensor(self.model(tokens, cache=self.slab, positions=positions, return_hidden=True))
        finally:
            if self.adapters is not None:
                self.adapters.clear()
        head = reduce_logits(self._head_logits(hidden[0, last]))
        for j, seq in enumerate(seqs):  # paged: kept for requests with the same prompt admitted later
            self.slab.remember(seq.out.prompt, tuple(t[j:j + 1].clone() for t in head))  # the sampler writes into head
        return head

    # --- decode ---------------------------------------------------------------------------------------------

    def decode(self, rows: list[int], seqs: list[Request]) -> Window:
        """A window of decode steps for the busy slots `rows`, run back to back on the device; nothing comes
        back to the host (the postprocess reads the window back once, at its end).

        The window is `sync_every` steps, cut to the fewest steps any request still has before max_new_tokens
        or max_len: a request that ends by length or context ends on the window's last step, and its slot is
        refilled at once. Sampling (`Sampler`) and stop tracking run on the device: each step feeds the
        tokens the previous step sampled, and the first stop token of each request is found there after the
        window. A request that stops earlier keeps decoding (its slot alone, nothing it writes is read by any
        other request) until the window ends; the host keeps its tokens up to the stop.
        Positions need no read-back: every request advances one position per step.

        With compile on each step runs the compiled graph of its bucket: the batch padded to the
        bucket of max(rows) + 1 (an idle slot in that range decodes token 0 at position 0 of its
        own slot, which nothing reads: a request prefills position 0 of its slot before reading it)."""
        budget = [min(s.params.max_new_tokens - len(s.out.tokens), self.max_len - len(s.out.prompt) - len(s.out.tokens))
                  for s in seqs]
        steps = max(1, min(self.sync_every, *budget))
        sampler = self._sampler(seqs, steps)
        n, eager = len(rows), self.compiled is None
        size = len(rows) if eager else self.compiled.bucket(max(rows) + 1)
        # paged: each request's blocks for the window's positions, and the window's block table
        self.slab.prepare(rows, [s.length for s in seqs], [s.length + steps for s in seqs], None if eager else size)
        # One copy to the device per window: the token, position and advance of each row of the step (a compiled
        # step's bucket rows are slots, its idle ones decode token 0 at position 0 and stay there; an eager
        # step's rows are the busy slots in order), and the slots of the busy rows.
        table = [[0] * size for _ in range(4)]
        for b, (slot, s) in enumerate(zip(rows, seqs)):
            r = b if eager else slot
            table[0][r], table[1][r], table[2][r] = s.out.tokens[-1], s.length, 1
        table[3][:n] = rows
        state = upload(torch.tensor(table), self.device)
        tokens, positions, advance = (state[i, :, None] for i in range(3))
        where = state[3, :n]
        if not eager:  # own copies: a compiled step's inputs start aligned (views into the table do not)
            tokens, positions, advance = tokens.clone(), positions.clone(), advance.clone()
        stops = self._stop_table(seqs)
        first = max(s.length for s in seqs)
        top = self._top(seqs)
        picks = []
        if self.adapters is not None:  # per request adapters (eager: row b is seqs[b])
            self.adapters.bind([s.adapter for s in seqs], self.device)
        for step in range(steps):
            keys = first + step + 1  # key positions the furthest request reads
            # no reference to the step's outputs outlives the pick: a CUDA-graph step overwrites them next replay
            head = constrain(self._step(rows, tokens, positions, keys, None if size == n else where), seqs)
            picked = pick(head, sampler, step, top)
            token = picked[0]
            feed_grammars(token, seqs)  # constrained requests: read back and fed to their grammars, step by step
            picks.append(picked)
            if step + 1 < steps:
                if eager:  # every row is busy: the sampled tokens are the next input as they are
                    tokens = token[:, None]
                    positions += 1
                else:
                    tokens[where, 0] = token
                    positions += advance
        if self.adapters is not None:
            self.adapters.clear()
        self.stats["decode_steps"] += steps
        self.stats["windows"] += 1
        return Window(picks, stops, steps, fed=steps)

    def _step(self, rows: list[int], tokens: torch.Tensor, positions: torch.Tensor, keys: int, where):
        """One decode step of the busy slots `rows` reading `keys` key positions -> the head's fp32 logits of
        each busy row with their argmax and log-sum-exp (`reduce_logits`). Eager: the rows are the busy slots.
        Compiled: the rows are a bucket of slots 0..size-1, `where` the busy ones among them (None: all)."""
        if self.compiled is None:
            self.slab.bind(rows, positions, keys=keys)
            hidden = full_tensor(self.decoder(tokens, cache=self.slab, positions=positions, return_hidden=True))[:, 0]
            return reduce_logits(self._head_logits(hidden))
        x = self.compiled(tokens, positions, keys)
        in_step = self.compiled.head_in_step
        if where is not None:  # idle bucket rows out (every row busy: no gather)
            x = tuple(t[where] for t in x) if in_step else x[where]
        self.stats["compiled_steps"] += 1
        # the step computed the head and its reductions itself, or returned hidden states
        return x if in_step else reduce_logits(self._head_logits(x))

    def _sampler(self, seqs: list[Request], steps: int) -> Sampler:
        params = [s.params for s in seqs]
        processor = None  # penalties, logit_bias, min_tokens (loom/infer/logits.py): they read the histories
        if any(p.processes for p in params):
            processor = LogitsProcessor(params, [(s.out.prompt, s.out.tokens) for s in seqs], self.vocab, self.device)
        return Sampler(params, [s.generator for s in seqs], steps, self.vocab, self.device, processor)

    def _stop_table(self, seqs: list[Request]) -> torch.Tensor | None:
        """[requests, most stop tokens] on the device, padded with -1 (never a token); None if none stop."""
        width = max(len(s.params.stop_token_ids) for s in seqs)
        if not width:
            return None
        rows = [list(s.params.stop_token_ids) + [-1] * (width - len(s.params.stop_token_ids)) for s in seqs]
        return upload(torch.tensor(rows), self.device)

    def _top(self, seqs: list[Request]) -> int:
        """The most likely tokens a window returns per token: the most any of its requests asks for."""
        return min(max(s.params.logprobs for s in seqs), self.vocab)
